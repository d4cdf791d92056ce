"""FSDPConfig(compile=True): per-block torch.compile under FSDP2, in real 2-process jobs (torchrun, gloo, CPU).

tests/scripts/train_parallel.py trains the tiny Qwen3-MoE at several layouts in one job, each from the
same seeded meta-device init on the same global batches; a "+c" layout is the same layout with its
blocks compiled (backend: --compile, default aot_eager), and ``compiled_frames`` is dynamo's count of
compiled frames in the process after each step. What is proven:

* Default run (one job, 10 steps, fp32, variable sequence lengths): with the aot_eager backend (graph
  capture + AOTAutograd, eager kernels) a compiled layout trains like its eager twin -- per-step loss and
  grad norm within RTOL over all 10 steps (with activation recompute: the recompute pair, slow set);
  compiled layouts do
  compile (the counter grows inside them), eager layouts compile nothing, and no compiled layout compiles
  again after step 2 although every step's sequences have other lengths (no recompile per shape).
* Checkpoint interchange (same job): an eager run's step-5 checkpoint resumed by a compiled run, and a
  compiled run's checkpoint resumed eagerly, continue exactly like the uninterrupted runs (steps 6..10);
  compiled and eager checkpoints hold the same tensor keys with the same shapes (compiling replaces
  ``forward`` in place: no ``_orig_mod`` in any name).
* Slow (HYPERACC_SLOW_TESTS=1): the same compiled-vs-eager comparison for expert (dp2ep2), tensor (dp1tp2)
  and context (dp1cp2) parallelism, and for the bf16 recipe; and the inductor backend, whose generated
  kernels round differently: its drift from eager is measured against the difference between two eager
  layouts that are mathematically equal (micro-batch size 1 vs 2) and held under a documented bound.
"""
from pathlib import Path

import pytest

from dist_utils import max_rel, run_layouts

STEPS = 20                  # the slow jobs (the inductor bounds below were measured over 20 steps)
# The default job: 10 steps (a step's sequences have other lengths every step, so steps 3..10 would show a
# recompile per shape as steps 3..20 did; dynamo marks a dimension dynamic at its second shape), the
# interchange at step 5. 20/15 measured the same (bitwise, or 1.3e-7) and cost 6 s more of a 32 s launch.
DEFAULT_STEPS, SAVE_STEP = 10, 5
RTOL = 1e-4                 # compiled (aot_eager) vs eager, per step; measured: bitwise, or 1.3e-7 (tp)
# inductor vs eager, per step over 20 steps. Measured on this CPU: loss 8.3e-5, grad norm 1.3e-3 (two eager
# layouts, mbs 1 vs 2: 1.1e-7 and 1.1e-6). The bound leaves room for other CPUs' vector code; a wrong
# kernel (a dropped term, a wrong gradient) moves the loss by far more within 20 steps at lr 3e-3.
INDUCTOR_LOSS_RTOL, INDUCTOR_GRAD_NORM_RTOL = 5e-3, 5e-2
INDUCTOR_FIRST_STEP_RTOL = 1e-5     # step 1: the same weights, forward only differs by kernel rounding

# The recompute pair (dp2r, dp2r+c) is a slow job of its own. (The default compiled resume recomputed too until
# the suite had to fit 10 minutes: 7 s of CPU of a 38 s job; compile with recompute is the slow set's now.)
DEFAULT = ["dp2", "dp2+c", "dp2+c<dp2", "dp2<dp2+c"]
DEFAULT_RECOMPUTE = []
RECOMPUTE = ["dp2r", "dp2r+c"]      # the "r" is ignored by the layout parser: dp2 with activation recompute
SLOW_PAIRS = ["rep2dp1", "dp2ep2", "dp1tp2", "dp1cp2"]     # rep2dp1: HSDP (2 replicas)


def _run(tmp_path_factory, name, layouts, *extra, steps=STEPS):
    return run_layouts(tmp_path_factory.mktemp(name), layouts, ["--steps", steps, *extra], nproc=2)


def _new_frames(job, spec):
    """Frames dynamo compiled while ``spec`` trained (the counter is per process and cumulative over the
    job's layouts, which run one after the other in the listed order)."""
    order = list(job)
    index = order.index(spec)
    before = job[order[index - 1]]["compiled_frames"][-1] if index else 0
    return job[spec]["compiled_frames"][-1] - before


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def job(tmp_path_factory, ckpt):
    """dp2 eager and compiled; each saves its step-5 state, then the compiled run resumes the eager
    checkpoint and the eager run the compiled one (steps 6..10)."""
    return _run(tmp_path_factory, "default", DEFAULT, "--recompute", *DEFAULT_RECOMPUTE,
                "--ckpt", ckpt, "--save-step", SAVE_STEP, steps=DEFAULT_STEPS)


