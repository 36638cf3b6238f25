"""What runs beside training: the ``dcp-atomic`` command line, verification (audit), the diff of two steps and a
run's save statistics, export to torch and safetensors, import of stock DCP checkpoints, and the demo."""

from .._base.faces import face

# The face: what the other layers import from here (tests/guards/test_layers.py holds them to it), by module.
__all__, __getattr__, __dir__ = face(__name__, {
    "cli": ("main",),
})
