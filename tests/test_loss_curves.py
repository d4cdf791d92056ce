"""examples/loss_curves.py: the loss-curve consistency tool, on real processes for a few steps."""
import importlib.util
import json
import math
import sys

import pytest

from dist_utils import REPO, run_python

TOOL = REPO / "examples" / "loss_curves.py"


@pytest.mark.slow      # its comparison, alignment and refusals are tested below without launching layouts
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


def test_layouts_it_cannot_run_are_refused_before_anything_runs(tmp_path, capsys):
    # the cheap checks run in-process (test_bad_layouts_...); the example's own checks refuse the rest. The
    # first case runs the tool as a process (its exit code), the others its main() in this process (a
    # process start-up costs ~3 s; main returns the exit code the tool's process exits with).
    tool = load_tool()
    for index, (layout, message) in enumerate((
            ("dp64", "needs 64 processes"),
            ("dp3", "layout 'dp3' cannot run: training.global_batch_size=8 is not divisible"),
            ("tp3", "layout 'tp3' cannot run: dry run for 3 ranks: tp_size=3 does not divide"),
            ("dp2-ep2 -- --training.no_such_flag=1", "no_such_flag"))):
        # dp1 first: had anything been launched before the check, its files would be in tmp_path
        argv = ["--steps", 2, "--out", tmp_path, "--layouts", "dp1", *layout.split()]
        if index == 0:
            proc = run_python(TOOL, argv, timeout=60, check=False)
            code, stderr = proc.returncode, proc.stderr
        else:
            capsys.readouterr()
            code = tool.main([str(arg) for arg in argv])
            stderr = capsys.readouterr().err
        assert code == 2 and message in stderr and stderr.count("\n") == 1, stderr
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- the analysis, on hand-written curves (no training)
def load_tool():
    """The tool as a module (examples/ is not a package), registered so that its dataclasses resolve."""
    spec = importlib.util.spec_from_file_location("loss_curves_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def curve(steps, loss):
    return {"step": list(steps), "loss": list(loss), "aux_loss": [0.1] * len(loss), "grad_norm": [1.0] * len(loss)}


def smooth_loss(n=30):
    return [3.0 + 1.0 / step for step in range(1, n + 1)]


def replot(folder, curves, *args, reference="dp1", steps=None):
    """Write folder/curves.json as the tool saves it and analyse it with --replot, in this process."""
    folder.mkdir(exist_ok=True)
    saved = {"reference": reference, "curves": curves, **({"steps": steps} if steps else {})}
    (folder / "curves.json").write_text(json.dumps(saved))
    return load_tool().main(["--replot", "--out", str(folder), *map(str, args)])


def test_a_non_finite_loss_fails_naming_the_layout_and_its_first_bad_step(tmp_path, capsys):
    loss = smooth_loss()
    nan_for_20 = loss[:4] + [math.nan] * 20 + loss[24:]
    assert replot(tmp_path / "nan", {"dp1": curve(range(1, 31), loss), "dp2": curve(range(1, 31), nan_for_20)}) == 1
    out = capsys.readouterr().out
    assert "FAILED dp2: the loss is nan at step 5 (non-finite at 20 step(s): 5-24)" in out
    assert "within the tolerance" not in out
    # inf in a layout, and NaN in the reference, fail just the same (the reference is named as such)
    assert replot(tmp_path / "inf", {"dp1": curve(range(1, 31), loss),
                                     "dp2": curve(range(1, 31), loss[:29] + [math.inf])}) == 1
    assert "FAILED dp2: the loss is inf at step 30" in capsys.readouterr().out
    assert replot(tmp_path / "ref", {"dp1": curve(range(1, 31), loss[:9] + [math.nan] + loss[10:]),
                                     "dp2": curve(range(1, 31), loss)}) == 1
    assert "FAILED dp1 (the reference): the loss is nan at step 10" in capsys.readouterr().out


def test_nan_safe_comparisons():
    tool = load_tool()
    assert tool.relative_deviation(math.nan, 1.0) == math.inf and tool.relative_deviation(1.0, math.nan) == math.inf
    assert tool.relative_deviation(None, 1.0) == math.inf and tool.relative_deviation(0.0, 0.0) == 0.0
    assert not tool.passed([tool.Row("dp1", smooth=0.0), tool.Row("dp2", smooth=math.nan)], tolerance=1.0)
    assert not tool.passed([tool.Row("dp1", smooth=0.0), tool.Row("dp2")], tolerance=1.0)     # never compared
    assert tool.passed([tool.Row("dp1", smooth=0.0), tool.Row("dp2", smooth=0.5)], tolerance=1.0)


def test_curves_are_aligned_on_step_numbers_not_positions(tmp_path, capsys):
    loss = smooth_loss(4)
    ref = curve([1, 2, 3, 4], loss)
    # the same losses, recorded out of order: equal curves
    assert replot(tmp_path / "order", {"dp1": ref, "dp2": curve([2, 1, 4, 3], [loss[1], loss[0], loss[3], loss[2]]),
                                       }, "--tolerance", 0) == 0, capsys.readouterr().out
    capsys.readouterr()
    # as many rows as the reference, but step 4 missing and a step 5 it lacks: both named, a failure
    assert replot(tmp_path / "gap", {"dp1": ref, "dp2": curve([1, 2, 3, 5], loss)}) == 1
    out = capsys.readouterr().out
    assert "FAILED dp2: missing step(s) 4 that the reference has; step(s) 5 that the reference lacks" in out
    # a reference missing some of the steps the run asked for is not a silently shorter comparison
    assert replot(tmp_path / "short", {"dp1": ref, "dp2": ref}, steps=6) == 1
    assert "FAILED dp1 (the reference): missing step(s) 5-6 of the 6" in capsys.readouterr().out


def test_a_step_recorded_twice_counts_with_its_last_record(tmp_path, capsys):
    loss = smooth_loss(4)
    # a resume from step 1 appended steps 2-3 again: the first records are the abandoned run's
    resumed = curve([1, 2, 3, 2, 3, 4], [loss[0], 99.0, 99.0, loss[1], loss[2], loss[3]])
    assert replot(tmp_path, {"dp1": curve([1, 2, 3, 4], loss), "dp2": resumed}, "--tolerance", 0) == 0
    out = capsys.readouterr().out
    assert "note: dp2: step(s) 2-3 recorded more than once; the last record of each is compared" in out
    assert "| dp2 | 4 steps |" in out


def test_replot_uses_the_recorded_reference_or_the_one_asked_for(tmp_path, capsys):
    loss = smooth_loss()
    curves = {"dp2": curve(range(1, 31), loss), "tp2": curve(range(1, 31), [v * 1.001 for v in loss])}
    assert replot(tmp_path, curves, reference="dp2") == 0            # no dp1 in this run
    out = capsys.readouterr().out
    assert "| dp2 (reference) |" in out and "| tp2 | 0 steps | 1.0e-03 (" in out
    assert load_tool().main(["--replot", "--out", str(tmp_path), "--layouts", "tp2", "dp2"]) == 0
    assert "| tp2 (reference) |" in capsys.readouterr().out
    assert load_tool().main(["--replot", "--out", str(tmp_path), "--layouts", "dp1", "tp2"]) == 2
    assert "dp1 not in" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--window", 0], "--window 0: the moving average needs at least one step. Fix: e.g. --window 25."),
    (["--window", -2], "--window -2"),
    (["--steps", 0], "--steps 0: the run needs at least one step"),
    (["--steps", -5], "--steps -5"),
    (["--tolerance", -1e-3], "--tolerance -0.001: must be a finite number >= 0"),
    (["--tolerance", "nan"], "--tolerance nan: must be a finite number >= 0"),
    (["--tolerance", "inf"], "--tolerance inf"),
])
def test_nonsense_numbers_are_refused_in_one_line(tmp_path, capsys, args, message):
    # on a saved run, so that a tool that let them through analyses instead of training
    assert replot(tmp_path, {"dp1": curve([1, 2], [3.0, 2.9]), "dp2": curve([1, 2], [3.0, 2.9])}, *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert [p.name for p in tmp_path.iterdir()] == ["curves.json"]          # nothing written


@pytest.mark.parametrize("layouts, message", [
    (["dp1", "dp2-ep0"], "layout 'dp2-ep0': 'ep0' must be >= 1. Fix: e.g. ep1, or leave ep out."),
    (["dp1", "dp0"], "'dp0' must be >= 1"),
    (["dp1", "dp2-dp4"], "dp is given twice"),
    (["dp1", "dp2", "dp2"], "dp2 given more than once"),
    (["dp1", "dp2-xx3"], "'xx3' is not one of"),
    (["dp1", "dp3-ep2"], "ep2 must divide"),
])
def test_bad_layouts_are_refused_in_one_line_before_anything_runs(tmp_path, capsys, layouts, message):
    out = tmp_path / "out"
    assert load_tool().main(["--steps", "1", "--out", str(out), "--layouts", *layouts]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists()
