"""The sequence-wise MoE load-balancing loss (hyperacc.training.router_aux): its value against transformers'
own formula applied to one sequence at a time, and that it is the same in every layout (real
processes, gloo, fp32) while transformers' per-micro-batch loss is not."""
import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import hyperacc
from dist_utils import max_rel, run_layouts, run_together
from hyperacc.data.collate import pad_collate
from hyperacc.models import build_causal_lm, qwen3_moe_config

STEPS, RTOL, COEF = 6, 1e-5, 0.05
SAVE_STEP = 3                # every fresh 2-process layout saves its step-3 state; RESUME continues one at another layout
RESUME = "dp2mb2<dp1cp2mb4"  # a cp 2 checkpoint (dense parameters sharded over dp_shard x cp) resumed at dp_shard 2


def _batch():
    gen = torch.Generator().manual_seed(0)
    samples = []
    for length in (12, 7, 16, 3):                      # right padding inside the batch
        ids = torch.randint(0, 512, (length,), generator=gen)
        samples.append({"input_ids": ids, "labels": ids.clone()})
    return pad_collate(samples)


def test_sequence_wise_value_is_transformers_formula_per_sequence():
    acc = hyperacc.Accelerator(checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=0)
    model = build_causal_lm(qwen3_moe_config(num_experts=8, router_aux_loss_coef=COEF), seed=0)
    reference = build_causal_lm(qwen3_moe_config(num_experts=8, router_aux_loss_coef=COEF), seed=0)
    reference.load_state_dict(model.state_dict())
    model = acc.prepare(model)
    batch = _batch()
    out = model(**batch)
    assert model.config.output_router_logits is False           # transformers' own term is off
    # by hand: transformers' function on each sequence alone (its own rows and padding mask), then the mean
    per_sequence = []
    with torch.no_grad():
        for i in range(batch["input_ids"].shape[0]):
            one = {k: v[i:i + 1] for k, v in batch.items()}
            logits = reference(**one, output_router_logits=True).router_logits
            per_sequence.append(load_balancing_loss_func(logits, 8, 2, one["attention_mask"]))
    expected = torch.stack(per_sequence).mean()
    torch.testing.assert_close(out.aux_loss, expected, rtol=1e-6, atol=0)
    plain = reference(**batch, output_router_logits=False).loss
    torch.testing.assert_close(out.loss, plain + COEF * expected, rtol=1e-6, atol=0)
    # transformers' micro-batch formula pools the four sequences: a different number
    pooled = load_balancing_loss_func(reference(**batch, output_router_logits=True).router_logits, 8, 2,
                                      batch["attention_mask"])
    assert abs(float(pooled.detach()) - float(expected)) > 1e-4
    acc.end_training()


def test_bad_modes_are_one_clear_error():
    from hyperacc.training.router_aux import check_mode
    from transformers import Qwen3Config, Qwen3ForCausalLM

    moe = build_causal_lm(qwen3_moe_config(), meta_device=True)
    with pytest.raises(ValueError, match="router_aux_loss='global' is not a mode; choose one of sequence, micro_batch"):
        check_mode(moe, "global")
    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    assert check_mode(dense, "sequence") is None and check_mode(dense, None) is None   # a policy for MoE models
    assert check_mode(moe, None) == "sequence" and check_mode(moe, "micro_batch") == "micro_batch"


def test_example_refuses_aux_modes_it_cannot_apply(capsys):
    from example_utils import load_example, run_main     # the example's main() in this process

    code, _, stderr = run_main(load_example("train_qwen_router_aux"), ["--model.router_aux_loss=global",
                                                                       "--training.dry_run=true"], capsys)
    assert code == 2 and "model.router_aux_loss" in stderr, stderr[-1500:]


# ----------------------------------------------------------------------------- layouts (real processes)
_rel = max_rel


def _run(tmp_path_factory, name, layouts, nproc, *extra):
    args = ["--steps", STEPS, "--gbs", 8, "--aux-coef", COEF, "--pad-multiple", 2, *extra]
    return run_layouts(tmp_path_factory.mktemp(name), layouts, args, nproc)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The 1-process reference -- 2 micro-batches of 4 sequences; the same with 8 micro-batches of 1; and
    with the aux loss off -- beside the 2-process layouts (run_together: independent, deterministic runs).
    The 2-process launch is also the default run's check of each kind of layout (EP, CP, TP: the 4-process
    jobs of tests/test_parallel.py and the cp 2 launch of tests/test_context_parallel.py are slow) and of an
    exact resume across layouts (RESUME, in the same launch)."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    return run_together(
        lambda: _run(tmp_path_factory, "ref", ["dp1mb4", "dp1mb1", "dp1mb4na"], 1),
        lambda: _run(tmp_path_factory, "two", ["dp2mb1", "dp2mb2", "dp2ep2mb1", "dp1cp2mb4", "dp1tp2mb2", RESUME], 2,
                     "--recompute", "dp2mb2", "--ckpt", ckpt, "--save-step", SAVE_STEP))


