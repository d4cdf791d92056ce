"""Context parallelism: each micro-batch's sequence split over the ``cp`` mesh dimension, with exact
attention across the split by all-to-all head/sequence exchange (Ulysses-style).

Why all-to-all and not ring attention. Around attention each rank trades its sequence shard of
*all* heads for the *whole* sequence of 1/cp of the heads (one all-to-all each for q, k and v), runs
the model's own attention kernel on full sequences, and trades back (one all-to-all for the
output). Consequences, measured or checked here:
  * it wraps whatever attention the model was configured with — eager, sdpa, flash — through
    transformers' `AttentionInterface`, so numerics are the kernel's own: per-step losses and grad
    norms equal cp = 1 to ~1e-7 relative in fp32 (tests/test_context_parallel.py);
  * causal masking is the kernel's ordinary full-sequence causal mask, so there is no causal load
    imbalance to correct (every rank does the same work: S x S for h/cp heads) and no shard-order
    permutation (contiguous shards, plain global position_ids);
  * torch's ring attention (`torch.distributed.tensor.experimental.context_parallel`) does not run
    on CPU/gloo in torch 2.13: "Operator aten._scaled_dot_product_flash_attention_for_cpu.default
    does not have a sharding strategy registered"; it covers SDPA only (no eager), and it rearranges
    the buffers it is given in place (leaf tensors that require grad are refused).
The price of all-to-all: the heads (after TP, per rank) must divide by cp; KV heads that do not
(GQA: Qwen3-30B-A3B has 4) are replicated just enough before the exchange, which is exact. Memory:
activations scale 1/cp except one layer's attention, which holds h/cp heads of the full sequence
(the S x S scores with eager; O(S) with flash/sdpa kernels).

Where it acts. `accumulate(model, batch)` (step mode) splits every micro-batch before counting its
tokens (`ContextParallel.shard`): labels are shifted on the *full* sequence first
(``shift_labels``: each shard's targets are the next tokens of the full sequence, the last token's
is -100), then input_ids / labels / position_ids (global positions, so rotary is exact) are cut
into cp contiguous pieces; a right-padding attention_mask is dropped (causality already hides
right padding from every real token); other padding is refused. Outside step mode (evaluation,
accelerate-style accumulation) nothing is split and attention runs unexchanged: every cp peer
computes the whole sequence, correct but redundant.
"""
from __future__ import annotations

import contextlib
import itertools
import sys
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from hyperacc.batch import packed_boundaries

IGNORE_INDEX = -100
_KEYS = itertools.count()
_SEQUENCE_KEYS = ("input_ids", "inputs_embeds", "token_type_ids")
TOKEN_MASK_KEY = "hyperacc_token_mask"   # the piece's padding mask: for statistics, never for attention


def _heads(model: nn.Module):
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv_heads


def kv_replication(heads: int, kv_heads: int, cp_size: int) -> Optional[int]:
    """The smallest factor r (dividing heads/kv_heads) with kv_heads*r divisible by cp; None if none."""
    groups = heads // kv_heads
    for r in range(1, groups + 1):
        if groups % r == 0 and (kv_heads * r) % cp_size == 0:
            return r
    return None


def check_context_parallel(model: nn.Module, cp_size: int, tp_size: int = 1) -> None:
    """Raise (before any collective) when ``model``'s attention cannot be split over ``cp_size`` ranks."""
    if cp_size <= 1:
        return
    name = type(model).__name__
    heads, kv_heads = _heads(model)
    wrappable = getattr(type(model), "_supports_attention_backend", False) and isinstance(heads, int)
    if not wrappable:
        raise ValueError(f"cp_size={cp_size} but {name}'s attention cannot be wrapped for context parallelism: "
                         "it needs a transformers model whose attention goes through AttentionInterface "
                         "(_supports_attention_backend) and a config with num_attention_heads. Set cp_size=1.")
    local, local_kv = heads // tp_size, kv_heads // tp_size
    if local % cp_size:
        raise ValueError(f"cp_size={cp_size} does not divide {name}'s num_attention_heads={heads}"
                         + (f" / tp_size={tp_size} = {local} per tensor-parallel rank" if tp_size > 1 else "")
                         + ": context parallelism exchanges whole heads by all-to-all. Pick a cp_size "
                         f"dividing {local}.")
    if kv_replication(local, max(local_kv, 1), cp_size) is None:
        raise ValueError(f"cp_size={cp_size}: {name}'s {local_kv} KV heads per rank cannot be replicated to a "
                         f"multiple of {cp_size} that divides its {local} query heads. Pick a cp_size dividing "
                         f"{local_kv}.")


