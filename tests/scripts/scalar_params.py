"""0-d (scalar) parameters under hyperacc, on any number of processes (tests/test_accelerate_scripts.py).

FSDP2 refuses 0-d parameters; hyperacc keeps them whole on every rank (`hyperacc.sharding.replicated`). The
model has two of them (``a``, ``b``) beside FSDP-sharded ones, among them ``w``: a 1-element 1-D
twin of ``a`` (the forward uses both the same way, so their local gradients are the same numbers).

Checked here, on every rank:
  * gradients equal a one-process reference (an unsharded copy of the model fed the global batch),
    after a synchronised backward, and after a `no_sync` micro-batch followed by a synchronised one
    (inside `no_sync` the scalar gradients stay local: they differ between ranks);
  * exactness: ``a.grad`` equals the FSDP-reduced gradient of its twin ``w`` bit for bit, so the
    scalars are averaged exactly as FSDP2 averages the rest;
  * values stay identical across ranks and follow the reference optimizer; `clip_grad_norm_`
    counts the scalars once;
  * `save_state` -> perturb -> `load_state` restores them and their optimizer state (the next step
    still follows the reference), and the checkpoint, `get_state_dict`, `unwrap_model` and
    `save_model` all hold them;
  * a model built on the meta device gets its scalars allocated, initialised and reduced.
Argument 2 (optional): ``hsdp`` for a dp_replicate=2 x dp_shard mesh (2-D reduction).
Prints ``RESULT {json}`` (rank 0): the scalars' first gradients and final values, for the test to
compare between world sizes.
"""
import copy
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from accelerate.utils import set_seed
from hyperacc import Accelerator, ParallelConfig

GLOBAL_BATCH = 16
TOL = dict(rtol=1e-6, atol=1e-6)   # fp32 sums in another order: a few ulps of the largest value (~2)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.w = nn.Parameter(torch.tensor([0.7]))      # 1-D: sharded by FSDP2
        self.a = nn.Parameter(torch.tensor(0.7))        # 0-d: kept whole
        self.b = nn.Parameter(torch.tensor(-0.3))       # 0-d: kept whole

    def forward(self, x):
        h = self.lin(x).sum(-1)
        return h * self.a + h * self.w + self.b


