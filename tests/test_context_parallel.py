"""Issue 14: context parallelism (real processes, gloo, fp32, tiny 8-expert Qwen3-MoE, router aux loss off).

Launches: a 2-process cp 2 job that saves at step 5; one process for the cp = 1 reference and the
resume of that cp 2 checkpoint at cp 1; a 4-process job for cp 4, dp_shard 2 x cp 2, tp 2 x cp 2
(with recompute) and dp_shard 2 x cp 2 x ep 2 (slow set); a 2-process launch of the bad inputs, shared
with tests/test_parallel.py's. Each layout
trains 10 AdamW steps of 2+ micro-batches from the same seeded init on the same global batches
(right-padded to a multiple of 4), and must match cp = 1 per step within 1e-5 relative.

All these launches are in the slow set (~32 s of CPU by default before). The default run keeps each
guarantee in a launch another file makes anyway: cp 2 equals one process in tests/test_router_aux.py
(dp1cp2mb4, test_every_layout_equals_one_process_with_the_aux_loss_on), its dense parameters sharded over
dp_shard x cp there (test_placements_and_expert_shares_of_each_kind_of_layout), a cp 2 checkpoint resumed
exactly at another layout there (test_resume_across_layouts_is_exact: at dp_shard 2), and the bad inputs'
one line on every rank in tests/test_parallel.py::test_bad_parallel_inputs_one_line_on_every_rank (the cp
cases ride its launch).
"""
import json

import pytest

from conftest import SLOW
import torch

from dist_utils import REPO, run_python, run_torchrun
from hyperacc.parallel.context import ContextParallel, check_context_parallel, kv_replication
from test_parallel import parallel_error_lines

SCRIPT = REPO / "tests" / "scripts" / "train_parallel.py"
STEPS, SAVE_STEP, RTOL = 10, 5, 1e-5
COMMON = ["--steps", STEPS, "--no-aux", "--pad-multiple", 4]


def _rel(a, b):
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


