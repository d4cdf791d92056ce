"""examples/train_qwen.py end to end on real `accelerate launch` processes (2 CPU ranks, gloo).

Three 2-process launches serve every assertion (module-scoped fixtures; the baseline beside the resume's two):
  baseline  - `make demo` (the Makefile's flags: the default config, 30 steps, production mode, uninterrupted,
              a checkpoint at the end) in a pseudo-terminal, as tests/test_demo_output.py runs it: its
              metrics.jsonl is the baseline, and its screen is checked here (one screen, one bar, the summary);
  resume    - run 1: validate mode, stopped after step 5 with a save at 5 (lr_scheduler.total_steps=30,
              so the baseline's lr schedule); run 2: production mode, --checkpoint.restore_from=LATEST,
              to step 10 (the same schedule: 5 resumed steps compared with the baseline's), appending
              to the same JSONL;
  nan       - validate mode with a NaN planted at step 3 on rank 1 (tests/scripts/train_qwen_nan.py).
Config errors run in this process through the example's main() (one of them also as a plain `python`
process, for the exit code); the 30B dry run is in test_precision.py.
"""
import json
import math
import os

import pytest

from dist_utils import REPO, run_accelerate, run_python, run_together
from example_utils import load_example, run_main
from test_demo_output import assert_demo_screen, run_demo

SCRIPT = REPO / "examples" / "train_qwen.py"
CPU2 = REPO / "accelerate_configs" / "cpu_fsdp2_2proc.yaml"
STEPS, STOP, END = 30, 5, 10       # the baseline's steps; the resume's: stopped at STOP, resumed to END


def _records(path):
    with open(path) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def _launch(args, env=None, check=True):
    return run_accelerate(SCRIPT, CPU2, ["--logging.progress_bar=false", *args], env=env, timeout=400,
                          check=check)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """The baseline beside the resume's two launches (run_together: independent, deterministic runs)."""
    return run_together(lambda: _baseline(tmp_path_factory), lambda: _resume(tmp_path_factory))


@pytest.fixture(scope="module")
def demo(launches):
    return launches[0]


@pytest.fixture(scope="module")
def baseline(demo):
    """The demo's metrics.jsonl: (train records, eval records)."""
    code, raw, run = demo
    assert code == 0, raw.decode(errors="replace")[-4000:]
    return _records(run / "metrics.jsonl")


@pytest.fixture(scope="module")
def resume(launches):
    return launches[1]


def _baseline(tmp_path_factory):
    """`make demo` in a pseudo-terminal: (exit code, bytes written, its run directory)."""
    run = tmp_path_factory.mktemp("baseline") / "run"
    return (*run_demo(run), run)