class MetaModel(Model):
    """Built on the meta device: prepare() allocates and initialises it (hyperacc.sharding.materialize)."""

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.reset_parameters()
        elif isinstance(module, MetaModel):
            with torch.no_grad():
                module.w.fill_(0.25), module.a.fill_(0.25), module.b.fill_(-0.5)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def gathered(t):
    """Every rank's copy of a plain tensor."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())] if dist.is_initialized() else [t]
    if dist.is_initialized():
        dist.all_gather(parts, t.contiguous())
    return parts


def check_grads(model, ref, where):
    for name, param in model.named_parameters():
        expected = dict(ref.named_parameters())[name].grad
        assert torch.allclose(full(param.grad), expected, **TOL), (where, name, full(param.grad), expected)
    # a and its FSDP-managed twin w had the same local gradients: the reductions must agree exactly.
    assert torch.equal(model.a.grad, full(model.w.grad)[0]), (where, model.a.grad, full(model.w.grad))
    for name in ("a", "b"):
        assert not isinstance(getattr(model, name), DTensor)
        copies = gathered(getattr(model, name).grad)
        assert all(torch.equal(c, copies[0]) for c in copies), (where, name, copies)


def check_values(model, ref, where):
    for name, param in model.named_parameters():
        expected = dict(ref.named_parameters())[name]
        assert torch.allclose(full(param.detach()), expected.detach(), **TOL), (where, name, param, expected)
    for name in ("a", "b"):
        copies = gathered(getattr(model, name).detach())
        assert all(torch.equal(c, copies[0]) for c in copies), (where, name, copies)


def main():
    out_dir = sys.argv[1]
    layout = sys.argv[2] if len(sys.argv) > 2 else "fsdp"
    # "hsdp": a 2-D (dp_replicate x dp_shard) mesh, reduced one mesh dimension at a time
    accelerator = Accelerator(parallel=ParallelConfig(dp_replicate_size=2, dp_shard_size=-1)) \
        if layout == "hsdp" else Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    if layout == "hsdp":
        assert accelerator.mesh["dp_replicate"].size() == 2 and accelerator.mesh["dp_shard"].size() == world // 2
    set_seed(0)
    model = Model()
    ref = copy.deepcopy(model)
    with torch.no_grad():
        if rank == 1:           # a rank with other initial values: prepare() must make them agree
            model.a.add_(5.0)
    data = torch.randn(3, GLOBAL_BATCH, 4)
    target = torch.randn(3, GLOBAL_BATCH)
    mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    check_values(model, ref, "after prepare")

    def local_loss(i):
        return F.mse_loss(model(data[i, mine]), target[i, mine])

    def ref_loss(i):
        return F.mse_loss(ref(data[i]), target[i])

    # 1. one synchronised backward, then a step
    accelerator.backward(local_loss(0))
    ref_loss(0).backward()
    check_grads(model, ref, "synchronised backward")
    first_grads = {"a": model.a.grad.item(), "b": model.b.grad.item()}
    optimizer.step(), ref_optimizer.step()
    check_values(model, ref, "after step 1")
    optimizer.zero_grad(), ref_optimizer.zero_grad()

    # 2. a no_sync micro-batch, then a synchronised one: the sum of both, averaged over ranks
    with accelerator.no_sync(model):
        accelerator.backward(local_loss(1))
    if world > 1:
        copies = gathered(model.a.grad)
        assert not torch.equal(copies[0], copies[1]), "inside no_sync the scalar gradients must stay local"
    accelerator.backward(local_loss(2))
    (ref_loss(1) + ref_loss(2)).backward()
    check_grads(model, ref, "no_sync then synchronised backward")
    norm = accelerator.clip_grad_norm_(model.parameters(), 1e9)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    assert torch.allclose(norm, ref_norm, **TOL), (norm, ref_norm)
    optimizer.step(), ref_optimizer.step()
    check_values(model, ref, "after step 2")
    optimizer.zero_grad(), ref_optimizer.zero_grad()

    # 3. checkpoint round trip
    ckpt = os.path.join(out_dir, "ckpt")
    saved = accelerator.save_state(ckpt)
    assert saved is not None
    keys = set(dcp.FileSystemReader(saved).read_metadata().state_dict_metadata)
    for name in ("a", "b"):
        assert any(key.split(".")[-1] == name and "optim" not in key for key in keys), (name, sorted(keys))
        assert any(key.endswith(f".{name}.exp_avg") for key in keys), (name, sorted(keys))
    with torch.no_grad():
        model.a.add_(1.0), model.b.sub_(1.0)
        optimizer.state[model.a]["exp_avg"].add_(3.0)
    accelerator.load_state(saved)
    check_values(model, ref, "after load_state")
    accelerator.backward(local_loss(0))
    ref_loss(0).backward()
    check_grads(model, ref, "backward after load_state")
    optimizer.step(), ref_optimizer.step()
    check_values(model, ref, "step after load_state (optimizer state restored)")

    # 4. full weights
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        for name in ("a", "b"):
            assert state[name].shape == torch.Size([]), (name, state[name])
            assert torch.allclose(state[name].cpu(), getattr(ref, name).detach(), **TOL)
    assert accelerator.unwrap_model(model).a is model.a
    export = os.path.join(out_dir, "export")
    accelerator.save_model(model, export)
    accelerator.wait_for_everyone()
    # 5. a model built on the meta device: the scalars are allocated on the device and initialised
    with torch.device("meta"):
        meta_model = MetaModel()
    meta_model = accelerator.prepare(meta_model)
    assert not meta_model.a.is_meta and meta_model.a.device == accelerator.device
    assert meta_model.a.item() == 0.25 and meta_model.b.item() == -0.5, (meta_model.a, meta_model.b)
    accelerator.backward(F.mse_loss(meta_model(data[0, mine]), target[0, mine]))
    assert torch.equal(meta_model.a.grad, full(meta_model.w.grad)[0]), (meta_model.a.grad, meta_model.w.grad)

    if accelerator.is_main_process:
        from safetensors.torch import load_file

        files = [f for f in os.listdir(export) if f.endswith(".safetensors")]
        tensors = {}
        for f in files:
            tensors.update(load_file(os.path.join(export, f)))
        for name in ("a", "b"):
            assert tensors[name].shape == torch.Size([]), (name, tensors.get(name))
            assert torch.allclose(tensors[name], getattr(ref, name).detach(), **TOL)
        values = {"a": model.a.item(), "b": model.b.item()}
        print("RESULT " + json.dumps({"world": world, "first_grads": first_grads, "final": values}), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
