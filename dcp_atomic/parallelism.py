"""The parallel layout a checkpoint was saved with (P6).

Recorded in the manifest so a load can tell "only the data-parallel degree
changed" (safe: FSDP/DTensor reshard natively) from "tensor_parallel_size
changed" (needs consent: a rebuilt image with a new default TP size is a
classic source of silently wrong weights).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

_DP_DIMS = ("dp", "dp_shard", "dp_replicate", "dp_shard_cp")


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    dp: int = 1
    pp: int = 1
    mesh_shape: tuple[int, ...] | None = None
    mesh_dim_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Parallelism.{name} must be a positive int, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    @classmethod
    def from_device_mesh(cls, mesh) -> "Parallelism":
        """Read dims named ``tp``, ``pp`` and ``dp`` / ``dp_shard`` / ``dp_replicate``."""
        names = tuple(mesh.mesh_dim_names or ())
        shape = tuple(int(s) for s in mesh.mesh.shape)
        if len(names) != len(shape):
            raise ValueError("Parallelism.from_device_mesh needs a mesh with mesh_dim_names")
        sizes = dict(zip(names, shape))
        dp = 1
        for name in _DP_DIMS:
            dp *= sizes.get(name, 1)
        return cls(tp=sizes.get("tp", 1), dp=dp, pp=sizes.get("pp", 1), mesh_shape=shape, mesh_dim_names=names)

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Parallelism":
        return cls(
            tp=int(raw.get("tp", 1)),
            dp=int(raw.get("dp", 1)),
            pp=int(raw.get("pp", 1)),
            mesh_shape=tuple(raw["mesh_shape"]) if raw.get("mesh_shape") else None,
            mesh_dim_names=tuple(raw["mesh_dim_names"]) if raw.get("mesh_dim_names") else None,
        )

    def describe(self) -> str:
        return f"tensor_parallel_size={self.tp} (dp={self.dp}, pp={self.pp}, world={self.world_size})"