class _AllToAll(torch.autograd.Function):
    """Chunk i of dim 0 goes to rank i of ``group``; backward is the same exchange."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        tensor = tensor.contiguous()
        out = torch.empty_like(tensor)
        dist.all_to_all_single(out, tensor, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _seq_to_heads(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """[b, h, s/cp, d] (all heads, my shard) -> [b, h/cp, s, d] (my heads, whole sequence)."""
    b, h, s, d = x.shape
    y = _AllToAll.apply(x.reshape(b, cp, h // cp, s, d).transpose(0, 1), group)   # [cp(seq), b, h/cp, s, d]
    return y.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """[b, s, h/cp, d] (my heads, whole sequence) -> [b, s/cp, h, d] (all heads, my shard)."""
    b, s, h, d = x.shape
    y = _AllToAll.apply(x.reshape(b, cp, s // cp, h, d).transpose(0, 1), group)   # [cp(heads), b, s/cp, h/cp, d]
    return y.permute(1, 2, 0, 3, 4).reshape(b, s // cp, cp * h, d)


# Ring/all-gather attention over a cp split sees one causal sequence per row: the samples of a packed
# row would attend to each other across the pieces. Refused rather than computed wrong.
PACKED_ROWS = ("context parallelism does not split packed rows (several samples in one row, position_ids "
               "restarting): attention across the cp pieces would mix the samples. Fix: padded rows "
               "(chat_collate(tokenizer, packing=False)) with ParallelConfig.cp_size > 1, or ParallelConfig.cp_size=1 "
               "to pack.")


class ContextParallel:
    """One model's context parallelism: its cp group, its wrapped attention, and the micro-batch split."""

    def __init__(self, group, cp_rank: int, cp_size: int):
        self.group, self.rank, self.size = group, cp_rank, cp_size
        self.active = False          # True inside accumulate(model, batch): inputs are shards
        self.token_mask = None       # this forward's piece of the dropped attention_mask (or None)

    @contextlib.contextmanager
    def sharded(self):
        self.active, before = True, self.active
        try:
            yield
        finally:
            self.active = before

    # ------------------------------------------------------------------ the micro-batch
    def shard(self, micro_batch: Dict) -> Dict:
        """This rank's contiguous piece of every sequence field, with globally shifted labels and
        global position_ids. Raises ValueError for a length cp does not divide or left padding."""
        key = next((k for k in _SEQUENCE_KEYS if torch.is_tensor(micro_batch.get(k))), None)
        if key is None:
            raise ValueError("context parallelism needs input_ids (or inputs_embeds) in every micro-batch.")
        length = micro_batch[key].shape[1]
        if packed_boundaries(micro_batch):
            raise ValueError(PACKED_ROWS)
        if length % self.size:
            raise ValueError(f"sequence length {length} is not divisible by cp_size={self.size}: context "
                             f"parallelism splits each sequence into {self.size} equal pieces. Pad sequences "
                             f"to a multiple of {self.size} (e.g. pad_collate(..., pad_to_multiple_of={self.size})).")
        piece = length // self.size
        cut = slice(self.rank * piece, (self.rank + 1) * piece)
        out = {k: v for k, v in micro_batch.items() if k != "attention_mask"}
        mask = micro_batch.get("attention_mask")
        if torch.is_tensor(mask) and mask.dim() == 2 and bool((mask[:, 1:] > mask[:, :-1]).any()):
            raise ValueError("context parallelism needs right padding: attention_mask has a padding position "
                             "before a real token (left padding or holes). Pad on the right (pad_collate does).")
        for name in _SEQUENCE_KEYS:
            if torch.is_tensor(out.get(name)):
                out[name] = out[name][:, cut]
        if torch.is_tensor(mask) and mask.dim() == 2:
            out[TOKEN_MASK_KEY] = mask[:, cut]        # taken off again before the model sees it
        if torch.is_tensor(out.get("labels")):
            labels = micro_batch.get("shift_labels")
            if labels is None:
                labels = torch.nn.functional.pad(micro_batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]
            out["labels"] = out["shift_labels"] = labels[:, cut].contiguous()
            if not bool((out["shift_labels"] != IGNORE_INDEX).any()):
                out["num_items_in_batch"] = 1     # a piece of padding only: loss 0 (sum / 1), not NaN
        positions = micro_batch.get("position_ids")
        if positions is None:
            positions = torch.arange(length).unsqueeze(0).expand(micro_batch[key].shape[0], -1)
        out["position_ids"] = positions[:, cut]
        out["use_cache"] = False
        return out

    def take_token_mask(self, module, args, kwargs):
        """Forward pre-hook: keep the piece's padding mask (e.g. for `hyperacc.training.router_aux`), out of
        the model's arguments."""
        self.token_mask = kwargs.pop(TOKEN_MASK_KEY, None)
        return args, kwargs

    # ------------------------------------------------------------------ attention
    def wrap(self, inner):
        """An AttentionInterface function: ``inner`` on whole sequences of this rank's heads."""
        cp, group = self.size, self.group

        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            if not self.active:
                return inner(module, query, key, value, attention_mask, *args, **kwargs)
            kwargs.pop("position_ids", None)       # shard positions; the exchanged sequence is whole
            groups = query.shape[1] // key.shape[1]
            replicate = kv_replication(query.shape[1], key.shape[1], cp)
            if replicate > 1:                      # GQA: kv head j serves query heads j*groups ...
                key, value = (t.repeat_interleave(replicate, dim=1) for t in (key, value))
            query, key, value = (_seq_to_heads(t, cp, group) for t in (query, key, value))
            mask = None
            if inner is _eager_of(module):         # eager adds the mask; sdpa/flash use is_causal
                length = query.shape[2]
                mask = torch.full((length, length), torch.finfo(query.dtype).min, dtype=query.dtype,
                                  device=query.device).triu(1)[None, None]
            saved = module.num_key_value_groups
            module.num_key_value_groups = groups // replicate
            try:
                out, _ = inner(module, query, key, value, mask, *args, **kwargs)
            finally:
                module.num_key_value_groups = saved
            return _heads_to_seq(out, cp, group), None
        return attention


