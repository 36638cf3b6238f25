"""Drop-in integrations for the frameworks that call DCP for their users.

Each module imports its framework on import, so import only the one you use:
``dcp_atomic.integrations.torchtitan`` (``AtomicCheckpointManager``),
``dcp_atomic.integrations.lightning`` (``AtomicModelParallelStrategy``) and
``dcp_atomic.integrations.accelerate`` (``AcceleratorCheckpoint``).
"""

__all__: list[str] = []  # no face: each module imports its framework, so a caller imports the one it uses
