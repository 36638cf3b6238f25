"""The state dict saved on one torch version and loaded on another (the cross-version script imports these)."""

from __future__ import annotations

import torch


RUN = "versions"


def _state() -> dict:
    generator = torch.Generator().manual_seed(7)
    return {
        "transposed": torch.randn(4, 8, generator=generator).t(),  # strides (1, 8): what 2.15 records
        "bf16": torch.randn(33, generator=generator).to(torch.bfloat16),
        "ints": torch.arange(7, dtype=torch.int32),
        "meta": {"epoch": 3},
    }


def _zeros() -> dict:
    return {k: (torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else {"epoch": -1})
            for k, v in _state().items()}


def _assert_loaded(target: dict) -> None:
    for key, value in _state().items():
        assert (torch.equal(target[key], value) if isinstance(value, torch.Tensor) else target[key] == value), key
