"""`parallelize(model, mesh, config)`: how a model is laid out on the job's meshes, in one function
that reads top to bottom -- tensor parallelism, expert parallelism, context parallelism, per-block
compile, activation recompute, then FSDP2.

Why one function: the order matters and each step assumes the ones before it. TP and EP replace
weights by DTensors on their meshes before FSDP2 shards them further (2-D DTensors on one mesh); CP
only reroutes attention. Compile comes after the TP/EP/CP hooks (dynamo sees them) and before
`fully_shard` (whose hooks then run eagerly around each compiled block); recompute wraps the compiled
forward rather than the other way round (`hyperacc.sharding.compile` says why: torchtitan applies
them the other way, which dynamo would trace as one side-effect-free region and the MoE router's
logit recording is a side effect). Experts become FSDP units of their own on the expert mesh.

Replaceable: ``Accelerator(parallelize_fn=my_parallelize)`` calls ``my_parallelize(model, mesh,
config)`` instead (``mesh``: the job's `hyperacc.runtime.mesh.MeshInfo`, ``config``: its
`hyperacc.FSDPConfig`), composed from the ``apply_*`` steps below or from torch's own. Around it
`prepare()` keeps what every layout needs: the checks (`check_model`, once per prepare, before any
collective), the precision recipe's dtype cast before it, and after it the allocation of meta-device
shards, the 0-d parameters' replication (leave them out of ``fully_shard`` with ``ignored_params``, as
`apply_fsdp` does) and the weights (seeded init, pretrained files, the model kind's own values).
"""
from __future__ import annotations

from typing import List

import torch
from torch import nn

from hyperacc import kinds, parallel
from hyperacc.config import FSDPConfig
from hyperacc.kinds import ModelKind
from hyperacc.precision import get_recipe
from hyperacc.runtime.mesh import MeshInfo
from hyperacc.sharding import compile as compilation
from hyperacc.sharding.fsdp import (allocate_shards, apply_fsdp, cast_parameters, check_not_sharded, enable_recompute,
                                    transformer_blocks)
from hyperacc.sharding.replicated import scalar_parameters

__all__ = ["apply_cp", "apply_ep", "apply_tp", "check_model", "parallelize", "shard_model"]


def check_model(model: nn.Module, mesh: MeshInfo, config: FSDPConfig, device_type: str) -> ModelKind:
    """Every model-dependent check of a prepare, before any collective and alike on every rank: the
    model kind's (`hyperacc.kinds`), the parallel sizes against the architecture, compile. Returns the
    model's kind. `Accelerator.prepare` runs it once per model."""
    kind = kinds.for_model(model)
    kind.check_layout(model, mesh.parallel)
    parallel.check_model(model, mesh.parallel)
    if mesh.parallel.tp_size > 1 and scalar_parameters(model):
        raise NotImplementedError(
            "This model has 0-d (scalar) parameters, which hyperacc replicates across data-parallel "
            "ranks; with tensor parallelism (tp_size > 1) their gradients could be partial per TP "
            "rank. Make them 1-D (shape [1]) or use tp_size=1.")
    compilation.check_backend(config, device_type, mesh.parallel)
    compilation.check_model(model, config)
    return kind


# --------------------------------------------------------------------------- the steps
def apply_tp(model: nn.Module, mesh: MeshInfo) -> None:
    """Tensor parallelism from the model's own TP plan (experts left to EP when ep_size > 1)."""
    if mesh.parallel.tp_size > 1:
        ep_plan = parallel.expert_parallel_plan(model, mesh.parallel.ep_size)
        parallel.apply_tensor_parallel(model, mesh.tp_mesh, parallel.tensor_parallel_plan(model, ep_plan))


def apply_ep(model: nn.Module, mesh: MeshInfo) -> List[nn.Module]:
    """Expert parallelism (all-to-all dispatch); returns the experts modules, which become FSDP units
    on the expert mesh (none without EP)."""
    ep_plan = parallel.expert_parallel_plan(model, mesh.parallel.ep_size)
    if not ep_plan:
        return []
    return parallel.apply_expert_parallel(model, mesh.ep_mesh, mesh.tp_mesh, ep_plan)


def apply_cp(model: nn.Module, mesh: MeshInfo) -> None:
    """Context parallelism: attention runs over the whole sequence through an all-to-all."""
    if mesh.parallel.cp_size > 1:
        parallel.apply_context_parallel(model, mesh.cp_mesh)


def _no_kv_cache(model: nn.Module) -> None:
    """A KV cache filled during forward would be filled again by the recomputation; a compiled block
    would be specialised (and recompiled) per layer on the cache's per-layer state."""
    if getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False


# --------------------------------------------------------------------------- the pipeline
def parallelize(model: nn.Module, mesh, config: FSDPConfig) -> nn.Module:
    """Lay ``model`` out on ``mesh`` (a `MeshInfo`; a plain DeviceMesh: FSDP only), in place; returns it."""
    blocks = transformer_blocks(model, config)
    experts = []
    if isinstance(mesh, MeshInfo):
        apply_tp(model, mesh)
        experts = apply_ep(model, mesh)
        apply_cp(model, mesh)
    if config.compile or config.activation_checkpointing:
        _no_kv_cache(model)
    if config.compile:
        compilation.compile_blocks(blocks, config)
    if config.activation_checkpointing:
        enable_recompute(blocks)
    apply_fsdp(model, blocks, mesh, config, experts)
    return model


def shard_model(model: nn.Module, mesh, config: FSDPConfig, device: torch.device,
                seed: int, *, initialize: bool = True) -> nn.Module:
    """Shard ``model`` in place with the default pipeline and return it, initialised from ``seed`` if
    it was on the meta device (``initialize=False``: allocated only, for the caller to fill). The
    standalone form of what `prepare()` does (`hyperacc.models.setup`), without a model kind's hooks
    beyond its dtype choice. ``mesh``: a `MeshInfo`, or a plain DeviceMesh for FSDP only."""
    check_not_sharded(model)
    kind = check_model(model, mesh, config, device.type) if isinstance(mesh, MeshInfo) else kinds.for_model(model)
    on_meta = any(p.is_meta for p in model.parameters())
    if not on_meta:
        model.to(device)
    cast_parameters(model, get_recipe(config.precision).param_dtype, keep=kind.keeps_dtype(model))
    parallelize(model, mesh, config)
    allocate_shards(model, mesh, config, device, seed, on_meta=on_meta, initialize=initialize)
    return model
