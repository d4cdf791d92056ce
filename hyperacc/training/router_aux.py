"""The MoE router's load-balancing loss, sequence-wise, so that it is the same in every layout.

transformers' ``load_balancing_loss_func`` measures expert load over whatever tokens one forward
sees: change the micro-batch size, or split sequences over context-parallel ranks, and the objective
itself changes (2.7e-4 in loss after 8 steps in hyperacc's tests). Sequence-wise, for each sequence
s, transformers' formula is applied to s alone -- f_e = s's (token, layer, top-k) assignments to
expert e / (layers x s's tokens), P_e = e's router probability summed over s's tokens and layers /
(layers x s's tokens), aux_s = experts x sum_e f_e P_e -- and the step's loss is the mean of aux_s
over the step's sequences (all micro-batches and data-parallel ranks; the count is known when the
step starts, like its tokens). A sequence's statistics depend on that sequence only, so every layout
computes the same numbers. This is the "sequence-wise" balance of DeepSeek-V3 and Megatron-core's
``seq_aux_loss`` with transformers' normalisation (it equals transformers' value for a batch of one
sequence); Megatron's "global" aux loss (statistics over the whole step, arXiv 2501.11873) would need
an all-reduce of the counts over every data-parallel rank in every layer of every micro-batch.

How: forward hooks on the model's router modules (the class transformers records ``router_logits``
from) collect each layer's router logits during one top-level forward; a hook on the model adds
``coef x`` this micro-batch's share to ``outputs.loss`` and sets ``outputs.aux_loss``. With context
parallelism a sequence's counts and token number are summed over the cp group (detached: a few
floats per sequence), while each rank's probabilities keep their gradient, so the cp ranks' shares
add up to aux_s and each rank's tokens get exactly their gradient. transformers' own term is
switched off (``output_router_logits=False``). Recomputation in backward records nothing. In packed rows
(`hyperacc.data.packing`: position_ids restarting, no attention mask) each sample is its own sequence,
so packing a step's samples leaves the term unchanged.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from hyperacc.batch import sequence_index
from hyperacc.parallel.context import context_of

MODES = ("sequence", "micro_batch")


def router_recorder(model: nn.Module) -> Optional[Tuple[type, int]]:
    """(router class, index of the logits in its output), from the ``router_logits`` entry of the
    model's ``_can_record_outputs`` (transformers' own output recording); None for a dense model."""
    for module in model.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            return getattr(recorder, "target_class", recorder), int(getattr(recorder, "index", 0) or 0)
    return None


def check_mode(model: nn.Module, mode: Optional[str]) -> Optional[str]:
    """The mode to use for ``model`` (None: no load-balancing loss), or one ValueError for an unknown
    mode. The Accelerator's mode is a policy for the MoE models it prepares: a dense model has none
    (a script with one model refuses the combination itself, as examples/train_qwen.py does)."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"router_aux_loss={mode!r} is not a mode; choose one of {', '.join(MODES)} (or None).")
    config = getattr(model, "config", None)
    if not (hasattr(config, "router_aux_loss_coef") and router_recorder(model) is not None):
        return None
    if mode is None:                 # the default: sequence-wise whenever the model adds the loss
        return "sequence" if getattr(config, "output_router_logits", False) else None
    config.output_router_logits = True           # an explicit mode switches the loss on
    return mode


def install(model: nn.Module, mode: Optional[str], weights) -> None:
    """After sharding: the sequence-wise loss on ``model`` when ``mode`` (from `check_mode`) says so."""
    if mode != "sequence":
        return

    SequenceAuxLoss(model, weights, context_of([model]))


