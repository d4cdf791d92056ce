"""TRL's DPO, KTO, reward, GRPO and RLOO trainers on hyperacc (`hyperacc.integrations.trl`), on real
processes (torchrun, gloo, CPU).

tests/scripts/dpo_runs.py trains a tiny Qwen2 loaded by path (as `trl/scripts/dpo.py` loads it) on 16
preference pairs read with `load_dataset`, global batch 4, fp32, 3 AdamW steps; its GRPO and RLOO runs
(tests/scripts/grpo_runs.py) on 8 prompts with a toy reward, 4 completions each. Default run, two launches
side by side: on 1 process plain `trl.DPOTrainer` (also with a synced reference), `KTOTrainer`, `RewardTrainer`
on accelerate, hyperacc's GRPO and RLOO, and resumes refused (inside a generation block, under another seed);
on 2 processes hyperacc's DPO full fine-tune, with precomputed reference log-probs, with LoRA and with a synced
reference, its KTO (full: a sharded reference too), its reward model, GRPO (full and LoRA), RLOO,
tests/scripts/uneven_generate.py's check (ranks that stop generating at different lengths) and GRPO under tensor
parallelism (refused). Slow set: a DPO and a GRPO full fine-tune killed right after their step-2 saves resume to
the uninterrupted runs' weights, bitwise; GRPO with gradient accumulation; GRPO on an MoE model.
"""
import json
import math

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

from dist_utils import REPO, run_torchrun, run_together  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "dpo_runs.py"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from hyperacc.data.default_corpus import load_default_tokenizer

    directory = tmp_path_factory.mktemp("dpo") / "base"
    tok = load_default_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         max_position_embeddings=128)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return directory


ONE = ("trl", "trl_kto", "trl_reward", "trl_sync", "grpo", "rloo", "grpo_midblock")
TWO = ("full", "precompute", "lora", "kto", "reward", "sync", "grpo", "grpo_lora", "rloo", "uneven", "grpo_tp")


@pytest.fixture(scope="module")
def runs(base_dir):
    """{run: record} of the 2-process launch, {"one/" + run: record} of the 1-process one; "uneven": the
    2-process generation of tests/scripts/uneven_generate.py, rank by rank."""
    one, two = base_dir.parent / "one", base_dir.parent / "two"
    uneven = two / "uneven"
    run_together(lambda: run_torchrun(SCRIPT, 1, [base_dir, one, *ONE], timeout=300),
                 lambda: run_torchrun(SCRIPT, 2, [base_dir, two, *TWO], timeout=300))
    read = lambda path: json.loads(path.read_text())  # noqa: E731
    return {**{f"one/{name}": read(one / f"{name}.json") for name in ONE},
            **{name: read(one / f"{name}.json") for name in ("trl", "trl_kto", "trl_reward", "trl_sync")},
            **{name: read(two / f"{name}.json") for name in TWO if name != "uneven"},
            "uneven": [read(uneven / f"rank{r}.json") for r in (0, 1)],
            "weights": {name: (torch.load(one / f"{name}.pt"), torch.load(two / f"{name}.pt"))
                        for name in ("grpo", "rloo")}}


def test_first_loss_is_ln2_when_the_policy_is_the_reference(runs):
    for name in ("trl", "full", "precompute", "lora"):
        assert runs[name]["losses"][0] == pytest.approx(math.log(2), abs=1e-6), name


def test_full_fine_tune_on_two_processes_equals_plain_trl_on_one(runs):
    """The issue's failure ('NoneType' object has no attribute 'fsdp_dim_names') is this run. (hyperacc on one
    process equals plain TRL bitwise here: the same weights' sha256; checked once, not kept as a launch.)"""
    plain = runs["trl"]["losses"]
    assert len(plain) == 3 and len(set(plain)) == 3
    assert runs["full"]["losses"] == pytest.approx(plain, abs=1e-5)


def test_the_reference_is_sharded_frozen_and_costs_its_shard(runs):
    full = runs["full"]
    assert full["ref_trainable"] == 0
    # after training (forwards done): each rank holds half of the reference, as of the policy
    assert full["ref_local_numel"] == full["policy_local_numel"] < full["ref_numel"]
    assert runs["trl"]["ref_trainable"] > 0          # plain TRL's reference: whole, requires_grad left on


def test_precomputed_reference_log_probs_equal_the_live_reference(runs):
    assert runs["precompute"]["ref_numel"] is None    # no reference in memory while training
    assert runs["precompute"]["losses"] == pytest.approx(runs["full"]["losses"], abs=1e-6)


def test_lora_uses_the_base_as_its_reference(runs):
    lora = runs["lora"]
    assert lora["ref_numel"] is None
    assert all(math.isfinite(x) for x in lora["losses"]) and lora["losses"][1] != lora["losses"][0]


