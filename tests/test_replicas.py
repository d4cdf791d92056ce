"""Copies that must agree do agree: HSDP replicas under every precision recipe, bf16 rounding that does
not depend on the layout, and the ReplicaGuard that catches copies drifting apart.

Real FSDP2 processes (torchrun, gloo) running tests/scripts/precision_run.py on a tiny Qwen3-MoE; the
default 2-process runs share one launch, the 1-process ones another (precision_run.py --then).
"""
import json
import math

import pytest
import torch

from dist_utils import REPO, max_rel, run_python, run_torchrun

RUN = REPO / "tests" / "scripts" / "precision_run.py"


def _runs(tmp, nproc, runs):
    """{name: args} run in one launch of ``nproc`` processes (precision_run.py --then): {name: record}."""
    argv = []
    for name, args in runs.items():
        argv += [*(["--then"] if argv else []), tmp / f"{name}.json", "--ckpt", tmp / f"ckpt_{name}", *map(str, args)]
    if nproc == 1:
        run_python(RUN, argv, timeout=400)
    else:
        run_torchrun(RUN, nproc, argv, timeout=400)
    return {name: json.loads((tmp / f"{name}.json").read_text()) for name in runs}


def _run(tmp, name, nproc, *args):
    return _runs(tmp, nproc, {name: args})[name]


# The default 2-process runs of this file share one launch (a start-up costs more than a run):
HSDP_ARGS = ["--replicate", 2, "--steps", 20]                    # + --precision, --dump
GUARD_ARGS = ["--precision", "bf16", "--steps", 12, "--guard-every", 2, "--perturb", 3]   # + the layout
WORLD_ARGS = ["--precision", "bf16_sr", "--steps", 16]
EP_STEPS = 4                      # the run under expert parallelism: "two" (same seed, data, lr) over its first steps


@pytest.fixture(scope="module")
def two_process_job(tmp_path_factory):
    """bf16_sr HSDP replicas (dumped), the bf16_sr run that saves at step 8 (and exports), its step-8 resume
    under bf16_sr and under fp32_master, the guard on HSDP replicas, and the bf16_sr run under expert
    parallelism (ep 2)."""
    tmp = tmp_path_factory.mktemp("two_process_job")
    (tmp / "dump").mkdir()
    records = _runs(tmp, 2, {"hsdp": ["--precision", "bf16_sr", *HSDP_ARGS, "--dump", tmp / "dump"],
                             "two": [*WORLD_ARGS, "--save-steps", 8, "--export", tmp / "hf"],
                             # tests/test_precision.py's bf16_sr checks, in this launch (its own is slow):
                             "resumed_2": ["--precision", "bf16_sr", "--steps", 10,
                                           "--restore", tmp / "ckpt_two" / "global_step_8"],
                             "cast": ["--precision", "fp32_master", "--steps", 9,
                                      "--restore", tmp / "ckpt_two" / "global_step_8"],
                             "guard": [*GUARD_ARGS, "--replicate", 2],
                             "ep": ["--precision", "bf16_sr", "--steps", EP_STEPS, "--ep", 2]})
    return tmp, records


def _series(record, key="loss"):
    steps = record["steps"]
    return [steps[k][key] for k in sorted(steps, key=int)]


def _differing(dump, world, replicate):
    """Names of parameters whose local shards differ between replicas (rank r and r + world/replicate)."""
    shards = [torch.load(dump / f"rank{r}.pt") for r in range(world)]
    stride = world // replicate
    bad = set()
    for rank in range(stride, world):
        mine, twin = shards[rank], shards[rank % stride]
        bad |= {n for n in mine if not torch.equal(mine[n].view(-1).view(torch.uint8), twin[n].view(-1).view(torch.uint8))}
    return sorted(bad)


@pytest.mark.parametrize("precision,world", [
    ("bf16_sr", 2),
    pytest.param("bf16", 2, marks=pytest.mark.slow),
    pytest.param("fp32_master", 2, marks=pytest.mark.slow),
    pytest.param("bf16_sr", 4, marks=pytest.mark.slow),
    pytest.param("bf16", 4, marks=pytest.mark.slow),
    pytest.param("fp32_master", 4, marks=pytest.mark.slow),
])
def test_hsdp_replicas_stay_bitwise_identical(request, tmp_path, precision, world):
    # dp_replicate 2 x dp_shard 1 (2 processes) or 2 x 2 (4): stochastic rounding used to be seeded
    # by the mesh coordinate, replicate index included, so every bf16 parameter differed after 5 steps.
    if (precision, world) == ("bf16_sr", 2):
        tmp, records = request.getfixturevalue("two_process_job")
        dump, record = tmp / "dump", records["hsdp"]
    else:
        dump = tmp_path / "dump"
        dump.mkdir()
        record = _run(tmp_path, "hsdp", world, "--precision", precision, *HSDP_ARGS, "--dump", dump)
    assert len(record["steps"]) == 20
    assert _differing(dump, world, 2) == []


