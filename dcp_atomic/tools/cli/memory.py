"""``dcp-atomic ls|show|verify PATH RUN --memory``: one node's memory tier (``MemoryTier(path=PATH)``) as a restore
on this node would judge it.

The slots are read with the memory tier's own functions (:class:`~dcp_atomic.memory.SlotDir` lists and unseals the
records, :func:`~dcp_atomic.memory.verify_slot` re-reads the bytes, :func:`~dcp_atomic.memory.newest_complete`
decides which step can be assembled), so the command cannot call a slot sound that a restore would refuse: a record
whose seal fails is FAILED with the reason, and under ``verify`` so is one whose bytes differ from its digests.
``ls`` and ``show`` read the records alone (and the data files' sizes), without torch; only ``verify`` reads the
bytes, and decodes the object items with torch's allow-list as a restore does.
"""

from __future__ import annotations

import os
from typing import Any

from ...errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeItemError
from ...memory import SlotDir, SlotRecord, newest_complete, slot_of, verify_slot
from .output import emit, format_mib

SOUND = ("sealed", "OK")  # a record whose seal holds (ls, show), and one whose bytes verify too (verify)


def slot_rows(path: str, run: str, *, read_data: bool) -> tuple[list[dict[str, Any]], list[tuple[str, SlotRecord]]]:
    """One row per slot record under ``path`` for ``run`` (own slots and replicas), and the sound records."""
    slots = SlotDir(path, run)
    rows, sound = [], []
    for where, record in slots.records():
        if isinstance(record, CorruptCheckpointError):
            rank, slot = slot_of(where)
            rows.append({"rank": rank, "slot": slot, "record": where, "status": "FAILED", "reason": record.message})
            continue
        data = slots.data(record.rank, record.slot)
        row = {"rank": record.rank, "slot": record.slot, "step": record.step, "sequence": record.sequence,
               "lineage": record.lineage, "world_size": record.world_size, "bytes": record.length,
               "items": len(record.items), "replica_held_by": record.holder, "record": where, "data": data}
        try:
            if record.run_id != run:  # as a restore judges it: a record under this run's directory naming another
                raise CorruptCheckpointError(f"{where}: names run {record.run_id!r}, not {run!r} (never restored)",
                                             path=where)
            if read_data:
                verify_slot(record, data)
            elif os.path.getsize(data) < record.length:
                raise CorruptCheckpointError(f"{data}: {os.path.getsize(data)} bytes, its commit record names "
                                             f"{record.length} (truncated)", path=data)
        except (CorruptCheckpointError, UnsafeItemError, OSError) as e:
            rows.append({**row, "status": "FAILED", "reason": getattr(e, "message", None) or str(e)})
            continue
        rows.append({**row, "status": SOUND[read_data]})
        sound.append((where, record))
    rows.sort(key=lambda r: (r["rank"], r.get("sequence", -1), r["slot"]))
    return rows, sound


