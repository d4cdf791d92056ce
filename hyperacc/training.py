"""Small, reusable pieces of a pre-training loop that are not the Accelerator's business.

* :func:`param_groups` - AdamW groups without weight decay on norms, biases (and other 1-D tensors);
* :func:`lr_lambda_scheduler` - warm-up + cosine/linear/constant decay as a ``LambdaLR``;
* :func:`evaluate` - mean token loss and perplexity over a fixed number of held-out batches;
* :class:`StepChecks` - ``training.mode=validate``: NaN/Inf and cross-rank agreement checks;
* :func:`test_hook_nan` - TEST HOOK ONLY: plant a NaN loss to exercise the checks.

Nothing here owns a process group: collectives go through the Accelerator that is passed in.
"""
from __future__ import annotations

import math
import os
from typing import List, Optional

import torch

from hyperacc.accumulation import count_label_tokens
from hyperacc.runtime import collective_float_dtype

__all__ = ["param_groups", "lr_lambda_scheduler", "evaluate", "eval_batch_indices", "StepChecks",
           "NonFiniteError", "DisagreementError", "test_hook_nan", "TEST_NAN_ENV", "TEST_NAN_RANK_ENV"]


# ---------------------------------------------------------------------------------- optimizer
def _no_decay(name: str, param: torch.Tensor) -> bool:
    """Norm weights, biases and every other tensor of fewer than two dimensions."""
    lowered = name.lower()
    return param.ndim < 2 or lowered.endswith(".bias") or "norm" in lowered


