"""What `prepare()` does to a model's weights, in order: sharding (`hyperacc.sharding.parallelize`),
then filling the shards (random initialisation, pretrained files, the model kind's own values).

Why one place: the order matters and is easy to break. The checks ran before (`check_model`, once
per prepare, before any collective); a rank-0-only `from_pretrained` is broadcast before sharding;
the model kind (`hyperacc.kinds`: PEFT's adapters) computes what it needs while the model still has
its full shapes; the recipe's dtype cast comes before the layout, whose last step is `fully_shard`;
the shards are then allocated and filled (`sharding.allocate_shards`, or the safetensors files); the
kind's values are written last so that neither the base model's ``_init_weights`` nor the files
overwrite them.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
from torch import nn

from hyperacc import weights
from hyperacc.kinds import ModelKind
from hyperacc.precision import get_recipe
from hyperacc.sharding.fsdp import (allocate_shards, broadcast_from_rank0, cast_parameters, check_not_sharded,
                                    rank0_only_weights_expected)
from hyperacc.sharding.parallelize import check_model, parallelize

__all__ = ["check_model", "shard_and_fill"]


def shard_and_fill(model: nn.Module, *, kind: ModelKind, mesh, fsdp_config, device: torch.device, seed: int,
                   num_processes: int, parallelize_fn: Optional[Callable] = None,
                   frozen: bool = False) -> Dict[str, nn.Parameter]:
    """Shard ``model`` in place on ``mesh`` (a `hyperacc.runtime.mesh.MeshInfo`) and give every rank its
    slices of the weights: pretrained (`hyperacc.models.load_pretrained(..., accelerator=)`),
    rank 0's, the model's own, or initialised from ``seed``. ``kind``: what `check_model` returned
    for it. ``parallelize_fn``: replaces `hyperacc.sharding.parallelize` (same arguments). Returns the
    parameters as they were before sharding, by name (what the user's optimizer holds, for
    `hyperacc.sharding.rebind.rebind_optimizer`). ``frozen``: a model that is only run (a preference
    trainer's reference): no parameter needs a gradient, and each keeps its stored dtype (no fp32 master copy
    of a bf16 reference: it has no optimizer state to be exact for)."""
    check_not_sharded(model)
    if num_processes > 1 and rank0_only_weights_expected():
        broadcast_from_rank0(model, device)
    originals = dict(model.named_parameters())
    on_meta = any(p.is_meta for p in model.parameters())
    pretrained = weights.source_of(model)     # the files fill the shards: each rank reads its own slices
    before = kind.before_sharding(model, device=device, seed=seed)    # collective: every rank, same order
    if not on_meta:
        model.to(device)
    if frozen:
        model.requires_grad_(False)
    cast_parameters(model, get_recipe(fsdp_config.precision).param_dtype, keep=kind.keeps_dtype(model),
                    keep_frozen=frozen)
    (parallelize_fn or parallelize)(model, mesh, fsdp_config)
    allocate_shards(model, mesh, fsdp_config, device, seed, on_meta=on_meta, initialize=pretrained is None)
    weights.fill_shards(model, pretrained)      # no-op without files
    kind.after_sharding(model, before, initialised=on_meta and pretrained is None)
    # transformers' `generate` runs its decoding loop in step on every rank (``synced_gpus``) when the model
    # is marked FSDP-managed: a rank whose sequences ended keeps calling the sharded forward, whose weight
    # gathers are collectives, instead of leaving the others waiting for ever.
    for module in model.modules():
        module._is_fsdp_managed_module = True
    return originals
