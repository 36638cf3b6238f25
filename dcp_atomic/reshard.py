"""Load-time layout policy (P6): a tensor/pipeline-parallel size change needs consent.

Same layout: load.  Only dp / world size changed: allowed, logged (FSDP and
DTensor reshard natively).  tp or pp changed: :class:`ReshardError` naming both
layouts unless ``allow_reshard=True``.  A checkpoint or job without a declared
layout loads with a warning that the check was skipped — never silently.
"""

from __future__ import annotations

import logging
from typing import Any

from .errors import ReshardError
from .parallelism import Parallelism

log = logging.getLogger(__name__)
_warned: set[str] = set()


def check_layout(*, saved: dict[str, Any] | None, current: Parallelism | None, allow_reshard: bool, where: str) -> None:
    if saved is None or current is None:
        missing = "the checkpoint" if saved is None else "this job"
        if missing not in _warned:  # once per process: a warning on every load would be noise
            _warned.add(missing)
            log.warning("%s: parallel layout check skipped (%s has no declared or inferable Parallelism)",
                        where, missing)
        return
    before = Parallelism.from_dict(saved)
    if (before.tp, before.pp) == (current.tp, current.pp):
        if before.world_size != current.world_size or before.dp != current.dp:
            log.info("%s: data-parallel reshard %s -> %s", where, before.describe(), current.describe())
        return
    if not allow_reshard:
        raise ReshardError(
            f"{where} was saved with {before.describe()}; this job has {current.describe()}. "
            "Loading across a tensor/pipeline-parallel size change can produce silently wrong weights; "
            "pass allow_reshard=True if this is intended.",
            saved=before.to_dict(),
            current=current.to_dict(),
        )
    log.warning("%s: resharding with consent: %s -> %s", where, before.describe(), current.describe())