@pytest.fixture(scope="module")
def reference(jobs):
    return jobs[0]


@pytest.fixture(scope="module")
def layouts(jobs):
    return jobs[1]


@pytest.mark.parametrize("layout", ["dp2mb1", "dp2mb2", "dp2ep2mb1", "dp1cp2mb4", "dp1tp2mb2"])
def test_every_layout_equals_one_process_with_the_aux_loss_on(reference, layouts, layout):
    ref, run = reference["dp1mb4"], layouts[layout]
    assert run["micro_batches"] >= 1 and len(run["losses"]) == STEPS
    assert run["tokens"] == ref["tokens"] and run["consumed_tokens"] == ref["consumed_tokens"]   # each token once
    assert all(a > 0 for a in run["aux_losses"])                              # every rank's aux loss is on
    assert _rel(ref["losses"], run["losses"]) <= RTOL, (ref["losses"], run["losses"])
    assert _rel(ref["grad_norms"], run["grad_norms"]) <= RTOL
    assert _rel(ref["step_aux_losses"], run["step_aux_losses"]) <= RTOL


def test_resume_across_layouts_is_exact(reference, layouts):
    """The default run's exact resume across layouts (tests/test_parallel.py's 4-process resumes and
    tests/test_context_parallel.py's cp 2 -> cp 1 resume are slow): dp1cp2mb4's step-3 checkpoint, its dense
    parameters sharded over dp_shard x cp, resumed at dp_shard 2, continues as the 1-process run."""
    ref, run = reference["dp1mb4"], layouts[RESUME]
    assert run["start_step"] == SAVE_STEP and len(run["losses"]) == STEPS - SAVE_STEP
    assert _rel(ref["losses"][SAVE_STEP:], run["losses"]) <= RTOL
    assert _rel(ref["grad_norms"][SAVE_STEP:], run["grad_norms"]) <= RTOL
    assert run["consumed_tokens"] == ref["consumed_tokens"]


def test_placements_and_expert_shares_of_each_kind_of_layout(layouts):
    """What each layout shards over (the default run's placement checks; tests/test_parallel.py's 4-process
    ones and tests/test_context_parallel.py's cp 2 one are slow)."""
    q, experts = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.gate_up_proj"
    dp, tp, ep, cp = (layouts[n]["placements"] for n in ("dp2mb1", "dp1tp2mb2", "dp2ep2mb1", "dp1cp2mb4"))
    assert dp[q] == "('dp_shard',):(Shard(dim=0),)"
    assert cp[q] == "('dp_shard_cp',):(Shard(dim=0),)"                     # dense params: dp_shard x cp
    assert "'tp'" in tp[q].split(":")[0] and tp[q].endswith("Shard(dim=0))")  # column-parallel q_proj
    assert "'tp'" in tp["lm_head.weight"].split(":")[0]                       # LM head and embeddings: TP too
    assert "'tp'" in tp["model.embed_tokens.weight"].split(":")[0]
    assert "'tp'" not in tp["model.layers.0.mlp.gate.weight"]                 # router replicated over tp
    assert ep[experts].startswith("('efsdp', 'ep'):") and ep[experts].endswith("Shard(dim=0))")
    assert ep[q] == "('dp_shard',):(Shard(dim=0),)"                           # dense params stay on the dense mesh
    assert layouts["dp2ep2mb1"]["expert_bytes_share"] == pytest.approx(0.5, abs=0.01)
    assert layouts["dp2mb1"]["expert_bytes_share"] == pytest.approx(0.5, abs=0.01)


def test_accumulation_does_not_change_it(reference):
    a, b = reference["dp1mb4"], reference["dp1mb1"]
    assert _rel(a["losses"], b["losses"]) <= RTOL and _rel(a["grad_norms"], b["grad_norms"]) <= RTOL


def test_the_aux_loss_changes_training(reference):
    assert _rel(reference["dp1mb4"]["grad_norms"], reference["dp1mb4na"]["grad_norms"]) > 1e-3
    assert all(a is None for a in reference["dp1mb4na"]["step_aux_losses"])


@pytest.mark.slow
def test_transformers_micro_batch_loss_is_layout_dependent(tmp_path_factory):
    pooled = _run(tmp_path_factory, "pooled", ["dp1mb4", "dp1mb1"], 1, "--aux-mode", "micro_batch")
    assert _rel(pooled["dp1mb4"]["grad_norms"], pooled["dp1mb1"]["grad_norms"]) > 1e-4   # transformers' own