def test_a_synced_reference_mixes_its_shards_as_plain_trl_mixes_whole_tensors(runs):
    """sync_ref_model=True: TRL's own callback mixes the policy into the reference every step (alpha 0.5);
    on hyperacc both are sharded alike, so it mixes shard into shard. 2 processes vs plain TRL on 1."""
    plain, synced = runs["trl_sync"]["losses"], runs["sync"]["losses"]
    assert synced == pytest.approx(plain, abs=1e-5)
    assert abs(plain[1] - runs["trl"]["losses"][1]) > 1e-3        # the sync changed the reference


def test_kto_and_reward_models_train_as_plain_trl(runs):
    """KTO (its reference sharded frozen as DPO's) and a reward model, 2 processes vs plain TRL on 1."""
    for name in ("kto", "reward"):
        plain = runs[f"trl_{name}"]["losses"]
        assert len(plain) == 3 and len(set(plain)) == 3, name
        assert runs[name]["losses"] == pytest.approx(plain, abs=1e-5), name
    assert runs["kto"]["ref_trainable"] == 0 and runs["kto"]["ref_local_numel"] == runs["kto"]["ref_numel"] // 2


@pytest.mark.slow   # by default 2 processes vs plain TRL on 1 (above); here 1 process: bitwise
def test_one_process_equals_plain_trl_bitwise(base_dir):
    out = base_dir.parent / "one_bitwise"
    run_torchrun(SCRIPT, 1, [base_dir, out, "trl", "full"], timeout=300)
    plain, hyper = (json.loads((out / f"{n}.json").read_text()) for n in ("trl", "full"))
    assert hyper["losses"] == plain["losses"] and hyper["digest"] == plain["digest"]


@pytest.mark.slow   # three launches; by default the Trainer's kill/resume is tests/test_trainer.py's
def test_killed_after_a_save_resumes_bitwise(base_dir):
    full, resumed = _uninterrupted_and_resumed(base_dir.parent / "resume", base_dir, "full4", "save")
    assert resumed["global_step"] == 4 and resumed["digest"] == full["digest"]
    assert resumed["losses"] == full["losses"]


def test_grpo_and_rloo_draw_the_same_completions_on_one_and_two_processes(runs):
    """Each completion is drawn from noise seeded by its place in the global batch (seeded_sampling): 1 and 2
    processes generate the same tokens at every step, and train to the same losses and weights (fp32)."""
    for name in ("grpo", "rloo"):
        one, two = runs[f"one/{name}"], runs[name]
        assert len(one["completions"]) == 3 and [c["step"] for c in one["completions"]] == [0, 1, 2], name
        assert all(len(c["ids"]) == 8 for c in one["completions"]), name
        assert one["completions"] == two["completions"], name
        distinct = {tuple(ids) for c in one["completions"] for ids in c["ids"]}
        assert len(distinct) == 24, f"{name}: completions repeat: the draws are not per sample"
        assert two["losses"] == pytest.approx(one["losses"], abs=1e-5), name
        assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5), name
        # on-policy, the loss is ~0 by construction (zero-mean advantages); the gradient is not
        assert all(g > 1e-2 for g in one["grad_norms"]), f"{name}: no gradient: {one['grad_norms']}"
        w1, w2 = runs["weights"][name]
        assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-4, name
    # lengths differ (an EOS drawn at step 1): generation went on in step while some rows had ended
    assert len({len(ids) for c in runs["grpo"]["completions"] for ids in c["ids"]}) > 1


def test_grpo_shards_its_reference_and_trains_lora_without_one(runs):
    grpo = runs["grpo"]
    assert grpo["ref_trainable"] == 0 and grpo["ref_local_numel"] == grpo["ref_numel"] // 2
    assert grpo["kl"][0] == 0 and grpo["kl"][-1] > 0               # the policy moves away from the reference
    lora = runs["grpo_lora"]
    assert lora["ref_numel"] is None
    assert lora["completions"][0] == grpo["completions"][0]       # LoRA B = 0: the first policy is the base
    assert lora["grad_norms"][0] > 0 and all(math.isfinite(x) for x in lora["losses"])


def test_generation_on_the_sharded_policy_survives_ranks_that_stop_early(runs):
    """Rank 0 wants 2 new tokens, rank 1 eight: without transformers' synced decoding (hyperacc marks its
    sharded models FSDP-managed) rank 1 waits for ever on rank 0's weights (seen: 60 s timeout). Greedy
    tokens equal an unsharded copy's; a LoRA model (whose generate bypasses the sharded root) samples."""
    for rank, out in enumerate(runs["uneven"]):
        new = 2 + 6 * rank
        assert len(out["greedy"]) == len(out["prompt"]) + new and out["greedy"] == out["expected"], rank
        assert len(out["sampled"]) == len(out["prompt"]) + new, rank


