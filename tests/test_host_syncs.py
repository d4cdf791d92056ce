"""Issue 12: no host synchronisation on a non-logging step of the example beyond the one it needs.

tests/scripts/count_host_syncs.py runs examples/train_qwen.py with tensor reads and torch.distributed
collectives counted per optimizer step (see its docstring for what counts). Per non-logging step:
* no read of a device/float tensor at all: the non-finite guard (``StepChecks``) folds the gradient
  norm's verdict into device scalars and reads them on logging steps and before saves only;
* one host collective on 2 processes (none on 1): the accumulator's step-statistics all_gather of
  host integers (the token count the loss scaling needs; no device work).
Per logging step: at most 2 host collectives beyond that one (the metrics window takes one).
"""
import json

import pytest

from dist_utils import REPO, run_accelerate, run_python

SCRIPT = REPO / "tests" / "scripts" / "count_host_syncs.py"
CPU2 = REPO / "accelerate_configs" / "cpu_fsdp2_2proc.yaml"
ARGS = ["--training.max_steps=6", "--logging.logging_steps=3", "--eval.eval_steps=0", "--checkpoint.save_ckpt=false",
        "--logging.progress_bar=false"]


def _check(steps, per_step_collectives):
    assert [(s["step"], s["logging"]) for s in steps] == [(n, n % 3 == 0) for n in range(1, 7)]
    for s in steps:
        stats = [c for c in s["host_collectives"] if "hyperacc/training/accumulation.py" in c]
        assert len(stats) == per_step_collectives, s
        if not s["logging"]:
            assert s["reads"] == [] and len(s["host_collectives"]) == per_step_collectives, s
        else:
            assert len(s["host_collectives"]) - per_step_collectives <= 2, s
    assert any(s["reads"] for s in steps if s["logging"])   # the counter sees reads: the flush reads values


@pytest.mark.slow     # the same counts on 1 process (no collective at all); by default: test_two_processes
def test_one_process(tmp_path):
    run_python(SCRIPT, [tmp_path, *ARGS], timeout=400)
    _check(json.loads((tmp_path / "rank0.json").read_text()), per_step_collectives=0)


@pytest.mark.parametrize("rank", [0, 1])
def test_two_processes(two_process_run, rank):
    _check(json.loads((two_process_run / f"rank{rank}.json").read_text()), per_step_collectives=1)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("host_syncs")
    run_accelerate(SCRIPT, CPU2, [out, *ARGS], timeout=400)
    return out
