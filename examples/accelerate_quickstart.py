# examples/accelerate_quickstart.py: torchrun --nproc-per-node 2 examples/accelerate_quickstart.py ROOT
import sys

import torch
from accelerate import Accelerator

from dcp_atomic.integrations.accelerate import AcceleratorCheckpoint


def run(until):
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    data = torch.utils.data.DataLoader(torch.randn(64, 8), batch_size=8, shuffle=True)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    with AcceleratorCheckpoint(accelerator, sys.argv[1], run_id="demo", keep_last=2) as checkpoint:
        start = checkpoint.load() or 0          # the latest committed step, verified; None on a fresh start
        for step in range(start + 1, until + 1):
            for batch in data:
                accelerator.backward(model(batch).pow(2).mean())
            optimizer.step(), optimizer.zero_grad(), scheduler.step()
            checkpoint.save(step)               # instead of accelerator.save_state(): one atomic step
        return start, checkpoint.manager.steps(), scheduler.get_last_lr()[0]


run(3)                                          # a first job: steps 1-3
start, kept, lr = run(5)                        # a restart resumes at 3 and trains on
if torch.distributed.get_rank() == 0:
    print(f"resumed from step {start}; kept steps {kept}; learning rate {lr:.4f}")
