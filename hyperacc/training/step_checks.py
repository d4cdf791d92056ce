"""Non-finite steps stop the job; in ``validate`` mode the ranks must also agree bit for bit.

Why a deferred guard: reading the gradient norm on the host every step would stall an accelerator's
launch queue once per step. In ``production`` the guard therefore stays on the device between
checks: each step folds "was the global gradient norm finite?" (and this rank's first non-finite
micro-batch loss) into a few device scalars, with no read. They are read on the host only

* on logging steps (``check_every``: the metrics flush synchronises there anyway), and
* before every checkpoint save (``acc.add_save_guard(checks.verify)``, done by the constructor),

so a non-finite step is never saved and never becomes LATEST, and the job stops at the next check
naming the FIRST non-finite step, its rank(s) and micro-batch. The updates between that step and the
check ran in memory only (at most ``check_every - 1`` of them) and are lost with the process; their
metrics records, already flushed or flushed on the way out, show what ran (``loss``/``grad_norm``
NaN). Call ``verify()`` once after the loop too, for the steps since the last check.

``validate`` checks every step before ``optimizer.step()`` (host reads and one ``all_gather``): the
non-finite step is never applied, and the step loss and gradient norm must be identical on every
rank (:class:`DisagreementError`).
"""
from __future__ import annotations

import math
from typing import List

import torch

from hyperacc.runtime import collective_float_dtype
from hyperacc.errors import NonFiniteError  # noqa: F401 - defined with every error class
from hyperacc.errors import DisagreementError  # noqa: F401 - defined with every error class

__all__ = ["StepChecks", "NonFiniteError", "DisagreementError"]

_FIX = (" Nothing from that step on was saved (LATEST is the last finite checkpoint). Fix: a lower learning rate "
        "or gradient clipping (Accelerator.clip_grad_norm_), check the data; resume with load_state('LATEST').")


