"""Gradient accumulation with exact token-weighted loss.

Step mode (`accumulate(model, batch)` with a list of micro-batches): every micro-batch's mean loss
is rescaled by (its valid label tokens) / (valid tokens of the whole step over all micro-batches
and data-parallel ranks), so that the summed gradients equal those of the global token mean, and
multiplied by the DP size to cancel the average FSDP2 takes when it reduces gradients. The token
total costs one all-reduce per step.

Accelerate-compatible mode (`accumulate(model)` with `gradient_accumulation_steps=k`) is
accelerate's own: the Accelerator inherits it (FSDP2's sync flag set through `no_sync`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Callable, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

from hyperacc.config import FSDPConfig

IGNORE_INDEX = -100


def count_label_tokens(labels: torch.Tensor) -> int:
    """Tokens that contribute to a causal-LM loss: labels != -100 after the model's shift by one."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def _to_device(micro_batch: Mapping, device: torch.device) -> dict:
    non_blocking = device.type != "cpu"
    return {key: value.to(device, non_blocking=non_blocking) if torch.is_tensor(value) else value
            for key, value in micro_batch.items()}


def _validate_step_batch(batch) -> None:
    if not isinstance(batch, Sequence) or isinstance(batch, (str, bytes)) or len(batch) == 0:
        raise TypeError(f"accumulate(model, batch) expects a non-empty list of micro-batch dicts (one "
                        f"MicroBatchDataLoader item); got {type(batch).__name__}.")
    for index, micro_batch in enumerate(batch):
        if not isinstance(micro_batch, Mapping):
            raise TypeError(f"micro-batch {index} is a {type(micro_batch).__name__}, not a dict of tensors.")
        if "labels" not in micro_batch:
            raise KeyError(f"micro-batch {index} has no 'labels' (keys: {sorted(micro_batch)}): step mode "
                           "weights the loss by valid label tokens. Add labels (-100 = ignored) to "
                           "the collate output.")


def _set_sync(models, *, reduce_now: bool, all_reduce_now: bool, reshard_now: bool) -> None:
    """Tell every FSDP unit of the prepared (root) models what to do in the coming backward."""
    for model in models:
        model.set_requires_gradient_sync(reduce_now)
        model.set_requires_all_reduce(all_reduce_now)
        model.set_reshard_after_backward(reshard_now)


class GradientAccumulator:
    """Owns the per-step accumulation state; the Accelerator forwards `accumulate`/`backward` here."""

    def __init__(self, *, device: torch.device, dp_size: int, group, fsdp: FSDPConfig,
                 on_sync_change: Callable[[bool], None] = lambda _value: None, same_tokens: int = 1):
        self.device = device
        self.dp_size = dp_size
        self.group = group              # spans every rank; ``same_tokens`` of them hold each token
        self.same_tokens = same_tokens  # the tp x cp peers of a DP rank: sums over ``group`` / this
        self.fsdp = fsdp
        self._on_sync_change = on_sync_change   # mirrors sync_gradients into accelerate's GradientState
        self.in_step = False
        self.step_tokens = 0            # valid label tokens of the last step, all DP ranks
        self.step_samples = 0           # samples of the last step, all DP ranks
        self.step_loss: Optional[float] = None  # global token-mean loss of the last step
        self.step_aux_loss: Optional[float] = None  # token-weighted MoE router aux loss (when recorded)
        self._aux_sum = None
        self._micro_tokens = 0
        self._loss_sum = None

    # ----------------------------------------------------------------- step mode
    @contextlib.contextmanager
    def step(self, models, batch) -> Iterator["_MicroBatches"]:
        _validate_step_batch(batch)
        tokens = [count_label_tokens(mb["labels"]) for mb in batch]   # counted once, on the host
        local = torch.tensor([sum(tokens), sum(int(mb["labels"].shape[0]) for mb in batch)],
                             dtype=torch.float64)
        totals = self._all_reduce(local)
        self.step_tokens, self.step_samples = round(float(totals[0])), round(float(totals[1]))
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._aux_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._aux_seen = False
        self.in_step = True
        self._on_sync_change(False)
        try:
            yield _MicroBatches(self, models, batch, tokens)
        finally:
            self.in_step = False
            self._on_sync_change(True)
            _set_sync(models, reduce_now=True, all_reduce_now=True, reshard_now=True)
        sums = self._all_reduce(torch.stack([self._loss_sum.detach(), self._aux_sum.detach()]).cpu())
        self.step_loss = float(sums[0]) / self.step_tokens if self.step_tokens else 0.0
        self.step_aux_loss = (float(sums[1]) / self.step_tokens if self.step_tokens else 0.0) \
            if self._aux_seen else None

    def _enter_micro_batch(self, models, tokens: int, is_last: bool) -> None:
        self._micro_tokens = tokens
        every = self.fsdp.reduce_every_micro_batch
        _set_sync(models, reduce_now=is_last or every, all_reduce_now=is_last,
                  reshard_now=is_last or self.fsdp.reshard_after_forward)
        self._on_sync_change(is_last)

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks: each token counted once although its tp/cp peers hold it too."""
        if self.dp_size > 1:
            if self.group is None:   # the default group, whose backend talks to the device
                moved = tensor.to(self.device)
                dist.all_reduce(moved)
                tensor = moved.cpu()
            else:
                dist.all_reduce(tensor, group=self.group)
            if self.same_tokens > 1:
                tensor = tensor / self.same_tokens
        return tensor

    def scale_step_loss(self, loss: torch.Tensor) -> torch.Tensor:
        tokens, total = self._micro_tokens, self.step_tokens
        if total == 0:
            if torch.any(loss.detach() != 0):
                raise ValueError("This step has no valid label tokens on any rank (all labels are -100) "
                                 "but the loss is non-zero; check the collate function's labels.")
            return loss * 0.0
        if tokens == 0 and not torch.isfinite(loss.detach()).all():
            raise ValueError("A micro-batch has no valid label tokens and its mean loss is NaN; "
                             "drop such samples or pack sequences so every micro-batch has labels.")
        self._loss_sum = self._loss_sum + loss.detach().to(torch.float64) * tokens
        return loss * (tokens * self.dp_size / total)

    def record_aux_loss(self, aux_loss) -> None:
        """Weight a micro-batch's MoE router aux loss by its tokens, as its loss (for logging only:
        transformers already adds ``router_aux_loss_coef * aux_loss`` to the loss)."""
        if aux_loss is None:
            return
        value = aux_loss.detach().to(torch.float64) if torch.is_tensor(aux_loss) else torch.tensor(float(aux_loss))
        self._aux_sum = self._aux_sum + value.to(self._aux_sum.device) * self._micro_tokens
        self._aux_seen = True


class _MicroBatches:
    """Iterates a step's micro-batches: moves each to the device and sets FSDP's sync flags."""

    def __init__(self, owner: GradientAccumulator, models, batch: List[Mapping], tokens: List[int]):
        self._owner, self._models, self._batch, self._tokens = owner, models, batch, tokens

    def __len__(self) -> int:
        return len(self._batch)

    def __iter__(self):
        last = len(self._batch) - 1
        for index, micro_batch in enumerate(self._batch):
            self._owner._enter_micro_batch(self._models, self._tokens[index], index == last)
            yield _to_device(micro_batch, self._owner.device)