def _resume(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    common = [f"--logging.metrics_file={out / 'metrics.jsonl'}", f"--lr_scheduler.total_steps={STEPS}",
              "--checkpoint.save_ckpt=true", f"--checkpoint.checkpoint_dir={out / 'ckpt'}",
              f"--checkpoint.save_steps={STOP}"]
    # The first job stops at STOP on the schedule of the whole run, as a preempted job would.
    first = _launch(common + [f"--training.max_steps={STOP}", "--training.mode=validate"])
    second = _launch(common + [f"--training.max_steps={END}", "--checkpoint.restore_from=LATEST"])
    return out, first, second, _records(out / "metrics.jsonl")


def test_loss_falls_and_metrics_complete(baseline):
    train, evals = baseline
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        for key in ("step", "epoch", "loss", "grad_norm", "lr", "step_time", "tokens_per_second"):
            assert r[key] is not None and math.isfinite(r[key]), (key, r)
    first = train[0]["loss"]
    last = sum(r["loss"] for r in train[-5:]) / 5
    assert last < first - 0.5, (first, last)
    # warm-up then cosine decay
    lrs = [r["lr"] for r in train]
    assert lrs[0] < lrs[2] and lrs[-1] < lrs[10]
    # evaluation every 10 steps on the held-out split; it improves too
    assert [e["step"] for e in evals] == [10, 20, 30]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert all(abs(e["eval_ppl"] - math.exp(e["eval_loss"])) < 1e-6 * e["eval_ppl"] for e in evals)


def test_make_demo_is_the_baseline_and_fits_one_screen(demo, baseline):
    """`make demo` fits one screen, one bar, the closing summary last: the default run's one pseudo-terminal
    run of it (tests/test_demo_output.py's own run of it is in the slow set)."""
    assert STEPS == 30 == baseline[0][-1]["step"]          # the demo's max_steps, the default config's
    assert_demo_screen(*demo)


def test_validate_mode_matches_production(baseline, resume):
    train, _ = baseline
    _, _, _, (resumed, _) = resume
    validate = [r["loss"] for r in resumed[:STOP]]
    production = [r["loss"] for r in train[:STOP]]
    assert validate == production


def test_resume_continues_exactly(baseline, resume):
    train, _ = baseline
    out, first, second, (resumed, _) = resume
    assert os.path.isfile(out / "ckpt" / "config.yaml")
    assert (out / "ckpt" / "latest_checkpoint_iteration.txt").read_text().strip() == str(END)
    assert f"resumed at step {STOP}" in second.stdout
    # the JSONL continues at STOP + 1, every step once
    assert [r["step"] for r in resumed] == list(range(1, END + 1))
    by_step = {r["step"]: r for r in train}
    assert resumed[STOP]["lr"] == pytest.approx(by_step[STOP + 1]["lr"], rel=1e-12)
    for r in resumed[STOP:]:
        ref = by_step[r["step"]]
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5), r["step"]
        assert r["lr"] == pytest.approx(ref["lr"], rel=1e-12), r["step"]
        assert r["consumed_samples"] == ref["consumed_samples"]


@pytest.mark.slow   # a NaN stopping the example: tests/test_fail_closed.py in the default run
def test_planted_nan_stops_validate_mode(tmp_path):
    # tests/scripts/train_qwen_nan.py: the example with a NaN loss planted at step 3 on rank 1
    proc = run_accelerate(REPO / "tests" / "scripts" / "train_qwen_nan.py", CPU2,
                          ["--logging.progress_bar=false", "--training.mode=validate", "--training.max_steps=5",
                           "--eval.eval_steps=0", f"--logging.metrics_file={tmp_path / 'm.jsonl'}"],
                          env={"NAN_AT_STEP": "3"}, timeout=400, check=False)
    assert proc.returncode != 0
    assert "non-finite loss at step 3 on rank 1 micro-batch 0" in proc.stderr, proc.stderr[-3000:]
    train, _ = _records(tmp_path / "m.jsonl")
    assert [r["step"] for r in train] == [1, 2]


@pytest.fixture(scope="module")
def example():
    return load_example("train_qwen_test_example")


def test_config_error_exits_2_in_one_line():
    """The interpreter's view, once: `python examples/train_qwen.py` with a bad flag exits 2, one line."""
    proc = run_python(SCRIPT, ["--training.max_stepz=3"], check=False, timeout=60)
    assert proc.returncode == 2
    assert "Unknown field 'training.max_stepz'" in proc.stderr and proc.stderr.count("config error") == 1, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, needle", [      # main() in this process (example_utils.run_main)
    (["--training.max_stepz=3"], "Unknown field 'training.max_stepz'"),
    (["--training.max_steps=three"], "training.max_steps must be int"),
    (["--optimizer._target_=torch.optim.SGD"], "_target_ cannot be overridden"),
    (["--training.global_batch_size=10", "--training.micro_batch_size=4"], "is not divisible by micro_batch_size=4"),
])
def test_config_errors(example, capsys, args, needle):
    code, _, err = run_main(example, args, capsys)
    assert code == 2
    assert needle in err and err.count("config error") == 1, err
    assert "Traceback" not in err


def test_indivisible_batch_for_the_world_size(example, capsys, monkeypatch):
    # checked from WORLD_SIZE before any process group or model exists
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, _, err = run_main(example, ["--training.global_batch_size=6"], capsys)
    assert code == 2
    assert "dp_size=2" in err and "2 data-parallel rank(s)" in err, err

