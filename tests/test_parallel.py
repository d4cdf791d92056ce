"""Issue 11: tensor and expert parallelism on the one mesh, composed with FSDP2 (real processes, gloo, fp32).

One 1-process reference and 4-process jobs (several layouts per job, each from the same seeded
meta-device init on the same global batches, 2 micro-batches per DP rank and step): job A trains dp4,
dp2tp2 and dp4ep2, saving at step 5, then resumes those checkpoints at other layouts in the same launch;
job B the other layouts of the issue. Both are in the slow set (a 4-process launch and its reference cost
~50 s of CPU): the default run keeps each guarantee on 2 processes in tests/test_router_aux.py's shared
launch -- TP (dp1tp2) and EP (dp2ep2) equal one process (test_every_layout_equals_one_process_with_the_aux_loss_on),
their placements and expert shares (test_placements_and_expert_shares_of_each_kind_of_layout) and an exact
resume across layouts (test_resume_across_layouts_is_exact: a cp 2 checkpoint resumed at dp 2).
"""
import json

import pytest
import torch

from conftest import SLOW

from dist_utils import REPO, max_rel, run_layouts
from hyperacc import parallel
from hyperacc.config import ParallelConfig
from hyperacc.models import build_causal_lm, qwen3_moe_config

STEPS, SAVE_STEP = 10, 5
RTOL = 1e-5


_rel = max_rel


def _run(tmp_path_factory, name, layouts, *extra, nproc=4):
    return run_layouts(tmp_path_factory.mktemp(name), layouts, ["--steps", STEPS, *extra], nproc)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory, "ref", ["dp1"], nproc=1)["dp1"]


# The default run covers each kind of layout once (the slow set: every layout of the issue).
JOB_B = ["dp4ep4", "dp2tp2ep4", "rep2dp2ep2"] if SLOW else []   # 2-process tp/ep: tests/test_router_aux.py
RESUMES = ["dp2tp2<dp4", "dp4ep2<dp4", "dp4ep4<dp4", "dp4<dp4ep2", "dp4<dp2tp2"]   # job A: slow (module docstring)


@pytest.fixture(scope="module")
def job_a(tmp_path_factory, ckpt):
    """dp4, dp2tp2 and dp4ep2, each saving its step-5 state; then, in the same launch (a 4-process start-up
    costs more than 5 steps), the resumes of those checkpoints at other layouts."""
    assert all(spec.split("<")[1] in ("dp4", "dp2tp2", "dp4ep2") for spec in RESUMES)
    return _run(tmp_path_factory, "a", ["dp4", "dp2tp2", "dp4ep2", *RESUMES], "--ckpt", ckpt, "--save-step", SAVE_STEP)


def _slow_unless(names, kept):
    return [n if n in kept else pytest.param(n, marks=pytest.mark.slow) for n in names]


@pytest.fixture(scope="module")
def job_b(tmp_path_factory):
    return _run(tmp_path_factory, "b", JOB_B, "--recompute", "dp2tp2ep4") if JOB_B else {}


@pytest.fixture(scope="module")
def job_resume(job_a):
    return {spec: job_a[spec] for spec in RESUMES}


@pytest.mark.slow   # TP/EP = 1 process by default: test_router_aux.py::test_every_layout_equals_one_process_with_the_aux_loss_on
@pytest.mark.parametrize("layout", ["dp4", "dp2tp2", "dp4ep2"])
def test_layouts_match_one_process_a(reference, job_a, layout):
    _check_exact(reference, job_a[layout])


@pytest.mark.parametrize("layout", _slow_unless(["dp4ep4", "dp2tp2ep4", "rep2dp2ep2"], JOB_B))
def test_layouts_match_one_process_b(reference, job_b, layout):
    _check_exact(reference, job_b[layout])


def _check_exact(reference, run):
    assert run["micro_batches"] >= 2
    assert len(run["losses"]) == STEPS
    assert _rel(reference["losses"], run["losses"]) <= RTOL
    assert _rel(reference["grad_norms"], run["grad_norms"]) <= RTOL
    # every token counted once: the step's count equals the 1-process count
    assert run["tokens"] == reference["tokens"]
    assert run["consumed_tokens"] == reference["consumed_tokens"] == sum(reference["tokens"])