@pytest.fixture(scope="module")
def recompute_job(tmp_path_factory, ckpt):
    """Slow: the dp2 pair with activation recompute from step 1 (compile with recompute is only here), saving
    its step-5 states beside the default job's."""
    return _run(tmp_path_factory, "recompute", RECOMPUTE, "--recompute", *RECOMPUTE,
                "--ckpt", ckpt, "--save-step", SAVE_STEP, steps=DEFAULT_STEPS)


def _job(request, spec):
    """The job that trained ``spec``: the recompute pair's slow job, or the default one."""
    return request.getfixturevalue("recompute_job" if spec in RECOMPUTE else "job")


@pytest.fixture(scope="module")
def slow_job(tmp_path_factory):
    # each compiled layout comes first of its kind in the process, so it compiles frames of its own. HSDP
    # comes first: listed after the tp2/cp2 layouts it reused their compiled code (guards pass) and drifted
    # by rounding (8.5e-8 at step 6, 1.3e-3 in grad norm by step 19 after MoE top-k flips) -- an artefact
    # of several models in one process; alone it is bitwise equal to eager.
    layouts = [spec for name in SLOW_PAIRS for spec in (name, name + "+c")]
    return _run(tmp_path_factory, "slow", layouts, "--pad-multiple", 2)


@pytest.fixture(scope="module")
def bf16_job(tmp_path_factory):
    return _run(tmp_path_factory, "bf16", ["dp2", "dp2+c"], "--precision", "bf16", "--optim", "hyperacc")


@pytest.fixture(scope="module")
def inductor_job(tmp_path_factory):
    from hyperacc.sharding.compile import _inductor_problem
    problem = _inductor_problem("cpu")
    if problem:
        pytest.skip(problem)
    return _run(tmp_path_factory, "inductor", ["dp2", "dp2+c", "dp2mb2"], "--compile", "inductor")


def _check_same_training(eager, compiled, steps=STEPS):
    assert len(eager["losses"]) == len(compiled["losses"]) == steps
    loss, grad_norm = max_rel(eager["losses"], compiled["losses"]), max_rel(eager["grad_norms"], compiled["grad_norms"])
    assert loss <= RTOL, f"{compiled['layout']} vs {eager['layout']}: loss rel {loss:.2e}"
    assert grad_norm <= RTOL, f"{compiled['layout']} vs {eager['layout']}: grad norm rel {grad_norm:.2e}"
    assert compiled["tokens"] == eager["tokens"]


def _check_compiled_once(job, spec):
    """``spec`` compiled frames of its own, all of them by step 2: steps 3..20 add none."""
    frames = job[spec]["compiled_frames"]
    assert _new_frames(job, spec) > 0, f"{spec} compiled nothing: {frames}"
    assert frames[1:] == [frames[1]] * (len(frames) - 1), f"{spec} recompiled after step 2: {frames}"


# ----------------------------------------------------------------------- default: dp2, aot_eager
# [dp2r] cases: slow (compile with activation recompute)
_SLOW_R = pytest.mark.slow


@pytest.mark.parametrize("eager", ["dp2", pytest.param("dp2r", marks=_SLOW_R)])
def test_compiled_matches_eager_per_step(request, eager):
    job = _job(request, eager)
    _check_same_training(job[eager], job[eager + "+c"], steps=DEFAULT_STEPS)


@pytest.mark.parametrize("spec", ["dp2+c", pytest.param("dp2r+c", marks=_SLOW_R)])
def test_compiled_layout_compiles_in_step_one_or_two_and_never_again(request, spec):
    job = _job(request, spec)
    _check_compiled_once(job, spec)
    # the steps' sequences have other lengths (so other token counts): no recompile per shape
    assert len(set(job[spec]["tokens"])) > 1


@pytest.mark.parametrize("spec", ["dp2", pytest.param("dp2r", marks=_SLOW_R), "dp2<dp2+c"])
def test_eager_layout_compiles_nothing(request, spec):
    job = _job(request, spec)
    assert _new_frames(job, spec) == 0, job[spec]["compiled_frames"]