class SequenceAuxLoss:
    """Installs the sequence-wise load-balancing loss on one prepared MoE model (see module doc).

    ``weights()``: in step mode (tokens of the step, sequences of the step, tokens of this
    micro-batch) -- all after any context-parallel split, as the accumulator counts them -- else None.
    ``context``: the model's `ContextParallel` (None without cp): while it splits sequences, their
    statistics are summed over its group and its piece of the padding mask is used.
    """

    def __init__(self, model: nn.Module, weights: Callable[[], Optional[Tuple[int, int, int]]], context=None):
        config = model.config
        self.coef = float(config.router_aux_loss_coef)
        self.experts, self.top_k = int(config.num_experts), int(config.num_experts_per_tok)
        self.weights, self.context = weights, context
        self._recording, self._mask, self._shape, self._samples = False, None, None, None
        router_class, self._index = router_recorder(model)
        self._routers = [module for module in model.modules() if isinstance(module, router_class)]
        for module in self._routers:
            module.register_forward_hook(self._record)
        model.register_forward_pre_hook(self._start, with_kwargs=True)
        model.register_forward_hook(self._finish, with_kwargs=True)
        config.output_router_logits = False          # transformers' per-forward term: off

    def _start(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        self._shape = tuple(ids.shape[:2])
        mask = kwargs.get("attention_mask")
        if mask is None and self._split():
            mask = self.context.token_mask
        self._mask = mask if torch.is_tensor(mask) and mask.dim() == 2 and tuple(mask.shape) == self._shape else None
        positions = kwargs.get("position_ids")
        packed = mask is None and torch.is_tensor(positions) and tuple(positions.shape[-2:]) == self._shape
        self._samples = sequence_index(positions) if packed else None    # packed rows: one sequence per sample
        self._clear()
        self._recording = True

    def _clear(self):
        for router in self._routers:
            router._hyperacc_router_logits = None

    def _record(self, module, args, output):
        # Kept on the router itself, not appended to a shared list: a compiled block (hyperacc.sharding.compile)
        # would otherwise be guarded on the list's length and recompile for every layer.
        if self._recording:                           # not while backward recomputes a block
            module._hyperacc_router_logits = output[self._index] if isinstance(output, (tuple, list)) else output

    def _finish(self, module, args, kwargs, output):
        self._recording = False
        logits = [router._hyperacc_router_logits for router in self._routers
                  if router._hyperacc_router_logits is not None]
        self._clear()
        if not logits:
            return output
        shares = self.sequence_shares(logits)
        weights = self.weights()
        if weights is None:                           # outside step mode: this batch's sequences
            term = shares.mean()
        else:
            step_tokens, step_sequences, micro_tokens = weights
            # the accumulator multiplies the loss by micro_tokens / step_tokens: this leaves sum(shares) / step_sequences
            term = shares.sum() * (step_tokens / (max(step_sequences, 1) * max(micro_tokens, 1)))
        output.aux_loss = term.detach()
        if getattr(output, "loss", None) is not None:
            output.loss = output.loss + self.coef * term.to(output.loss.dtype)
        return output

    def _split(self) -> bool:
        """Whether this forward sees cp pieces of its sequences (only inside step mode)."""
        return self.context is not None and self.context.active

    def _sequence_of_tokens(self, device) -> Tuple[torch.Tensor, int]:
        """Each token's sequence number (rows in order; the samples of a packed row each their own) and
        how many sequences there are."""
        batch, length = self._shape
        if self._samples is None:
            return torch.arange(batch, device=device).repeat_interleave(length), batch
        samples = self._samples.to(device)
        per_row = samples[:, -1] + 1
        first = torch.cumsum(per_row, 0) - per_row                    # number of a row's first sample
        return (samples + first.unsqueeze(1)).reshape(-1), int(per_row.sum())

    def sequence_shares(self, logits) -> torch.Tensor:
        """This rank's share of each sequence's aux_s ([sequences]); over the cp group they add up to aux_s."""
        batch, length = self._shape
        device = logits[0].device
        mask = (self._mask.to(device=device, dtype=torch.float32) if self._mask is not None
                else torch.ones(batch, length, device=device)).reshape(-1, 1)
        sequence, sequences = self._sequence_of_tokens(device)
        counts = torch.zeros(sequences, self.experts, device=device)
        probs = torch.zeros(sequences, self.experts, device=device)
        for layer in logits:
            p = torch.softmax(layer.float(), dim=-1).view(batch * length, self.experts)
            chosen = torch.zeros_like(p).scatter_(1, torch.topk(p, self.top_k, dim=-1).indices, 1.0)
            counts.index_add_(0, sequence, chosen * mask)
            probs = probs.index_add(0, sequence, p * mask)
        tokens = torch.zeros(sequences, device=device).index_add_(0, sequence, mask.squeeze(1))
        stats = torch.cat([counts, tokens.unsqueeze(1)], dim=1).detach()
        if self._split():                             # the whole sequence's counts and length
            dist.all_reduce(stats, group=self.context.group)
        counts, tokens = stats[:, :-1], stats[:, -1]
        rows = len(logits) * tokens.clamp(min=1)
        fraction = counts / rows.unsqueeze(1)
        share = self.experts * (fraction * probs / rows.unsqueeze(1)).sum(dim=1)
        return torch.where(tokens > 0, share, torch.zeros_like(share))
