"""Expert parallelism: whole experts per rank over ``ep``, tokens moved by all-to-all.

Why transformers' machinery: the model's own EP plan (`config.base_model_ep_plan`: `grouped_gemm`
expert weights split on the expert dim, `ep_dispatch_experts` on the experts module) and
`transformers.distributed.expert_parallel.apply_expert_parallelism` with its `AllToAllEP` compose
with hyperacc's meshes: the expert weights become meta DTensors ``Shard(0)`` on the expert mesh's
``ep`` dim; the experts module's forward sends each (token, expert) pair to the expert's rank with
`all_to_all_single` (uneven splits, autograd through the functional all-to-all), runs the local
experts with the model's `experts_implementation` (`grouped_mm` or the loop) and brings the
weighted outputs back. With TP the ranks of a tp group share a batch; AllToAllEP lets each send a
disjoint slice, so every token reaches its experts once.

What hyperacc adds: the experts modules are FSDP units of their own on the expert mesh's ``efsdp``
dim (x ``dp_replicate`` under HSDP), sharded before their decoder blocks; everything else stays on
the dense mesh. Gradient factors: every rank scales its loss by dp_size / (global tokens) and FSDP
averages dense gradients over the dp ranks, which gives the global token mean. An expert's gradient
already holds, through the all-to-all's backward, the tokens its ep group routed to it (each token
once), and the efsdp (x dp_replicate) reduction adds the other groups': every token of the step
exactly once, times dp_size. So the experts' FSDP reduction must *sum* and divide by dp_size:
`set_gradient_divide_factor(dp_size)`, on gloo (no PREMUL_SUM) with
`set_force_sum_reduction_for_comms(True)` as well, except where efsdp is 1 (no reduce-scatter: FSDP
divides by the factor itself and a forced sum would divide a second time).
"""
from __future__ import annotations

from typing import Dict, List

import torch.nn as nn

from hyperacc.parallel.plans import expand_plan, model_plan

DISPATCH_STYLE = "ep_dispatch_experts"
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def num_experts(model: nn.Module) -> int:
    """Routed experts per MoE layer from the model's config; 0 for a dense model."""
    config = getattr(model, "config", None)
    for field in _EXPERT_COUNT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def check_expert_parallel(model: nn.Module, ep_size: int) -> None:
    """Raise (before any collective) when ``model``'s experts cannot be split over ``ep_size`` ranks."""
    if ep_size <= 1:
        return
    experts = num_experts(model)
    if not experts:
        raise ValueError(f"ep_size={ep_size} but {type(model).__name__} is a dense model (no experts in its "
                         "config): expert parallelism needs a mixture-of-experts model. Set ep_size=1.")
    plan = model_plan(model, "ep")
    if DISPATCH_STYLE not in plan.values():
        raise ValueError(f"ep_size={ep_size} but {type(model).__name__} publishes no expert-parallel plan with "
                         f"'{DISPATCH_STYLE}' (config.base_model_ep_plan): set ep_size=1.")
    if experts % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide the {experts} experts of {type(model).__name__}: "
                         f"each expert-parallel rank holds whole experts. Pick an ep_size dividing {experts}.")


def expert_parallel_plan(model: nn.Module, ep_size: int) -> Dict[str, str]:
    return expand_plan(model, model_plan(model, "ep")) if ep_size > 1 else {}


def apply_expert_parallel(model: nn.Module, ep_mesh, tp_mesh, plan: Dict[str, str]) -> List[nn.Module]:
    """Split the experts over ``ep_mesh`` and install the all-to-all dispatch; returns the experts
    modules (each becomes an FSDP unit on the expert mesh)."""
    # Public entry point of transformers' EP styles (transformers >= 5.21).
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    apply_expert_parallelism(model, ep_mesh, tp_mesh, plan, ep_implementation="all_to_all")
    modules = dict(model.named_modules())
    return [modules[name] for name, style in plan.items() if style == DISPATCH_STYLE]


def set_expert_gradient_reduction(experts: List[nn.Module], dp_size: int, efsdp_size: int) -> None:
    """Make FSDP sum the expert gradients over the expert-FSDP ranks and divide by ``dp_size``."""
    for module in experts:
        module.set_gradient_divide_factor(float(dp_size))
        if efsdp_size > 1:
            module.set_force_sum_reduction_for_comms(True)