def test_a_resume_inside_a_generation_block_or_under_another_seed_is_refused(runs):
    """TRL keeps a generation's completions in memory for num_iterations steps; a checkpoint between two
    generations (here a user's callback asked for it) cannot resume as the run would have gone on."""
    out = runs["one/grpo_midblock"]
    assert out["global_step"] == 1
    assert out["error"].startswith("RuntimeError") and "saved at step 1, between two generations (every 2 " in out["error"]
    # first, the same checkpoint under another seed: the completions are keyed by it
    assert out["seed_error"].startswith("ValueError") and "seed=7, this one has seed=8" in out["seed_error"]


def test_online_options_hyperacc_cannot_serve_are_refused_in_one_line(tmp_path, base_dir):
    """vLLM, a save cadence inside generation blocks, a sampling option the seeded sampler cannot apply and a
    temperature of 0 (on plain TRL: an error at the first generation, after the models are built):
    one NotImplementedError naming each, before the Accelerator exists."""
    import trl
    from datasets import Dataset

    from hyperacc.integrations.trl import GRPOTrainer

    args = trl.GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=2, num_generations=2,
                          max_steps=4, report_to=[], use_cpu=True, max_completion_length=4, use_vllm=True,
                          num_iterations=2, save_strategy="steps", save_steps=3,
                          generation_kwargs={"typical_p": 0.5}, temperature=0.0)
    with pytest.raises(NotImplementedError) as caught:
        GRPOTrainer(model=str(base_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                    args=args, train_dataset=Dataset.from_dict({"prompt": ["a b", "c d"]}))
    message = str(caught.value)
    assert "GRPOConfig.use_vllm=True" in message and "GRPOConfig.save_steps=3" in message
    assert "multiple of 2" in message and "typical_p=0.5" in message and "temperature=0.0" in message
    assert "\n" not in message


@pytest.mark.slow   # three launches; the default GRPO runs check 1 vs 2 processes, test_trainer.py the Trainer's kill
def test_grpo_killed_after_a_save_resumes_bitwise(base_dir):
    """The completions after the resume are the uninterrupted run's (drawn by sample and step, not by the
    restored generator alone), and so are the weights, bit for bit."""
    full, resumed = _uninterrupted_and_resumed(base_dir.parent / "grpo_resume", base_dir, "grpo4", "grpo_save")
    assert resumed["global_step"] == 4 and resumed["digest"] == full["digest"]
    assert resumed["losses"] == full["losses"] and resumed["completions"] == full["completions"][2:]


def test_online_training_under_tensor_parallelism_is_refused(runs):
    """tp_size=2 on 2 processes: TRL's generation batch, reward gathering and slicing count every process as a
    data-parallel rank (measured: 1 vs 2 processes then disagree). One line on every rank, at construction."""
    error = runs["grpo_tp"]["error"]
    assert error and error.startswith("GRPOTrainer with tp_size=2, ep_size=1") and "dp_shard_size" in error
    assert "\n" not in error


def test_a_generating_trainer_is_refused_in_one_line(tmp_path, base_dir):
    """GRPO through the plain Trainer mixin (not the online one): refused when the Accelerator would be built
    (before any process group), naming the classes that serve it."""
    import trl
    from datasets import Dataset

    from hyperacc.integrations.transformers import HyperaccTrainerMixin

    class GRPOOnHyperacc(HyperaccTrainerMixin, trl.GRPOTrainer):
        pass

    args = trl.GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=2, num_generations=2,
                          max_steps=1, report_to=[], use_cpu=True, max_completion_length=4)
    with pytest.raises(NotImplementedError, match=r"GRPOOnHyperacc: a trainer that generates its own completions "
                                                  r".*HyperaccOnlineMixin first"):
        GRPOOnHyperacc(model=str(base_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                       args=args, train_dataset=Dataset.from_dict({"prompt": ["a b", "c d"]}))


def test_evaluation_mode_prepares_a_frozen_model_outside_the_checkpoints(base_dir):
    """`Accelerator.prepare_model(model, evaluation_mode=True)`, the seam TRL's reference goes through, in this
    process: frozen, its own dtype under the fp32-master recipe, eval mode, not among the checkpointed models;
    preparing it again, or for training, is one clear error."""
    from transformers import AutoModelForCausalLM

    import hyperacc

    acc = hyperacc.Accelerator(checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=3)
    try:
        policy = AutoModelForCausalLM.from_pretrained(str(base_dir))
        ref = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.bfloat16)
        policy = acc.prepare(policy)
        prepared = acc.prepare_model(ref, evaluation_mode=True)
        assert prepared is ref and not ref.training
        assert all(not p.requires_grad and p.dtype == torch.bfloat16 for p in ref.parameters())
        assert all(p.dtype == torch.float32 for p in policy.parameters())      # the policy: fp32 master weights
        assert any(m is policy for m in acc._models) and not any(m is ref for m in acc._models)
        ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.isfinite(ref(input_ids=ids).logits.float()).all()
        with pytest.raises(ValueError, match="already prepared"):
            acc.prepare_model(ref, evaluation_mode=True)
        with pytest.raises(ValueError, match="prepared with evaluation_mode=True"):
            acc.prepare(ref)
    finally:
        acc.end_training()


