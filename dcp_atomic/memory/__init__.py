"""The memory tier (P16): every rank's state snapshotted into RAM-backed slots at every step, copies verified on other
failure domains, one commit sequence with the other tiers, and restores from it.  Below the manager, which drives it;
built on the local tier's placement and the one transport."""

from .._base.faces import face

# The face: what the other layers import from here (tests/guards/test_layers.py holds them to it), by module.
__all__, __getattr__, __dir__ = face(__name__, {
    "items": ("flatten", "install"),
    "options": ("MemoryTier",),
    "slots": ("SlotDir", "SlotRecord", "SlotSink", "newest_complete", "slot_of", "verify_slot"),
    "snapshots": ("MemorySnapshots", "Restored", "SnapshotFuture"),
})