def param_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    """Two optimizer parameter groups: decayed matrices, and norms/biases with weight_decay=0.

    Works before ``prepare()`` (``prepare`` rebinds the groups to the sharded parameters).
    Empty groups are left out.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if _no_decay(name, param) else decay).append(param)
    groups = [{"params": decay, "weight_decay": float(weight_decay)},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def lr_lambda_scheduler(optimizer, schedule, max_steps: int):
    """``LambdaLR`` whose factor after ``s`` steps is ``schedule.lr_factor(s, max_steps)``.

    ``schedule``: anything with ``lr_factor(step, max_steps)`` (``cli_config.LRSchedulerConfig``).
    The factor is recomputed from the step count, so a restored scheduler continues exactly.
    """
    def factor(step: int) -> float:
        return schedule.lr_factor(step, max_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------------- evaluation
def eval_batch_indices(num_samples: int, batch_index: int, batch_size: int, dp_rank: int,
                       dp_size: int) -> List[int]:
    """Sample ids of evaluation batch ``batch_index`` on DP rank ``dp_rank``: fixed, disjoint
    across ranks, wrapping around a small held-out set."""
    start = (batch_index * dp_size + dp_rank) * batch_size
    return [(start + i) % num_samples for i in range(batch_size)]


@torch.no_grad()
def evaluate(acc, model, dataset, *, batches: int, batch_size: int, collate_fn=None) -> dict:
    """Token-weighted mean loss (over batches and DP ranks) and perplexity on ``dataset``.

    Every rank runs the same number of forward passes (FSDP all-gathers are collective).
    The model is put in eval mode and returned to train mode afterwards.
    """
    from hyperacc.data.collate import default_collate

    collate = collate_fn or default_collate
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    tokens = 0
    try:
        for b in range(batches):
            ids = eval_batch_indices(len(dataset), b, batch_size, acc.dp_rank, acc.dp_size)
            batch = collate([dataset[i] for i in ids])
            batch = {k: v.to(acc.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            n = count_label_tokens(batch["labels"])
            loss = model(**batch).loss
            loss_sum += loss.detach().double().cpu() * n
            tokens += n
    finally:
        model.train(was_training)
    dtype = collective_float_dtype(acc.runtime.backend)
    local = torch.stack([loss_sum, torch.tensor(float(tokens), dtype=torch.float64)])
    totals = acc.reduce(local.to(acc.device, dtype)).cpu()
    total_loss, total_tokens = float(totals[0]), float(totals[1])
    mean = total_loss / total_tokens if total_tokens else float("nan")
    try:
        ppl = math.exp(mean)
    except OverflowError:
        ppl = float("inf")
    return {"loss": mean, "ppl": ppl, "tokens": int(total_tokens)}


# ---------------------------------------------------------------------------------- validate mode
class NonFiniteError(FloatingPointError):
    """A loss or gradient norm became NaN/Inf (validate mode)."""


class DisagreementError(RuntimeError):
    """Values that must be identical on every rank differ (validate mode)."""


class StepChecks:
    """``training.mode=validate``: per-step NaN/Inf checks and cross-rank agreement.

    Usage per step: ``watch_loss(loss, micro_batch_index)`` for every micro-batch (local, no
    collective), then ``check(step, step_loss, grad_norm)`` once, after the gradient norm: ONE
    all_gather of (first bad micro-batch, step loss, grad norm) from every rank. Every rank
    raises the same error, so the job stops cleanly instead of hanging in a collective.
    ``enabled=False`` (production) makes both calls no-ops.
    """

    def __init__(self, acc, enabled: bool, rtol: float = 0.0):
        self.acc = acc
        self.enabled = enabled
        self.rtol = rtol
        self._bad_micro_batch = -1
        self._bad_value = 0.0

    def watch_loss(self, loss: torch.Tensor, micro_batch: int) -> None:
        if not self.enabled or self._bad_micro_batch >= 0:
            return
        value = float(loss.detach())
        if not math.isfinite(value):
            self._bad_micro_batch, self._bad_value = micro_batch, value

    def check(self, step: int, step_loss: Optional[float], grad_norm) -> None:
        if not self.enabled:
            return
        norm = float(grad_norm.detach() if torch.is_tensor(grad_norm) else grad_norm)
        local = torch.tensor([float(self._bad_micro_batch), float(step_loss), norm], dtype=torch.float64)
        self._bad_micro_batch, bad_value = -1, self._bad_value
        dtype = collective_float_dtype(self.acc.runtime.backend)
        table = self.acc.gather(local.to(self.acc.device, dtype)).reshape(-1, 3).cpu().double()
        bad = [(rank, int(row[0])) for rank, row in enumerate(table) if row[0] >= 0]
        if bad:
            where = ", ".join(f"rank {r} micro-batch {m}" for r, m in bad)
            raise NonFiniteError(f"validate mode: non-finite loss at step {step} on {where} "
                                 f"(this rank {self.acc.process_index}: "
                                 f"{bad_value if self.acc.process_index in dict(bad) else 'finite'}).")
        for rank, row in enumerate(table):
            if not math.isfinite(float(row[2])):
                raise NonFiniteError(f"validate mode: non-finite gradient norm {float(row[2])} at step "
                                     f"{step} on rank {rank}.")
            if not math.isfinite(float(row[1])):
                raise NonFiniteError(f"validate mode: non-finite step loss {float(row[1])} at step "
                                     f"{step} on rank {rank}.")
        for column, name in ((1, "step loss"), (2, "gradient norm")):
            ref = float(table[0, column])
            for rank in range(1, table.shape[0]):
                value = float(table[rank, column])
                if abs(value - ref) > self.rtol * abs(ref):
                    raise DisagreementError(f"validate mode: {name} differs across ranks at step {step}: "
                                            f"rank 0 has {ref!r}, rank {rank} has {value!r}.")


# ---------------------------------------------------------------------------------- TEST HOOK
TEST_NAN_ENV = "HYPERACC_TEST_NAN_AT_STEP"
TEST_NAN_RANK_ENV = "HYPERACC_TEST_NAN_RANK"


def test_hook_nan(loss: torch.Tensor, step: int, rank: int, micro_batch: int) -> torch.Tensor:
    """TEST HOOK, not a feature: with ``HYPERACC_TEST_NAN_AT_STEP=N`` the first micro-batch loss of
    optimizer step N on rank ``HYPERACC_TEST_NAN_RANK`` (default 1) becomes NaN. Used by the tests
    of validate mode; a no-op when the variable is unset."""
    at = os.environ.get(TEST_NAN_ENV)
    if at is None or int(at) != step or micro_batch != 0:
        return loss
    if rank != int(os.environ.get(TEST_NAN_RANK_ENV, "1")):
        return loss
    return loss * float("nan")
