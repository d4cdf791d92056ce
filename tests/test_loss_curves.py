"""examples/loss_curves.py: the loss-curve consistency tool, on real processes for a few steps."""
import json

import pytest

from dist_utils import REPO, run_python

TOOL = REPO / "examples" / "loss_curves.py"


def test_the_tool_compares_layouts_and_writes_curves(tmp_path):
    proc = run_python(TOOL, ["--steps", 4, "--layouts", "dp1", "dp2-mb1", "--tolerance", 1e-5, "--out", tmp_path],
                      timeout=400)
    data = json.loads((tmp_path / "curves.json").read_text())
    assert data["reference"] == "dp1" and set(data["curves"]) == {"dp1", "dp2-mb1"}
    ref, two = data["curves"]["dp1"], data["curves"]["dp2-mb1"]
    assert ref["step"] == two["step"] == [1, 2, 3, 4] and all(a > 0 for a in ref["aux_loss"])
    assert max(abs(a - b) / b for a, b in zip(two["loss"], ref["loss"])) <= 1e-5
    assert "| dp2-mb1 |" in proc.stdout and "within the tolerance" in proc.stdout


@pytest.mark.slow
def test_a_deviation_beyond_the_tolerance_fails(tmp_path):
    # transformers' per-micro-batch aux loss changes with the micro-batch size: a tolerance of 1e-9 says so
    proc = run_python(TOOL, ["--steps", 3, "--layouts", "dp1", "dp1-mb4", "--tolerance", 1e-9, "--out", tmp_path,
                             "--", "--model.router_aux_loss=micro_batch"], timeout=400, check=False)
    assert proc.returncode == 1 and "BEYOND the tolerance" in proc.stdout, proc.stdout[-2000:]


def test_layouts_it_cannot_run_are_refused_before_anything_runs(tmp_path):
    for layout, message in (("dp2-xx3", "'xx3' is not one of"), ("dp3-ep2", "ep2 must divide"),
                            ("dp64", "needs 64 processes")):
        proc = run_python(TOOL, ["--layouts", "dp1", layout, "--out", tmp_path], timeout=60, check=False)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())