@pytest.mark.slow   # by default: test_router_aux.py::test_placements_and_expert_shares_of_each_kind_of_layout
def test_placements(job_a, job_b):
    q, experts = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.gate_up_proj"
    dp4, tp, ep2 = job_a["dp4"]["placements"], job_a["dp2tp2"]["placements"], job_a["dp4ep2"]["placements"]
    assert dp4[q] == "('dp_shard',):(Shard(dim=0),)"
    assert tp[q].startswith("('dp_shard', 'tp'):") and tp[q].endswith("Shard(dim=0))")
    assert tp["lm_head.weight"].startswith("('dp_shard', 'tp'):")          # LM head and embeddings: TP too
    assert tp["model.embed_tokens.weight"].startswith("('dp_shard', 'tp'):")
    assert tp["model.layers.0.mlp.gate.weight"] == "('dp_shard',):(Shard(dim=0),)"   # router replicated over tp
    assert ep2[experts].startswith("('efsdp', 'ep'):") and ep2[experts].endswith("Shard(dim=0))")
    assert ep2[q] == "('dp_shard',):(Shard(dim=0),)"                       # dense params stay on the dense mesh
    if "rep2dp2ep2" in job_b:
        hsdp = job_b["rep2dp2ep2"]["placements"][experts]
        assert hsdp.startswith("('dp_replicate', 'efsdp', 'ep'):(Replicate(),")


@pytest.mark.slow   # by default: test_router_aux.py::test_placements_and_expert_shares_of_each_kind_of_layout
def test_each_rank_holds_its_share_of_expert_bytes(job_a, job_b):
    for run in (job_a["dp4ep2"], *(job_b[n] for n in ("dp4ep4", "dp2tp2ep4") if n in job_b)):
        assert run["expert_bytes_share"] == pytest.approx(0.25, abs=0.01), run["layout"]
    if "rep2dp2ep2" in job_b:
        assert job_b["rep2dp2ep2"]["expert_bytes_share"] == pytest.approx(0.5, abs=0.01)   # replicated x 2
    # TP leaves packed experts whole (DCP cannot save their strided layout): FSDP over dp_shard 2 only
    assert job_a["dp2tp2"]["expert_bytes_share"] == pytest.approx(0.5, abs=0.01)


@pytest.mark.slow   # by default: test_router_aux.py::test_every_layout_equals_one_process_with_the_aux_loss_on (per-step aux loss)
def test_aux_loss_present_in_every_layout(reference, job_a, job_b):
    assert all(a > 0 for a in reference["aux_losses"])
    for run in [*job_a.values(), *job_b.values()]:        # the resumed layouts too
        # each rank logs its own micro-batches' aux losses: positive, of the reference's order
        assert all(a > 0 for a in run["aux_losses"]), run["layout"]


@pytest.mark.slow   # one exact resume across layouts by default: test_router_aux.py::test_resume_across_layouts_is_exact
@pytest.mark.parametrize("spec", RESUMES)
def test_resume_across_layouts_is_exact(reference, job_resume, spec):
    run = job_resume[spec]
    assert run["start_step"] == SAVE_STEP
    assert len(run["losses"]) == STEPS - SAVE_STEP
    assert _rel(reference["losses"][SAVE_STEP:], run["losses"]) <= RTOL
    assert _rel(reference["grad_norms"][SAVE_STEP:], run["grad_norms"]) <= RTOL
    assert run["consumed_tokens"] == reference["consumed_tokens"]


# ----------------------------------------------------------------------- MoE aux loss, in-process
def _tiny_moe(aux=None, **overrides):
    return build_causal_lm(qwen3_moe_config(num_experts=8, **overrides), seed=0, router_aux_loss=aux)


def _batch():
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def test_aux_loss_on_by_default_and_equals_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = _tiny_moe()
    assert model.config.output_router_logits is True
    out = model(**_batch())
    config = model.config
    expected = load_balancing_loss_func(out.router_logits, config.num_experts, config.num_experts_per_tok, None)
    assert out.aux_loss is not None and float(out.aux_loss.detach()) > 0
    torch.testing.assert_close(out.aux_loss, expected)
    plain = _tiny_moe(aux=False)
    plain.load_state_dict(model.state_dict())
    main = plain(**_batch()).loss
    torch.testing.assert_close(out.loss, main + config.router_aux_loss_coef * out.aux_loss)


