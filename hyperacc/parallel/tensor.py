"""Tensor parallelism from the model's own plan, applied before `fully_shard`.

Why transformers' machinery: transformers 5.x publishes a TP plan per architecture (Llama, Qwen2/3,
Qwen3-MoE, Mixtral, ...) and implements its styles (`colwise`, `rowwise`, `packed_colwise`,
`embedding_rowwise`, `colwise_gather_output`, `moe_tp_experts`, ...) as DTensor parameters plus
forward hooks (`transformers.distributed.tensor_parallel.apply_tensor_parallelism`). That composes
with hyperacc as it is: the styles turn meta parameters into meta DTensors on ``mesh["tp"]`` (a
sub-mesh of the job's one dense mesh), `fully_shard` over ``mesh["dp_shard"]`` then makes them 2-D
DTensors on the same root mesh (FSDP2 + TP), and `hyperacc.sharding.materialize` fills every rank's
slice of a 2-D DTensor from the full, seeded initialisation with `distribute_tensor(...,
src_data_rank=None)`. Translating each style to torch's `parallelize_module` would duplicate
per-architecture knowledge (packed gate/up expert weights, MoE expert TP, q/k norms over sharded
heads) that transformers already keeps up to date.

Modules with packed weights (`packed_colwise`, e.g. Qwen3-MoE's fused expert gate/up) are left
out of TP: see `tensor_parallel_plan`. One style is replaced: `replicated_with_grad_allreduce` (q/k norms applied to a rank's own heads)
all-reduces the parameter's accumulated ``.grad`` in a post-accumulate hook, which under gradient
accumulation would all-reduce the earlier micro-batches' share again. Here the all-reduce sits in
the autograd graph instead (identity forward, sum over tp in backward), once per use.
"""
from __future__ import annotations

import contextlib
from typing import Dict

import torch
import torch.distributed as dist
import torch.nn as nn

from hyperacc.parallel.plans import drop_covered, expand_plan, model_plan

PARTIAL_GRAD_STYLE = "replicated_with_grad_allreduce"
PACKED_STYLES = ("packed_colwise", "packed_rowwise")


def check_tensor_parallel(model: nn.Module, tp_size: int) -> None:
    """Raise (before any collective) when ``model`` cannot be split over ``tp_size`` ranks."""
    if tp_size <= 1:
        return
    if not model_plan(model, "tp"):
        raise ValueError(f"tp_size={tp_size} but {type(model).__name__} publishes no tensor-parallel plan "
                         "(config.base_model_tp_plan / _tp_plan): use a model that has one, or set tp_size=1.")
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide {type(model).__name__}'s {field}={heads}: "
                             f"each tensor-parallel rank must hold whole heads. Pick a tp_size dividing {heads}.")


def tensor_parallel_plan(model: nn.Module, expert_plan: Dict[str, str]) -> Dict[str, str]:
    """The expanded TP plan, without the modules that expert parallelism takes over, and without
    modules holding packed (fused gate/up) weights: their `_StridedShard` layout cannot be saved by
    torch.distributed.checkpoint (overlapping chunks), so such experts stay whole over tp and are
    split by FSDP over dp_shard (and by EP when ep_size > 1)."""
    plan = drop_covered(expand_plan(model, model_plan(model, "tp")), expert_plan)
    packed = {name.rpartition(".")[0]: style for name, style in plan.items() if style in PACKED_STYLES}
    return _without_tied_aliases(model, drop_covered(plan, packed))


def tied_aliases(model: nn.Module) -> Dict[str, str]:
    """``{alias: owner}`` of tied weights (``lm_head.weight`` -> ``model.embed_tokens.weight``): one
    parameter, listed once by ``named_parameters`` (under its owner's name)."""
    owners = {id(param): name for name, param in model.named_parameters()}
    aliases = {}
    for module_name, module in model.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{attr}" if module_name else attr
            if owners.get(id(param), name) != name:
                aliases[name] = owners[id(param)]
    return aliases


def _without_tied_aliases(model: nn.Module, plan: Dict[str, str]) -> Dict[str, str]:
    """The tied weight is sharded once, by its owner's entry; the alias's parameter entry is dropped
    (its module keeps its forward hooks, and `apply_tensor_parallel` re-ties it to the sharded owner).
    Both entries must split the same dimension, else an error naming them."""
    aliases = tied_aliases(model)
    for alias, owner in aliases.items():
        styles = {plan.get(alias), plan.get(owner)} - {None}
        if len(styles) == 2 and styles - _VOCAB_DIM0_STYLES:
            raise ValueError(f"{alias} is tied to {owner}, but their tensor-parallel styles ({plan[alias]!r}, "
                             f"{plan[owner]!r}) split it differently. Untie the weights "
                             "(config.tie_word_embeddings=False) or set tp_size=1.")
    return {name: style for name, style in plan.items() if name not in aliases}


# Styles that split a [vocab, hidden] weight along dim 0: a tied embedding/head pair may mix them.
_VOCAB_DIM0_STYLES = {"embedding_rowwise", "colwise", "colwise_gather_output"}


def apply_tensor_parallel(model: nn.Module, tp_mesh, plan: Dict[str, str]) -> None:
    """Shard the parameters named by ``plan`` over ``tp_mesh`` and hook their modules' forwards."""
    # Public entry point of transformers' TP styles (transformers >= 5.20).
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    own = {name: style for name, style in plan.items() if style == PARTIAL_GRAD_STYLE}
    aliases = tied_aliases(model)
    apply_tensor_parallelism(model, tp_mesh, {k: v for k, v in plan.items() if k not in own})
    for alias, owner in aliases.items():      # sharding replaced the owner's Parameter: tie again
        module_name, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(module_name), attr, model.get_parameter(owner))
    modules = dict(model.named_modules())
    for name in own:
        if name in modules:
            _sum_grads_over(modules[name], tp_mesh.get_group())


class _SumGradOver(torch.autograd.Function):
    """Identity forward; the gradient is summed over ``group`` in backward."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_grads_over(module: nn.Module, group) -> None:
    """Run ``module`` with its own parameters seen through `_SumGradOver`: each rank's gradient
    covers its own heads only, the sum over the tensor-parallel group is the full gradient."""
    original = module.forward

    def forward(*args, **kwargs):
        with _params_through(module, group):
            return original(*args, **kwargs)
    module.forward = forward


@contextlib.contextmanager
def _params_through(module: nn.Module, group):
    saved = {name: p for name, p in module._parameters.items() if p is not None and p.requires_grad}
    if torch.is_grad_enabled():
        for name, param in saved.items():
            module._parameters[name] = _SumGradOver.apply(param, group)
    try:
        yield
    finally:
        module._parameters.update(saved)

