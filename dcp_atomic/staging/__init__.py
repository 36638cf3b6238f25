"""Bounded staging (P16): live tensors copied window by window through a pool of ``Staging.pool_bytes`` after the
call returns, instead of a whole host copy of the state at the call; a version check per tensor turns an in-place
change before ``wait_staged()`` into a typed ``StagingRaceError``.  ``async_save`` uses :mod:`.live_state`, the
memory tier's snapshots :mod:`.stager`; a durable copy of a memory slot, which nothing changes, goes
as it is (:class:`~.live_state.StableState`)."""

from .._base.faces import face

# The face: what the other layers import from here (tests/guards/test_layers.py holds them to it), by module.
__all__, __getattr__, __dir__ = face(__name__, {
    "live_state": ("LiveState", "StableState"),
    "options": ("Staging",),
    "pool": ("WindowPool",),
    "stager": ("StagedCopy", "StageSink", "Stager"),
    "versions": ("gate_optimizer_steps", "LiveTensor"),
})