def test_aux_loss_changes_the_gradient():
    with_aux, without = _tiny_moe(router_aux_loss_coef=0.1), _tiny_moe(aux=False)
    without.load_state_dict(with_aux.state_dict())
    for model in (with_aux, without):
        model(**_batch()).loss.backward()
    gate = "model.layers.0.mlp.gate.weight"
    grads = [dict(m.named_parameters())[gate].grad for m in (with_aux, without)]
    assert not torch.allclose(grads[0], grads[1])


def test_dense_model_keeps_no_router_logits():
    from transformers import Qwen3Config
    model = build_causal_lm(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8), meta_device=True)
    assert not getattr(model.config, "output_router_logits", False)


# ----------------------------------------------------------------------- bad input: one clear error each
def test_ep_must_divide_the_ranks_of_a_replica():
    with pytest.raises(ValueError, match="ep_size=3 does not divide dp_shard"):
        ParallelConfig(ep_size=3).resolved(4)
    with pytest.raises(ValueError, match="ep_size=4 does not divide dp_shard"):
        ParallelConfig(dp_replicate_size=2, ep_size=4).resolved(4)


def test_ep_must_divide_the_experts():
    model = build_causal_lm(qwen3_moe_config(num_experts=6), meta_device=True)
    with pytest.raises(ValueError, match="ep_size=4 does not divide the 6 experts"):
        parallel.check_model(model, ParallelConfig(ep_size=4).resolved(4))


def test_tp_must_divide_heads_and_kv_heads():
    model = build_causal_lm(qwen3_moe_config(), meta_device=True)      # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        parallel.check_model(model, ParallelConfig(tp_size=4).resolved(4))
    parallel.check_model(model, ParallelConfig(tp_size=2).resolved(4))


def test_dense_model_with_ep_is_an_error():
    from transformers import Qwen3Config
    model = build_causal_lm(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8), meta_device=True)
    with pytest.raises(ValueError, match="dense model"):
        parallel.check_model(model, ParallelConfig(ep_size=2).resolved(4))


def test_model_without_tp_plan_is_an_error():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="publishes no tensor-parallel plan"):
        parallel.check_model(model, ParallelConfig(tp_size=2).resolved(2))


def test_cp_is_accepted_by_the_mesh_checks():      # context parallelism: tests/test_context_parallel.py
    from hyperacc.runtime.mesh import check_supported
    check_supported(ParallelConfig(cp_size=2).resolved(4))


def test_ep_size_from_environment(monkeypatch):
    monkeypatch.setenv("HYPERACC_PARALLEL_EP_SIZE", "4")
    config = ParallelConfig()
    assert config.ep_size == 4 and config.resolved(8).efsdp_size == 2
    assert ParallelConfig(ep_size=2).ep_size == 2        # an explicit value beats the environment


# ----------------------------------------------------------------------- D1: dp_shard 2 x tp 2, SIGKILL, resume
CKPT_SCRIPT = REPO / "tests" / "scripts" / "ckpt_train.py"