def test_bf16_sr_does_not_depend_on_the_world_size_and_resumes_across_it(two_process_job, tmp_path):
    saved, records = two_process_job
    two = records["two"]
    # one process: the same run, then the resume of the 2-process run's step 8, in one job
    ones = _runs(tmp_path, 1, {"one": WORLD_ARGS,
                               "resumed": [*WORLD_ARGS, "--restore", saved / "ckpt_two" / "global_step_8"]})
    one, resumed = ones["one"], ones["resumed"]
    assert max_rel(_series(two), _series(one)) <= 1e-5          # was 1.8e-4: rounding keyed by shard
    assert max_rel(_series(two, "grad_norm"), _series(one, "grad_norm")) <= 1e-5
    assert resumed["start"] == 8
    tail = {k: v for k, v in two["steps"].items() if int(k) > 8}
    assert max_rel(_series(resumed), _series({"steps": tail})) <= 1e-5
    assert max_rel(_series(resumed, "grad_norm"), _series({"steps": tail}, "grad_norm")) <= 1e-5


@pytest.mark.parametrize("layout", [
    ["--replicate", 2],                                                       # HSDP replicas
    pytest.param(["--tp", 2, "--perturb-param", "model.layers.1.self_attn.k_norm.weight"],   # a norm every
                 marks=pytest.mark.slow),                                     # TP rank keeps whole
])
def test_the_guard_passes_agreeing_copies_and_finds_a_one_ulp_mismatch_at_its_next_check(request, tmp_path, layout):
    # checks every 2 steps: step 2 passes (the copies agree); rank 1's copy of one parameter then
    # moves by one ulp after step 3, and the check of step 4 names it
    if layout == ["--replicate", 2]:
        record = request.getfixturevalue("two_process_job")[1]["guard"]
    else:
        record = _run(tmp_path, "guard", 2, *GUARD_ARGS, *layout)
    assert record["mismatch"]["step"] == 4 and sorted(record["steps"], key=int) == ["1", "2", "3", "4"], record
    error = record["mismatch"]["error"]
    assert "differs between ranks 0 and 1" in error and "hold the same slice of it" in error and "\n" not in error
    assert ("k_norm" if "--tp" in layout else "model.embed_tokens.weight") in error


# Slow set for time only (two launches; the rounding's own tests run by default). An earlier session saw its
# torchrun abort twice at gloo teardown under load; 330 launches here (2 and 4 ranks, up to 12 processes and
# three busy loops on 2 cores, with and without pytest) never aborted: see issue 38's note.
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_element_indices_match_torchs_own_sharding(tmp_path, world):
    # the oracle: distribute_tensor(arange(numel)) puts each element's global index where it lives
    out = tmp_path / "indices.json"
    run_torchrun(REPO / "tests" / "scripts" / "rounding_indices.py", world, [out], timeout=300)
    assert json.loads(out.read_text()) == []


def test_the_guard_refuses_a_nonsense_interval():
    from hyperacc.training.replica_guard import ReplicaGuard

    for bad in (-1, 2.5, "10", True):
        with pytest.raises(ValueError, match="whole number of steps"):
            ReplicaGuard(object(), every=bad)


def test_bf16_sr_under_expert_parallelism_agrees_with_its_run_without(two_process_job):
    """bf16_sr under a model-parallel layout (ep 2): the same losses as the bf16_sr run without it, within 2e-3
    (its rounding and bf16 sums follow the layout), stored in bf16. The default run's guarantee of
    tests/test_feature_pairs.py::test_feature_pair[ep+bf16_sr] (the example's pair, in the slow set), in this
    file's shared launch."""
    _, records = two_process_job
    ep, two = records["ep"], records["two"]
    assert ep["param_dtypes"] == ep["state_dtypes"] == ["bfloat16"] and ep["stochastic_rounding"] is True
    losses = _series(ep)
    assert len(losses) == EP_STEPS and all(0 < x < 20 for x in losses), losses
    assert max_rel(losses, _series(two)[:EP_STEPS]) <= 2e-3, (losses, _series(two))


# ----------------------------------------------------------------------- bf16_sr training, resume, export
# The default run's checks of tests/test_precision.py's bf16_sr launch (slow there), on this file's shared launch:
def test_bf16_sr_trains_sharded_bf16_with_bf16_states(two_process_job):
    run = two_process_job[1]["two"]
    assert run["param_dtypes"] == run["grad_dtypes"] == run["state_dtypes"] == ["bfloat16"]
    assert run["stochastic_rounding"] is True
    losses = _series(run)
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0]


def test_bf16_sr_resumes_bitwise(two_process_job):
    records = two_process_job[1]
    run, resumed = records["two"], records["resumed_2"]
    assert resumed["start"] == 8 and not resumed["warnings"]
    assert {s: resumed["steps"][s] for s in ("9", "10")} == {s: run["steps"][s] for s in ("9", "10")}


def test_a_resume_under_another_recipe_casts_with_a_warning(two_process_job):
    converted = two_process_job[1]["cast"]
    assert any("saved under precision='bf16_sr' and this run uses 'fp32_master'" in w for w in converted["warnings"])
    assert converted["param_dtypes"] == converted["state_dtypes"] == ["float32"] and converted["start"] == 8
    assert math.isfinite(converted["steps"]["9"]["loss"])


def test_hf_export_writes_the_parameters_dtype(two_process_job):
    hf = two_process_job[0] / "hf"
    headers = [json.loads(f.read_bytes()[8:8 + int.from_bytes(f.read_bytes()[:8], "little")])
               for f in hf.glob("*.safetensors")]
    assert headers and {v["dtype"] for h in headers for k, v in h.items() if k != "__metadata__"} == {"BF16"}
    assert json.loads((hf / "config.json").read_text())["dtype"] == "bfloat16"
