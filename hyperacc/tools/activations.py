"""Activation memory of a transformer block, the dry run's model of it (`hyperacc.tools.dry_run`).

Per block and micro-batch: what autograd saves in forward (fitted to the saved tensors of a real
Qwen3-MoE block, fp32 and bf16), what its backward holds on top (the gradients of its activations:
(1 + 3 top_k) hidden rows per token in the MoE, attention's score gradients), and, over the
model, the larger of the loss's moment and one block's backward on top of every block's input
(recompute) or every block's saved tensors (no recompute). See benchmarks/README.md "The memory
plan against measurement" for the measurements behind each term.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class BlockActivations:
    """Bytes one block holds for one micro-batch on one rank (see `block_activations`)."""
    saved: float            # what autograd saves in its forward (the input too where a norm saves it)
    mlp_saved: float        # the part of ``saved`` the MLP half holds (freed before attention's backward)
    backward_extra: float   # the most its backward holds above ``saved``: gradients of activations
    block_input: float      # the input, which a checkpoint keeps instead of ``saved``
    input_in_saved: float   # the part of ``saved`` that is the input itself (fp32: RMSNorm saves it)


def _dims(config, tp: int) -> dict:
    get = lambda name, default=0: int(getattr(config, name, None) or default)  # noqa: E731
    hidden, heads = get("hidden_size"), get("num_attention_heads", 1)
    return dict(hidden=hidden, heads=heads, head_dim=get("head_dim") or hidden // heads, q_heads=heads // tp,
                kv_heads=max(1, get("num_key_value_heads", heads) // tp), experts=get("num_experts"),
                top_k=get("num_experts_per_tok"), expert_size=get("moe_intermediate_size"),
                intermediate=get("intermediate_size"), vocab=get("vocab_size"))


def block_activations(config, *, tokens: int, seq_len: int, micro_batch_size: int, compute: int,
                      eager_attention: bool, tp: int = 1, cp: int = 1, ep: int = 1) -> BlockActivations:
    """One Qwen3-style block's activations for ``tokens`` tokens on one rank (its 1/cp of each sequence).

    Fitted to transformers' Qwen3-MoE block on CPU (fp32 and bf16; hidden, heads, kv heads, head_dim,
    experts, top-k, expert size, sequence and attention varied one at a time; each coefficient is a
    whole number of tensors). Saved, per token: RMSNorms 8 + 4b bytes per hidden unit, q/k/v width
    4 + 3b per unit (q/k norms, RoPE, attention inputs/output), 4 per expert (fp32 router softmax),
    top_k x (2 hidden + 4 expert-width) x b (expert rows in, gate_up, activation, down, out); eager
    attention adds its (seq x seq) fp32 softmax (+ its 16-bit cast) and the repeated k/v.

    Backward holds more than the saved tensors (measured with torch's MemTracker, peak live bytes of
    the block's forward + backward): first the MLP's backward, with everything still saved, holds
    (1 + 3 top_k) hidden rows per token for an MoE (the routed rows' gradients through down, the gate
    and the routing weights; h + max(2h, 2 x intermediate) for a dense MLP); then attention's, with
    the MLP half freed, holds the gradients of q, k, v and the output (2 q-width + 3 kv-width), two
    hidden rows (the residual's and the output's gradients) and, in eager attention, two (seq x seq)
    score gradients (the fp32 softmax's backward and its 16-bit or fp32 input's).
    Under recompute this is what one block adds during its backward on top of every block's input.
    """
    d, b = _dims(config, tp), compute
    hidden, head_dim = d["hidden"], d["head_dim"]
    q_width, kv_width = d["q_heads"] * head_dim, d["kv_heads"] * head_dim
    attn_saved = hidden * (4 + 2 * b) + (q_width + kv_width) * (4 + 3 * b) + 300
    norm2 = hidden * (4 + 2 * b)                           # the post-attention RMSNorm
    if d["experts"]:
        mlp_saved = norm2 + 4 * d["experts"] + d["top_k"] * (2 * hidden + 4 * d["expert_size"]) * b
        if ep > 1:
            mlp_saved += 2 * d["top_k"] * hidden * b      # all-to-all dispatch and combine buffers
        mlp_extra = (1 + 3 * d["top_k"]) * hidden * b
    else:
        mlp_saved = norm2 + 4 * d["intermediate"] * b     # dense MLP: gate, up, activation, down input
        mlp_extra = (hidden + 2 * max(hidden, d["intermediate"])) * b
    attn_extra = (2 * q_width + 3 * kv_width + 2 * hidden) * b  # + the residual's and the output's gradients
    per_token = attn_saved + mlp_saved
    saved, extra_attn = per_token * tokens, attn_extra * tokens
    if eager_attention:     # this rank's heads' (seq x seq) scores, repeated k/v
        scores = micro_batch_size * max(1, d["heads"] // (tp * cp)) * seq_len * seq_len
        saved += scores * (4 + (b if b < 4 else 0)) + tokens * 2 * (q_width - kv_width) * b
        extra_attn += scores * (4 + b)
    mlp, block_input = mlp_saved * tokens, hidden * b * tokens
    return BlockActivations(saved=float(saved), mlp_saved=float(mlp),
                            backward_extra=float(max(mlp_extra * tokens, extra_attn - mlp)),
                            block_input=float(block_input), input_in_saved=float(block_input if b == 4 else 0))


def activation_moments(config, *, tokens: int, seq_len: int, micro_batch_size: int, compute: int, layers: int,
                       recompute: bool, eager_attention: bool, tp: int = 1, cp: int = 1, ep: int = 1) -> tuple:
    """(peak, tail): bytes of activations (and their gradients) of one micro-batch of ``tokens``
    tokens on one rank (this rank's 1/cp of each sequence) at their peak, and what backward still
    holds when it reaches the first layer, i.e. beside (nearly) all of the step's gradients.

    The peak is the larger of two moments of backward:
    - The loss's backward: every block's saved tensors (under recompute: every block's input, which
      the checkpoint keeps) and, per logit, the logit itself, the fp32 log-softmax, its gradient and
      the logits' fp32 gradient (b + 12 bytes, b = the compute dtype's size: 16 in fp32, 14 in bf16).
      With them the final norm's and the head's inputs and, when the router's load-balancing loss is
      on, each layer's fp32 router softmax (saved by that loss, outside the blocks).
    - The last block's backward, once those are freed: the same blocks plus, under recompute, that
      block's saved tensors re-materialised; its gradients of activations (`block_activations`); the
      logits, which the caller's output still holds.
    The tail is the first layer's backward: the logits, its input and its (re-materialised) saved
    tensors with their gradients.
    Checked against the peak live bytes (torch's MemTracker) of whole models' forward + backward,
    recompute on and off; `benchmarks/memory_plan.py` checks it within real training runs.
    """
    block = block_activations(config, tokens=tokens, seq_len=seq_len, micro_batch_size=micro_batch_size,
                              compute=compute, eager_attention=eager_attention, tp=tp, cp=cp, ep=ep)
    d, b = _dims(config, tp), compute
    if recompute:
        blocks = layers * block.block_input
        one_block = block.saved - block.input_in_saved + block.backward_extra   # on top of its input
    else:
        blocks, one_block = layers * block.saved, block.backward_extra          # on top of its saved
    logits = tokens * d["vocab"] * b
    loss = tokens * d["vocab"] * (12 + b)                  # logits, fp32 log-softmax and both gradients
    head = tokens * d["hidden"] * (4 + 2 * b)              # the final norm and the head's input
    if d["experts"] and getattr(config, "output_router_logits", False):
        head += layers * tokens * d["experts"] * 4         # the aux loss's fp32 router softmax, every layer
    rope = tokens * 2 * b * d["head_dim"]
    peak = blocks + rope + max(loss + head, logits + one_block)
    tail = rope + logits + (block.block_input if recompute else block.saved) + one_block
    return float(peak), float(min(tail, peak))


def activation_bytes(config, **kwargs) -> float:
    """The peak of `activation_moments` (same arguments)."""
    return activation_moments(config, **kwargs)[0]
