"""The storage tiers' half of ``CheckpointManager.load``: which step and save (global rank 0 decides, or the local
tier's restore), the reader, DCP's load, and its failure typed and named with the step; and the durable root's answers
that a load and a listing share (the step to read, its resume point, its metadata).  The manager asks the snapshot
tier first (:mod:`.snapshot_tier`) and reports what was loaded (:mod:`.reports`)."""

from __future__ import annotations

from typing import Any, Callable

import torch.distributed.checkpoint as dcp

from .._base import world_of_one
from .._base.retry import Deadline
from ..dcp.planners import AtomicLoadPlanner
from ..dcp.watched import WatchedReader
from ..errors import CheckpointError, CheckpointNotFoundError
from ..exchange.collective import raise_typed
from ..format.layout import validate_step
from ..format.parallelism import Parallelism
from ..protocol.catalog import latest_step as scan_latest_step
from ..protocol.commit import ResumePoint, known_sequence, read_committed, read_marker, resume_point
from .tiering import TierContext, TierPolicy


class StorageLoads:
    """One manager's loads from its storage tiers (every method on every rank alike unless it says rank 0)."""

    def __init__(self, ctx: TierContext, tier: TierPolicy, *, parallelism: Parallelism | None,
                 share_reads: bool | None, resolve_everywhere: Callable[[Any, int], None]) -> None:
        """``resolve_everywhere``: every rank resolves the reader's step, all raise if one cannot (P5)."""
        self.ctx, self.tier, self.parallelism, self.share_reads = ctx, tier, parallelism, share_reads
        self.resolve_everywhere = resolve_everywhere

    def load(self, state_dict: dict[str, Any], step: int | None, save_id: str | None, allow_reshard: bool,
             attempt: dict[str, Any]) -> tuple[int, WatchedReader, ResumePoint | None, bool]:
        """Load ``step`` (None: the newest) into ``state_dict``, from the local tier where it restores it, else the
        durable root; (step, its reader, the resume point, whether the local tier served).  ``attempt["step"]``:
        the step once known (for the failure's report)."""
        ctx = self.ctx
        root, storage_options, wanted = ctx.root, ctx.storage_options, save_id
        local = self.tier.restore(step, state_dict, wanted)
        if local is not None:  # a local root's path: no storage options
            root, chosen, save_id, resumed = local
            storage_options = None
        else:
            chosen, save_id, resumed = ctx.on_rank0(lambda: self.resolve(step, wanted), "resolve the step to load",
                                                    request="the latest step" if step is None else f"step {step}")
        if chosen is None:
            raise self.nothing_committed()
        attempt["step"] = chosen
        # Visibility waits get half the group timeout: the manifest shards read while DCP plans (no
        # barrier there) must give up before the peers' gather of plans times out.
        watch = ctx.watch(f"loading step {chosen}")
        reader = WatchedReader(root, ctx.run_id, chosen, save_id=save_id, parallelism=self.parallelism,
                               allow_reshard=allow_reshard, timeout=ctx.timeout / 2, storage_options=storage_options,
                               thread_count=ctx.thread_count, share_reads=self.share_reads, process_group=ctx.group,
                               watch=watch)
        self.resolve_everywhere(reader, chosen)
        try:
            world_of_one.explain()
            dcp.load(state_dict, storage_reader=reader, planner=AtomicLoadPlanner(), process_group=ctx.group)
        except BaseException as e:
            failure = watch.verdict or ctx.translate(e, f"loading step {chosen}")
            if isinstance(failure, CheckpointError):
                failure.details.setdefault("step", chosen)  # where: which step a load without one resolved
            raise_typed(failure)
        watch.finish()
        return chosen, reader, resumed, local is not None

    def nothing_committed(self) -> CheckpointNotFoundError:
        ctx = self.ctx
        return CheckpointNotFoundError(f"no committed checkpoint for run {ctx.run_id!r} under "
                                       f"{ctx.layout.storage.describe()}", run_id=ctx.run_id)

    def resolve(self, step: int | None,
                wanted: str | None = None) -> tuple[int | None, str | None, ResumePoint | None]:
        """Rank 0: (step, save_id, resume point) to load from the durable root: every rank then waits for that exact
        attempt, and the resume point says which later steps this job's saves may supersede (P14)."""
        ctx, layout = self.ctx, self.ctx.layout
        if step is None:
            step = self.latest()
            if step is None:
                return None, None, None
        validate_step(step)
        if not layout.storage.is_dir(layout.step_dir(step)):  # no trace of it: nothing to wait for (P9)
            raise CheckpointNotFoundError(
                f"run {ctx.run_id!r} has no step {step} ({layout.step_dir(step)} does not exist); "
                "manager.steps() lists the committed ones", step=step)
        save_id = read_marker(layout, step, Deadline(ctx.timeout)).save_id
        if wanted is not None and save_id != wanted:
            raise CheckpointNotFoundError(
                f"step {step} of run {ctx.run_id!r} holds save {save_id}, not the requested save {wanted} (the step "
                "was saved again since); nothing was loaded", step=step, save_id=wanted)
        return step, save_id, resume_point(layout, step)

    def latest(self) -> int | None:
        """Rank 0: the durable root's newest committed step."""
        ctx = self.ctx
        return scan_latest_step(ctx.root, ctx.run_id, ctx.storage_options, timeout=ctx.timeout, missing_root_ok=True)

    def resumed_at(self, step: int) -> ResumePoint:
        """Rank 0: the resume point of a load another tier served (the snapshot tier): at ``step``, above every
        sequence this process knows, so later saves supersede what that restore abandoned (P14)."""
        durable = resume_point(self.ctx.layout, step)
        return ResumePoint(step=step, sequence=max(durable.sequence, known_sequence(self.ctx.layout)))

    def metadata(self, step: int | None) -> dict[str, Any]:
        """Rank 0: the user metadata of ``step`` (None: the newest), read from its verified manifest."""
        chosen, _, _ = self.resolve(step)
        if chosen is None:
            raise self.nothing_committed()
        return read_committed(self.ctx.layout, chosen, Deadline(self.ctx.timeout)).manifest.user_metadata or {}
