"""0-d (scalar) parameters: FSDP2 cannot shard them, so they are kept whole on every rank.

`fully_shard` refuses a parameter without a dimension ("doesn't support scalar parameters"), yet
models have them (a learned temperature, a gate, accelerate's RegressionModel). `shard_model` passes
them to `fully_shard` as ``ignored_params``: they stay plain tensors, identical on every rank, and
FSDP2 neither gathers nor reduces them. `ReplicatedScalars` does for them what DDP does for every
parameter:

* at prepare, every rank takes the value of the first rank of the FSDP mesh (a broadcast);
* after each backward in which FSDP2 reduces the model's gradients, their gradients are averaged
  over the same ranks FSDP2 averages over (the FSDP mesh: dp_replicate x dp_shard (x cp)), in one
  all-reduce per mesh dimension.

When FSDP2 reduces is its sync flag, which everything sets through the prepared (root) model's
`set_requires_gradient_sync` (accelerate's `no_sync`/`accumulate`, hyperacc's step mode,
`trigger_sync_in_backward`): that method is wrapped to record the flag too. Inside `no_sync` the
scalars' gradients accumulate locally, as FSDP2's unsharded ones do; the next synchronised backward
averages the whole accumulated gradient. That equals FSDP2's result: the part averaged before is
the same on every rank, and averaging is linear.

The reduction runs at the end of backward (an autograd engine callback, queued from the model's
outputs and from the scalars' own gradients), so a rank whose backward does not reach a scalar
still joins the all-reduce (with no gradient: it stays None where no rank produced one).
Everything else sees them as ordinary replicated tensors: the optimizer updates them like any
parameter, state dicts, DCP checkpoints and exports hold them whole, and gradient clipping counts
them once.
"""
from __future__ import annotations

import functools
from typing import List

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves  # private, no public pytree in torch; what FSDP2 flattens outputs with


def scalar_parameters(model: nn.Module) -> List[nn.Parameter]:
    """The model's 0-d parameters, each once (tied ones included once), in registration order."""
    return [param for param in model.parameters() if param.dim() == 0]


class ReplicatedScalars:
    """Keeps ``params`` (plain tensors on every rank of ``mesh``) equal and their gradients averaged."""

    def __init__(self, model: nn.Module, params: List[nn.Parameter], mesh):
        self.params = list(params)
        self.mesh = mesh
        self.requires_sync = True
        self._queued = False
        self._groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
        self._wrap_sync_flag(model)
        model.register_forward_hook(self._after_forward)
        for param in self.params:
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(lambda _param: self._queue())

    def _wrap_sync_flag(self, model: nn.Module) -> None:
        fsdp_set = model.set_requires_gradient_sync

        @functools.wraps(fsdp_set)
        def set_requires_gradient_sync(requires_gradient_sync: bool, *, recurse: bool = True) -> None:
            fsdp_set(requires_gradient_sync, recurse=recurse)
            self.requires_sync = bool(requires_gradient_sync)

        model.set_requires_gradient_sync = set_requires_gradient_sync

    @torch.no_grad()
    def broadcast(self) -> None:
        """Every rank of the mesh takes the value of its first rank (coordinate 0 on every dimension)."""
        for group in self._groups:
            for param in self.params:
                dist.broadcast(param.data, group=group, group_src=0)

    # ------------------------------------------------------------------ backward
    def _after_forward(self, _module, _args, output) -> None:
        self._queued = False      # a backward that raised never ran its callback
        if not torch.is_grad_enabled():
            return
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad):
        self._queue()
        return grad

    def _queue(self) -> None:
        if not self._queued:
            self._queued = True
            # private: torch has no public "run at the end of this backward" hook (FSDP2 uses the same call)
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)

    @torch.no_grad()
    def _reduce(self) -> None:
        self._queued = False
        if not self.requires_sync:
            return
        params = [p for p in self.params if p.requires_grad]
        if not params:
            return
        grads = [p.grad for p in params]
        dtype = functools.reduce(torch.promote_types, [g.dtype for g in grads if g is not None], torch.float32)
        device = params[0].device
        values = [torch.zeros((), dtype=dtype, device=device) if g is None else g.detach().to(dtype) for g in grads]
        present = [(torch.zeros if g is None else torch.ones)((), dtype=dtype, device=device) for g in grads]
        flat = torch.stack(values + present)
        for group in self._groups:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        count = len(params)
        means = flat[:count] / self.mesh.size()
        for index, (param, mean) in enumerate(zip(params, means)):
            if param.grad is not None:
                param.grad.copy_(mean)
            elif flat[count + index].item():     # host read only in this rare case
                param.grad = mean.to(param.dtype)
            # else no rank produced a gradient: it stays None, as under FSDP2


def replicate_scalars(model: nn.Module, params: List[nn.Parameter], mesh) -> None:
    """After `fully_shard(model, ignored_params=params)`: make ``params`` data-parallel replicas."""
    if not params or mesh.size() == 1:
        return
    ReplicatedScalars(model, params, mesh).broadcast()
