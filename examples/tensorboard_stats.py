"""Feed CheckpointManager's statistics (docs/statistics.md) to TensorBoard.

    python examples/tensorboard_stats.py --root /tmp/ckpt --logdir /tmp/tb && tensorboard --logdir /tmp/tb

Single process for brevity.  In a multi-rank job ``on_saved`` runs on rank 0 only, while ``on_loaded`` and
``on_failed`` run on every rank: create the SummaryWriter on rank 0 and pass the callbacks there, or tag
the load and failure scalars with ``stats["rank"]``.  Needs ``pip install tensorboard``.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch.utils.tensorboard import SummaryWriter

from dcp_atomic import Callbacks, CheckpointError, CheckpointManager

warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")


IDENTITY = ("step", "rank", "world_size", "schema_version")  # numbers that are labels, not measurements


def tensorboard_callbacks(board: SummaryWriter) -> Callbacks:
    """``on_saved`` / ``on_loaded`` / ``on_failed`` writing each number under ``checkpoint/<kind>/<field>``
    at the checkpoint's step; a failure adds 1 to ``checkpoint/failures`` and its message as text."""

    def numbers(stats: dict) -> None:
        for name, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name not in IDENTITY:
                board.add_scalar(f"checkpoint/{stats['kind']}/{name}", value, global_step=stats["step"])
        board.flush()

    def failed(stats: dict) -> None:
        board.add_scalar("checkpoint/failures", 1, global_step=stats["step"] or 0)
        board.add_text("checkpoint/failure", f"{stats['operation']} on rank {stats['rank']}: {stats['message']}",
                       global_step=stats["step"] or 0)
        board.flush()

    return Callbacks(on_saved=numbers, on_loaded=numbers, on_failed=failed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="checkpoint root")
    parser.add_argument("--logdir", required=True, help="TensorBoard log directory")
    parser.add_argument("--steps", type=int, default=3, help="checkpoints to save, every 10 steps")
    args = parser.parse_args()

    model = torch.nn.Linear(64, 64)
    with SummaryWriter(args.logdir) as board, \
            CheckpointManager(args.root, "demo", keep_last=2, callbacks=tensorboard_callbacks(board)) as manager:
        for step in range(10, 10 * args.steps + 1, 10):
            manager.async_save(step, {"model": model.state_dict()}).result()
        manager.load({"model": model.state_dict()})
        try:  # a deliberate failure: the last step is committed already
            manager.save(10 * args.steps, {"model": model.state_dict()})
        except CheckpointError as e:
            print(f"failed as intended: {type(e).__name__}")


if __name__ == "__main__":
    main()
