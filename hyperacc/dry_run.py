"""Dry run: plan the FSDP2 (+ TP/EP) sharding of a meta-device model for N ranks and estimate memory per rank.

No process group and no real tensor are needed: the model is only inspected. FSDP2 shards every
parameter on dim 0 over the ``dp_shard`` ranks (padded to equal chunks; replicas under HSDP
hold the same shard), so the largest shard a rank holds is ``ceil(dim0 / dp_shard) * rest``.
With ``tp > 1`` the parameters the model's TP plan splits are 1/tp first; with ``ep > 1`` the
experts are 1/ep per rank (whole experts) and FSDP-sharded over efsdp = dp_shard*tp/ep instead.
All-to-all volume (EP): every routed (token, expert) pair whose expert lives on another rank is
sent there and its output sent back, in forward, backward (and the recompute forward).
With ``cp > 1`` FSDP shards over dp_shard*cp, each rank holds seq/cp tokens of every sequence
(activations and logits 1/cp), attention holds heads/(tp*cp) heads of the whole sequence, and
q, k, v and the attention output cross the cp group by all-to-all in every (re)computation.

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
    tp: int
    ep: int
    efsdp: int
    dense_params_per_rank: int
    expert_params_per_rank: int
    all_to_all_bytes: float              # sent per rank and optimizer step (EP)
    total_params: int
    params_per_rank: int                 # the most any rank holds (rank 0: padding goes to the end)
    units: int                           # FSDP units: blocks + root
    largest_unit_params: int
    block_class: List[str]
    bytes: Dict[str, float]              # category -> bytes per rank
    device_bytes: float                  # what lives in device memory
    host_bytes: float                    # what lives in host memory (CPU offload)
    notes: List[str]
    cp: int = 1


def _numel(shape) -> int:
    return int(math.prod(shape)) if len(shape) else 1


def _shard_numel(shape, shards: int) -> int:
    if len(shape) == 0:
        return 1
    return math.ceil(shape[0] / shards) * _numel(shape[1:])


_TP_SPLITS = ("colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep", "rowwise_split_input",
              "packed_colwise", "packed_rowwise", "embedding_rowwise", "embedding_colwise")


def _parallel_shares(model: nn.Module, tp: int, ep: int) -> Dict[str, tuple]:
    """Parameter name -> (divisor before FSDP, is_expert) under the model's own TP/EP plans."""
    from hyperacc.parallel.expert import DISPATCH_STYLE, check_expert_parallel
    from hyperacc.parallel.plans import drop_covered, expand_plan, model_plan
    from hyperacc.parallel.tensor import check_tensor_parallel

    check_tensor_parallel(model, tp)
    check_expert_parallel(model, ep)
    params = dict(model.named_parameters())
    ep_plan = expand_plan(model, model_plan(model, "ep")) if ep > 1 else {}
    tp_plan = drop_covered(expand_plan(model, model_plan(model, "tp")), ep_plan) if tp > 1 else {}
    shares = {name: (1, False) for name in params}
    for name, style in tp_plan.items():
        if name in params and style in _TP_SPLITS and not (style.startswith("rowwise") and name.endswith("bias")):
            shares[name] = (tp, False)
    experts = [name for name, style in ep_plan.items() if style == DISPATCH_STYLE]
    for name in params:
        if any(name.startswith(e + ".") for e in experts):
            shares[name] = (ep, True)
    return shares


