"""Fail-closed checks on 2 processes: every rank raises the same error and no collective hangs.

Raw FSDP2 (fully_shard on a cpu mesh) + Checkpointer, no Accelerator. Writes OUT.rank<R>.json.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hyperacc.checkpoint import Checkpointer, TrainState
from hyperacc.config import CheckpointConfig
from hyperacc.runtime.progress import Progress


class Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def build(mesh, extra_layer=False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)] + ([torch.nn.Linear(4, 4)] if extra_layer else [])
    model = torch.nn.Sequential(*layers)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return TrainState(models=[model], optimizers=[opt], schedulers=[], loader=None, progress=Progress(),
                      dp_rank=dist.get_rank(), dp_size=dist.get_world_size(), seed=1)


def main():
    out, root = sys.argv[1], sys.argv[2]
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

    config = CheckpointConfig(checkpoint_dir=root, is_async=True)
    state = build(mesh)
    state.models[0](torch.randn(2, 16)).sum().backward()
    state.optimizers[0].step()
    state.progress.global_step = 2
    ckpt = Checkpointer(config, device_type="cpu")
    attempt("async_save", lambda: os.path.basename(ckpt.save(state)))
    attempt("load_after_async", lambda: os.path.basename(ckpt.load(build(mesh), "LATEST")))   # waits first
    attempt("missing_dir", lambda: ckpt.load(build(mesh), os.path.join(root, "nope")))
    attempt("missing_key", lambda: ckpt.load(build(mesh, extra_layer=True), "LATEST"))
    if rank == 0:
        os.rename(os.path.join(root, "global_step_2", "extra_state", "extra_state_rank_1.pt"),
                  os.path.join(root, "moved.pt"))
    dist.barrier()
    attempt("missing_rank_file_verified", lambda: ckpt.load(build(mesh), "LATEST"))   # manifest check
    unverified = Checkpointer(config, device_type="cpu", integrity=False)   # the checks behind it
    attempt("missing_rank_file", lambda: unverified.load(build(mesh), "LATEST"))
    if rank == 0:
        os.rename(os.path.join(root, "moved.pt"),
                  os.path.join(root, "global_step_2", "extra_state", "extra_state_rank_1.pt"))
    dist.barrier()
    rank1_file = os.path.join(root, "global_step_2", "extra_state", "extra_state_rank_1.pt")
    if rank == 0:             # a pickle payload in rank 1's file only: rank 1 refuses, rank 0 must not hang
        os.rename(rank1_file, os.path.join(root, "moved.pt"))
        torch.save({"progress": Evil(os.path.join(root, "pwned"))}, rank1_file)
    dist.barrier()
    attempt("unsafe_rank1_file", lambda: unverified.load(build(mesh), "LATEST"))
    results["pwned"] = os.path.exists(os.path.join(root, "pwned"))
    dist.barrier()
    if rank == 0:
        os.replace(os.path.join(root, "moved.pt"), rank1_file)
    dist.barrier()
    fresh = build(mesh)
    attempt("load_ok", lambda: os.path.basename(ckpt.load(fresh, "LATEST")))
    results["weights_equal"] = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(fresh.models[0].parameters(), state.models[0].parameters()))
    ckpt.finish(state)
    with open(f"{out}.rank{rank}.json", "w") as handle:
        json.dump(results, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
