"""``dcp-atomic stats``: a run's saves step by step, from the statistics each step records, as a table or a chart.

Why from the steps and not from a log: the manager hands its statistics to callbacks (docs/statistics.md), which
a job may never have wired to anything, while every committed step keeps its own record of how it was written:
the manifest's start and manifest times, each rank's bytes written and reused and its write time (``ranks.json``),
the commit marker's time and, for a step the background drain committed to the durable root, the drain's claim.
So the history of any run, including one saved before anyone asked, is there to read, in one small read per file
and no data.  A step without records (imported from stock DCP) is a row of dashes, never a row of zeros.  Load and
restore times are not recorded with a step (they reach ``on_loaded`` only), so they cannot appear here.
"""

from __future__ import annotations

from typing import Any

from .._base.extras import install_advice
from .._base.retry import Deadline
from ..errors import CheckpointError
from ..format.layout import RunLayout
from ..format.manifest import Marker
from ..protocol.commit import read_claim, read_committed

#: the figures of a row, in table order: (field, heading, unit); a field a step does not record is None
FIGURES = (("save_seconds", "save", "s"), ("write_seconds", "write", "s"), ("bytes", "bytes", "B"),
           ("bytes_written", "written", "B"), ("bytes_reused", "reused", "B"), ("drain_seconds", "drain", "s"))

PLOT_EXTRA = install_advice("plot")


def step_statistics(layout: RunLayout, markers: list[Marker], root_tier: str, timeout: float) -> list[dict[str, Any]]:
    """One row per committed step, oldest first: what its manifest, ``ranks.json``, marker and claim record.
    ``root_tier``: which tier the root is (``local`` for a node's local root)."""
    return [_row(layout, marker, root_tier, timeout) for marker in sorted(markers, key=lambda m: m.step)]


def _row(layout: RunLayout, marker: Marker, root_tier: str, timeout: float) -> dict[str, Any]:
    row: dict[str, Any] = {"step": marker.step, "save_id": marker.save_id, "committed_at": marker.committed_at,
                           "tier": None, **{name: None for name, _, _ in FIGURES}}
    try:
        committed = read_committed(layout, marker.step, Deadline(timeout))
        committed.load_rank_records(layout, Deadline(timeout))
    except CheckpointError as e:  # a damaged manifest or ranks.json: the row says so, the others still print
        return {**row, "error": e.message}
    manifest = committed.manifest
    claim = read_claim(layout, marker.step, marker.save_id) or {}
    drained = "drained_from" in claim  # the drain's claim: saved on the local tier, then copied here
    row["tier"] = "local" if drained else root_tier
    row["drained"] = drained
    if not manifest.stats:  # imported, or written before ranks recorded their figures
        return row
    # from the writer's start to the commit; a drained step's marker is the drain's, so to its (local) manifest
    row.update(save_seconds=(manifest.written_at if drained else marker.committed_at) - manifest.started_at,
               write_seconds=max(s["write_seconds"] for s in manifest.stats),
               bytes=sum(s["bytes"] for s in manifest.stats),
               bytes_written=sum(s.get("bytes_written", s["bytes"]) for s in manifest.stats),
               bytes_reused=sum(s.get("bytes_reused", 0) for s in manifest.stats))
    if drained and isinstance(claim.get("started_at"), (int, float)):
        row["drain_seconds"] = marker.committed_at - claim["started_at"]
    return row


def plotting():
    """matplotlib's pyplot, drawing to files (the CLI runs on login nodes without a display); ImportError naming
    :data:`PLOT_EXTRA` without it.  Asked before any step is read, so a missing extra costs nothing."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA}") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Times and bytes over steps, in two panels, to a PNG at ``path`` (needs matplotlib: :data:`PLOT_EXTRA`)."""
    pyplot = plotting()
    figure, (times, sizes) = pyplot.subplots(2, 1, sharex=True, figsize=(9, 6))
    for axes, unit, scale in ((times, "s", 1.0), (sizes, "B", 2**20)):
        for name, heading, field_unit in FIGURES:
            if field_unit != unit:
                continue
            points = [(r["step"], r[name] / scale) for r in rows if r.get(name) is not None]
            if points:
                steps, values = zip(*points)
                axes.plot(steps, values, marker="o", label=heading)
        axes.set_ylabel("seconds" if unit == "s" else "MiB")
        axes.grid(True, alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(loc="upper left")
    tiers = {row["tier"] for row in rows if row.get("tier")}
    if len(tiers) > 1:  # a run that changed tiers: its local saves are marked on both panels
        for row in rows:
            if row.get("tier") == "local":
                for axes in (times, sizes):
                    axes.axvline(row["step"], color="0.85", zorder=0)
    sizes.set_xlabel("step" + (" (grey: saved through the local tier)" if len(tiers) > 1 else ""))
    times.set_title(title + (f" (tier: {tiers.pop()})" if len(tiers) == 1 else ""))
    figure.tight_layout()
    figure.savefig(path, format="png")
    pyplot.close(figure)
