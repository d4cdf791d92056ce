"""What `prepare()` does to a model's weights, in order: checks, sharding, then filling the shards
(random initialisation, pretrained files, PEFT's adapter initialisation).

Why one place: the order matters and is easy to break. Checks run before any collective; a
rank-0-only `from_pretrained` is broadcast before sharding; adapter values are computed while the
model still has its full shapes; the shards are allocated and filled by `fully_shard` and
`sharding.materialize` (or the safetensors files); the adapters are written last so that neither
the base model's ``_init_weights`` nor the files overwrite them.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from hyperacc import parallel, weights
from hyperacc.sharding import compile as compilation
from hyperacc.integrations import peft, peft_runtime
from hyperacc.sharding import broadcast_from_rank0, rank0_only_weights_expected, shard_model


def shard_and_fill(model: nn.Module, *, mesh, fsdp_config, device: torch.device, seed: int,
                   num_processes: int) -> Dict[str, nn.Parameter]:
    """Shard ``model`` in place on ``mesh`` (a `hyperacc.runtime.mesh.MeshInfo`) and give every rank its
    slices of the weights: pretrained (`hyperacc.models.load_pretrained(..., accelerator=)`),
    rank 0's, the model's own, or initialised from ``seed``. Returns the parameters as they were
    before sharding, by name (what the user's optimizer holds, for `wrappers.rebind_optimizer`)."""
    parallel.check_model(model, mesh.parallel)      # before any collective
    compilation.check_backend(fsdp_config, device.type, mesh.parallel)
    compilation.check_model(model, fsdp_config)
    if num_processes > 1 and rank0_only_weights_expected():
        broadcast_from_rank0(model, device)
    peft.broadcast_adapters(model, device)      # built before the seed was set: rank 0's init everywhere
    originals = dict(model.named_parameters())
    on_meta = any(p.is_meta for p in model.parameters())
    adapters = peft.initial_adapter_values(model, seed)     # PEFT's own init, full size, seeded per layer
    pretrained = weights.source_of(model)     # the files fill the shards: each rank reads its own slices
    shard_model(model, mesh, fsdp_config, device, seed, initialize=pretrained is None)
    weights.fill_shards(model, pretrained)      # no-op without files
    if on_meta and pretrained is None:
        peft.copy_modules_to_save(model)        # a trainable copy starts as its (just initialised) original
    peft.write_values(model, adapters)
    peft_runtime.match_copy_dtypes(model)       # fp32 modules_to_save copies between bf16 base layers
    peft_runtime.reshard_around_switches(model)     # PEFT's requires_grad toggles land on the sharded parameters
    return originals
