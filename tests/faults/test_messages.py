"""Messages stay readable: cut at a word boundary, never mid-word."""

from __future__ import annotations


def test_long_messages_are_cut_at_a_word_boundary():
    from dcp_atomic.errors import shorten

    text = "OSError: [Errno 28] No space left on device while writing __0_0.distcp"
    assert shorten(text, 200) == text
    assert shorten(text, 40) == "OSError: [Errno 28] No space left on…"
    assert len(shorten("x" * 50, 20)) == 20  # one long word: cut inside it, still marked
