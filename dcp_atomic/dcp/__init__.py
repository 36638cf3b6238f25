"""DCP's storage layer: ``AtomicStorageWriter`` / ``AtomicStorageReader``, the planners, identity and layout checks,
read checks and shared reads.  Everything ``dcp.save`` / ``dcp.load`` calls."""

from .._base.faces import face

# The face: what the other layers import from here (tests/guards/test_layers.py holds them to it), by module.
__all__, __getattr__, __dir__ = face(__name__, {
    "identity": ("default_thread_count",),
    "planners": ("AtomicLoadPlanner", "AtomicSavePlanner"),
    "read_checks": ("check_stored_items", "decode_chunk", "item_id", "payload_proven", "read_by_a_load",
                    "read_dcp_metadata"),
    "reader": ("AtomicStorageReader",),
    "reshard": ("check_layout", "infer_parallelism"),
    "reuse": ("refuse_unsupported",),
    "watched": ("WatchedReader", "WatchedSavePlanner", "WatchedWriter"),
    "writer": ("AtomicStorageWriter",),
})
