"""Stored files moved between ranks in bounded memory (dcp_atomic/exchange/file_transfer.py): the local tier's replicas
and restores.  Real gloo worlds; chunks made small so every stream crosses part and chunk boundaries."""

from __future__ import annotations

import os

from tests.harness import assert_all_ok, run_world

CHUNK = 64 << 10


def _files(directory: str, rank: int, sizes: list[int]) -> list[str]:
    paths = []
    for i, size in enumerate(sizes):
        path = os.path.join(directory, f"src-{rank}-{i}")
        with open(path, "wb") as f:
            f.write(bytes((rank * 31 + i + n) % 251 for n in range(size)))
        paths.append(path)
    return paths


def _ring(ctx, sizes, truncate_after_index=False, fault_on_rank1=None):
    """Each rank sends an inline part and files of ``sizes`` to the next rank; counts every message's size.
    ``fault_on_rank1``: "spool" (its spool directory cannot be made), "fsize" (its writes fail past 1.5 chunks)."""
    import resource
    import signal

    import torch.distributed as dist

    from dcp_atomic.exchange import file_transfer
    from dcp_atomic.exchange.file_transfer import Part, Spooled, transfer

    file_transfer.CHUNK_BYTES = CHUNK
    sent_sizes = []
    real_isend = dist.isend
    dist.isend = lambda tensor, *a, **k: (sent_sizes.append(tensor.numel()), real_isend(tensor, *a, **k))[1]
    mine = os.path.join(ctx.root, f"rank{ctx.rank}")
    os.makedirs(mine, exist_ok=True)
    paths = _files(mine, ctx.rank, sizes)
    parts = [Part.inline("shard", f"shard of {ctx.rank}".encode())]
    parts += [Part(f"file{i}", size, path=path) for i, (size, path) in enumerate(zip(sizes, paths))]
    if truncate_after_index and ctx.rank == 0:
        os.truncate(paths[-1], sizes[-1] // 2)  # the file shrinks after it was listed: the stream still completes
    world = ctx.world_size
    source = (ctx.rank - 1) % world
    spool = os.path.join(mine, ".incoming")
    if ctx.rank == 1 and fault_on_rank1 == "spool":
        open(spool, "wb").close()  # a stray file where the spool directory goes
    if ctx.rank == 1 and fault_on_rank1 == "fsize":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (CHUNK * 3 // 2, resource.RLIM_INFINITY))
    try:
        received = transfer({(ctx.rank + 1) % world: parts}, {source: f"rank {source}"}, dist.group.WORLD, spool)
    except OSError as e:
        return {"error": str(e), "spool": os.listdir(spool) if os.path.isdir(spool) else None}
    finally:
        dist.isend = real_isend
    got = received[source]
    os.makedirs(os.path.join(ctx.root, "expect"), exist_ok=True)
    equal = []
    for i, path in enumerate(_files(os.path.join(ctx.root, "expect"), source, sizes)):
        part = got[f"file{i}"]
        with open(part.path, "rb") as spooled, open(path, "rb") as f:
            equal.append(isinstance(part, Spooled) and spooled.read() == f.read())
    return {"inline": got["shard"], "equal": equal, "largest_message": max(sent_sizes),
            "spooled": sorted(os.listdir(spool))}


def test_files_arrive_exact_in_chunks_no_message_larger_than_a_chunk(root):
    sizes = [5 * CHUNK + 123, 0, 17, 2 * CHUNK]  # crosses chunk and part boundaries; an empty file in the middle
    results = assert_all_ok(run_world(_ring, 3, root, args=(sizes,), timeout=90))
    for rank, out in enumerate(results):
        assert out["inline"] == f"shard of {(rank - 1) % 3}".encode()
        assert out["equal"] == [True] * len(sizes)
        assert out["largest_message"] <= CHUNK  # a transfer's memory per peer is one chunk, whatever the files
        assert len(out["spooled"]) == len(sizes)


def test_a_file_truncated_mid_transfer_fails_on_the_sender_and_its_receiver_gets_bytes_no_check_accepts(root):
    results = assert_all_ok(run_world(_ring, 2, root, args=([3 * CHUNK, 3 * CHUNK], True), timeout=90))
    assert "truncated" in results[0]["error"] and results[0]["spool"] == []  # the sender raises after the stream
    # The receiver got the whole stream (the sender padded it): the first file exact, the second not what was
    # stored, which the block digests of write_rank_files refuse (tests/tiers/test_tiers.py covers that refusal).
    assert results[1]["equal"] == [True, False]


def test_a_rank_that_cannot_make_its_spool_fails_alone_and_at_once_its_peers_complete(root):
    # Before: the failing rank skipped the exchange and its peers waited in it until the group timed out.
    results = assert_all_ok(run_world(_ring, 2, root, args=([3 * CHUNK], False, "spool"), timeout=60, pg_timeout=20))
    assert ".incoming" in results[1]["error"] and results[1]["spool"] is None
    assert results[0]["equal"] == [True]  # rank 1 still sent its files: rank 0's transfer completed


def test_a_write_that_fails_mid_file_leaves_no_spool_file_behind(root):
    results = assert_all_ok(run_world(_ring, 2, root, args=([3 * CHUNK, CHUNK], False, "fsize"), timeout=60))
    assert "File too large" in results[1]["error"], results[1]
    assert results[1]["spool"] == []  # the partial file went at once, not at the next transfer
    assert results[0]["equal"] == [True, True]


def _overlapped(ctx, kill_rank0_after=None):
    """Ranks 0 and 1 each stream a 6-chunk file to the other; records, per stream, when each receive was posted
    and each chunk written, and which buffers carried them.  ``kill_rank0_after``: rank 0 SIGKILLs itself once it
    has written that many chunks (a peer dying mid-stream)."""
    import signal

    import torch.distributed as dist

    from dcp_atomic.exchange import file_transfer
    from dcp_atomic.exchange.file_transfer import Part, transfer

    file_transfer.CHUNK_BYTES = CHUNK
    events, buffers = [], {"recv": set(), "send": set()}
    real_irecv, real_isend, real_feed = dist.irecv, dist.isend, file_transfer._Receiver._feed

    def irecv(tensor, *a, **k):
        if tensor.numel() == CHUNK:
            events.append("posted")
            buffers["recv"].add(tensor.data_ptr())
        return real_irecv(tensor, *a, **k)

    def isend(tensor, *a, **k):
        if tensor.numel() == CHUNK:
            buffers["send"].add(tensor.data_ptr())
        return real_isend(tensor, *a, **k)

    def feed(self, data):
        events.append("written")
        if kill_rank0_after is not None and ctx.rank == 0 and events.count("written") > kill_rank0_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_feed(self, data)

    dist.irecv, dist.isend, file_transfer._Receiver._feed = irecv, isend, feed
    mine = os.path.join(ctx.root, f"rank{ctx.rank}")
    os.makedirs(mine, exist_ok=True)
    [path] = _files(mine, ctx.rank, [6 * CHUNK])
    peer = 1 - ctx.rank
    spool = os.path.join(mine, ".incoming")
    try:
        received = transfer({peer: [Part("file", 6 * CHUNK, path=path)]}, {peer: f"rank {peer}"}, dist.group.WORLD,
                            spool)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "spool": sorted(os.listdir(spool))}
    [expected] = _files(os.path.join(ctx.root, "expect"), peer, [6 * CHUNK])
    with open(received[peer]["file"].path, "rb") as got, open(expected, "rb") as want:
        equal = got.read() == want.read()
    return {"events": events, "equal": equal, "recv_buffers": len(buffers["recv"]),
            "send_buffers": len(buffers["send"])}


def test_a_chunk_is_written_while_the_next_is_on_the_wire_in_order_with_two_buffers_per_stream(root):
    os.makedirs(os.path.join(root, "expect"), exist_ok=True)
    for out in assert_all_ok(run_world(_overlapped, 2, root, timeout=90)):
        assert out["equal"]  # every byte in order, across 6 rounds of alternating buffers
        events = out["events"]
        assert events.count("posted") == events.count("written") == 6
        for k in range(5):  # chunk k is written only after chunk k + 1's receive is posted (overlap)
            written_k = [i for i, e in enumerate(events) if e == "written"][k]
            assert events[:written_k].count("posted") >= k + 2, events
        assert out["recv_buffers"] == 2 and out["send_buffers"] == 2  # memory: two chunks per stream and side


def test_a_peer_killed_mid_stream_fails_the_survivor_within_the_group_timeout_and_leaves_no_spool_file(root):
    os.makedirs(os.path.join(root, "expect"), exist_ok=True)
    outcomes = run_world(_overlapped, 2, root, args=(2,), timeout=90, pg_timeout=10)
    assert outcomes[0].killed
    assert outcomes[1].ok, outcomes[1].error
    survivor = outcomes[1].value
    # the survivor raised the transport's typed error naming the dead peer, never returned a partial file
    assert survivor["error"].startswith("PeerLost: "), survivor
    assert "Silent rank(s): 0 (" in survivor["error"], survivor
    assert survivor["spool"] == []  # its partly written spool file went with the failure


def _ring_with_a_frozen_rank(ctx):
    """World 3: each rank streams a 6-chunk file to the next; rank 2 freezes (SIGSTOP) inside its third round."""
    import time

    import torch.distributed as dist

    from dcp_atomic.exchange import file_transfer
    from dcp_atomic.exchange.file_transfer import Part, transfer

    file_transfer.CHUNK_BYTES = CHUNK
    mine = os.path.join(ctx.root, f"rank{ctx.rank}")
    os.makedirs(mine, exist_ok=True)
    [path] = _files(mine, ctx.rank, [6 * CHUNK])
    spool = os.path.join(mine, ".incoming")
    source = (ctx.rank - 1) % 3
    started = time.monotonic()
    try:
        transfer({(ctx.rank + 1) % 3: [Part("file", 6 * CHUNK, path=path)]}, {source: f"rank {source}"},
                 dist.group.WORLD, spool, what="the ring test", timeout=4, exchange_id="ring")
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "silent": getattr(e, "details", {}).get("silent"),
                "seconds": time.monotonic() - started, "spool": sorted(os.listdir(spool))}
    return {"error": None}


def test_a_peer_frozen_mid_stream_is_named_by_every_rank_within_the_transfer_timeout_not_the_groups(root):
    """Rank 2 stops answering in its third chunk round.  Rank 0 (receiving from it) and rank 1 (receiving from rank 0,
    which stalls behind it) both raise PeerLost naming rank 2 only: rank 0 checked in alive, so rank 1's failed
    connection to it is a symptom.  Within the transfer's 4 s timeout, not the group's 300 s; no spool file left."""
    outcomes = run_world(_ring_with_a_frozen_rank, 3, root, timeout=120, pg_timeout=300, wait_for=[0, 1],
                         rank_env=lambda rank: {"DCP_ATOMIC_FAILPOINTS": "transfer.round@2#3=stop" if rank == 2
                                                else None})
    for rank in (0, 1):
        assert outcomes[rank].ok, outcomes[rank].error
        out = outcomes[rank].value
        assert out["error"] is not None and out["error"].startswith("PeerLost: PeerLost: the ring test: "), out
        assert out["silent"] == "2", out
        assert out["seconds"] < 60, out
        assert out["spool"] == [], out
