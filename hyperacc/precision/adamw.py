"""AdamW for parameters stored in bf16: fp32 arithmetic, moments in a chosen dtype, rounded writes.

torch's AdamW keeps its moments in the parameter's dtype and updates in it, so bf16 parameters get
bf16 moments and round-to-nearest updates, and there is no way to ask for more. This AdamW computes
every update in fp32 from fp32 copies of the parameter, gradient and moments (one parameter at a
time, so the copies are transient), stores the moments in ``state_dtype`` and writes the parameter
back rounded to nearest or stochastically. With fp32 parameters and fp32 moments it performs
exactly the operations of ``torch.optim.AdamW(foreach=False)`` in the same order (bitwise equal).

Stochastic rounding is keyed by what each element *is*: its random bits are a hash of (seed, step,
parameter name, the element's index in the full, unsharded tensor). Every replica of a shard (HSDP,
parameters kept whole on every rank) therefore rounds the same update identically, and the rounding
does not depend on how the tensor is sharded: a bf16 run resumed at another DP size rounds exactly
as the uninterrupted one would have. There is no RNG state to checkpoint. Its state entries
(``step``, ``exp_avg``, ``exp_avg_sq``) are named as torch's, so checkpoints convert between the two
by a cast.

``state_dtype`` / ``stochastic_rounding`` left as None follow the Accelerator's precision recipe at
``prepare`` (fp32 moments, round to nearest when never prepared).

Why not torchao's ``_AdamW(bf16_stochastic_round=True)`` (torchao 0.18, an optional extra; its
``torchao.optim`` has no public ``AdamW``): its update is one compiled, fused kernel, 2.5-5x faster
per step on CPU (4 M bf16 parameters: 0.05-0.15 s against 0.25-0.40 s here; its first step compiles,
~5 s with an empty inductor cache; `benchmarks/libraries_weights.py`, issue 39), but its rounding
bits are ``torch.randint`` over the local shard. Measured on 2 processes after 5 steps: 1 process and
2 (Shard(0)) end up to 0.0625 apart, and two replicas agree only while their global RNG states do
(after one rank drew one random number more, they differ). Ours agrees bitwise in all three cases,
which HSDP replicas, the replica guard and a resume at another world size rely on.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch
from torch.distributed.tensor import DTensor

from hyperacc.precision.rounding import dim_positions, element_indices, rounding_key, rounding_noise, stochastic_round_

__all__ = ["AdamW", "stochastic_round_"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) that is exact for bf16 parameters; see the module docstring."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, state_dtype: Optional[torch.dtype] = None,
                 stochastic_rounding: Optional[bool] = None, seed: Optional[int] = None):
        # Written `not (in range)`: NaN fails every comparison, so it is refused too (and inf by isfinite).
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if not (float(value) >= 0 and math.isfinite(float(value))):
                raise ValueError(f"AdamW: {name}={value} must be a finite number >= 0.")
        if len(tuple(betas)) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
            raise ValueError(f"AdamW: betas={tuple(betas)} must be two numbers in [0, 1).")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.state_dtype = state_dtype
        self.stochastic_rounding = stochastic_rounding
        self.seed = None if seed is None else int(seed)     # None: the Accelerator's seed at prepare
        self.param_names: Dict[int, str] = {}               # id(param) -> name, given at prepare
        self._slice_positions: Dict[int, list] = {}         # id(param) -> its shard's global positions

    def follow_recipe(self, recipe, *, seed: Optional[int] = None, names: Optional[Dict[int, str]] = None) -> None:
        """Take the recipe's moment dtype and rounding, and the run's seed, for whatever the
        constructor left unset; ``names`` (id(param) -> parameter name) key the rounding."""
        if self.seed is None and seed is not None:
            self.seed = int(seed)
        if names:
            self.param_names.update(names)
        if self.state_dtype is None:
            self.state_dtype = recipe.state_dtype
        if self.stochastic_rounding is None:
            self.stochastic_rounding = recipe.stochastic_rounding

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            for param in group["params"]:
                index += 1
                if param.grad is not None:
                    self._update(param, group, index)
        return loss

    def _positions(self, param: torch.Tensor) -> list:
        """`rounding.dim_positions` of ``param``, derived once: a parameter's layout never changes."""
        if id(param) not in self._slice_positions:
            self._slice_positions[id(param)] = dim_positions(param)
        return self._slice_positions[id(param)]

    def _new_state(self, param: torch.Tensor) -> dict:
        dtype = self.state_dtype or torch.float32
        return {"step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)}

    def _update(self, param: torch.Tensor, group: dict, index: int) -> None:
        state = self.state[param]
        if not state:
            state.update(self._new_state(param))
        state["step"] += 1
        step = float(state["step"])
        tensors = [_local(param), _local(param.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"])]
        rounded = self.stochastic_rounding and tensors[0].dtype == torch.bfloat16
        key = rounding_key(self.seed or 0, int(step), self.param_names.get(id(param), f"#{index}")) if rounded else None
        positions = self._positions(param) if key is not None else None
        start = 0
        for pieces in _chunks(tensors):
            noise = None
            if key is not None:
                indices = element_indices(param, start, pieces[0].numel(), positions)
                noise = rounding_noise(key, indices, wide=param.numel() > 1 << 32)
            _adamw_(*pieces, group, step, noise)
            start += pieces[0].numel()


CHUNK = 1 << 22     # elements updated at a time: the fp32 copies of a huge shard stay ~100 MB


def _chunks(tensors):
    """The same flat slices of each tensor (all contiguous and of one shape), or the whole tensors."""
    numel = tensors[0].numel()
    if numel <= CHUNK or not all(t.is_contiguous() and t.shape == tensors[0].shape for t in tensors):
        return [tensors]
    flat = [t.view(-1) for t in tensors]
    return [[f[start:start + CHUNK] for f in flat] for start in range(0, numel, CHUNK)]


def _adamw_(stored, grad, m_stored, v_stored, group: dict, step: float, noise) -> None:
    """One AdamW update of one (piece of a) parameter, in fp32, written back into the stored dtypes."""
    lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    grad = grad.float()
    p = stored.float()              # a copy unless fp32: then the update is in place, as torch's
    m, v = m_stored.float(), v_stored.float()
    # torch.optim.AdamW's single-tensor operations, in its order
    p.mul_(1 - lr * decay)
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (v.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))
    for target, value in ((m_stored, m), (v_stored, v), (stored, p)):
        if target is value or target.data_ptr() == value.data_ptr():
            continue
        if noise is not None and target is stored:
            stochastic_round_(stored, p, noise)
        else:
            target.copy_(value)
