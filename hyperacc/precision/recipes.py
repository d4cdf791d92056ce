"""Precision recipes: in which dtype parameters, gradients and optimizer states live.

One field (``FSDPConfig.precision``) picks the recipe; everything that depends on it reads it here:
sharding (the dtype parameters are stored and reduced in), the optimizer (the dtype of AdamW's
moments and how updates are rounded), the dry run (bytes per parameter) and checkpoints (the recipe
is recorded; a resume under another recipe converts, with a warning).

Why three: fp32 master weights cost 16 bytes per parameter with AdamW, so Qwen3-30B-A3B on 8 ranks
needs 56.9 GiB per rank before any activation -- no room on a 64 GB device. Storing parameters and
gradients in bf16 saves 4 bytes per parameter; bf16 moments save 4 more. What bf16 parameters lose
is small updates: ``p + lr * u`` rounds back to ``p`` when ``lr * u`` is under half a bf16 step
(2^-9 of ``|p|``). Stochastic rounding rounds up with the probability of the lost fraction, so the
expected parameter is the fp32 one and small updates survive on average, at no memory cost. Both
bf16 recipes use it: rounded to nearest, bf16 parameters ended 4.2 % above fp32's loss after 300
steps of the tiny model (its cosine schedule's small late updates vanished); stochastically
rounded, within 0.1 % (benchmarks/precision.py).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Dict, Optional

import torch

from hyperacc.config.recipes import DEFAULT_RECIPE, RECIPE_NAMES, check_recipe_name
from hyperacc.precision.adamw import AdamW

__all__ = ["Recipe", "RECIPES", "DEFAULT_RECIPE", "get_recipe", "check_recipe", "recipe_for",
           "adapt_optimizer"]


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    param_dtype: torch.dtype          # sharded parameters and their gradients
    state_dtype: torch.dtype          # AdamW's exp_avg and exp_avg_sq
    stochastic_rounding: bool         # how an fp32-computed update is written into a bf16 parameter
    summary: str

    @property
    def low_precision(self) -> bool:
        return self.param_dtype != torch.float32

    def bytes_per_param(self) -> Dict[str, int]:
        """Persistent bytes per parameter with AdamW: parameter, gradient, the two moments."""
        size = lambda dtype: torch.empty((), dtype=dtype).element_size()  # noqa: E731
        return {"params": size(self.param_dtype), "grads": size(self.param_dtype),
                "optimizer": 2 * size(self.state_dtype)}


RECIPES: Dict[str, Recipe] = {r.name: r for r in (
    Recipe("fp32_master", torch.float32, torch.float32, False,
           "fp32 parameters (master weights), gradients and AdamW moments; compute in "
           "fsdp.mixed_precision (bf16 all-gathers, fp32 gradient reduction)"),
    Recipe("bf16", torch.bfloat16, torch.float32, True,
           "bf16 parameters and gradients (reduced in fp32), fp32 AdamW moments; each update computed "
           "in fp32 and stochastically rounded"),
    Recipe("bf16_sr", torch.bfloat16, torch.bfloat16, True,
           "bf16 parameters, gradients (reduced in fp32) and AdamW moments; each update computed in "
           "fp32 and stochastically rounded, so small updates survive on average"),
)}


def get_recipe(name: Optional[str]) -> Recipe:
    """The recipe called ``name`` (None: the default), or one ValueError listing the choices."""
    return RECIPES[check_recipe_name(name)]


assert tuple(RECIPES) == RECIPE_NAMES, "hyperacc.config.recipes.RECIPE_NAMES lists every recipe"


def _bf16_supported(device_type: str) -> bool:
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type == "npu":       # bf16 needs Ascend 910B or newer
        npu = getattr(torch, "npu", None)
        check = getattr(npu, "is_bf16_supported", None)
        return bool(check()) if check is not None else True
    return True                     # CPU: bf16 kernels exist everywhere torch 2.x runs


def check_recipe(recipe: Recipe, *, mixed_precision: Optional[str], device_type: str,
                 has_loss_scaler: bool) -> Recipe:
    """``recipe``, or one ValueError naming the problem and the fix when this device cannot run it
    with ``mixed_precision`` (called before any collective)."""
    if mixed_precision == "fp16":
        if recipe.low_precision:
            raise ValueError(f"precision={recipe.name!r} stores bf16 parameters, which cannot compute in "
                             "mixed_precision='fp16'. Fix: mixed_precision='bf16' (or none) with this recipe.")
        if not has_loss_scaler:
            raise ValueError("mixed_precision='fp16' without a loss scaler: fp16 gradients under- and "
                             f"overflow silently, and no scaler exists on {device_type}. Fix: "
                             "mixed_precision='bf16' (no scaler needed).")
    uses_bf16 = recipe.low_precision or mixed_precision == "bf16"
    if uses_bf16 and not _bf16_supported(device_type):
        raise ValueError(f"precision={recipe.name!r} with mixed_precision={mixed_precision!r} needs bf16, which "
                         f"this {device_type} device does not support. Fix: precision='fp32_master' with "
                         "mixed_precision='fp16' (and its loss scaler) or no mixed precision.")
    return recipe


def recipe_for(fsdp_config, device_type: str, has_loss_scaler: bool) -> Recipe:
    """The recipe an `FSDPConfig` names, checked against this device (`check_recipe`)."""
    return check_recipe(get_recipe(fsdp_config.precision), mixed_precision=fsdp_config.mixed_precision,
                        device_type=device_type, has_loss_scaler=has_loss_scaler)


def adapt_optimizer(optimizer, recipe: Recipe, *, seed: Optional[int] = None,
                    names: Optional[Dict[int, str]] = None) -> None:
    """At ``prepare``: give a `hyperacc.precision.adamw.AdamW` the recipe's moment dtype and rounding, and
    refuse torch's Adam/AdamW under a bf16 recipe (bf16 moments, small updates rounded away)."""
    if isinstance(optimizer, AdamW):
        optimizer.follow_recipe(recipe, seed=seed, names=names)   # the run's seed, names key the rounding
        return
    if not recipe.low_precision:
        return
    name = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(f"precision={recipe.name!r} stores bf16 parameters, and {name} would keep bf16 moments "
                         "and round every update to nearest (small updates vanish). Fix: "
                         "hyperacc.precision.adamw.AdamW(params, lr=..., betas=..., eps=..., weight_decay=...) -- "
                         "torch.optim.AdamW's arguments but amsgrad/maximize, decoupled weight decay (torch.optim."
                         "Adam's weight_decay is an L2 term); its states and rounding follow the recipe -- or "
                         f"precision='fp32_master' to keep {name}.")
    warnings.warn(f"precision={recipe.name!r}: {name} updates the bf16 parameters in its own arithmetic; "
                  "hyperacc.precision.adamw.AdamW computes in fp32 and keeps the recipe's states.", stacklevel=3)