class StepChecks:
    """Usage per step: ``watch_loss(loss, i)`` for every micro-batch (no read), then
    ``check(step, step_loss, grad_norm)`` once, after the gradient norm and before ``optimizer.step()``.
    Or once, as a step hook: ``acc.add_step_hook(checks)`` runs both inside ``optimizer.step()``, before
    the update, on the losses given to ``acc.backward`` and the norm of ``acc.clip_grad_norm_``
    (`hyperacc.training.hooks`).

    ``acc``: the Accelerator (its ``gather`` and device; ``add_save_guard`` when it has one).
    ``check_every``: production reads the device record every that many steps (the logging steps).
    ``step_loss``: a float or a zero-argument callable, read in validate mode only.
    """

    def __init__(self, acc, validate: bool, rtol: float = 0.0, check_every: int = 1):
        self.acc = acc
        self.validate = validate
        self.rtol = rtol
        self.check_every = max(1, int(check_every))
        self._losses: List[torch.Tensor] = []
        device = getattr(acc, "device", torch.device("cpu"))
        self._norm_bad = torch.full((), -1, dtype=torch.int64, device=device)    # first step: global verdict
        self._loss_step = torch.full((), -1, dtype=torch.int64, device=device)   # this rank's first bad loss:
        self._loss_index = torch.full((), -1, dtype=torch.int64, device=device)  # step, micro-batch, value
        self._loss_value = torch.zeros((), dtype=torch.float64, device=device)
        if hasattr(acc, "add_save_guard"):
            acc.add_save_guard(self.verify)

    def watch_loss(self, loss: torch.Tensor, micro_batch: int) -> None:
        del micro_batch  # the position in the list is the micro-batch index
        self._losses.append(loss.detach().reshape(()))

    def check(self, step: int, step_loss, grad_norm) -> None:
        norm = grad_norm.detach() if torch.is_tensor(grad_norm) else torch.tensor(float(grad_norm))
        if self.validate:
            self._check_now(step, step_loss, float(norm))
            return
        self._record(step, norm)
        if step % self.check_every == 0:
            self.verify()

    # ------------------------------------------------------------------ production: on the device
    def _record(self, step: int, norm: torch.Tensor) -> None:
        """Fold this step into the device record: a fixed handful of device ops per step (not per
        micro-batch), ``torch.where`` with Python scalars, no copy, no read."""
        first = (self._norm_bad < 0) & ~torch.isfinite(norm.to(self._norm_bad.device))
        self._norm_bad = torch.where(first, step, self._norm_bad)
        if self._losses:
            losses = torch.stack(self._losses).to(self._loss_value.device, torch.float64)
            bad = ~torch.isfinite(losses)
            index = bad.to(torch.int64).argmax()           # the first non-finite micro-batch (0 if none)
            first = (self._loss_step < 0) & bad.any()
            self._loss_step = torch.where(first, step, self._loss_step)
            self._loss_index = torch.where(first, index, self._loss_index)
            self._loss_value = torch.where(first, losses.gather(0, index.reshape(1)).reshape(()), self._loss_value)
        self._losses.clear()

    def verify(self) -> None:
        """Raise :class:`NonFiniteError` on every rank if any step since the start was non-finite.

        One host read of a scalar that is the same on every rank (the global gradient norm's verdict),
        so all ranks decide alike; only then one ``all_gather`` says which rank saw which loss."""
        step = int(self._norm_bad)
        if step < 0:
            return
        table = self._gather(torch.stack([self._loss_step.double(), self._loss_index.double(), self._loss_value]))
        bad = [(rank, int(row[1]), float(row[2])) for rank, row in enumerate(table) if row[0] == step]
        if bad:
            where = ", ".join(f"rank {r} micro-batch {m} (loss {v})" for r, m, v in bad)
            raise NonFiniteError(f"non-finite loss at step {step} on {where}.{_FIX}", step)
        raise NonFiniteError(f"non-finite gradient norm at step {step} (every micro-batch loss was finite).{_FIX}",
                             step)

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        dtype = collective_float_dtype(self.acc.runtime.backend)
        return self.acc.gather(local.to(self.acc.device, dtype)).reshape(-1, local.numel()).cpu().double()

    # ------------------------------------------------------------------ validate: every step, on the host
    def _first_bad(self):
        """(index, value) of this rank's first non-finite micro-batch loss of the step, or (-1, 0.0)."""
        for index, loss in enumerate(self._losses):
            value = float(loss)
            if not math.isfinite(value):
                return index, value
        return -1, 0.0

    def _check_now(self, step: int, step_loss, norm: float) -> None:
        step_loss = step_loss() if callable(step_loss) else step_loss
        loss = float("nan") if step_loss is None else float(step_loss)
        bad_index, bad_value = self._first_bad()
        self._losses.clear()
        table = self._gather(torch.tensor([float(bad_index), bad_value, loss, norm], dtype=torch.float64))
        bad = [(rank, int(row[0]), float(row[1])) for rank, row in enumerate(table) if row[0] >= 0]
        if bad:
            where = ", ".join(f"rank {r} micro-batch {m} (loss {v})" for r, m, v in bad)
            raise NonFiniteError(f"non-finite loss at step {step} on {where}.{_FIX}", step)
        for rank, row in enumerate(table):
            for column, name in ((3, "gradient norm"), (2, "step loss")):
                if not math.isfinite(float(row[column])):
                    raise NonFiniteError(f"non-finite {name} {float(row[column])} at step {step} on rank {rank}."
                                         f"{_FIX}", step)
        for column, name in ((2, "step loss"), (3, "gradient norm")):
            ref = float(table[0, column])
            for rank in range(1, table.shape[0]):
                value = float(table[rank, column])
                if abs(value - ref) > self.rtol * abs(ref):
                    raise DisagreementError(f"validate mode: {name} differs across ranks at step {step}: "
                                            f"rank 0 has {ref!r}, rank {rank} has {value!r}.")