@pytest.mark.parametrize("spec,uninterrupted", [("dp2+c<dp2", "dp2+c"), ("dp2<dp2+c", "dp2")])
def test_resume_across_compile_is_exact(job, spec, uninterrupted):
    run, reference = job[spec], job[uninterrupted]
    assert run["start_step"] == SAVE_STEP
    assert len(run["losses"]) == DEFAULT_STEPS - SAVE_STEP
    loss = max_rel(reference["losses"][SAVE_STEP:], run["losses"])
    grad_norm = max_rel(reference["grad_norms"][SAVE_STEP:], run["grad_norms"])
    assert loss <= RTOL and grad_norm <= RTOL, (loss, grad_norm)
    assert run["consumed_tokens"] == reference["consumed_tokens"]


def test_resumed_compiled_run_does_not_recompile(job):
    """The compiled resume compiles in its first step at most: the counter is positive and stays where it was
    for all its steps."""
    frames = job["dp2+c<dp2"]["compiled_frames"]
    assert frames[0] > 0 and frames == [frames[0]] * len(frames), frames


def _saved_tensors(folder: Path) -> dict:
    """{key: size} of the one DCP checkpoint (the folder holding ``.metadata``) under ``folder``."""
    import torch.distributed.checkpoint as dcp

    found = sorted(p.parent for p in folder.rglob(".metadata"))
    assert len(found) == 1, (folder, found, sorted(p.name for p in folder.iterdir()))
    metadata = dcp.FileSystemReader(str(found[0])).read_metadata().state_dict_metadata
    return {key: tuple(getattr(item, "size", ())) for key, item in metadata.items()}


@pytest.mark.parametrize("eager", ["dp2", pytest.param("dp2r", marks=_SLOW_R)])
def test_compiled_and_eager_checkpoints_hold_the_same_tensors(request, ckpt, eager):
    _job(request, eager)
    eager_keys, compiled_keys = _saved_tensors(Path(ckpt) / eager), _saved_tensors(Path(ckpt) / (eager + "+c"))
    assert any(".layers.0.self_attn.q_proj.weight" in key for key in eager_keys), sorted(eager_keys)[:20]
    assert not [key for key in compiled_keys if "_orig_mod" in key or "_checkpoint_wrapped" in key]
    assert sorted(compiled_keys) == sorted(eager_keys), set(compiled_keys) ^ set(eager_keys)
    assert compiled_keys == eager_keys      # and the same global shapes


# ----------------------------------------------------------------------- slow: ep, tp, cp, hsdp; bf16
@pytest.mark.slow
@pytest.mark.parametrize("eager", SLOW_PAIRS)
def test_compiled_matches_eager_per_step_parallel(slow_job, eager):
    _check_same_training(slow_job[eager], slow_job[eager + "+c"])
    _check_compiled_once(slow_job, eager + "+c")
    assert _new_frames(slow_job, eager) == 0


@pytest.mark.slow
def test_compiled_matches_eager_per_step_bf16_recipe(bf16_job, job):
    _check_same_training(bf16_job["dp2"], bf16_job["dp2+c"])
    _check_compiled_once(bf16_job, "dp2+c")
    # the recipe did apply: bf16 parameters train another curve than fp32's from step 1
    assert max_rel(job["dp2"]["losses"][:1], bf16_job["dp2"]["losses"][:1]) > 1e-6


# ----------------------------------------------------------------------- slow: inductor
@pytest.mark.slow
def test_inductor_drift_is_bounded(inductor_job):
    eager, compiled, other_eager = inductor_job["dp2"], inductor_job["dp2+c"], inductor_job["dp2mb2"]
    _check_compiled_once(inductor_job, "dp2+c")
    assert len(compiled["losses"]) == len(other_eager["losses"]) == STEPS
    drift = max_rel(eager["losses"], compiled["losses"]), max_rel(eager["grad_norms"], compiled["grad_norms"])
    layouts = max_rel(eager["losses"], other_eager["losses"]), max_rel(eager["grad_norms"], other_eager["grad_norms"])
    first = max_rel(eager["losses"][:1], compiled["losses"][:1])
    figures = (f"inductor vs eager over {STEPS} steps: loss rel {drift[0]:.2e}, grad norm rel {drift[1]:.2e}, "
               f"step 1 loss rel {first:.2e}; eager mbs1 vs mbs2: loss rel {layouts[0]:.2e}, grad norm rel "
               f"{layouts[1]:.2e}")
    print(figures)
    assert layouts[0] <= 1e-5 and layouts[1] <= 1e-5, figures     # the eager yardstick is near-exact
    assert first <= INDUCTOR_FIRST_STEP_RTOL, figures
    assert drift[0] <= INDUCTOR_LOSS_RTOL and drift[1] <= INDUCTOR_GRAD_NORM_RTOL, figures
