"""The one global gradient norm over DTensors that live on different meshes.

With expert parallelism, dense gradients are DTensors on the dense mesh (1-D dp_shard, or 2-D
dp_shard x tp) and expert gradients are DTensors on the expert mesh (efsdp x ep). DTensor refuses
arithmetic across meshes, so the norm is taken per mesh (each reduced over its own mesh: a plain,
identical value on every rank) and the per-mesh norms are combined: (sum of n_g^p)^(1/p), or the
max for the inf-norm.

bf16 gradients are measured in float64 where the device has it (CPU, CUDA; float32 on NPUs): the
squares of bf16 values are exact in float64 and their sums are exact to ~1e-16, so the norm, and
with it the clipping coefficient, comes out bitwise the same whatever the sharding and summation
order. In float32 the order shows (1e-7 apart between 1 and 2 processes), and scaling bf16
gradients by coefficients 1e-7 apart flips some of them by a bf16 step: layouts drifted 1e-4 apart
within 16 steps, while with float64 they stay bitwise equal.
"""
from __future__ import annotations

import math
from typing import List

import torch
from torch.distributed.tensor import DTensor

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def group_by_mesh(params) -> List[list]:
    """Parameters grouped by their gradient's device mesh (plain tensors in a group of their own),
    in order of first appearance: the same order on every rank."""
    groups: dict = {}
    for param in params:
        grad = param.grad
        key = grad.device_mesh if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(param)
    return list(groups.values())


def total_norm(groups: List[list], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients of ``groups`` together, as a plain tensor, identical on every rank."""
    norm_type = float(norm_type)
    norms = []
    for params in groups:
        grads = [p.grad for p in params]
        if any(g.dtype in _LOW_PRECISION for g in grads):     # bf16 gradients: see the module docstring
            wide = torch.float32 if grads[0].device.type == "npu" else torch.float64
            norm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g, norm_type, dtype=wide) for g in grads]), norm_type).to(torch.float32)
        else:
            norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        norms.append(norm)
    if not norms:
        return torch.tensor(0.0)
    if len(norms) == 1:
        return norms[0]
    device = norms[0].device
    stacked = torch.stack([n.to(device=device, dtype=torch.float64) for n in norms])
    if math.isinf(norm_type):
        combined = stacked.max()
    else:
        combined = stacked.pow(norm_type).sum().pow(1.0 / norm_type)
    return combined.to(norms[0].dtype)
