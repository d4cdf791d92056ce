"""Step hooks: what runs around each optimizer step, registered once and run in one defined order.

Why: besides forward, backward and the update, a pre-training step needs checks before the update
(a non-finite step must never be applied or saved), and after it a replica comparison, the metrics
record, compile warnings, housekeeping, evaluation and the save policy, each on its own cadence and
with ordering constraints between them (the compile count goes into the metrics record; the step's
metrics are flushed after its checkpoint is saved; housekeeping runs at the same step on every rank).
Called one by one that was eight objects per step in the example's loop. Registered once with
`Accelerator.add_step_hook`, they run from ``optimizer.step()`` and `Accelerator.step_end()`, and
the loop is forward, backward, clip, step, ``step_end()`` again. (torchtitan's trainer and
Lightning's callbacks do the same; this protocol is hyperacc's own and smaller.)

A hook is an object with any of these methods, or a plain callable (called as ``on_step_end``):

    before_optimizer_step(state)  inside ``optimizer.step()`` of the first prepared optimizer, before
                                  the update: raising stops the step before anything is applied
    on_step_end(state)            in ``step_end()``, after the optimizer and scheduler steps
    on_save(state)                in ``step_end()``, after every ``on_step_end``, when its save policy saved

``state`` is a `StepState`. Hooks run by ascending order (``add_step_hook(hook, order=N)``, else the
hook's ``order`` attribute, else ``DEFAULT``); equal orders run in registration order. The built-in
orders, which the hyperacc objects below get when registered as they are:

    CHECKS = 100         StepChecks: the step's losses and gradient norm, before the update
    REPLICA_GUARD = 100  ReplicaGuard: copies that must agree, every N steps
    COMPILE_WATCH = 200  CompileWatch: frames compiled (into the metrics record), recompile warning
    METRICS = 300        MetricsLogger: buffer the step (one gather per logging window); flush after a save
    CLEANUP = 400        PeriodicCleanup: gc / empty_cache at the same step on every rank
    DEFAULT = 500        your hooks (the example's evaluation)
    SAVE = 900           the Accelerator's save policy (CheckpointConfig.save_steps / save_epochs)

Cost per step: a few Python calls per hook and no device work or host read of its own
(benchmarks/step_hooks.py, tiny Qwen3-MoE on the loaded 2-core CPU machine: 2.7 µs per step to run six
hooks that do nothing; the example's hooks vs the same objects called one by one, +14 to +18 µs per
step median, 0.05-0.06 % of a 29 ms step, within that machine's noise).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

from hyperacc.runtime.housekeeping import PeriodicCleanup
from hyperacc.sharding.compile import CompileWatch
from hyperacc.training.metrics import MetricsLogger
from hyperacc.training.replica_guard import ReplicaGuard
from hyperacc.training.step_checks import StepChecks

__all__ = ["StepState", "StepHooks", "HookHandle", "as_step_hook", "SavePolicyHook", "CHECKS", "REPLICA_GUARD",
           "COMPILE_WATCH", "METRICS", "CLEANUP", "DEFAULT", "SAVE"]

CHECKS = 100
REPLICA_GUARD = 100
COMPILE_WATCH = 200
METRICS = 300
CLEANUP = 400
DEFAULT = 500
SAVE = 900

_METHODS = ("before_optimizer_step", "on_step_end", "on_save")


@dataclass
class StepState:
    """What a hook learns about the step in progress (one object per step, both phases).

    ``step``: the optimizer step being applied (``before_optimizer_step``: ``global_step + 1``) or just
    applied (``on_step_end``: ``global_step``). ``epoch``: the epoch its batch came from (set for
    ``on_step_end``). ``grad_norm``: the step's `Accelerator.clip_grad_norm_` result (a device tensor,
    unread) or None. ``lr``: the first parameter group's learning rate the update used.
    ``micro_losses``: the micro-batch losses given to ``backward`` in step mode (device scalars, unread).
    ``extra``: values for the step's metrics record (hooks before METRICS add to it). ``saved``: the
    directory the save policy wrote at this step, else None.
    """

    accelerator: Any
    step: int
    epoch: int = 0
    grad_norm: Any = None
    lr: Optional[float] = None
    micro_losses: List[Any] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    saved: Optional[str] = None

    def step_loss(self) -> Optional[float]:
        """The step's global token-mean loss: a host read and a collective, so only on the steps that need it."""
        return self.accelerator.step_loss

    def step_metrics(self) -> dict:
        """The step's counts and per-rank loss shares for `MetricsLogger.log_step` (no host read)."""
        return self.accelerator.accumulator.step_metrics()


class HookHandle:
    """Returned by ``add``: ``remove()`` unregisters the hook."""

    def __init__(self, owner: "StepHooks", hook):
        self._owner, self.hook = owner, hook

    def remove(self) -> None:
        self._owner._entries = [entry for entry in self._owner._entries if entry[2] is not self.hook]


