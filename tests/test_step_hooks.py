"""Step hooks (hyperacc.training.hooks) on a real Accelerator, one process: the order they run in around
the update, what they see, the built-in objects registered as they are, and their errors. The example
runs them on 2 processes (test_example.py, test_step_checks.py, test_replicas.py, test_metrics.py
compare its outputs)."""
import json

import pytest
import torch

import hyperacc
from hyperacc.models import build_causal_lm, qwen3_moe_config
from hyperacc.runtime.housekeeping import PeriodicCleanup
from hyperacc.sharding.compile import CompileWatch
from hyperacc.training import hooks
from hyperacc.training.metrics import MetricsLogger
from hyperacc.training.step_checks import NonFiniteError, StepChecks

VOCAB, SEQ = 512, 16


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


@pytest.fixture
def make(tmp_path):
    """make(save_steps) -> (acc, model, optimizer, loader, scheduler): the tiny MoE, 2 micro-batches per step."""
    made = []

    def build(save_steps=2):
        acc = hyperacc.Accelerator(checkpoint=hyperacc.CheckpointConfig(
            save_ckpt=True, checkpoint_dir=str(tmp_path / "ckpt"), save_steps=save_steps), seed=3)
        acc.save_on_end = False
        made.append(acc)
        model = build_causal_lm(qwen3_moe_config(), seed=3, router_aux_loss=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
        loader = hyperacc.MicroBatchDataLoader(Tokens(), global_batch_size=4, micro_batch_size=2, seed=3)
        return (acc, *acc.prepare(model, optimizer, loader, scheduler))
    yield build
    for acc in made:
        acc.end_training()


def _loop(acc, model, optimizer, loader, scheduler, steps, *, clip=True, poison_step=None):
    """The example's loop; ``poison_step``: that step's losses are NaN. Returns step_end's results."""
    results = []
    for batch in loader:
        with acc.accumulate(model, batch) as micro_batches:
            for mb in micro_batches:
                loss = model(**mb).loss
                acc.backward(loss * float("nan") if acc.progress.global_step + 1 == poison_step else loss)
        if clip:
            acc.clip_grad_norm_(model.parameters(), float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        results.append(acc.step_end())
        if acc.progress.global_step >= steps:
            return results


def _flat(model):
    return torch.cat([p.detach().full_tensor().reshape(-1) for p in model.parameters()])


def test_hooks_run_in_order_around_the_update_and_see_the_step(make, tmp_path):
    acc, model, optimizer, loader, scheduler = run = make()
    calls, seen = [], []

    class Recorder:
        def before_optimizer_step(self, state):
            seen.append(dict(step=state.step, global_step=acc.progress.global_step, lr=state.lr,
                             lr_now=optimizer.param_groups[0]["lr"], norm=state.grad_norm,
                             losses=[float(x) for x in state.micro_losses], params=_flat(model)))
            calls.append(("before", state.step))

        def on_step_end(self, state):
            calls.append(("end", state.step, state.saved))

        def on_save(self, state):
            calls.append(("save", state.step, state.saved))

    class AfterSave:
        order = hooks.SAVE + 1

        def on_step_end(self, state):
            calls.append(("after_save", state.step, state.saved))

    metrics = MetricsLogger(metrics_file=str(tmp_path / "m.jsonl"), logging_steps=100, progress_bar=False,
                            log_fn=lambda *_: None)
    acc.add_step_hook(AfterSave())
    acc.add_step_hook(Recorder())
    acc.add_step_hook(lambda state: calls.append(("first", state.step)), order=1)
    for hook in (metrics, CompileWatch(True), PeriodicCleanup(gc_steps=1)):
        acc.add_step_hook(hook)
    norms = []
    original = acc.clip_grad_norm_
    acc.clip_grad_norm_ = lambda *a, **k: norms.append(original(*a, **k)) or norms[-1]

    results = _loop(*run, 3)

    saved = str(tmp_path / "ckpt" / "global_step_2")
    assert results == [None, saved, None]
    assert calls == [("before", 1), ("first", 1), ("end", 1, None), ("after_save", 1, None),
                     ("before", 2), ("first", 2), ("end", 2, None), ("after_save", 2, saved), ("save", 2, saved),
                     ("before", 3), ("first", 3), ("end", 3, None), ("after_save", 3, None)]
    for index, record in enumerate(seen):     # before the update: the step about to be applied, its lr
        assert record["step"] == record["global_step"] + 1 == index + 1
        assert record["lr"] == record["lr_now"] == pytest.approx(1e-3 / (index + 1))
        assert record["norm"] is norms[index] and len(record["losses"]) == 2
    assert not torch.equal(seen[0]["params"], seen[1]["params"])   # step 1 was applied after its hook
    # The metrics hook: the step saved at 2 is flushed at its save (logging_steps=100), with the
    # compile watch's count in its record (it ran before the metrics); step 3 waits for the window.
    records = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert [r["step"] for r in records] == [1, 2] and all(r["compiles"] == 0 for r in records)
    assert records[0]["lr"] == pytest.approx(1e-3) and records[1]["lr"] == pytest.approx(5e-4)
    assert records[0]["grad_norm"] == pytest.approx(float(norms[0]))
    metrics.close()
    assert [json.loads(line)["step"] for line in open(tmp_path / "m.jsonl")] == [1, 2, 3]


@pytest.mark.parametrize("validate", [False, True])
def test_step_checks_stop_a_non_finite_step_before_the_update_and_the_save(make, tmp_path, validate):
    acc, model, *_ = run = make(save_steps=1)
    acc.add_step_hook(StepChecks(acc, validate=validate, check_every=1))
    _loop(*run, 1)
    applied = _flat(model)
    with pytest.raises(NonFiniteError, match=r"non-finite loss at step 2 on rank 0 micro-batch 0 \(loss nan\)"):
        _loop(*run, 3, poison_step=2)
    assert acc.progress.global_step == 1 and torch.equal(_flat(model), applied)   # step 2 was never applied,
    assert (tmp_path / "ckpt" / "global_step_1").is_dir()                        # nor saved
    assert not (tmp_path / "ckpt" / "global_step_2").exists()


def test_step_checks_hook_needs_the_gradient_norm(make):
    acc, *_ = run = make()
    acc.add_step_hook(StepChecks(acc, validate=False))
    with pytest.raises(ValueError, match=r"needs the step's gradient norm: call acc.clip_grad_norm_"):
        _loop(*run, 1, clip=False)
    assert acc.progress.global_step == 0


def test_registration_errors_and_removal(make):
    acc, *_ = run = make()
    checks = StepChecks(acc, validate=False)
    acc.add_step_hook(checks)
    with pytest.raises(ValueError, match="already a step hook"):
        acc.add_step_hook(checks)
    with pytest.raises(TypeError, match="int is not a step hook"):
        acc.add_step_hook(42)
    with pytest.raises(TypeError, match=r"order='late'"):
        acc.add_step_hook(lambda state: None, order="late")
    calls = []
    handle = acc.add_step_hook(lambda state: calls.append(state.step))
    _loop(*run, 1)
    handle.remove()
    _loop(*run, 2)
    assert calls == [1]


class _Reads:
    """Counts host reads of tensors while active."""

    NAMES = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu")

    def __init__(self, monkeypatch):
        self.count, self.active = 0, False
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name)))

    def _counting(self, original):
        def wrapper(tensor, *args, **kwargs):
            self.count += self.active
            return original(tensor, *args, **kwargs)
        return wrapper

    def around(self, fn):
        def wrapper(*args, **kwargs):
            self.active = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.active = False
        return wrapper


def test_the_hooks_read_nothing_from_the_device_between_logging_steps(make, tmp_path, monkeypatch):
    """Production: the checks, guard, metrics, compile watch and cleanup stay on the device between
    their logging/check steps, as the loop did when it called them one by one."""
    acc, *_ = run = make(save_steps=0)
    metrics = MetricsLogger(metrics_file=str(tmp_path / "m.jsonl"), logging_steps=4, progress_bar=False,
                            log_fn=lambda *_: None)
    for hook in (StepChecks(acc, validate=False, check_every=4), hyperacc.ReplicaGuard(acc, every=4), metrics,
                 CompileWatch(False), PeriodicCleanup(gc_steps=1)):
        acc.add_step_hook(hook)
    reads = _Reads(monkeypatch)
    acc.step_hooks.before_optimizer_step = reads.around(acc.step_hooks.before_optimizer_step)
    acc.step_hooks.step_end = reads.around(acc.step_hooks.step_end)
    _loop(*run, 3)
    assert reads.count == 0                    # steps 1-3: nothing read
    _loop(*run, 4)
    assert reads.count > 0                     # step 4: the checks, the guard and the metrics window read
    metrics.close()
