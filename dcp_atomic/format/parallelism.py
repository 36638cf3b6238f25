"""The parallel layout a checkpoint was saved with (P6).

Recorded in the manifest so a load can tell "only the data-parallel degree
changed" (safe: FSDP/DTensor reshard natively) from "tensor_parallel_size
changed" (needs consent: a rebuilt image with a new default TP size is a
classic source of silently wrong weights).

Which degree needs consent follows from what the weights depend on:

* ``tp``, ``pp`` and ``ep`` decide which rank holds which slice of a weight
  (expert parallelism places whole experts on ranks); state kept outside
  DTensors — manual shards, fused layouts, per-rank router counters — is only
  sound under the layout it was saved with, so changing them needs consent.
* ``dp`` and ``cp`` do not: context parallelism splits the *sequence*, and the
  weights are replicated or FSDP-sharded across it exactly as across ``dp``
  (torchtitan even folds ``dp_shard`` and ``cp`` into one ``fsdp`` dimension).

Frameworks name their mesh dimensions differently; :data:`MESH_DIM_ROLES` is
the one table of the names this library understands (torchtitan 0.3's dense,
sparse and data-loading meshes; Lightning's ``ModelParallelStrategy``).  A
name outside it is reported by name, never guessed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from .._base import arguments
from ..errors import ArgumentError, ConfigurationError

#: What each mesh dimension name means for the layout.  Roles: ``tp``/``pp``/``cp``/``ep`` are those degrees;
#: ``dp`` is the whole data-parallel degree; ``dp_replicate``/``dp_shard`` multiply to it; ``dp_shard*cp`` is
#: FSDP folded over context parallelism (weights cannot tell the two apart, so it counts as data parallel);
#: ``efsdp`` is FSDP over the ranks experts share (``efsdp * ep == dp_shard * cp * tp``); ``dp*cp`` (the loss
#: dim) and ``world`` only restate the others: they are checked against them, never read alone.
MESH_DIM_ROLES: dict[str, str] = {
    # torchtitan (MeshAxisName and build_mesh of 0.3; dp_shard_cp / dp_cp from earlier releases)
    "tp": "tp",
    "pp": "pp",
    "cp": "cp",
    "ep": "ep",
    "dp": "dp",
    "batch": "dp",  # torchtitan's data-loading dim: dp_replicate * dp_shard
    "dp_replicate": "dp_replicate",
    "dp_shard": "dp_shard",
    "fsdp": "dp_shard*cp",
    "dp_shard_cp": "dp_shard*cp",
    "efsdp": "efsdp",  # FSDP inside the expert region (torchtitan's sparse mesh): dp_shard * cp * tp / ep
    "dp_cp": "dp*cp",  # the loss dim
    "loss_mesh": "dp*cp",
    "world": "world",
    # Lightning's ModelParallelStrategy
    "data_parallel": "dp",
    "tensor_parallel": "tp",
}


@dataclass(frozen=True)
class Parallelism:
    """A job's layout.  ``cp`` and ``ep`` came later: manifests without them read as 1, and old positional
    calls (``Parallelism(tp, dp, pp, mesh_shape, mesh_dim_names)``) keep their meaning."""

    tp: int = 1
    dp: int = 1
    pp: int = 1
    mesh_shape: tuple[int, ...] | None = None
    mesh_dim_names: tuple[str, ...] | None = None
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "pp", "cp", "ep"):
            arguments.count(f"Parallelism({name}=...)", getattr(self, name), optional=False)
        if (self.dp * self.cp * self.tp) % self.ep:  # experts are spread over ranks the other degrees make
            raise arguments.refused("Parallelism(ep=...)", self.ep, f"a divisor of dp*cp*tp={self.dp * self.cp * self.tp}"
                                    " (experts are spread over the ranks of the other degrees)")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp * self.cp  # ep reuses ranks of dp, cp and tp

    @classmethod
    def from_device_mesh(cls, mesh) -> "Parallelism":
        """The layout of a named DeviceMesh; raises :class:`ConfigurationError` naming any dimension it does
        not know (see :data:`MESH_DIM_ROLES`)."""
        names = tuple(mesh.mesh_dim_names or ())
        shape = tuple(int(s) for s in mesh.mesh.shape)
        if len(names) != len(shape):
            raise ConfigurationError(
                f"Parallelism.from_device_mesh needs a mesh with mesh_dim_names (got a mesh of shape {list(shape)} "
                "without names); build it with init_device_mesh(..., mesh_dim_names=...) or pass Parallelism(...)",
                mesh_shape=list(shape),
            )
        return cls.from_mesh_dims([list(zip(names, shape))])

    @classmethod
    def from_mesh_dims(cls, meshes: Iterable[Iterable[tuple[str, int]]]) -> "Parallelism":
        """The layout implied by the (name, size) dimensions of one or more meshes of one job.

        A name means the same dimension on every mesh it appears on (torchtitan slices its dense and sparse
        meshes from one world), so sizes are merged by name; names that describe one degree twice (``batch``
        and ``dp_shard``) must agree.  Raises :class:`ConfigurationError` naming what it cannot read.
        """
        sizes: dict[str, int] = {}
        clashes: list[str] = []
        for mesh in meshes:
            for name, size in mesh:
                if sizes.setdefault(name, int(size)) != int(size):
                    clashes.append(f"{name!r} is {sizes[name]} on one mesh and {size} on another")
        unknown = sorted(set(sizes) - set(MESH_DIM_ROLES))
        if unknown:
            raise ConfigurationError(
                f"unknown device-mesh dimension name(s) {unknown} (mesh dims {sizes}); the layout cannot be read "
                f"from them. Known names: {sorted(MESH_DIM_ROLES)}. Rename the mesh dims or pass "
                "Parallelism(tp=..., dp=..., pp=..., cp=..., ep=...) explicitly",
                unknown=unknown, mesh_dims=sizes,
            )
        by_role: dict[str, dict[str, int]] = {}
        for name, size in sizes.items():
            by_role.setdefault(MESH_DIM_ROLES[name], {})[name] = size

        def degree(role: str) -> int | None:
            found = by_role.get(role, {})
            if len(set(found.values())) > 1:
                clashes.append(f"{role} is given as {found}")
            return next(iter(found.values()), None)

        tp, pp, cp, ep = (degree(r) or 1 for r in ("tp", "pp", "cp", "ep"))
        total, folded = degree("dp"), degree("dp_shard*cp")
        dp_shard = degree("dp_shard")
        if dp_shard is None and folded is not None:
            if folded % cp:
                clashes.append(f"{by_role['dp_shard*cp']} (dp_shard * cp) is not a multiple of cp={cp}")
            dp_shard = folded // cp
        elif dp_shard is not None and folded is not None and folded != dp_shard * cp:
            clashes.append(f"{by_role['dp_shard*cp']} is not dp_shard={dp_shard} * cp={cp}")
        efsdp = degree("efsdp")
        if efsdp is not None:  # the sparse mesh: its FSDP dim spans dp_shard * cp * tp / ep ranks
            if dp_shard is None and total is None:
                if (efsdp * ep) % (cp * tp):
                    clashes.append(f"efsdp={efsdp} * ep={ep} is not a multiple of cp={cp} * tp={tp}")
                dp_shard = efsdp * ep // (cp * tp)
            elif dp_shard is not None and efsdp * ep != dp_shard * cp * tp:
                clashes.append(f"efsdp={efsdp} * ep={ep} is not dp_shard={dp_shard} * cp={cp} * tp={tp}")
        parts = [d for d in (degree("dp_replicate"), dp_shard) if d is not None]
        dp = total if total is not None else math.prod(parts)
        if total is not None and parts and math.prod(parts) != total:
            clashes.append(f"data-parallel degree {by_role['dp']} is not dp_replicate * dp_shard = {math.prod(parts)}")
        for role, what, expected in (("dp*cp", "dp * cp", dp * cp), ("world", "the world", dp * cp * tp * pp)):
            if degree(role) not in (None, expected):  # e.g. torchtitan's flat ("world",) mesh passed alone
                clashes.append(f"{by_role[role]} is not {what} that the other dims make ({expected}); this dim "
                               "only restates the others")
        if clashes:
            raise ConfigurationError(
                f"device-mesh dims {sizes} do not describe one layout: " + "; ".join(clashes)
                + ". Pass Parallelism(...) explicitly",
                mesh_dims=sizes,
            )
        try:
            return cls(tp=tp, dp=dp, pp=pp, cp=cp, ep=ep, mesh_shape=tuple(sizes.values()),
                       mesh_dim_names=tuple(sizes))
        except ArgumentError as e:
            raise ConfigurationError(f"device-mesh dims {sizes}: {e.message}. Pass Parallelism(...) explicitly",
                                     mesh_dims=sizes) from None

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Parallelism":
        return cls(
            tp=int(raw.get("tp", 1)),
            dp=int(raw.get("dp", 1)),
            pp=int(raw.get("pp", 1)),
            cp=int(raw.get("cp", 1)),
            ep=int(raw.get("ep", 1)),
            mesh_shape=tuple(raw["mesh_shape"]) if raw.get("mesh_shape") else None,
            mesh_dim_names=tuple(raw["mesh_dim_names"]) if raw.get("mesh_dim_names") else None,
        )

    def describe(self) -> str:
        extra = "".join(f", {name}={getattr(self, name)}" for name in ("cp", "ep") if getattr(self, name) != 1)
        return f"tensor_parallel_size={self.tp} (dp={self.dp}, pp={self.pp}{extra}, world={self.world_size})"