def _ckpt_launch(nproc, out, *args, wait=True):
    """torchrun of ckpt_train.py in a session of its own; returns the Popen (waited for when ``wait``)."""
    import subprocess
    import sys

    from dist_utils import _env, free_port
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(CKPT_SCRIPT), str(out), *map(str, args)]
    proc = subprocess.Popen(cmd, env=_env(), cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    if wait:
        output = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, output[-6000:]
    return proc


@pytest.mark.slow
def test_d1_dp2_tp2_sigkill_of_the_job_then_resume_is_bitwise(tmp_path):
    """Save at step 4, train step 5, SIGKILL every process of the job (launcher and workers), relaunch
    with restore_from=LATEST: steps 5..8 and the final parameters equal an uninterrupted run bitwise."""
    import os
    import signal
    import time

    common = ["--tp", 2, "--steps", 8, "--save-steps", 4]
    _ckpt_launch(4, tmp_path / "a", "--ckpt", tmp_path / "A", *common, "--dump-params", tmp_path / "a.pt")
    killed = _ckpt_launch(4, tmp_path / "b", "--ckpt", tmp_path / "B", *common, "--hold-after", 5, wait=False)
    pids = [tmp_path / f"b.pid{rank}" for rank in range(4)]
    deadline = time.time() + 240
    while not all(p.exists() for p in pids) and killed.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    assert all(p.exists() for p in pids), killed.communicate(timeout=30)[0][-6000:]
    for pid in [killed.pid, *(int(p.read_text()) for p in pids)]:
        os.kill(pid, signal.SIGKILL)
    killed.wait(timeout=30)
    assert (tmp_path / "B" / "latest_checkpoint_iteration.txt").read_text().strip() == "4"
    _ckpt_launch(4, tmp_path / "c", "--ckpt", tmp_path / "B", *common, "--restore", "LATEST",
                 "--dump-params", tmp_path / "c.pt")
    for rank in range(4):
        a = json.load(open(f"{tmp_path / 'a'}.rank{rank}.json"))
        c = json.load(open(f"{tmp_path / 'c'}.rank{rank}.json"))
        assert c["start_step"] == 4 and sorted(c["steps"]) == ["5", "6", "7", "8"]
        for step, rec in c["steps"].items():
            assert rec == a["steps"][step], step        # loss, lr, epoch, RNG draws: bitwise
        assert c["progress"] == a["progress"]
    pa, pc = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "c.pt")
    assert pa.keys() == pc.keys() and all(torch.equal(pa[k], pc[k]) for k in pa)


# ----------------------------------------------------------------------- bad input on real processes
ERRORS_SCRIPT = REPO / "tests" / "scripts" / "parallel_errors.py"


def per_rank_case_lines(tmp_path, nproc, cases):
    """Launch parallel_errors.py once for ``cases``; {rank: {case: its one error line}} from each rank's
    own stderr file (torchrun --redirects)."""
    import subprocess
    import sys

    from dist_utils import _env, free_port
    logs = tmp_path / "rank_logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", f"--log-dir={logs}", "--redirects=3", str(ERRORS_SCRIPT), *cases]
    proc = subprocess.run(cmd, env=_env(), cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = {}
    for rank in range(nproc):
        text = sorted(logs.rglob(f"{rank}/stderr.log"))[-1].read_text()
        found = [line for line in text.splitlines() if line.startswith("case ")]
        assert len(found) == len(cases), text[-4000:]
        lines[rank] = {line.split(":")[0][5:]: line.split(": ", 1)[1] for line in found}
    return lines


# Every 2-process bad-input case of this file and of tests/test_context_parallel.py, in one launch per session
# (a launch costs more than the cases): whichever file runs first launches it.
ERROR_CASES = ["ep_ranks", "ep_experts", "tp_heads", "dense_ep", "cp_seq", "cp_heads", "cp_unwrappable"]
_ERROR_LINES: dict = {}


def parallel_error_lines(tmp_path_factory):
    """{rank: {case: its one error line}} for ERROR_CASES (per_rank_case_lines, launched once)."""
    if not _ERROR_LINES:
        _ERROR_LINES.update(per_rank_case_lines(tmp_path_factory.mktemp("parallel_errors"), 2, ERROR_CASES))
    return _ERROR_LINES


def test_bad_parallel_inputs_one_line_on_every_rank(tmp_path_factory):
    lines = parallel_error_lines(tmp_path_factory)
    assert lines[0] == lines[1]                 # rank 1 says the same, no rank hung in a collective
    expected = {"ep_ranks": "ep_size=3 does not divide dp_shard*cp*tp = 2*1*1",
                "ep_experts": "ep_size=2 does not divide the 3 experts",
                "tp_heads": "tp_size=2 does not divide Qwen3MoeForCausalLM's num_attention_heads=3",
                "dense_ep": "is a dense model"}
    for case, needle in expected.items():
        assert lines[1][case].startswith("ValueError: ") and needle in lines[1][case], lines[1][case]
    # the context-parallel cases of the same launch (tests/test_context_parallel.py's own check is in the slow set)
    assert lines[1]["cp_seq"].startswith("ValueError: sequence length 15 is not divisible by cp_size=2")
    assert "cp_size=2 does not divide Qwen3MoeForCausalLM's num_attention_heads=3" in lines[1]["cp_heads"]
    assert "attention cannot be wrapped for context parallelism" in lines[1]["cp_unwrappable"]
