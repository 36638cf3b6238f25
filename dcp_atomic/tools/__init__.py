"""What runs beside training: the ``dcp-atomic`` command line, verification (audit), export to torch and
safetensors, import of stock DCP checkpoints, and the demo."""
