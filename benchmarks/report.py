"""Turning measurements into results: medians and ratios, tables, target verdicts, JSON, the chart.

A world scenario keeps one *entry* per (world, medium, contender): lists over repeats, filled by
:func:`record`.  :func:`summarize` turns entries into rows of medians and ratios to stock DCP;
:func:`print_contender_tables`, :func:`print_targets`, :func:`write_json` and :func:`draw_png` show them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Any

import torch

import dcp_atomic
from benchmarks.common import GB, MiB, say
from benchmarks.contenders import is_stock_uncompressed, label


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def environment() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "dcp_atomic": dcp_atomic.__version__,
            "cpu_count": os.cpu_count(), "machine": platform.machine(), "kernel": platform.release(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "loadavg": os.getloadavg()}


def print_wall(began: float, load_before: tuple[float, float, float]) -> float:
    """The run's last line: its wall time (``began`` from ``time.monotonic``) and the load average around it; returns
    the wall time."""
    wall = time.monotonic() - began
    print(f"\nwall time {wall:.0f} s; load average {os.getloadavg()[0]:.2f} at the end ({load_before[0]:.2f} at the "
          "start)")
    return wall


def record(entry: dict, measured: dict) -> None:
    """Append one counted save/load (a :func:`benchmarks.world.save_and_load` record) to ``entry``."""
    save, warm, cold = measured["save"], measured["warm"], measured["cold"]
    for key, value in (("save_s", max(r["seconds"] for r in save)),
                       ("warm_load_s", max(r["seconds"] for r in warm)),
                       ("cold_load_s", max(r["seconds"] for r in cold) if cold else None),
                       ("commit_s", save[0].get("commit_seconds")),
                       ("save_cpu_s", sum(r["cpu_seconds"] for r in save)),
                       ("warm_load_cpu_s", sum(r["cpu_seconds"] for r in warm)),
                       ("cold_load_cpu_s", sum(r["cpu_seconds"] for r in cold) if cold else None),
                       ("rss_save", [r["rss_extra"] for r in save]),
                       ("rss_load", [r["rss_extra"] for r in warm + (cold or [])]),
                       ("bytes_on_disk", measured["bytes_on_disk"]),
                       ("control_bytes", measured["control_bytes"]),
                       ("save_s_per_rank", [r["seconds"] for r in save]),
                       ("warm_load_s_per_rank", [r["seconds"] for r in warm])):
        if value is not None:
            entry.setdefault(key, []).append(value)


def summarize(entries: dict, data_bytes: int, order: list[str], items: int | None = None) -> dict:
    """{contender: row} of medians, GB/s (and items/s when ``items``), ranges and ratios to stock DCP.

    "stock_best" is the stock thread_count variant with the fastest median save (thread_count only changes
    the writer), compared on every metric -- not the luckiest load of several identical readers.
    """
    gb = data_bytes / GB
    rows: dict[str, dict] = {}
    for name in sorted(entries, key=lambda n: order.index(n) if n in order else len(order)):
        e = entries[name]
        row: dict[str, Any] = {"repeats": len(e["save_s"])}
        for metric, key in (("save", "save_s"), ("warm_load", "warm_load_s"), ("cold_load", "cold_load_s")):
            seconds = e.get(key, [])
            row[f"{metric}_gbps"] = gb / med(seconds) if seconds else None
            row[f"{metric}_gbps_range"] = [gb / max(seconds), gb / min(seconds)] if seconds else None
            row[f"{metric}_best_of_n_gbps"] = gb / min(seconds) if seconds else None
            if items is not None:
                row[f"{metric}_items_per_s"] = items / med(seconds) if seconds else None
            cpu = e.get(key.replace("_s", "_cpu_s"), [])
            row[f"{metric}_cpu_s_per_gb"] = med(cpu) / gb if cpu else None
        commit = med(e.get("commit_s", []))
        row.update({
            "commit_s": commit,
            "commit_pct_of_save": 100 * commit / med(e["save_s"]) if commit is not None else None,
            "bytes_on_disk": med(e["bytes_on_disk"]),
            "control_bytes": med(e["control_bytes"]),
            "stored_over_logical": med(e["bytes_on_disk"]) / data_bytes,
            "peak_rss_extra_save_mib": max(max(r) for r in e["rss_save"]) / MiB,
            "peak_rss_extra_load_mib": max(max(r) for r in e["rss_load"]) / MiB,
        })
        rows[name] = row
    variants = [n for n in rows if is_stock_uncompressed(n)]
    best_name = max(variants, key=lambda n: rows[n]["save_gbps"]) if variants else None
    stock, best = rows.get("stock"), rows.get(best_name) if best_name else None
    for row in rows.values():
        for k in ("save_gbps", "warm_load_gbps", "cold_load_gbps"):
            row[f"{k}_vs_stock"] = row[k] / stock[k] if stock and stock[k] and row[k] else None
            row[f"{k}_vs_stock_best"] = row[k] / best[k] if best and best[k] and row[k] else None
    return {"contenders": rows, "stock_best": best_name}


# -- tables -----------------------------------------------------------------------------------


def print_contender_tables(summary: dict, intro: str, items: bool = False) -> None:
    """One table per world and medium: ``summary[world][medium]`` is a :func:`summarize` result."""
    print(f"\n{intro}")
    columns = [("save GB/s", "", 10, lambda r: fmt(r["save_gbps"], ".2f"))]
    if items:
        columns.append(("save", "items/s", 10, lambda r: fmt(r["save_items_per_s"], ".0f")))
    columns += [("x", "", 6, lambda r: fmt(r["save_gbps_vs_stock"], ".2f")),
                ("x best", "", 7, lambda r: fmt(r["save_gbps_vs_stock_best"], ".2f")),
                ("warm ld", "GB/s", 9, lambda r: fmt(r["warm_load_gbps"], ".2f"))]
    if items:
        columns.append(("warm ld", "items/s", 10, lambda r: fmt(r["warm_load_items_per_s"], ".0f")))
    columns += [("x", "", 6, lambda r: fmt(r["warm_load_gbps_vs_stock"], ".2f")),
                ("x best", "", 7, lambda r: fmt(r["warm_load_gbps_vs_stock_best"], ".2f")),
                ("cold ld", "GB/s", 9, lambda r: fmt(r["cold_load_gbps"], ".2f")),
                ("x", "", 6, lambda r: fmt(r["cold_load_gbps_vs_stock"], ".2f")),
                ("x best", "", 7, lambda r: fmt(r["cold_load_gbps_vs_stock_best"], ".2f")),
                ("commit ms", "", 10, lambda r: fmt(r["commit_s"] and r["commit_s"] * 1e3, ".0f")),
                ("%save", "", 6, lambda r: fmt(r["commit_pct_of_save"], ".1f")),
                ("on disk GB", "", 11, lambda r: f"{r['bytes_on_disk'] / GB:.3f}"),
                ("metadata", "MB", 9, lambda r: f"{r['control_bytes'] / 1e6:.2f}"),
                ("stored/", "logical", 8, lambda r: f"{r['stored_over_logical']:.3f}"),
                ("RSS+ save", "MiB/rank", 10, lambda r: f"{r['peak_rss_extra_save_mib']:.0f}"),
                ("RSS+ load", "MiB/rank", 10, lambda r: f"{r['peak_rss_extra_load_mib']:.0f}"),
                ("CPU save", "s/GB", 9, lambda r: fmt(r["save_cpu_s_per_gb"], ".2f")),
                ("CPU load", "s/GB", 9, lambda r: fmt(r["warm_load_cpu_s_per_gb"], ".2f"))]
    for world, per_medium in summary.items():
        for medium, block in per_medium.items():
            best = label(block["stock_best"]) if block["stock_best"] else "-"
            print(f"\n== world {world}, {medium} (best torch FSW thread_count by save speed: {best}) ==")
            print(f"{'contender':<26}" + "".join(f"{h:>{w}}" for h, _, w, _ in columns))
            print(f"{'':<26}" + "".join(f"{h:>{w}}" for _, h, w, _ in columns))
            for name, row in block["contenders"].items():
                print(f"{label(name):<26}" + "".join(f"{cell(row):>{w}}" for _, _, w, cell in columns))


# -- targets ----------------------------------------------------------------------------------


def check(target: str, value: float | None, limit: float, higher_is_better: bool, *, world: str | None = None,
          medium: str | None = None, contender: str | None = None, best: float | None = None,
          note: str = "") -> dict:
    """One verdict: ``value`` against ``limit`` ("met"), and ``best`` (vs the best stock variant) likewise."""
    def judge(v: float | None) -> bool | None:
        if v is None:
            return None
        return v >= limit if higher_is_better else v <= limit

    return {"target": target, "world": world, "medium": medium, "contender": contender, "value": value,
            "met": judge(value), "value_vs_best": best, "met_vs_best": judge(best) if best is not None else None,
            "note": note}


SMOKE = False  # set by bench.py for a --smoke run: its sizes are far below the targets' (print_targets says so)


def _verdict_words() -> dict:
    """MET / MISS / n/a; under --smoke, said first that a miss says nothing (one place for every scenario)."""
    word = {True: "MET ", False: "MISS", None: "n/a "}
    if SMOKE:
        print("(--smoke: sizes far below the headline runs', so a verdict here only shows the scenario runs; a miss "
              "says nothing about the target)")
        word[False] = "miss (smoke)"
    return word


def print_verdicts(checks: list[dict], width: int, unit: str = "") -> None:
    """The targets of a scenario measured against its own rows (no stock contender): one line each."""
    print("\n== targets ==")
    word = _verdict_words()
    for c in checks:
        print(f"{c['target']:<{width}}{fmt(c['value'], '.2f'):>8}{unit}  {word[c['met']]}"
              + (f"  {c['note']}" if c["note"] else ""))


def print_targets(checks: list[dict]) -> None:
    print("\n== targets (vs torch FSW default | vs its best measured thread_count) ==")
    word = _verdict_words()
    places = [f"w{c['world']} {c['medium']}" if c["world"] else "" for c in checks]
    width = max([10] + [len(p) + 1 for p in places])
    for c, where in zip(checks, places):
        line = (f"{c['target']:<44}{where:<{width}}{label(c['contender']) if c['contender'] else '':<26}"
                f"{fmt(c['value'], '.2f'):>8} {word[c['met']]}")
        if c["value_vs_best"] is not None:
            line += f" | {c['value_vs_best']:.2f} {word[c['met_vs_best']]}"
        if c["note"]:
            line += f"  {c['note']}"
        print(line)


# -- files ------------------------------------------------------------------------------------


def write_json(document: dict, path: str) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(document, f, indent=1)
    say(f"wrote {path}")


def draw_png(summary: dict, path: str, title: str) -> None:
    """Grouped bars: GB/s per contender per world size, one panel per medium and metric; whiskers = min..max."""
    if not path:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed (pip install matplotlib): PNG skipped")
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    media = sorted({m for per in summary.values() for m in per}, key=lambda m: (m != "disk", m))
    metrics = [("save_gbps", "save"), ("warm_load_gbps", "warm load"), ("cold_load_gbps", "cold load")]
    worlds = sorted(summary, key=int)
    names: list[str] = []
    for per in summary.values():
        for block in per.values():
            names += [n for n in block["contenders"] if n not in names]
    fig, axes = plt.subplots(len(media), len(metrics), figsize=(6 * len(metrics), 4 * len(media)), squeeze=False)
    width = 0.8 / max(1, len(names))
    colors = plt.get_cmap("tab10")
    for i, medium in enumerate(media):
        for j, (key, metric) in enumerate(metrics):
            ax = axes[i][j]
            drawn = False
            for k, name in enumerate(names):
                xs, ys, low, high = [], [], [], []
                for x, world in enumerate(worlds):
                    row = summary[world].get(medium, {}).get("contenders", {}).get(name)
                    if row and row[key]:
                        xs.append(x + (k - (len(names) - 1) / 2) * width)
                        ys.append(row[key])
                        lo, hi = row.get(f"{key}_range") or (row[key], row[key])
                        low.append(max(0.0, row[key] - lo))
                        high.append(max(0.0, hi - row[key]))
                if xs:
                    drawn = True
                    ax.bar(xs, ys, width, label=label(name), color=colors(k % 10),
                           yerr=[low, high], capsize=2, error_kw={"elinewidth": 0.8, "alpha": 0.7})
            ax.set_title(f"{metric}, {medium}")
            ax.grid(axis="y", alpha=0.3)
            if drawn:
                ax.set_xticks(range(len(worlds)), [f"world {w}" for w in worlds])
                ax.set_ylabel("GB/s (higher is better)")
            else:
                ax.text(0.5, 0.5, "not measured" + (" (a tmpfs cannot be dropped)" if medium == "tmpfs" else ""),
                        ha="center", va="center", transform=ax.transAxes)
                ax.set_xticks([])
                ax.set_yticks([])
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    say(f"wrote {path}")