def _run(folder, nproc, layouts, *extra):
    out = folder / f"{'_'.join(layouts).replace('<', 'from')}.json"
    args = [out, *layouts, *COMMON, *map(str, extra)]
    (run_python(SCRIPT, args) if nproc == 1 else run_torchrun(SCRIPT, nproc, args))
    return {r["layout"]: r for r in json.loads(out.read_text())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cp")
    ckpt = folder / "ckpt"
    result = _run(folder, 2, ["cp2"], "--ckpt", ckpt, "--save-step", SAVE_STEP)
    result.update(_run(folder, 1, ["dp1", "dp1<cp2"], "--ckpt", ckpt))
    if FOUR_PROCESS:
        result.update(_run(folder, 4, FOUR_PROCESS, "--recompute", "tp2cp2"))
    return result


# The default run: cp 2 and tp 2 x cp 2 with recompute; the slow set: every layout of the issue.
FOUR_PROCESS = ["cp4", "dp2cp2", "tp2cp2", "dp2cp2ep2"] if SLOW else []


@pytest.mark.slow   # by default: test_router_aux.py::test_every_layout_equals_one_process_with_the_aux_loss_on[dp1cp2mb4]
@pytest.mark.parametrize("layout", ["cp2", "cp4", "dp2cp2", "tp2cp2", "dp2cp2ep2"])
def test_layout_matches_cp1(runs, layout):
    reference, run = runs["dp1"], runs[layout]
    assert run["micro_batches"] >= 2 and len(run["losses"]) == STEPS
    assert _rel(reference["losses"], run["losses"]) <= RTOL
    assert _rel(reference["grad_norms"], run["grad_norms"]) <= RTOL
    assert run["tokens"] == reference["tokens"]          # each token counted once over dp x cp
    assert run["consumed_tokens"] == reference["consumed_tokens"]
    assert run["dp_size"] == {"cp2": 1, "cp4": 1, "dp2cp2": 2, "tp2cp2": 1, "dp2cp2ep2": 2}[layout]


@pytest.mark.slow   # by default: test_router_aux.py::test_placements_and_expert_shares_of_each_kind_of_layout
def test_dense_parameters_are_sharded_over_dp_shard_x_cp(runs):
    q = "model.layers.0.self_attn.q_proj.weight"
    assert runs["cp2"]["placements"][q] == "('dp_shard_cp',):(Shard(dim=0),)"
    if "tp2cp2" in runs:
        assert runs["tp2cp2"]["placements"][q].startswith("('dp_shard_cp', 'tp'):")


@pytest.mark.slow   # by default: test_router_aux.py::test_resume_across_layouts_is_exact (cp 2 -> dp_shard 2)
def test_resume_cp2_at_cp1_is_exact(runs):
    run, reference = runs["dp1<cp2"], runs["dp1"]
    assert run["start_step"] == SAVE_STEP and len(run["losses"]) == STEPS - SAVE_STEP
    assert _rel(reference["losses"][SAVE_STEP:], run["losses"]) <= RTOL
    assert _rel(reference["grad_norms"][SAVE_STEP:], run["grad_norms"]) <= RTOL
    assert run["consumed_tokens"] == reference["consumed_tokens"]


@pytest.mark.slow   # by default: test_parallel.py::test_bad_parallel_inputs_one_line_on_every_rank (same cases, same launch)
def test_bad_inputs_one_line_on_every_rank(tmp_path_factory):
    lines = parallel_error_lines(tmp_path_factory)       # the launch shared with tests/test_parallel.py
    assert lines[0] == lines[1]
    assert lines[1]["cp_seq"].startswith("ValueError: sequence length 15 is not divisible by cp_size=2")
    assert "cp_size=2 does not divide Qwen3MoeForCausalLM's num_attention_heads=3" in lines[1]["cp_heads"]
    assert "attention cannot be wrapped for context parallelism" in lines[1]["cp_unwrappable"]


# ----------------------------------------------------------------------- the split, in-process
def _pieces(micro_batch, cp):
    return [ContextParallel(None, rank, cp).shard(micro_batch) for rank in range(cp)]


def test_labels_are_shifted_on_the_whole_sequence_then_split():
    ids = torch.arange(10, 18).unsqueeze(0)
    labels = ids.clone()
    labels[0, 6:] = -100                                    # right padding
    mask = (labels != -100).long()
    pieces = _pieces({"input_ids": ids, "labels": labels, "attention_mask": mask}, 4)
    assert torch.equal(torch.cat([p["input_ids"] for p in pieces], 1), ids)
    assert torch.equal(torch.cat([p["shift_labels"] for p in pieces], 1),
                       torch.tensor([[11, 12, 13, 14, 15, -100, -100, -100]]))   # piece 0's last target: token 2
    assert torch.equal(torch.cat([p["position_ids"] for p in pieces], 1), torch.arange(8).unsqueeze(0))
    assert all("attention_mask" not in p and p["use_cache"] is False for p in pieces)
    assert pieces[3].get("num_items_in_batch") == 1 and "num_items_in_batch" not in pieces[0]   # padding only


def test_split_refuses_indivisible_length_and_left_padding():
    ids = torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by cp_size=4"):
        _pieces({"input_ids": ids, "labels": ids}, 4)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="needs right padding"):
        _pieces({"input_ids": ids, "labels": ids, "attention_mask": mask}, 2)


def test_kv_heads_are_replicated_only_as_needed():
    assert kv_replication(4, 2, 2) == 1 and kv_replication(4, 2, 4) == 2 and kv_replication(32, 4, 8) == 2
    assert kv_replication(2, 1, 2) == 2


def test_dry_run_accounts_activations_per_rank_with_cp():
    from hyperacc.tools.dry_run import plan_sharding
    from hyperacc.models import build_causal_lm, qwen3_moe_config

    model = build_causal_lm(qwen3_moe_config(), meta_device=True)
    key = "activations"
    plans = {cp: plan_sharding(model, world_size=4, cp=cp, micro_batch_size=1, seq_len=4096) for cp in (1, 2, 4)}
    assert plans[2].bytes[key] == pytest.approx(plans[1].bytes[key] / 2, rel=0.01)
    assert plans[4].bytes[key] == pytest.approx(plans[1].bytes[key] / 4, rel=0.01)
    assert plans[2].dp_shard == 2 and plans[2].cp == 2 and plans[2].params_per_rank == plans[1].params_per_rank
    with pytest.raises(ValueError, match="cp_size=8 does not divide"):
        check_context_parallel(model, 8)
