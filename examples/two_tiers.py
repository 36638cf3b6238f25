# examples/two_tiers.py: torchrun --nproc-per-node 2 examples/two_tiers.py DIR
import os
import shutil
import sys

import torch
import torch.distributed as dist

from dcp_atomic import CheckpointManager, LocalTierOptions

dist.init_process_group("gloo")
rank = dist.get_rank()
local_root = os.path.join(sys.argv[1], f"node{rank}-nvme")  # on a cluster: the node's own disk, e.g. /local_nvme/ckpt


def manager():
    # Here each rank plays one node; on a cluster leave failure_domain out ($DCP_ATOMIC_FAILURE_DOMAIN, else the host).
    return CheckpointManager(os.path.join(sys.argv[1], "durable"), "run1", local=LocalTierOptions(
        local_root, replicas=1, keep_local=2, durable_every=2, failure_domain=f"node{rank}"))


torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
with manager() as checkpoints:
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.add_(0.1)
        checkpoints.save(step, {"model": model.state_dict()})  # local-committed: replicas on the other node verified
    checkpoints.wait()  # step 2 was also drained to the durable root in the background; wait() waits for it
    # (leaving the `with` block, close() drains step 3 too: the last step of a job reaches the durable root)
    local_steps, durable_steps = checkpoints.steps(tier="local"), checkpoints.steps(tier="durable")

dist.barrier()
if rank == 1:
    shutil.rmtree(local_root)  # node 1 is replaced: its disk comes back empty
dist.barrier()

fresh = torch.nn.Linear(8, 4)
state = {"model": fresh.state_dict()}
with manager() as checkpoints:
    step = checkpoints.load(state)  # node 1 gets its files back from node 0's replicas, verified
    served = checkpoints.restored_from
assert torch.equal(fresh.weight, model.weight)
if rank == 1:
    print(f"local steps {local_steps}, durable {durable_steps}; restored step {step} from the {served['tier']} tier, "
          f"{served['ranks_fetched']} ranks' files fetched from the other node")
dist.destroy_process_group()
