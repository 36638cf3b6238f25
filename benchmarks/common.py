"""What several scenarios share: state dicts, bit-exact checks, memory probes, the media they write to."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Callable

import torch

GB = 1e9
MiB = 2**20
RUN_ID = "bench"


class BenchError(RuntimeError):
    pass


def say(line: str) -> None:
    """Progress goes to stderr (tables go to stdout)."""
    print(line, file=sys.stderr, flush=True)


def quiet_warnings() -> None:
    warnings.filterwarnings("ignore", message=r".*assuming the intent is to (save|load) in a single process")
    warnings.filterwarnings("ignore", message=r".*Detected an existing checkpoint.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*TypedStorage is deprecated.*")
    logging.getLogger("dcp_atomic").setLevel(logging.WARNING)


# -- state dicts ----------------------------------------------------------------------------


def layer_weight_shapes(hidden: int) -> dict[str, tuple[int, int]]:
    """One decoder layer's matrices (grouped-query attention, 4x MLP)."""
    kv = hidden // 4
    return {
        "attn.qkv.weight": (hidden + 2 * kv, hidden),
        "attn.out.weight": (hidden, hidden),
        "mlp.up.weight": (4 * hidden, hidden),
        "mlp.down.weight": (hidden, 4 * hidden),
    }


def plan_transformer(target_bytes: float, hidden: int) -> tuple[list[tuple[str, tuple[int, ...]]], int]:
    """The weight matrices (fqn, global shape) whose weights + two fp32 moments come nearest ``target_bytes``."""
    slots: list[tuple[str, tuple[int, ...]]] = []
    total = layers = 0
    for layer in itertools.count():
        for name, shape in layer_weight_shapes(hidden).items():
            group = math.prod(shape) * (2 + 4 + 4)  # bf16 weight + two fp32 moments
            if slots and total + group / 2 > target_bytes:
                return slots, layers
            slots.append((f"layers.{layer}.{name}", shape))
            total += group
            layers = layer + 1
    raise AssertionError("unreachable")


def transformer_bytes(target_bytes: float, hidden: int) -> int:
    """Logical tensor bytes of :func:`transformer_state` (all ranks together)."""
    slots, layers = plan_transformer(target_bytes, hidden)
    return sum(math.prod(s) for _, s in slots) * 10 + layers * hidden * 2


def transformer_state(target_bytes: float, hidden: int, rank: int = 0, world: int = 1, mesh=None) -> dict:
    """A training job's state: bf16 weights, their two fp32 Adam moments, small objects.

    With a ``mesh`` every tensor is a DTensor sharded ``Shard(0)`` and this is rank ``rank``'s part;
    without one, plain tensors of the whole state.
    """
    from torch.distributed.tensor import DTensor, Shard

    slots, layers = plan_transformer(target_bytes, hidden)

    def sharded(global_shape, dtype, fill: Callable[[tuple, torch.Generator], torch.Tensor], seed: int):
        if global_shape[0] % world:
            raise SystemExit(f"world size {world} does not divide dimension {global_shape[0]}")
        local_shape = (global_shape[0] // world, *global_shape[1:])
        generator = torch.Generator().manual_seed(seed * 1000 + rank)
        local = fill(local_shape, generator).to(dtype)
        if mesh is None:
            return local
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(global_shape),
                                  stride=torch.empty(global_shape, device="meta").stride())

    model: dict[str, Any] = {}
    moments: dict[str, Any] = {}
    seed = itertools.count(1)
    for fqn, shape in slots:
        norm = f"layers.{fqn.split('.')[1]}.norm.weight"
        if norm not in model:
            model[norm] = sharded((hidden,), torch.bfloat16, lambda s, g: torch.ones(s), next(seed))
        model[fqn] = sharded(shape, torch.bfloat16, lambda s, g: torch.randn(s, generator=g) * 0.02, next(seed))
        moments[fqn] = {
            "exp_avg": sharded(shape, torch.float32, lambda s, g: torch.randn(s, generator=g) * 1e-3, next(seed)),
            "exp_avg_sq": sharded(shape, torch.float32, lambda s, g: torch.rand(s, generator=g) * 1e-6, next(seed)),
        }
    return {
        "model": model,
        "optim": {
            "state": moments,
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": sorted(moments)}],
        },
        "step": 12_345,
        "dataloader": {"epoch": 2, "samples_seen": 98_765_432, "shard_order": list(range(64))},
        "config": {"name": "bench-transformer", "hidden": hidden, "layers": layers, "dtype": "bfloat16"},
    }


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def flat_items(tree, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted path, leaf) pairs; tensors are leaves, as are non-dict/list values."""
    if isinstance(tree, dict):
        return [kv for key, value in tree.items() for kv in flat_items(value, f"{prefix}{key}.")]
    if isinstance(tree, list) and any(isinstance(v, (dict, list, torch.Tensor)) for v in tree):
        return [kv for i, value in enumerate(tree) for kv in flat_items(value, f"{prefix}{i}.")]
    return [(prefix[:-1], tree)]


def tensor_bytes(tree) -> int:
    return sum(local_of(v).nbytes for _, v in flat_items(tree) if isinstance(v, torch.Tensor))


def zeroed_like(tree):
    """Same structure, tensors zero-filled (DTensors stay DTensors), other values None (a load must restore them)."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {key: zeroed_like(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [zeroed_like(value) for value in tree]
    return None