def _eager_of(module: nn.Module):
    """The model family's own eager attention (transformers keeps one per modeling file)."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def apply_context_parallel(model: nn.Module, cp_mesh) -> ContextParallel:
    """Route ``model``'s attention through the all-to-all exchange on ``cp_mesh``; the returned
    object (also ``model._hyperacc_context``) splits micro-batches for it."""
    # Public registries of transformers' attention and mask functions (transformers >= 4.48).
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    context = ContextParallel(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size())
    current = model.config._attn_implementation or "eager"
    if current == "eager":
        attention = next((m for m in model.modules() if hasattr(m, "num_key_value_groups")), None)
        inner = _eager_of(attention) if attention is not None else None
    else:
        inner = ALL_ATTENTION_FUNCTIONS.get(current)
    if inner is None:
        raise ValueError(f"cp_size={context.size}: {type(model).__name__}'s attention ({current!r}) cannot be "
                         "wrapped for context parallelism (no attention module with num_key_value_groups, or an "
                         "unknown implementation). Use attn_implementation='eager' or 'sdpa', or set cp_size=1.")
    name = f"hyperacc_cp{next(_KEYS)}_{current}"
    AttentionInterface.register(name, context.wrap(inner))
    # outside step mode the inner kernel runs on local sequences with its usual mask
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current if current in
                                                                        ALL_MASK_ATTENTION_FUNCTIONS else "eager"])
    model.set_attn_implementation(name)
    model._hyperacc_context = context
    model.register_forward_pre_hook(context.take_token_mask, with_kwargs=True)
    return context


def context_of(models) -> Optional[ContextParallel]:
    """The ContextParallel of the first model that has one (None without context parallelism)."""
    for model in models:
        context = getattr(model, "_hyperacc_context", None)
        if context is not None:
            return context
    return None
