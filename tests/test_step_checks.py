"""StepChecks in one process, on a real Accelerator: the production guard stays on the device between
checks (no host read), names the FIRST non-finite step at the next check, and refuses every save.
The 2-process runs of the example (planted NaN on one rank) are in test_fail_closed.py/test_example.py."""
import math
from pathlib import Path

import pytest
import torch

import hyperacc
from hyperacc.training.step_checks import NonFiniteError, StepChecks

NAN = float("nan")


@pytest.fixture(scope="module")
def acc(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    accelerator = hyperacc.Accelerator(checkpoint=hyperacc.CheckpointConfig(
        save_ckpt=True, checkpoint_dir=str(directory), save_steps=0))
    model = torch.nn.Linear(4, 4)
    accelerator.model, accelerator.optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    yield accelerator
    accelerator.end_training()


@pytest.fixture(autouse=True)
def no_leftover_guards(acc):
    yield
    acc._get_checkpointer().save_guards.clear()   # each test's StepChecks registered itself


def _step(checks, step, losses, norm):
    for index, loss in enumerate(losses):
        checks.watch_loss(torch.tensor(loss), index)
    checks.check(step, lambda: sum(losses) / len(losses), torch.tensor(norm))


class _Reads:
    """Counts host reads of tensors (``item``/``float``/``int``/``bool``/``tolist``/``cpu``)."""

    NAMES = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(original))

    def _counting(self, original):
        def wrapper(tensor, *args, **kwargs):
            self.count += 1
            return original(tensor, *args, **kwargs)
        return wrapper


def test_no_read_between_checks_and_first_bad_step_named(acc, monkeypatch):
    checks = StepChecks(acc, validate=False, check_every=4)
    reads = _Reads(monkeypatch)
    _step(checks, 1, [1.0, 2.0], 1.0)
    _step(checks, 2, [1.0, NAN], NAN)        # the first non-finite step: micro-batch 1
    _step(checks, 3, [NAN, NAN], NAN)
    assert reads.count == 0                  # steps 1-3 are not check steps: nothing was read
    with pytest.raises(NonFiniteError, match=r"non-finite loss at step 2 on rank 0 micro-batch 1 \(loss nan\)") as err:
        _step(checks, 4, [NAN], NAN)
    assert err.value.step == 2


def test_finite_run_passes_its_checks(acc):
    checks = StepChecks(acc, validate=False, check_every=2)
    for step in range(1, 7):
        _step(checks, step, [0.5, 0.25], 3.0)
    checks.verify()


def test_non_finite_norm_with_finite_losses(acc):
    checks = StepChecks(acc, validate=False, check_every=1)
    with pytest.raises(NonFiniteError, match="non-finite gradient norm at step 5"):
        _step(checks, 5, [1.0], math.inf)


def test_save_is_refused_after_a_non_finite_step(acc):
    checks = StepChecks(acc, validate=False, check_every=100)    # registers itself as a save guard
    _step(checks, 1, [NAN], NAN)
    with pytest.raises(NonFiniteError, match="at step 1"):
        acc.save_state()
    assert not list(Path(acc.checkpoint_config.checkpoint_dir).glob("global_step_*"))   # nothing written


def test_validate_checks_every_step_before_the_update(acc):
    checks = StepChecks(acc, validate=True)
    _step(checks, 1, [1.0], 1.0)
    with pytest.raises(NonFiniteError, match="non-finite loss at step 2 on rank 0 micro-batch 0"):
        _step(checks, 2, [NAN], NAN)
