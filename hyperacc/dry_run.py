"""Dry run: plan the FSDP2 sharding of a meta-device model for N ranks and estimate memory per rank.

No process group and no real tensor are needed: the model is only inspected. FSDP2 shards every
parameter on dim 0 over the ``dp_shard`` ranks (padded to equal chunks; replicas under HSDP
hold the same shard), so the largest shard a rank holds is ``ceil(dim0 / dp_shard) * rest``.

Estimated bytes per rank (``estimate``):
  persistent: sharded fp32 master parameters, sharded fp32 gradients, AdamW's two fp32 moments;
  transient: the all-gathered compute copies of two FSDP units (the one running and the one
    prefetched) in the compute dtype, plus one unit's unsharded gradients in the reduce dtype;
  activations (rough, optional): saved block inputs under activation checkpointing (or every
    block's activations without it), one block's recompute peak, and the fp32 logits.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional

import torch.nn as nn

__all__ = ["ShardingPlan", "plan_sharding", "format_plan"]

_BYTES = {"bf16": 2, "fp16": 2, None: 4}


@dataclasses.dataclass
class ShardingPlan:
    world_size: int
    dp_replicate: int
    dp_shard: int
    total_params: int
    params_per_rank: int                 # the most any rank holds (rank 0: padding goes to the end)
    units: int                           # FSDP units: blocks + root
    largest_unit_params: int
    block_class: List[str]
    bytes: Dict[str, float]              # category -> bytes per rank
    device_bytes: float                  # what lives in device memory
    host_bytes: float                    # what lives in host memory (CPU offload)
    notes: List[str]


def _numel(shape) -> int:
    return int(math.prod(shape)) if len(shape) else 1


def _shard_numel(shape, shards: int) -> int:
    if len(shape) == 0:
        return 1
    return math.ceil(shape[0] / shards) * _numel(shape[1:])


def plan_sharding(model: nn.Module, *, world_size: int, dp_replicate: int = 1, tp: int = 1, cp: int = 1,
                  wrap_classes=None, mixed_precision: Optional[str] = None, cpu_offload: bool = False,
                  activation_checkpointing: bool = False, micro_batch_size: Optional[int] = None,
                  seq_len: Optional[int] = None, eager_attention: bool = True) -> ShardingPlan:
    """Plan ``model`` (on the meta device) for ``world_size`` ranks; no process group needed."""
    from hyperacc.sharding import block_classes, find_blocks

    fixed = dp_replicate * tp * cp
    if world_size % fixed:
        raise ValueError(f"world size {world_size} is not divisible by dp_replicate*tp*cp={fixed}")
    if tp != 1 or cp != 1:
        raise ValueError("the dry run plans data parallelism (FSDP/HSDP) only: tp_size and cp_size must be 1")
    shards = world_size // fixed
    names = block_classes(model, wrap_classes)
    blocks = find_blocks(model, names)
    in_block = set()
    unit_sizes = []
    for block in blocks:
        params = list(block.parameters())
        in_block.update(id(p) for p in params)
        unit_sizes.append(sum(p.numel() for p in params))
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_block)
    unit_sizes.append(root)
    total = sum(p.numel() for p in model.parameters())
    local = sum(_shard_numel(tuple(p.shape), shards) for p in model.parameters())
    compute = _BYTES[mixed_precision]
    largest = max(unit_sizes)
    second = sorted(unit_sizes)[-2] if len(unit_sizes) > 1 else 0
    sizes = {
        "params (fp32 master, sharded)": 4.0 * local,
        "grads (fp32, sharded)": 4.0 * local,
        "optimizer (AdamW exp_avg + exp_avg_sq, fp32)": 8.0 * local,
        f"transient: 2 all-gathered units ({'bf16' if compute == 2 else 'fp32'})": float(compute * (largest + second)),
        "transient: 1 unit of unsharded grads (fp32 reduce)": 4.0 * largest,
    }
    notes = []
    config = getattr(model, "config", None)
    if micro_batch_size and seq_len and config is not None:
        hidden = int(getattr(config, "hidden_size", 0))
        layers = len(blocks)
        heads = int(getattr(config, "num_attention_heads", 1))
        vocab = int(getattr(config, "vocab_size", 0))
        tokens = micro_batch_size * seq_len
        block_peak = tokens * hidden * compute * 16
        if eager_attention:      # the (heads x seq x seq) score and probability matrices
            block_peak += micro_batch_size * heads * seq_len * seq_len * compute * 2
        if activation_checkpointing:
            acts = layers * tokens * hidden * compute + block_peak
        else:
            acts = layers * block_peak
        acts += 2 * tokens * vocab * 4
        sizes["activations (rough: block inputs, one block's recompute, fp32 logits)"] = float(acts)
        notes.append("activations are a rough order of magnitude" + (
            " (eager attention: its seq x seq scores are included)" if eager_attention else ""))
    persistent = ("params (fp32 master, sharded)", "grads (fp32, sharded)",
                  "optimizer (AdamW exp_avg + exp_avg_sq, fp32)")
    if cpu_offload:
        host = sum(sizes[k] for k in persistent)
        device = sum(v for k, v in sizes.items() if k not in persistent)
        notes.append("cpu_offload: parameters, gradients and optimizer states live in host memory")
    else:
        host = 0.0
        device = sum(sizes.values())
    if not blocks:
        notes.append(f"no module of class {names} found: the whole model is one FSDP unit")
    return ShardingPlan(world_size=world_size, dp_replicate=dp_replicate, dp_shard=shards, total_params=total,
                        params_per_rank=local, units=len(unit_sizes), largest_unit_params=largest,
                        block_class=names, bytes=sizes, device_bytes=device, host_bytes=host, notes=notes)


def _human(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(int(n))


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:9.2f} {unit}"
    return f"{n:9.0f} B"


def format_plan(plan: ShardingPlan) -> str:
    """A readable report of ``plan``; the first lines are stable for scripts to grep."""
    lines = [
        f"dry run: world_size={plan.world_size} (dp_replicate={plan.dp_replicate} x dp_shard={plan.dp_shard})",
        f"total_params={plan.total_params} ({_human(plan.total_params)})",
        f"params_per_rank={plan.params_per_rank} ({_human(plan.params_per_rank)})",
        f"fsdp_units={plan.units} (blocks of {', '.join(plan.block_class) or 'none'} + root); "
        f"largest unit {_human(plan.largest_unit_params)} params",
        "estimated bytes per rank:",
    ]
    for name, value in plan.bytes.items():
        lines.append(f"  {name:<72} {_bytes(value)}")
    lines.append(f"  {'device total':<72} {_bytes(plan.device_bytes)}")
    if plan.host_bytes:
        lines.append(f"  {'host total (offloaded)':<72} {_bytes(plan.host_bytes)}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