def clear(tree) -> None:
    """Zero every tensor in place and set every other leaf to None (for a verified load)."""
    containers = [tree]
    while containers:
        node = containers.pop()
        keys = node.keys() if isinstance(node, dict) else range(len(node))
        for key in keys:
            value = node[key]
            if isinstance(value, torch.Tensor):
                local_of(value).zero_()
            elif isinstance(value, (dict, list)):
                containers.append(value)
            else:
                node[key] = None


def assert_bit_exact(expected, actual, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        ok = (isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype
              and torch.equal(local_of(actual), local_of(expected)))
        if not ok:
            raise BenchError(f"loaded value differs from the saved one at {where or '<root>'}")
    elif isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            raise BenchError(f"loaded keys differ from the saved ones at {where or '<root>'}")
        for key in expected:
            assert_bit_exact(expected[key], actual[key], f"{where}.{key}" if where else str(key))
    elif isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            raise BenchError(f"loaded list differs at {where or '<root>'}")
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_bit_exact(e, a, f"{where}[{i}]")
    elif actual != expected:
        raise BenchError(f"loaded {actual!r} != saved {expected!r} at {where or '<root>'}")


# -- memory ---------------------------------------------------------------------------------

_libc = None


def malloc_trim() -> None:
    global _libc
    try:
        _libc = _libc or ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakRssKinds:
    """Largest growth of anonymous memory (``RssAnon``: heap, buffers) and of mapped shared pages (``RssShmem``: a
    tmpfs slot's pages while mapped) during a ``with`` block, in bytes, sampled every 2 ms by a thread (the kernel
    keeps no high-water mark per kind).  What a memory budget means is the first; the second is the slots."""

    def __enter__(self) -> "PeakRssKinds":  # no collection or trim here: it runs inside a timing
        self.anon_base, self.shmem_base = status_kib("RssAnon") * 1024, status_kib("RssShmem") * 1024
        self.anon_extra = self.shmem_extra = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def _sample(self) -> None:
        while True:
            self.anon_extra = max(self.anon_extra, status_kib("RssAnon") * 1024 - self.anon_base)
            self.shmem_extra = max(self.shmem_extra, status_kib("RssShmem") * 1024 - self.shmem_base)
            if self._stop.wait(0.002):
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._sampler.join()
        self._sample()


class PeakRss:
    """Largest resident-set growth during a ``with`` block, in bytes.

    Resets the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``) and
    reads VmHWM afterwards: exact, and no sampling thread competing for the GIL.
    Falls back to sampling VmRSS every millisecond where clear_refs is refused.
    """

    def __init__(self) -> None:
        self.extra = 0
        self.method = "VmHWM"

    def __enter__(self) -> "PeakRss":
        gc.collect()
        malloc_trim()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._sampler = None
        except OSError:
            self.method = "sampled VmRSS"
            self._peak = 0
            self._stop = threading.Event()
            self._sampler = threading.Thread(target=self._sample, daemon=True)
        self.baseline = status_kib("VmRSS") * 1024
        if self._sampler:
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, status_kib("VmRSS") * 1024)
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        if self._sampler:
            self._stop.set()
            self._sampler.join()
            peak = max(self._peak, status_kib("VmRSS") * 1024)
        else:
            peak = status_kib("VmHWM") * 1024
        self.extra = max(0, peak - self.baseline)