def restorable(sound: list[tuple[str, SlotRecord]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Per lineage and world size among ``sound`` records: the step a restore on this node could assemble alone; and
    the sequences whose records name different steps (a record re-sealed with another step: never restored)."""
    conflicts: list[str] = []
    groups: dict[tuple[str, int], list[tuple[str, SlotRecord]]] = {}
    for where, record in sound:
        groups.setdefault((record.lineage, record.world_size), []).append((where, record))
    found = []
    for (lineage, world_size), records in sorted(groups.items()):
        records_of = {}
        for where, r in records:
            records_of.setdefault(r.sequence, []).append(f"{where} (rank {r.rank}, step {r.step})")

        def mixed(sequence: int, steps: list[int]) -> None:
            conflicts.append(f"the records of sequence {sequence} (lineage {lineage}) name different steps {steps}: "
                             f"{', '.join(records_of[sequence])}; a restore takes none of them")

        newest = newest_complete([(r.rank, r.sequence, r.step, where) for where, r in records], world_size, mixed)
        if newest is not None:
            found.append({"lineage": lineage, "world_size": world_size, "step": newest[1], "sequence": newest[0]})
    return found, conflicts


def _scan(args, *, read_data: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    rows, sound = slot_rows(args.root, args.run, read_data=read_data)
    if not rows:
        raise CheckpointNotFoundError(f"no memory slots of run {args.run!r} under {args.root} (this node's "
                                      f"MemoryTier path; each node holds its own)")
    return rows, *restorable(sound)


def _print(rows: list[dict[str, Any]], assemblable: list[dict[str, Any]], conflicts: list[str]) -> None:
    print(f"{'rank':>4} {'slot':>4} {'step':>10} {'seq':>6} {'size':>12}  {'status':<7} copy")
    for row in rows:
        held = row.get("replica_held_by")
        copy = "" if "step" not in row else f"replica held by rank {held}" if held is not None else "own"
        print(f"{row['rank']:>4} {row['slot']:>4} {row.get('step', '-'):>10} {row.get('sequence', '-'):>6} "
              f"{format_mib(row['bytes']) if 'bytes' in row else '-':>12}  {row['status']:<7} {copy}"
              + (f"  lineage {row['lineage']}" if "lineage" in row else ""))
        if row["status"] == "FAILED":
            print(f"       {row['reason']}")
    for conflict in conflicts:
        print(f"CONFLICT: {conflict}")
    for found in assemblable:
        print(f"this node alone can restore step {found['step']} (sequence {found['sequence']}, lineage "
              f"{found['lineage']}, world size {found['world_size']})")
    if not assemblable:
        print("this node alone holds no complete step (every rank's share of one sequence): a restore needs the "
              "other nodes' copies")


def cmd_ls(args) -> int:
    rows, assemblable, conflicts = _scan(args, read_data=False)
    if args.json:
        emit({"memory": args.root, "run": args.run, "slots": rows, "restorable": assemblable, "conflicts": conflicts})
    else:
        _print(rows, assemblable, conflicts)
    return 0


def cmd_show(args) -> int:
    """The records of one step (default: the newest this node can restore alone), with their items."""
    rows, assemblable, conflicts = _scan(args, read_data=False)
    step = args.step if args.step is not None else max(assemblable, key=lambda f: f["sequence"])["step"] \
        if assemblable else None
    chosen = [row for row in rows if row.get("step") == step]
    if step is None or not chosen:
        raise CheckpointNotFoundError(f"no memory slot of run {args.run!r} step {step} under {args.root}"
                                      if step is not None else
                                      f"no complete step of run {args.run!r} under {args.root}: name a step")
    items = {}
    for row in chosen:
        if row["status"] != "FAILED":
            with open(row["record"], "rb") as f:
                record = SlotRecord.from_bytes(f.read(), row["record"])
            items[row["record"]] = [item.to_json() for item in record.items]
    if args.json:
        emit({"memory": args.root, "run": args.run, "step": step, "slots": chosen, "items": items,
              "restorable": assemblable, "conflicts": conflicts})
        return 0
    _print(chosen, assemblable, conflicts)
    for where, listed in items.items():
        print(f"{where}:")
        for item in listed:
            print(f"  {item['key']:<60} {item['dtype'] or item['kind']:<16} {item['nbytes']:>12} bytes")
    return 0


def cmd_verify(args) -> int:
    """Every slot's bytes against its record's digests (``step``: that step's slots, and the unreadable records);
    exit 1 if any FAILED or records of one sequence name different steps."""
    rows, assemblable, conflicts = _scan(args, read_data=True)
    if args.step is not None:
        rows = [row for row in rows if row.get("step") in (None, args.step)]
        if not any(row.get("step") == args.step for row in rows):
            raise CheckpointNotFoundError(f"no memory slot of run {args.run!r} step {args.step} under {args.root}")
    ok = all(row["status"] == "OK" for row in rows) and not conflicts
    if args.json:
        emit({"memory": args.root, "run": args.run, "slots": rows, "restorable": assemblable, "conflicts": conflicts,
              "ok": ok})
    else:
        _print(rows, assemblable, conflicts)
    return 0 if ok else 1