def plan_sharding(model: nn.Module, *, world_size: int, dp_replicate: int = 1, tp: int = 1, cp: int = 1,
                  ep: int = 1, wrap_classes=None, mixed_precision: Optional[str] = None, cpu_offload: bool = False,
                  activation_checkpointing: bool = False, micro_batch_size: Optional[int] = None,
                  seq_len: Optional[int] = None, eager_attention: bool = True,
                  micro_batches: int = 1) -> ShardingPlan:
    """Plan ``model`` (on the meta device) for ``world_size`` ranks; no process group needed.
    ``micro_batches``: per DP rank and optimizer step (for the all-to-all volume per step)."""
    from hyperacc.sharding import block_classes, find_blocks

    fixed = dp_replicate * tp * cp
    if world_size % fixed:
        raise ValueError(f"world size {world_size} is not divisible by dp_replicate*tp*cp={fixed}")
    dp_shard = world_size // fixed
    shards = dp_shard * cp                          # FSDP shards dense parameters over dp_shard x cp
    if (shards * tp) % ep:
        raise ValueError(f"ep_size={ep} does not divide dp_shard*cp*tp = {shards * tp}")
    efsdp = shards * tp // ep
    share = _parallel_shares(model, tp, ep)
    from hyperacc.parallel.context import check_context_parallel, kv_replication
    check_context_parallel(model, cp, tp)
    names = block_classes(model, wrap_classes)
    blocks = find_blocks(model, names)

    def after_split(name, p):                       # the per-rank numel before FSDP
        return p.numel() // share[name][0]

    def sharded(name, p):                           # what a rank keeps after TP/EP, then FSDP on dim 0
        divisor, expert = share[name]
        shape = list(p.shape) or [1]
        shape[0] = math.ceil(shape[0] / divisor)    # whole experts / tp slices (padding ignored)
        return _shard_numel(tuple(shape), efsdp if expert else shards)

    named = dict(model.named_parameters())
    ids = {id(p): n for n, p in named.items()}
    in_block, unit_sizes, gathered = set(), [], 0.0
    for block in blocks:
        dense = expert = 0
        for p in block.parameters():
            in_block.add(id(p))
            n = ids[id(p)]
            if share[n][1]:
                expert += after_split(n, p)
            else:
                dense += after_split(n, p)
        unit_sizes += [dense] + ([expert] if expert else [])
        gathered += dense * (shards - 1) / shards + expert * (efsdp - 1) / efsdp
    unit_sizes.append(sum(after_split(n, p) for n, p in named.items() if id(p) not in in_block))
    gathered += unit_sizes[-1] * (shards - 1) / shards
    total = sum(p.numel() for p in model.parameters())
    local_dense = sum(sharded(n, p) for n, p in named.items() if not share[n][1])
    local_expert = sum(sharded(n, p) for n, p in named.items() if share[n][1])
    local = local_dense + local_expert
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
    if tp > 1 or ep > 1:
        notes.append(f"of the persistent params per rank: dense {_human(local_dense)} ({_bytes(4.0 * local_dense).strip()} "
                     f"fp32), expert {_human(local_expert)} ({_bytes(4.0 * local_expert).strip()} fp32); "
                     f"grads and AdamW states follow the same split")
    # all-gathered per rank: each unit in forward and again in backward, every micro-batch
    notes.append(f"all-gathered per rank and step (FSDP, received, {micro_batches} micro-batch(es)): "
                 f"{_bytes(gathered * compute * 2 * micro_batches).strip()}")
    config = getattr(model, "config", None)
    all_to_all = 0.0
    if ep > 1 and micro_batch_size and seq_len and config is not None:
        top_k = int(getattr(config, "num_experts_per_tok", 1) or 1)
        hidden = int(getattr(config, "hidden_size", 0))
        layers = sum(1 for n in share if share[n][1] and n.endswith(".gate_up_proj")) or len(blocks)
        tokens = micro_batch_size * seq_len * micro_batches / tp / cp  # a tp group's ranks split its tokens
        passes = 2 * (3 if activation_checkpointing else 2)            # dispatch + combine, fwd/bwd(/recompute)
        all_to_all = tokens * top_k * hidden * compute * layers * passes * (ep - 1) / ep
        sizes_note = f"all-to-all per rank and step (EP, sent): {_bytes(all_to_all).strip()}"
        notes.append(sizes_note)
    config = getattr(model, "config", None)
    if micro_batch_size and seq_len and config is not None:
        hidden = int(getattr(config, "hidden_size", 0))
        layers = len(blocks)
        heads = int(getattr(config, "num_attention_heads", 1))
        vocab = int(getattr(config, "vocab_size", 0))
        tokens = micro_batch_size * seq_len // cp                   # this rank's piece of each sequence
        block_peak = tokens * hidden * compute * 16
        if eager_attention:      # the (heads x seq x seq) score and probability matrices, heads of this rank
            block_peak += micro_batch_size * max(1, heads // (tp * cp)) * seq_len * seq_len * compute * 2
        if activation_checkpointing:
            acts = layers * tokens * hidden * compute + block_peak
        else:
            acts = layers * block_peak
        acts += 2 * tokens * vocab * 4
        sizes["activations (rough: block inputs, one block's recompute, fp32 logits)"] = float(acts)
        if cp > 1:
            head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
            kv = int(getattr(config, "num_key_value_heads", None) or heads) // tp
            kv *= kv_replication(heads // tp, max(kv, 1), cp) or 1
            per_token = (2 * heads // tp + 2 * kv) * head_dim * compute     # q, k, v out; attention output back
            passes = 3 if activation_checkpointing else 2                # forward, backward (, recompute)
            cp_bytes = tokens * micro_batches * layers * per_token * passes * (cp - 1) / cp
            notes.append(f"all-to-all per rank and step (CP, sent): {_bytes(cp_bytes).strip()}")
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
    return ShardingPlan(world_size=world_size, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep,
                        efsdp=efsdp,
                        dense_params_per_rank=local_dense, expert_params_per_rank=local_expert,
                        all_to_all_bytes=all_to_all, total_params=total,
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
        f"dry run: world_size={plan.world_size} (dp_replicate={plan.dp_replicate} x dp_shard={plan.dp_shard}"
        + (f" x cp={plan.cp}" if plan.cp > 1 else "") + (f" x tp={plan.tp}" if plan.tp > 1 else "")
        + (f"; experts: ep={plan.ep} x efsdp={plan.efsdp}" if plan.ep > 1 else "") + ")",
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
