"""Dry run: plan the FSDP2 (+ TP/EP/CP) sharding of a meta-device model for N ranks and estimate
memory per rank under a precision recipe. No process group and no real tensor are needed.

Sharding: FSDP2 shards every parameter on dim 0 over the ``dp_shard`` (x cp) ranks (padded to equal
chunks; replicas under HSDP hold the same shard). With ``tp > 1`` the parameters the model's TP plan
splits are 1/tp first; with ``ep > 1`` the experts are 1/ep per rank (whole experts) and
FSDP-sharded over efsdp = dp_shard*cp*tp/ep instead.

Bytes per rank (``plan_sharding(...).bytes``), by category:
  persistent: sharded parameters, gradients and AdamW's two moments, in the recipe's dtypes
    (`hyperacc.precision`); frozen parameters (``requires_grad=False``: a PEFT model's base) have
    no gradient and no optimizer state, and a PEFT model's keep their own dtype (`prepare` does not
    cast them: a bf16 base stays bf16 under fp32_master);
  transients of forward + backward: the root unit all-gathered (it is not resharded after
    forward) plus two block units (the running one and the prefetched one; every unit when
    ``reshard_after_forward`` is off), one unit's unsharded gradients in the compute dtype plus
    the fp32 reduce-scatter buffer FSDP2 copies them into, and the activations autograd saves;
  optimizer step: what the optimizer allocates while it runs -- fp32 copies of one parameter
    shard for `hyperacc.precision.adamw.AdamW` (or torch's single-tensor AdamW on CPU), one moment-sized
    temporary of every parameter for torch's foreach AdamW on accelerators.
The device peak is the larger of two phases: backward = parameters + moments + the transients +
activations and gradients (one micro-batch: the larger of the activations' peak and the gradients
plus what backward still holds when it reaches the first layer -- backward starts with every
activation and no gradient and ends the other way round, ``zero_grad`` frees the previous step's;
several micro-batches: the activations plus the earlier micro-batches' gradients, which FSDP2 keeps
unsharded in fp32 unless ``reduce_every_micro_batch``), and the optimizer step = parameters +
gradients + moments + its own transient.

Activations (`activation_moments`) are the larger of two moments of backward: the loss's (the
logits with the fp32 log-softmax and its gradients) and the last block's, when one block's saved
tensors and the gradients of its activations are live -- on top of every block's saved tensors,
or under recompute every block's input (the checkpoint keeps it) with that one block
re-materialised. A block's saved tensors per token (`block_activations`: RMSNorm upcasts to fp32,
q/k norms and RoPE, attention inputs/outputs, the router's fp32 softmax, top-k expert rows through
gate_up / activation / down, eager attention's seq x seq scores) were fitted to autograd's
saved-tensor hooks on CPU, the gradients to the peak live bytes of its backward.
`benchmarks/memory_plan.py` compares the whole plan with measured peaks, where weights dominate
and where activations do (recompute on and off).

Traffic notes: FSDP all-gathers per step, EP all-to-all (every routed (token, expert) pair whose
expert lives on another rank goes there and back, in forward, backward and the recompute
forward), CP all-to-all of q, k, v and the attention output.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional

import torch
import torch.nn as nn

from hyperacc.tools.activations import (BlockActivations, activation_bytes, activation_moments,  # noqa: F401
                                  block_activations)
from hyperacc.tools.plan_report import (_bytes, _human, check_fits, fits, format_plan, plan_report,  # noqa: F401
                                  write_report)
from hyperacc import kinds
from hyperacc.config import ParallelConfig
from hyperacc.parallel.context import check_context_parallel, kv_replication
from hyperacc.parallel.expert import DISPATCH_STYLE, check_expert_parallel, expert_parallel_plan
from hyperacc.parallel.tensor import check_tensor_parallel, tensor_parallel_plan
from hyperacc.precision import get_recipe
from hyperacc.precision.adamw import CHUNK
from hyperacc.sharding import block_classes, find_blocks

__all__ = ["ShardingPlan", "plan_sharding", "format_plan", "plan_report", "write_report", "check_fits"]

_COMPUTE_BYTES = {"bf16": 2, "fp16": 2}
PERSISTENT = ("params", "grads", "optimizer states")


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
    device_bytes: float                  # peak in device memory: max(backward, optimizer step) phase
    host_bytes: float                    # what lives in host memory (CPU offload)
    notes: List[str]
    cp: int = 1
    precision: str = "fp32_master"
    labels: Dict[str, str] = dataclasses.field(default_factory=dict)   # category -> what it holds
    trainable_params: Optional[int] = None      # of total_params (None: every one)


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
    check_tensor_parallel(model, tp)
    check_expert_parallel(model, ep)
    params = dict(model.named_parameters())
    ep_plan = expert_parallel_plan(model, ep)
    tp_plan = tensor_parallel_plan(model, ep_plan) if tp > 1 else {}   # what sharding applies (packed experts whole)
    shares = {name: (1, False) for name in params}
    for name, style in tp_plan.items():
        if name in params and style in _TP_SPLITS and not (style.startswith("rowwise") and name.endswith("bias")):
            shares[name] = (tp, False)
    experts = [name for name, style in ep_plan.items() if style == DISPATCH_STYLE]
    for name in params:
        if any(name.startswith(e + ".") for e in experts):
            shares[name] = (ep, True)
    return shares


def _optimizer_step_bytes(recipe, local_params: int, largest_local: int, device_type: str) -> tuple:
    if recipe.low_precision:        # hyperacc.precision.adamw.AdamW: fp32 param, grad, moments, sqrt, denominator
        return 4.0 * 6 * min(largest_local, CHUNK), "fp32 copies of one parameter piece (hyperacc AdamW)"
    if device_type == "cpu":        # torch's single-tensor AdamW: the square root and the denominator
        return 4.0 * 2 * largest_local, "torch AdamW's temporaries for the largest parameter shard"
    return float(torch.empty((), dtype=recipe.state_dtype).element_size() * local_params), \
        "foreach AdamW: one moment-sized temporary of every parameter"


def _backward_gradients_and_activations(sizes: Dict[str, float], tail: float, micro_batches: int,
                                        cpu_offload: bool) -> float:
    """What backward holds at most of activations and gradients together (the transients aside).

    One micro-batch per step: backward starts with every activation saved and no gradient
    (``zero_grad`` freed the last step's) and ends the other way round: the sharded gradients grow
    as the activations are freed. The phase holds the larger of the activations' peak and the
    gradients plus ``tail``, what is still held when backward reaches the first layer (the logits
    the caller holds, that layer's activations: `activation_moments`). Several micro-batches: the
    later ones' backward starts with the earlier ones' gradients already there -- the sharded ones
    when every micro-batch is reduced, else (FSDP2 without gradient sync) every unit's unsharded
    gradients, accumulated in fp32 until the last micro-batch reduce-scatters them.
    """
    activations = sizes.get("activations", 0.0)
    if "accumulated grads" in sizes:
        return activations + sizes["accumulated grads"]
    grads = 0.0 if cpu_offload else sizes["grads"]
    return activations + grads if micro_batches > 1 else max(activations, grads + tail)


def _hidden_bytes(model: nn.Module, named: Dict[str, nn.Parameter], stored, default: int) -> int:
    """Bytes per element of the hidden states without mixed precision: the input embeddings' stored
    dtype (a frozen bf16 base under PEFT computes in bf16 whatever the recipe stores its adapters in)."""
    try:
        weight = model.get_input_embeddings().weight
    except (AttributeError, NotImplementedError):
        return default
    name = next((n for n, p in named.items() if p is weight), None)
    return default if name is None else stored(name, weight)


def plan_sharding(model: nn.Module, *, world_size: int, dp_replicate: int = 1, tp: int = 1, cp: int = 1,
                  ep: int = 1, wrap_classes=None, mixed_precision: Optional[str] = None,
                  precision: Optional[str] = None, cpu_offload: bool = False,
                  activation_checkpointing: bool = False, reshard_after_forward: bool = True,
                  micro_batch_size: Optional[int] = None, seq_len: Optional[int] = None,
                  eager_attention: bool = True, micro_batches: int = 1, reduce_every_micro_batch: bool = False,
                  device_type: str = "cuda") -> ShardingPlan:
    """Plan ``model`` (on the meta device) for ``world_size`` ranks; no process group needed.
    ``micro_batches``: per DP rank and optimizer step (traffic, and the gradients accumulation keeps);
    ``reduce_every_micro_batch``: as `hyperacc.FSDPConfig`'s. ``device_type``: where it will run
    ("cpu" changes only how torch's AdamW allocates)."""
    recipe = get_recipe(precision)
    kind = kinds.for_model(model)
    try:        # what prepare refuses for the model's kind (PEFT with tp/ep > 1)
        kind.check_layout(model, ParallelConfig(dp_replicate_size=dp_replicate, dp_shard_size=-1, cp_size=cp,
                                                tp_size=tp, ep_size=ep))
    except NotImplementedError as err:
        raise ValueError(str(err)) from None
    fixed = dp_replicate * tp * cp
    if world_size % fixed:
        raise ValueError(f"world size {world_size} is not divisible by dp_replicate*tp*cp={fixed}")
    dp_shard = world_size // fixed
    shards = dp_shard * cp                          # FSDP shards dense parameters over dp_shard x cp
    if (shards * tp) % ep:
        raise ValueError(f"ep_size={ep} does not divide dp_shard*cp*tp = {shards * tp}")
    efsdp = shards * tp // ep
    share = _parallel_shares(model, tp, ep)
    check_context_parallel(model, cp, tp)
    names = block_classes(model, wrap_classes)
    blocks = find_blocks(model, names)
    named = dict(model.named_parameters())

    def after_split(name, p):                       # the per-rank numel before FSDP
        return p.numel() // share[name][0]

    def sharded(name, p):                           # what a rank keeps after TP/EP, then FSDP on dim 0
        divisor, expert = share[name]
        shape = list(p.shape) or [1]
        shape[0] = math.ceil(shape[0] / divisor)    # whole experts / tp slices (padding ignored)
        return _shard_numel(tuple(shape), efsdp if expert else shards)

    per_param = recipe.bytes_per_param()
    param_bytes = per_param["params"]
    compute = _COMPUTE_BYTES.get(mixed_precision, param_bytes)
    # Frozen parameters: no gradient, no optimizer state. Those the model's kind keeps in their own dtype
    # (a PEFT model's frozen base: prepare casts the trainable ones only) keep it; the rest are cast to the
    # recipe's.
    kept = kind.keeps_dtype(model)
    frozen = {n for n, p in named.items() if not p.requires_grad}

    def stored(n, p):                               # bytes per element as prepare stores the parameter
        return p.element_size() if n in kept and p.is_floating_point() else param_bytes

    def gathered_bytes(n, p):                       # all-gathered: mixed_precision's dtype, else the stored one
        return compute if mixed_precision in _COMPUTE_BYTES else stored(n, p)

    ids = {id(p): n for n, p in named.items()}
    in_block, block_units, block_bytes, block_trainable, gathered = set(), [], [], [], 0.0
    for block in blocks:
        numel, nbytes, trainable = {False: 0, True: 0}, {False: 0, True: 0}, {False: 0, True: 0}
        for p in block.parameters():
            in_block.add(id(p))
            n = ids[id(p)]
            expert = share[n][1]
            numel[expert] += after_split(n, p)
            nbytes[expert] += after_split(n, p) * gathered_bytes(n, p)
            trainable[expert] += 0 if n in frozen else after_split(n, p)
        parts = [False] + ([True] if numel[True] else [])
        block_units += [numel[k] for k in parts]
        block_bytes += [nbytes[k] for k in parts]
        block_trainable += [trainable[k] for k in parts]
        gathered += nbytes[False] * (shards - 1) / shards + nbytes[True] * (efsdp - 1) / efsdp
    root = [(n, p) for n, p in named.items() if id(p) not in in_block]
    root_unit = sum(after_split(n, p) for n, p in root)
    root_bytes = sum(after_split(n, p) * gathered_bytes(n, p) for n, p in root)
    gathered += root_bytes * (shards - 1) / shards
    unit_sizes = block_units + [root_unit]
    unit_trainable = block_trainable + [sum(after_split(n, p) for n, p in root if n not in frozen)]
    total = sum(p.numel() for p in model.parameters())
    trainable_total = sum(p.numel() for n, p in named.items() if n not in frozen)
    local_dense = sum(sharded(n, p) for n, p in named.items() if not share[n][1])
    local_expert = sum(sharded(n, p) for n, p in named.items() if share[n][1])
    local = local_dense + local_expert
    local_trainable = sum(sharded(n, p) for n, p in named.items() if n not in frozen)
    local_frozen_bytes = sum(sharded(n, p) * stored(n, p) for n, p in named.items() if n in frozen)
    largest = max(unit_sizes)
    largest_trainable = max(unit_trainable)
    ordered = sorted(block_bytes)
    live_blocks = sum(block_bytes) if not reshard_after_forward else sum(ordered[-2:])
    sizes = {
        "params": float(per_param["params"] * local_trainable + local_frozen_bytes),
        "grads": float(per_param["grads"] * local_trainable),
        "optimizer states": float(per_param["optimizer"] * local_trainable),
        "all-gathered units": float(root_bytes + live_blocks),
        "unsharded grads": float((compute + 4) * largest_trainable),
    }
    dtype_name = str(recipe.param_dtype).replace("torch.", "")
    state_name = str(recipe.state_dtype).replace("torch.", "")
    compute_name = {2: "bf16", 4: "fp32"}[compute] if mixed_precision != "fp16" else "fp16"
    gathered_name = compute_name if not frozen or mixed_precision in _COMPUTE_BYTES else "stored dtypes"
    frozen_dtypes = sorted({str(p.dtype if n in kept else recipe.param_dtype).replace("torch.", "")
                            for n, p in named.items() if n in frozen})
    labels = {
        "params": (f"params ({dtype_name}, sharded)" if not frozen else
                   f"params (trainable {dtype_name} + frozen {'/'.join(frozen_dtypes)}, sharded)"),
        "grads": f"grads ({dtype_name}, sharded)",
        "optimizer states": f"optimizer states (AdamW exp_avg + exp_avg_sq, {state_name})",
        "all-gathered units": (f"transient: root unit + {'every' if not reshard_after_forward else 'two'} block "
                               f"unit(s) all-gathered ({gathered_name})"),
        "unsharded grads": f"transient: one unit's unsharded grads ({compute_name}) + fp32 reduce-scatter buffer",
    }
    notes = [f"precision={recipe.name}: {recipe.summary}"]
    if frozen:
        how = f"kept in their own dtype ({kind.name.upper()})" if frozen & kept else "cast to the recipe"
        notes.append(f"trainable {_human(trainable_total)} of {_human(total)} params "
                     f"({100 * trainable_total / max(total, 1):.2f} %), frozen {_human(total - trainable_total)} "
                     f"({'/'.join(frozen_dtypes)}, {how}): frozen ones have no grads and no optimizer states")
    if tp > 1 or ep > 1:
        notes.append(f"of the persistent params per rank: dense {_human(local_dense)}, expert {_human(local_expert)}; "
                     "grads and AdamW states follow the same split")
    # all-gathered per rank: each unit in forward and again in backward, every micro-batch
    notes.append(f"all-gathered per rank and step (FSDP, received, {micro_batches} micro-batch(es)): "
                 f"{_bytes(gathered * 2 * micro_batches).strip()}")
    config = getattr(model, "config", None)
    all_to_all = 0.0
    if ep > 1 and micro_batch_size and seq_len and config is not None:
        top_k = int(getattr(config, "num_experts_per_tok", 1) or 1)
        hidden = int(getattr(config, "hidden_size", 0))
        layers = sum(1 for n in share if share[n][1] and n.endswith(".gate_up_proj")) or len(blocks)
        tokens = micro_batch_size * seq_len * micro_batches / tp / cp  # a tp group's ranks split its tokens
        passes = 2 * (3 if activation_checkpointing else 2)            # dispatch + combine, fwd/bwd(/recompute)
        all_to_all = tokens * top_k * hidden * compute * layers * passes * (ep - 1) / ep
        notes.append(f"all-to-all per rank and step (EP, sent): {_bytes(all_to_all).strip()}")
    activations_tail = 0.0
    if micro_batch_size and seq_len and config is not None:
        tokens = micro_batch_size * seq_len // cp                   # this rank's piece of each sequence
        sizes["activations"], activations_tail = activation_moments(
            config, tokens=tokens, seq_len=seq_len, micro_batch_size=micro_batch_size,
            compute=_hidden_bytes(model, named, stored, compute) if mixed_precision not in _COMPUTE_BYTES else compute,
            layers=len(blocks), recompute=activation_checkpointing, eager_attention=eager_attention, tp=tp, cp=cp,
            ep=ep)
        labels["activations"] = ("activations (block inputs + max(loss's fp32 grads, a recomputed block))"
                                 if activation_checkpointing else
                                 "activations (every block + max(loss's fp32 grads, a block's grads))")
        if micro_batches == 1:
            notes.append(f"backward ends with the grads and {_bytes(activations_tail).strip()} of activations "
                         "(the logits the caller holds, the first layer's backward)")
        if cp > 1:
            heads = int(getattr(config, "num_attention_heads", 1))
            hidden = int(getattr(config, "hidden_size", 0))
            head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
            kv = int(getattr(config, "num_key_value_heads", None) or heads) // tp
            kv *= kv_replication(heads // tp, max(kv, 1), cp) or 1
            per_token = (2 * heads // tp + 2 * kv) * head_dim * compute     # q, k, v out; attention output back
            passes = 3 if activation_checkpointing else 2                # forward, backward (, recompute)
            cp_bytes = tokens * micro_batches * len(blocks) * per_token * passes * (cp - 1) / cp
            notes.append(f"all-to-all per rank and step (CP, sent): {_bytes(cp_bytes).strip()}")
    if micro_batches > 1 and not reduce_every_micro_batch:
        sizes["accumulated grads"] = 4.0 * sum(unit_trainable)
        labels["accumulated grads"] = ("accumulation: every unit's unsharded grads (fp32), kept between "
                                       "micro-batches")
    largest_local = max((sharded(n, p) for n, p in named.items() if n not in frozen), default=0)
    sizes["optimizer step"], labels["optimizer step"] = _optimizer_step_bytes(recipe, local_trainable, largest_local,
                                                                              device_type)
    labels["optimizer step"] = "transient: optimizer step, " + labels["optimizer step"]
    persistent = sum(sizes[k] for k in PERSISTENT)
    host = persistent if cpu_offload else 0.0
    on_device = 0.0 if cpu_offload else persistent
    if cpu_offload:
        notes.append("cpu_offload: parameters, gradients and optimizer states live in host memory "
                     "(the optimizer step runs there too)")
    held = _backward_gradients_and_activations(sizes, activations_tail, micro_batches, cpu_offload)
    backward = on_device - (0.0 if cpu_offload else sizes["grads"]) + held + sum(
        sizes[k] for k in ("all-gathered units", "unsharded grads"))
    step = on_device + (0.0 if cpu_offload else sizes["optimizer step"])
    if not blocks:
        notes.append(f"no module of class {names} found: the whole model is one FSDP unit")
    return ShardingPlan(world_size=world_size, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep,
                        efsdp=efsdp, dense_params_per_rank=local_dense, expert_params_per_rank=local_expert,
                        all_to_all_bytes=all_to_all, total_params=total, params_per_rank=local,
                        units=len(unit_sizes), largest_unit_params=largest, block_class=names, bytes=sizes,
                        device_bytes=max(backward, step), host_bytes=host, notes=notes, precision=recipe.name,
                        labels=labels, trainable_params=trainable_total)
