"""Gradient accumulation with exact token-weighted loss.

Step mode (`accumulate(model, batch)` with a list of micro-batches): every micro-batch's mean loss
is rescaled by (its valid label tokens) / (valid tokens of the whole step over all micro-batches
and data-parallel ranks), so that the summed gradients equal those of the global token mean, and
multiplied by the DP size to cancel the average FSDP2 takes when it reduces gradients. With context
parallelism each micro-batch is first cut into this rank's piece of every sequence
(`hyperacc.parallel.context`): tokens are then counted per piece (each once over dp x cp), and the
"DP size" above is dp x cp, the ranks FSDP averages over.

Host synchronisation: the step's statistics that the scaling needs (valid label tokens, samples, and
the token-id range of ``input_ids``) are counted on the loader's host tensors and exchanged with ONE
all_gather of four integers over the CPU group: no device work, no device sync. The loss is summed
on the device and reduced across ranks only when ``step_loss`` is read (logging steps). Counters,
one meaning each: ``step_tokens`` = valid label tokens (labels != -100 after the causal shift) of
the step over all DP ranks, counted once although tp/cp peers hold them too; ``step_samples`` =
sequences of the step over all DP ranks (the samples of packed rows each counted: `hyperacc.data.packing`).

Accelerate-compatible mode (`accumulate(model)` with `gradient_accumulation_steps=k`) is
accelerate's own: the Accelerator inherits it (FSDP2's sync flag set through `no_sync`).

The gradient-sync flag (``sync_gradients``: does the coming backward reduce gradients, so that an
optimizer step follows?) has one owner, the accumulator: in step mode it alone sets it (False for a
step's micro-batches but the last, True on the last and after the step), and hyperacc reads it here
(`hyperacc.sharding.rebind.PreparedScheduler`). Its store is accelerate's ``GradientState``, written
directly, because accelerate's own readers and writers use that object: ``AcceleratedOptimizer``
skips ``step()`` and ``AcceleratedScheduler`` holds still while it is False, scripts read
``Accelerator.sync_gradients``, accelerate-mode ``accumulate(model)`` and transformers' ``Trainer``
set it there. (It used to travel accumulator -> callback -> Accelerator -> GradientState -> a
scheduler wrapper that read the process-wide object back.)
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping
from typing import Iterator, List, Optional, Sequence

import torch
from accelerate.state import GradientState
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from hyperacc.config import FSDPConfig
from hyperacc.batch import IGNORE_INDEX, count_label_tokens, count_sequences  # noqa: F401 - re-exported
from hyperacc.parallel.context import context_of
from hyperacc.errors import TokenIdError  # noqa: F401 - defined with every error class

def _micro_batch_tokens(micro_batch: Mapping) -> int:
    """A micro-batch's loss tokens; ``shift_labels`` (already shifted, e.g. a context-parallel piece
    of a sequence) are counted as they are."""
    shifted = micro_batch.get("shift_labels")
    if torch.is_tensor(shifted):
        return int((shifted != IGNORE_INDEX).sum())
    return count_label_tokens(micro_batch["labels"])


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


def _set_sync(units: List, *, reduce_now: bool, all_reduce_now: bool, reshard_now: bool) -> None:
    """Tell every FSDP unit of the prepared models what to do in the coming backward (per unit,
    ``recurse=False``: FSDP's recursive setters walk every submodule, three times per micro-batch)."""
    for unit in units:
        unit.set_requires_gradient_sync(reduce_now, recurse=False)
        unit.set_requires_all_reduce(all_reduce_now, recurse=False)
        unit.set_reshard_after_backward(reshard_now, recurse=False)


def _check_ids(hi: int, lo: int, vocab_size: Optional[int], step: Optional[int]) -> None:
    where = f"the batch of step {step}" if step is not None else "the batch"
    if vocab_size is not None and hi >= vocab_size:
        raise TokenIdError(f"{where} holds token id {hi} but the model's vocab_size is {vocab_size} "
                           f"(ids must be < {vocab_size}): the data was tokenized with another, larger vocabulary. "
                           f"Fix: convert the data with the model's tokenizer, or build the model with "
                           f"config.vocab_size={hi + 1} or more.")
    if lo < 0:
        raise TokenIdError(f"{where} holds a negative token id ({lo}). Fix: check the dataset.")


class GradientAccumulator:
    """Owns the per-step accumulation state; the Accelerator forwards `accumulate`/`backward` here."""

    def __init__(self, *, device: torch.device, dp_size: int, group, fsdp: FSDPConfig, gradient_state=None,
                 same_tokens: int = 1, same_samples: Optional[int] = None):
        """``gradient_state``: where the sync flag is kept (the Accelerator's ``gradient_state``; default
        accelerate's ``GradientState()``, the same shared object): see the module docstring."""
        self.device = device
        self.dp_size = dp_size          # ranks holding distinct tokens (dp x cp): FSDP's reduction world
        self.group = group              # spans every rank; ``same_tokens`` of them hold each token
        self.same_tokens = same_tokens  # the tp peers of a rank: token/loss sums over ``group`` / this
        self.same_samples = same_samples or same_tokens   # the tp x cp peers: sample sums / this
        self.fsdp = fsdp
        self._gradient_state = gradient_state if gradient_state is not None else GradientState()
        self.in_step = False
        self.step_tokens = 0            # valid label tokens of the last step, all DP ranks (see module doc)
        self.step_samples = 0           # sequences of the last step, all DP ranks
        self._loss_sum = None           # this rank's token-weighted loss sum of the last step (device)
        self._aux_sum = None            # same for the MoE router aux loss
        self._aux_seen = False
        self._reduced = None            # (step_loss, step_aux_loss) once read
        self._micro_tokens = 0
        self.micro_losses: List[torch.Tensor] = []   # this step's micro-batch losses as given to backward (unread)
        self._units = weakref.WeakKeyDictionary()   # prepared model -> its FSDP units, found once

    @property
    def sync_gradients(self) -> bool:
        """Whether the coming backward reduces gradients (an optimizer step follows it): False inside a
        step but on its last micro-batch, True otherwise; in accelerate mode what accelerate decided."""
        return bool(self._gradient_state.sync_gradients)

    def _set_sync(self, value: bool) -> None:
        self._gradient_state.sync_gradients = value     # as accelerate's Accelerator.sync_gradients setter

    @property
    def step_loss(self) -> Optional[float]:
        """Global token-mean loss of the last step; reading it costs one all-reduce (and a host sync)."""
        return self._reduce()[0]

    @property
    def step_aux_loss(self) -> Optional[float]:
        """Token-weighted MoE router aux loss of the last step (None unless passed to ``backward``)."""
        return self._reduce()[1]

    def step_metrics(self) -> dict:
        """The last step for ``MetricsLogger.log_step(**...)``: global ``tokens``/``samples`` (host ints)
        and ``rank_shares``, this rank's loss (and aux loss) sum over the step's global tokens as device
        tensors (no sync): their sum over all ranks is the step's mean, reduced on logging steps."""
        stats = {"tokens": self.step_tokens, "samples": self.step_samples}
        if self._loss_sum is not None:
            scale = 1.0 / (max(self.step_tokens, 1) * self.same_tokens)
            sums = {"loss": self._loss_sum, "aux_loss": self._aux_sum if self._aux_seen else None}
            stats["rank_shares"] = {key: value * scale for key, value in sums.items() if value is not None}
        return stats

    def _reduce(self):
        if self._reduced is None:
            if self._loss_sum is None:
                return None, None
            sums = self._all_reduce(torch.stack([self._loss_sum, self._aux_sum]).cpu())
            mean = [float(v) / self.step_tokens if self.step_tokens else 0.0 for v in sums]
            self._reduced = (mean[0], mean[1] if self._aux_seen else None)
        return self._reduced

    # ----------------------------------------------------------------- step mode
    @contextlib.contextmanager
    def step(self, models, batch, step: Optional[int] = None) -> Iterator["_MicroBatches"]:
        _validate_step_batch(batch)
        context, problem = context_of(models), None
        if context is not None:                   # context parallelism: this rank's piece of each sequence
            try:
                batch = [context.shard(mb) for mb in batch]
            except ValueError as err:             # told to every rank through the count exchange
                problem = str(err)
        tokens = [_micro_batch_tokens(mb) for mb in batch]   # host tensors: no device sync
        ids = [mb["input_ids"] for mb in batch if torch.is_tensor(mb.get("input_ids")) and mb["input_ids"].numel()]
        local = [sum(tokens), sum(count_sequences(mb) for mb in batch),
                 max((int(i.max()) for i in ids), default=-1), -min((int(i.min()) for i in ids), default=0),
                 int(problem is not None)]
        total_tokens, samples, hi, neg_lo, bad = self._gather_counts(local)
        if bad:
            raise ValueError(problem or f"{bad} rank(s) could not split their micro-batches for context "
                             "parallelism (sequence length not divisible by cp_size, or left padding); "
                             "their own error says which.")
        vocab = getattr(getattr(models[0], "config", None), "vocab_size", None) if models else None
        _check_ids(hi, -neg_lo, vocab, step)      # every rank the same verdict, before any forward
        self.step_tokens, self.step_samples = total_tokens, samples
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._aux_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._aux_seen, self._reduced = False, None
        self.micro_losses = []
        self.in_step = True
        self._set_sync(False)
        try:
            with context.sharded() if context is not None else contextlib.nullcontext():
                yield _MicroBatches(self, models, batch, tokens)
        finally:
            self.in_step = False
            self._set_sync(True)
            _set_sync(self._fsdp_units(models), reduce_now=True, all_reduce_now=True, reshard_now=True)

    def _gather_counts(self, local: List[int]) -> List[int]:
        """Sums of tokens and samples over the DP ranks (each counted once although tp/cp peers hold it
        too) and the max of the id bounds: one all_gather of host integers over the CPU group."""
        if self.dp_size == 1 or not dist.is_initialized():
            return local
        on_host = dist.get_backend(self.group) == "gloo"     # the CPU group; else the default one
        mine = torch.tensor(local, dtype=torch.int64, device="cpu" if on_host else self.device)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, mine, group=self.group)
        table = torch.stack(parts).cpu()
        sums = table.sum(dim=0)
        highs = table.max(dim=0).values
        return [int(sums[0]) // self.same_tokens, int(sums[1]) // self.same_samples, int(highs[2]), int(highs[3]),
                int(sums[4])]

    def _enter_micro_batch(self, models, tokens: int, is_last: bool) -> None:
        self._micro_tokens = tokens
        every = self.fsdp.reduce_every_micro_batch
        _set_sync(self._fsdp_units(models), reduce_now=is_last or every, all_reduce_now=is_last,
                  reshard_now=is_last or self.fsdp.reshard_after_forward)
        self._set_sync(is_last)

    def _fsdp_units(self, models) -> list:
        units = []
        for model in models:
            if model not in self._units:
                self._units[model] = [m for m in model.modules() if isinstance(m, FSDPModule)]
            units += self._units[model]
        return units

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of a host tensor over the data-parallel ranks, each token counted once (tp/cp peers)."""
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
        self.micro_losses.append(loss.detach())     # for the step checks (hyperacc.training.hooks)
        tokens, total = self._micro_tokens, self.step_tokens
        if total == 0:       # rare: reading the loss on the host is fine here
            if torch.any(loss.detach() != 0):
                raise ValueError("This step has no valid label tokens on any rank (all labels are -100) "
                                 "but the loss is non-zero; check the collate function's labels.")
            return loss * 0.0
        if tokens == 0 and not torch.isfinite(loss.detach()).all():   # host-known rare case only
            raise ValueError("A micro-batch has no valid label tokens and its mean loss is NaN; "
                             "drop such samples or pack sequences so every micro-batch has labels.")
        self._loss_sum = self._loss_sum + loss.detach().to(torch.float64) * tokens
        return loss * (tokens * self.dp_size / total)

    def aux_weights(self):
        """(tokens of the step, sequences of the step, tokens of this micro-batch) inside a step,
        else None: what `hyperacc.training.router_aux` needs to weight a micro-batch's share of the loss."""
        return (self.step_tokens, self.step_samples, self._micro_tokens) if self.in_step else None

    def record_aux_loss(self, aux_loss) -> None:
        """Weight a micro-batch's MoE router aux loss by its tokens, as its loss (for logging only:
        the model's loss already holds ``router_aux_loss_coef * aux_loss``)."""
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
