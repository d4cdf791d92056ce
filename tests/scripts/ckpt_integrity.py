"""Issue-10 checks on 2 processes (raw FSDP2 on a cpu mesh + Checkpointer): each fault raises the
same error on every rank, and the job goes on (a barrier after each attempt would hang otherwise).

usage: ckpt_integrity.py OUT TMPDIR   -> OUT.rank<R>.json
"""
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hyperacc.checkpoint import Checkpointer, TrainState
from hyperacc.config import CheckpointConfig
from hyperacc.runtime.progress import Progress


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 16)
        self.late = torch.nn.Linear(16, 16)     # used from step 6 on only
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x, step):
        h = torch.tanh(self.first(x))
        if step >= 6:
            h = h + torch.tanh(self.late(h))
        return self.head(h)


def build(mesh, seed=0, groups=1):
    torch.manual_seed(seed)
    model = Net()
    for layer in (model.first, model.late, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    if groups == 2:
        params = [{"params": params[:2]}, {"params": params[2:]}]
    opt = torch.optim.AdamW(params, lr=0.05)
    return TrainState(models=[model], optimizers=[opt], schedulers=[], loader=None, progress=Progress(),
                      dp_rank=dist.get_rank(), dp_size=dist.get_world_size(), seed=1)


def train(state, steps):
    model, opt = state.models[0], state.optimizers[0]
    for _ in range(steps):
        step = state.progress.global_step + 1
        gen = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
        ((model(x, step) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        state.progress.global_step = step


def main():
    out, tmp = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    results = {}

    def attempt(name, fn):
        try:
            results[name] = ["ok", fn()]
        except Exception as err:  # noqa: BLE001
            results[name] = [type(err).__name__, str(err)]
        dist.barrier()            # a hang here would mean the ranks diverged

    # single writer: another process holds the directory
    locked_root = os.path.join(tmp, "locked")
    holder, pid = None, [0]
    if rank == 0:
        holder = subprocess.Popen(
            [sys.executable, "-c", "import time\nfrom hyperacc.checkpoint import Checkpointer\n"
             "from hyperacc.config import CheckpointConfig\n"
             f"Checkpointer(CheckpointConfig(checkpoint_dir={locked_root!r})).lock()\n"
             "print('locked', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "locked"
        pid = [holder.pid]
    dist.broadcast_object_list(pid, src=0)
    results["holder_pid"] = pid[0]
    state = build(mesh)
    train(state, 1)
    attempt("locked", lambda: Checkpointer(CheckpointConfig(checkpoint_dir=locked_root)).save(state))
    if holder is not None:
        holder.kill()
        holder.wait()

    # two checkpoints, then damage the newest
    root = os.path.join(tmp, "ckpt")
    config = CheckpointConfig(checkpoint_dir=root, restore_train_state=True)
    state = build(mesh)
    ckpt = Checkpointer(config)
    for target in (2, 4):
        train(state, target - state.progress.global_step)
        ckpt.save(state)
    ckpt.finish(state)
    step4 = os.path.join(root, "global_step_4")
    if rank == 0:   # a failing disk under rank 1's shard: only rank 1 verifies that file
        with open(os.path.join(step4, "__1_0.distcp"), "r+b") as handle:
            handle.seek(os.path.getsize(handle.name) // 2)
            handle.write(b"\0" * 64)
    dist.barrier()
    reader = CheckpointConfig(checkpoint_dir=root, save_ckpt=False)   # reads only: sets nothing aside
    attempt("flipped_rank1", lambda: Checkpointer(reader).load(build(mesh), step4))
    attempt("latest_fallback", lambda: os.path.basename(Checkpointer(reader).load(build(mesh), "LATEST")))
    if rank == 0:
        with open(os.path.join(step4, "__0_0.distcp"), "r+b") as handle:
            handle.truncate(100)
    dist.barrier()
    attempt("truncated_explicit", lambda: Checkpointer(reader).load(build(mesh), step4))
    attempt("optimizer_mismatch", lambda: Checkpointer(config).load(build(mesh, groups=2),
                                                                    os.path.join(root, "global_step_2")))

    # exact resume with a layer unused until step 6 (no optimizer state at the step-4 save)
    reference = build(mesh)
    train(reference, 8)
    first = build(mesh)
    train(first, 4)
    exact = os.path.join(tmp, "exact")
    saver = Checkpointer(CheckpointConfig(checkpoint_dir=exact))
    path = saver.save(first)
    saver.finish(first)
    resumed = build(mesh, seed=7)
    Checkpointer(CheckpointConfig(checkpoint_dir=exact)).load(resumed, path)
    results["late_layer_no_state"] = resumed.models[0].late.weight not in resumed.optimizers[0].state
    train(resumed, 4)
    results["late_layer_exact"] = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(reference.models[0].parameters(), resumed.models[0].parameters()))
    with open(f"{out}.rank{rank}.json", "w") as handle:
        json.dump(results, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