# -- media ----------------------------------------------------------------------------------


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def can_drop_caches() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "not root: cold loads skipped"
    try:
        drop_caches()
    except OSError as e:
        return False, f"/proc/sys/vm/drop_caches not writable ({e.strerror}): cold loads skipped"
    return True, "root: page cache dropped before each cold load (sync; echo 3 > /proc/sys/vm/drop_caches)"


def fs_type(path: str) -> str:
    path = os.path.realpath(path)
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mount, fstype = parts[1], parts[2]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                best, kind = mount, fstype
    return kind


def bytes_on_disk(path: str, control_only: bool = False) -> int:
    """Sum of file sizes under ``path``; ``control_only``: all but the data files (``.distcp``, torch.save's ``.pt``)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            if control_only and name.endswith((".distcp", ".pt")):
                continue
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


class Media:
    """A scratch directory per medium (``disk``, ``tmpfs``): created on enter, removed on exit."""

    def __init__(self, media: list[str], need_bytes: float, disk_root: str | None = None,
                 tmpfs_root: str | None = None) -> None:
        self.media, self.need = media, need_bytes
        self.disk_root, self.tmpfs_root = disk_root, tmpfs_root
        self.dirs: dict[str, str] = {}
        self.notes: dict[str, str] = {}
        self._mounted: str | None = None

    def __enter__(self) -> "Media":
        for medium in self.media:
            if medium == "disk":
                root = self.disk_root or "/var/tmp"
                kind = fs_type(root)
                if kind in ("tmpfs", "ramfs"):
                    raise SystemExit(f"--disk-root {root} is on {kind}, not a disk")
            else:
                root = self.tmpfs_root or "/dev/shm"
                kind = fs_type(root)
                if kind != "tmpfs":
                    root, kind = self._mount_tmpfs(), "tmpfs"
            os.makedirs(root, exist_ok=True)
            folder = tempfile.mkdtemp(prefix="dcp-bench-", dir=root)
            free = shutil.disk_usage(folder).free
            if free < self.need:
                raise SystemExit(f"{medium}: {folder} has {free / GB:.1f} GB free, needs {self.need / GB:.1f} GB")
            self.dirs[medium] = folder
            self.notes[medium] = f"{folder} ({kind}, {free / GB:.0f} GB free)"
        return self

    def _mount_tmpfs(self) -> str:
        if os.geteuid() != 0:
            raise SystemExit("no tmpfs at /dev/shm and not root to mount one: pass --tmpfs-root or --media disk")
        point = tempfile.mkdtemp(prefix="dcp-bench-tmpfs-")
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(1.2 * self.need)}", "tmpfs", point], check=True)
        self._mounted = point
        return point

    def __exit__(self, *exc) -> None:
        for folder in self.dirs.values():
            shutil.rmtree(folder, ignore_errors=True)
        if self._mounted:
            subprocess.run(["umount", self._mounted], check=False)
            os.rmdir(self._mounted)