def test_a_nan_argument_is_refused_in_one_line(tmp_path, base_dir):
    """DPOConfig(beta=nan) trains with a loss of exactly 0.0 on plain TRL/accelerate (nothing moves, nothing
    says so); on hyperacc it is one line before any process group."""
    import trl

    from hyperacc.integrations.trl import DPOTrainer

    args = trl.DPOConfig(output_dir=str(tmp_path / "nan"), beta=float("nan"), report_to=[], use_cpu=True,
                         bf16=False)
    with pytest.raises(ValueError, match=r"DPOConfig\.beta=nan: not a number"):
        DPOTrainer(model=str(base_dir), args=args, train_dataset=_pairs_dataset(), processing_class=_tokenizer(base_dir))


def _pairs_dataset():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": "a b", "chosen": " c", "rejected": " d"}] * 4)


def _tokenizer(base_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(base_dir))


@pytest.mark.slow   # one more launch; the default GRPO runs take one micro-batch per step
def test_grpo_with_gradient_accumulation_equals_one_micro_batch(runs, base_dir):
    """gradient_accumulation_steps=2 (TRL splits each generation in two micro-batches, shuffled per rank) on 2
    processes: the same completions, losses and weights as the one-micro-batch run of the same global batch."""
    out = base_dir.parent / "ga2"
    run_torchrun(SCRIPT, 2, [base_dir, out, "grpo_ga2"], timeout=300)
    ga2 = json.loads((out / "grpo_ga2.json").read_text())
    assert ga2["completions"] == runs["grpo"]["completions"]
    assert ga2["losses"] == pytest.approx(runs["grpo"]["losses"], abs=1e-5)
    weights = torch.load(out / "grpo_ga2.pt")
    assert max((weights[k] - runs["weights"]["grpo"][1][k]).abs().max().item() for k in weights) < 1e-4


@pytest.mark.slow   # two more launches of a second model
def test_grpo_on_a_moe_model_with_router_logits(tmp_path_factory):
    """A Qwen3-MoE whose config asks for router logits (the aux loss): on plain TRL its generation fails in
    transformers' aux-loss formula on a cached decoding step; here generation runs without them, training
    adds transformers' per-micro-batch aux term (as the SFT integration does: a per-rank mean, so 1 and 2
    processes differ by its share), and the completions are the same on 1 and 2 processes."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from hyperacc.data.default_corpus import load_default_tokenizer

    root = tmp_path_factory.mktemp("grpo_moe")
    tok = load_default_tokenizer()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                            max_position_embeddings=128, output_router_logits=True, router_aux_loss_coef=0.01)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(root / "base"))
    tok.save_pretrained(str(root / "base"))
    run_together(lambda: run_torchrun(SCRIPT, 1, [root / "base", root / "one", "grpo"], timeout=300),
                 lambda: run_torchrun(SCRIPT, 2, [root / "base", root / "two", "grpo"], timeout=300))
    one, two = (json.loads((root / n / "grpo.json").read_text()) for n in ("one", "two"))
    assert one["completions"] == two["completions"]
    assert all(a is not None and 1.0 < a < 4.0 for a in one["aux_loss"] + two["aux_loss"])
    assert two["losses"] == pytest.approx(one["losses"], abs=5e-4)


def _uninterrupted_and_resumed(out, base_dir, full: str, killed: str):
    """Records of run ``full`` (4 steps) and of run ``killed`` (the same, killed right after its step-2 save,
    then resumed), each its own 2-process launch."""
    run_torchrun(SCRIPT, 2, [base_dir, out, full], timeout=300)
    proc = run_torchrun(SCRIPT, 2, [base_dir, out, killed], timeout=300, check=False)
    assert proc.returncode != 0 and (out / killed / "global_step_2").is_dir()
    run_torchrun(SCRIPT, 2, [base_dir, out, killed], env={"RESUME": "1"}, timeout=300)
    return tuple(json.loads((out / f"{n}.json").read_text()) for n in (full, f"{killed}_resumed"))
