"""The command line's usage errors and small answers: a bad ``--timeout`` or step is exit 2 (the usage code) before
the root is opened, an export's failure has a type, ``ls`` of a stock DCP directory says how to import it, a partial
step is reported at once instead of after ``--timeout``, and a step read in a moment prints no progress line."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic import AtomicStorageWriter
from dcp_atomic.tools.cli import main, output

RUN = "exp"


def _save(root, step):
    dcp.save({"w": torch.arange(16.0), "meta": {"step": step}}, storage_writer=AtomicStorageWriter(root, RUN, step))


@pytest.mark.parametrize("argv", [["--timeout", "-5", "ls", "ROOT"], ["ls", "ROOT", "--timeout=0"],
                                  ["ls", "ROOT", RUN, "--timeout", "nan"]])
def test_a_timeout_that_is_not_a_positive_number_is_a_usage_error(root, capsys, argv):
    argv = [root if a == "ROOT" else a for a in argv]
    assert main(argv) == 2
    assert "--timeout" in capsys.readouterr().err
    assert main(["--json", *argv]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "UsageError" and "--timeout" in error["message"], error


@pytest.mark.parametrize("command", ["show", "verify", "rm", "export", "import"])
def test_a_negative_step_is_a_usage_error_naming_what_a_step_is(root, tmp_path, capsys, command):
    _save(root, 1)
    argv = {"show": ["show", root, RUN, "-1"], "verify": ["verify", root, RUN, "-1"], "rm": ["rm", root, RUN, "-1"],
            "export": ["export", root, RUN, "-1", str(tmp_path / "out.pt")],
            "import": ["import", str(tmp_path), root, RUN, "-1"]}[command]
    assert main(argv) == 2
    assert "argument step: the value must be an int >= 0, got -1" in capsys.readouterr().err
    assert main(["--json", *argv]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "UsageError" and "must be an int >= 0, got -1" in error["message"], error
    assert os.path.isdir(os.path.join(root, RUN, "step_0000000001"))


def test_an_export_failure_has_a_type(root, capsys):
    _save(root, 1)
    missing = os.path.join(root, "no", "such", "dir", "out.pt")
    assert main(["--json", "export", root, RUN, "1", missing]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "NotFound" and os.path.join(root, "no", "such", "dir") in error["message"], error


def test_ls_of_a_stock_dcp_directory_says_how_to_import_it(root, capsys):
    stock = os.path.join(root, "stock")
    dcp.save({"w": torch.ones(4)}, storage_writer=dcp.FileSystemWriter(stock))
    assert main(["ls", stock]) == 0
    out = capsys.readouterr().out
    assert f"no runs under {stock}" in out and f"dcp-atomic import {stock} ROOT RUN STEP" in out, out
    assert main(["--json", "ls", stock]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["runs"] == [] and f"dcp-atomic import {stock}" in listing["hint"], listing
    assert main(["ls", root, "stock"]) == 0  # the stock directory named as a run of its parent
    assert "dcp-atomic import" in capsys.readouterr().out
    _save(root, 1)
    assert main(["--json", "ls", root]) == 0
    assert "hint" not in json.loads(capsys.readouterr().out)  # a root with runs: nothing to suggest


@pytest.mark.parametrize("command", ["show", "verify", "export"])
def test_a_partial_step_is_reported_at_once_not_after_the_timeout(root, tmp_path, capsys, command):
    _save(root, 1)
    os.makedirs(os.path.join(root, RUN, "step_0000000009", "20260101T000000Z-deadbeef"))
    argv = ["--json", "--timeout", "60", command, root, RUN, "9"] + ([str(tmp_path / "out.pt")]
                                                                     if command == "export" else [])
    started = time.monotonic()
    assert main(argv) == 1
    assert time.monotonic() - started < 20, "the partial step's marker was waited for"
    reply = json.loads(capsys.readouterr().out)
    message = reply[0]["problems"][0] if command == "verify" else reply["error"]["message"]
    assert "step 9 of run 'exp' is not committed" in message and "1 attempt(s)" in message, reply


def test_a_step_verified_in_a_moment_prints_no_progress_line(root, capsys):
    _save(root, 1)
    assert main(["verify", root, RUN, "1"]) == 0
    captured = capsys.readouterr()
    assert "step 1: OK" in captured.out
    assert "verify step 1" not in captured.err and "GB" not in captured.err, captured.err


def test_a_long_copy_prints_its_progress_in_the_unit_that_shows_it(capsys, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(output, "time", type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])}))
    progress = output.CopyProgress(3 << 20, "verify step 7")
    progress(1 << 20)  # within the first interval: nothing yet
    clock[0] += 2.5
    progress(1 << 20)
    clock[0] += 0.5
    progress(1 << 20)  # done: the line that ends at 100%
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["verify step 7:  66.7% of 3.0 MiB (819.2 KiB/s)", "verify step 7: 100.0% of 3.0 MiB (1.0 MiB/s)"]


def test_every_help_text_is_plain_and_describes_every_positional_argument():
    """What ``--help`` prints is read in a terminal: no reST backticks, and every positional argument says what it
    is (ROOT, RUN, STEP... in every command)."""
    import argparse

    from dcp_atomic.tools.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, command in {"": parser, **commands}.items():
        assert "`" not in command.format_help(), name
        for action in command._actions:
            if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
                assert action.help, (name, action.dest)