class StepHooks:
    """The hooks of one Accelerator and the step in progress; the Accelerator calls
    ``before_optimizer_step`` from an optimizer step pre-hook and ``step_end`` from its own."""

    def __init__(self, accelerator):
        self._accelerator = accelerator
        self._entries: list = []           # (order, registration number, hook), kept sorted
        self._added = 0
        self.grad_norm = None               # the step's clip_grad_norm_ (the Accelerator records it)
        self._state: Optional[StepState] = None   # built before the update, finished by step_end

    def add(self, hook, order: Optional[int] = None) -> HookHandle:
        adapted = as_step_hook(hook)
        if any(entry[2] is adapted or getattr(entry[2], "target", None) is hook for entry in self._entries):
            raise ValueError(f"{type(hook).__name__} is already a step hook of this Accelerator: it would run "
                             "twice per step. Register each hook once (add_step_hook returns a handle to remove it).")
        order = order if order is not None else getattr(adapted, "order", DEFAULT)
        if isinstance(order, bool) or not isinstance(order, int):
            raise TypeError(f"add_step_hook(order={order!r}): give an int (hyperacc.training.hooks: CHECKS=100 "
                            "... SAVE=900; your hooks default to DEFAULT=500).")
        self._added += 1
        self._entries.append((order, self._added, adapted))
        self._entries.sort(key=lambda entry: entry[:2])
        return HookHandle(self, adapted)

    def __len__(self) -> int:
        return len(self._entries)

    def _run(self, method: str, state: StepState) -> None:
        for _, _, hook in self._entries:
            call = getattr(hook, method, None)
            if call is not None:
                call(state)

    def before_optimizer_step(self, optimizer) -> None:
        """The first prepared optimizer is about to update: run the hooks' ``before_optimizer_step``."""
        acc = self._accelerator
        state = StepState(acc, int(acc.progress.global_step) + 1, int(acc.progress.epoch), self.grad_norm,
                          optimizer.param_groups[0]["lr"], list(acc.accumulator.micro_losses))
        self._state = state
        self._run("before_optimizer_step", state)

    def step_end(self, loader=None) -> Optional[str]:
        """Run ``on_step_end`` in order, then ``on_save`` when the save policy saved. Returns the
        directory saved, or None. ``loader``: the training loader (the step's epoch comes from it)."""
        acc = self._accelerator
        state, self._state = self._state or StepState(acc, 0, grad_norm=self.grad_norm), None
        state.step = int(acc.progress.global_step)
        state.epoch = batch_epoch(loader, int(acc.progress.epoch))
        self.grad_norm = None
        self._run("on_step_end", state)
        if state.saved:
            self._run("on_save", state)
        return state.saved


def batch_epoch(loader, default: int) -> int:
    """The epoch the last consumed step's batch came from. A MicroBatchDataLoader moves its position
    to the next epoch as it yields an epoch's last step (a checkpoint saved after that step must
    resume at the next epoch), so there a position at step 0 of epoch e means the batch was e - 1's."""
    epoch = getattr(loader, "epoch", None)
    if epoch is None:
        return default
    if getattr(loader, "step_in_epoch", None) == 0 and epoch > 0:
        return int(epoch) - 1
    return int(epoch)


# ---------------------------------------------------------------------------------- adapters
class _Adapter:
    """A hyperacc object registered as it is: ``target`` is that object."""
    order = DEFAULT

    def __init__(self, target):
        self.target = target


class _StepChecksHook(_Adapter):
    order = CHECKS

    def before_optimizer_step(self, state: StepState) -> None:
        if state.grad_norm is None:
            raise ValueError("StepChecks as a step hook needs the step's gradient norm: call "
                             "acc.clip_grad_norm_(model.parameters(), max_norm) before optimizer.step() "
                             "(max_norm=float('inf') measures it without clipping).")
        for index, loss in enumerate(state.micro_losses):
            self.target.watch_loss(loss, index)
        self.target.check(state.step, state.step_loss, state.grad_norm)


class _ReplicaGuardHook(_Adapter):
    order = REPLICA_GUARD

    def on_step_end(self, state: StepState) -> None:
        self.target.maybe_check(state.step, loss=state.step_loss)


class _CompileWatchHook(_Adapter):
    order = COMPILE_WATCH

    def on_step_end(self, state: StepState) -> None:
        state.extra.update(self.target.step(state.step))


class _MetricsHook(_Adapter):
    order = METRICS

    def on_step_end(self, state: StepState) -> None:
        self.target.log_step(step=state.step, epoch=state.epoch, grad_norm=state.grad_norm, lr=state.lr,
                             extra=state.extra, **state.step_metrics())

    def on_save(self, state: StepState) -> None:
        self.target.flush()         # the metrics file then holds every step the checkpoint holds


class _CleanupHook(_Adapter):
    order = CLEANUP

    def on_step_end(self, state: StepState) -> None:
        self.target.maybe_run(state.step)


class _FunctionHook(_Adapter):
    def on_step_end(self, state: StepState) -> None:
        self.target(state)


class SavePolicyHook:
    """The Accelerator's save policy as a hook: ``save()`` returns the directory saved or None."""
    order = SAVE

    def __init__(self, save: Callable[[], Optional[str]]):
        self._save = save

    def on_step_end(self, state: StepState) -> None:
        state.saved = self._save()


@functools.singledispatch
def as_step_hook(hook):
    """``hook`` as an object with the hook methods: hyperacc's own step objects are adapted (see the
    module docstring); an object with any hook method is used as it is; a callable becomes an
    ``on_step_end`` hook. Register adapters for your own types with ``as_step_hook.register``."""
    if any(callable(getattr(hook, method, None)) for method in _METHODS):
        return hook
    if callable(hook):
        return _FunctionHook(hook)
    raise TypeError(f"add_step_hook: a {type(hook).__name__} is not a step hook. Give an object with "
                    "before_optimizer_step(state), on_step_end(state) or on_save(state), or a function of the state.")


as_step_hook.register(StepChecks, _StepChecksHook)
as_step_hook.register(ReplicaGuard, _ReplicaGuardHook)
as_step_hook.register(CompileWatch, _CompileWatchHook)
as_step_hook.register(MetricsLogger, _MetricsHook)
as_step_hook.register(PeriodicCleanup, _CleanupHook)
