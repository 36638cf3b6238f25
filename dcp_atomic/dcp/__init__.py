"""DCP's storage layer: ``AtomicStorageWriter`` / ``AtomicStorageReader``, the planners, identity and layout checks,
read checks and shared reads.  Everything ``dcp.save`` / ``dcp.load`` calls."""
