"""examples/train_qwen.py with LoRA (--peft.*) and the dry-run planner with a PEFT model.

One 2-process `accelerate launch` run (a module fixture) serves the end-to-end checks: LoRA on the
tiny default from a random bf16 base, saving at steps 2 and 4 and exporting the adapter; the slow set
resumes it from LATEST to step 6 with another export directory. Everything else runs in this process:
the config checks (load_config / preflight / the check functions, as tests/test_bad_input.py does),
the example's dry run, and plan_sharding on a PEFT model. The slow set adds LoRA from a pretrained
bf16 directory with modules_to_save and the merged export, and a resume compared with an
uninterrupted run.
"""
import dataclasses
import json
import math
import sys

import pytest
import torch

pytest.importorskip("peft")

from example_utils import config_error, load_example  # noqa: E402
from dist_utils import REPO, run_accelerate  # noqa: E402
from hyperacc.models import build_causal_lm, qwen3_moe_config  # noqa: E402

SCRIPT = REPO / "examples" / "train_qwen.py"
CPU2 = REPO / "accelerate_configs" / "cpu_fsdp2_2proc.yaml"
STOP, STEPS = 4, 6
TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj"}


@pytest.fixture(scope="module")
def example():
    return load_example("train_qwen_peft")


_config_error = config_error


def _launch(args, check=True):
    return run_accelerate(SCRIPT, CPU2, ["--logging.progress_bar=false", "--eval.eval_steps=0",
                                         "--logging.logging_steps=1", *map(str, args)], timeout=400, check=check)


def _records(path):
    with open(path) as handle:
        return [r for r in map(json.loads, filter(str.strip, handle)) if "loss" in r]


def _checkpoint_tensors(path, prefix="model."):
    """The tensors of a DCP checkpoint whose keys start with ``prefix``, read without a process group."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items()
             if k.startswith(prefix) and hasattr(m, "size")}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def _vocab():
    from hyperacc.data.text import load_tokenizer
    return len(load_tokenizer(None))


# ----------------------------------------------------------------------------- 2 processes end to end
@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    common = ["--peft.method=lora", "--checkpoint.save_ckpt=true", f"--checkpoint.checkpoint_dir={out / 'ckpt'}",
              "--checkpoint.save_steps=2", f"--lr_scheduler.total_steps={STEPS}",
              f"--logging.metrics_file={out / 'metrics.jsonl'}"]
    first = _launch(common + [f"--training.max_steps={STOP}", f"--peft.export_dir={out / 'adapter'}"])
    return out, common, first, None


@pytest.fixture(scope="module")
def lora_resumed(lora_run):
    out, common, first, _ = lora_run
    # The export directory may change on resume (it is an output, not part of the setup).
    second = _launch(common + [f"--training.max_steps={STEPS}", "--checkpoint.restore_from=LATEST",
                               f"--peft.export_dir={out / 'adapter_resumed'}"])
    return out, common, first, second


def test_checkpoint_holds_the_adapters_only(lora_run):
    out, _, first, _ = lora_run
    assert "7,168 trainable of 147,328 parameters" in first.stdout, first.stdout[-2000:]
    keys = set(_checkpoint_tensors(out / "ckpt" / f"global_step_{STOP}"))
    expected = {f"model.base_model.model.model.layers.{layer}.self_attn.{proj}.lora_{ab}.default.weight"
                for layer in range(2) for proj in TARGETS for ab in "AB"}
    assert keys == expected, sorted(keys ^ expected)[:8]            # no base key (embeddings, experts, norms)


def test_adapter_export_loads_with_peft_and_is_the_checkpoint(lora_run):
    from peft import PeftModel
    from safetensors.torch import load_file

    out, _, _, _ = lora_run
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], set(config["target_modules"])) == (8, 16, TARGETS)
    model = PeftModel.from_pretrained(build_causal_lm(qwen3_moe_config(vocab_size=_vocab())), str(out / "adapter"))
    layer = model.base_model.model.model.layers[1].self_attn.v_proj
    assert layer.lora_A["default"].weight.shape == (8, 64)
    assert layer.lora_B["default"].weight.abs().sum() > 0            # trained away from PEFT's B = 0
    # The export holds exactly what the checkpoint of the same step holds, bitwise.
    saved = _checkpoint_tensors(out / "ckpt" / f"global_step_{STOP}")
    exported = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert len(exported) == len(saved)
    for key, value in saved.items():
        name = key[len("model."):].replace(".default.weight", ".weight")
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], value), name


@pytest.mark.slow   # a second launch (the SIGKILL resume of the library is in the default set: test_peft.py)
def test_resume_continues_and_exports_again(lora_resumed):
    out, _, first, second = lora_resumed
    assert "resumed at step 4" in second.stdout, second.stdout[-2000:]
    rows = _records(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert (out / "ckpt" / "latest_checkpoint_iteration.txt").read_text().strip() == str(STEPS)
    assert (out / "adapter_resumed" / "adapter_model.safetensors").is_file()


def test_resume_refuses_another_peft_setup(example, lora_run):
    out, common, _, _ = lora_run
    resume = common + [f"--training.max_steps={STEPS}", "--checkpoint.restore_from=LATEST"]
    message = _config_error(example, resume + ["--peft.r=4"], preflight=True)
    assert "would change its fine-tuning setup (peft.r: 8 -> 4)" in message, message
    message = _config_error(example, [a for a in resume if a != "--peft.method=lora"], preflight=True)
    assert "peft.method: 'lora' -> 'none'" in message, message


@pytest.mark.slow   # a third launch: the uninterrupted run the resume must match
def test_resume_matches_an_uninterrupted_run(lora_resumed, tmp_path):
    out, _, _, _ = lora_resumed
    _launch(["--peft.method=lora", f"--lr_scheduler.total_steps={STEPS}", f"--training.max_steps={STEPS}",
             f"--logging.metrics_file={tmp_path / 'metrics.jsonl'}"])
    straight = {r["step"]: r["loss"] for r in _records(tmp_path / "metrics.jsonl")}
    resumed = {r["step"]: r["loss"] for r in _records(out / "metrics.jsonl")}
    for step in range(1, STEPS + 1):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5), step


@pytest.mark.slow   # pretrained bf16 base, modules_to_save, merged export: 2 processes
def test_lora_from_a_pretrained_directory_with_merged_export(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = tmp_path / "base"
    build_causal_lm(qwen3_moe_config(vocab_size=_vocab()), seed=0).to(torch.bfloat16).save_pretrained(base_dir)
    _launch([f"--model.name_or_path={base_dir}", "--data.tokenizer=default", "--peft.method=lora",
             "--peft.modules_to_save=lm_head", "--training.max_steps=3", "--checkpoint.save_ckpt=true",
             f"--checkpoint.checkpoint_dir={tmp_path / 'ckpt'}", f"--peft.export_dir={tmp_path / 'adapter'}",
             f"--peft.merged_export_dir={tmp_path / 'merged'}"])
    keys = _checkpoint_tensors(tmp_path / "ckpt" / "global_step_3")
    assert any(".modules_to_save.default." in k for k in keys)
    assert not any(k.endswith(("base_layer.weight", "embed_tokens.weight", "gate_up_proj")) for k in keys)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert next(merged.parameters()).dtype == torch.bfloat16      # the base's own dtype (peft.base_dtype=None)
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir),
                                          str(tmp_path / "adapter")).merge_and_unload()
    ours, theirs = merged.state_dict(), reference.state_dict()
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name].float(), value.float(), rtol=0, atol=2e-2, msg=name)
    ids = torch.randint(0, _vocab(), (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits.float(), reference(input_ids=ids).logits.float(),
                                   rtol=0, atol=5e-2)


# ----------------------------------------------------------------------------- config checks (one process)
@pytest.mark.parametrize("flag, value", [
    ("r", "0"), ("r", "-2"), ("alpha", "0"), ("alpha", "-1"), ("alpha", "nan"), ("alpha", "inf"),
    ("dropout", "1"), ("dropout", "-0.1"), ("dropout", "nan"), ("dropout", "inf"),
])
def test_bad_numbers_are_refused(example, flag, value):
    message = _config_error(example, ["--peft.method=lora", f"--peft.{flag}={value}"])
    assert f"peft.{flag}" in message, message


@pytest.mark.parametrize("flag", ["tp_size", "ep_size"])
def test_tensor_and_expert_parallel_are_refused(example, flag):
    message = _config_error(example, ["--peft.method=lora", f"--parallel.{flag}=2"])
    assert f"parallel.{flag}=2" in message and f"--parallel.{flag}=1" in message, message


@pytest.mark.parametrize("args, needle", [
    (["--peft.r=16"], "peft.r=16 is set but peft.method=none"),
    (["--peft.export_dir=out"], "peft.export_dir='out' is set but peft.method=none"),
    (["--peft.method=lora", "--peft.target_modules=all-linear,q_proj"], "cannot be combined"),
    (["--peft.method=lora", "--peft.base_dtype=fp16"], "peft.base_dtype must be"),
    (["--peft.method=qlora"], "peft.method must be one of"),
])
def test_inconsistent_options_are_refused(example, args, needle):
    assert needle in _config_error(example, args)


@pytest.mark.parametrize("args, needle", [
    (["--peft.target_modules=q_proj,qproj"], "peft.target_modules: 'qproj' matches no module of Qwen3MoeForCausalLM"),
    (["--peft.modules_to_save=lm_haed"], "peft.modules_to_save: 'lm_haed' matches no module"),
    (["--peft.target_modules=self_attn"], "PEFT refuses this LoRA setup on Qwen3MoeForCausalLM: Target module "
                                          "Qwen3MoeAttention is not supported. Currently, only the following"),
    (["--peft.target_modules=all-linear"], "mlp.experts: adapters on parameters (LoraConfig.target_parameters"),
])
def test_targets_are_checked_on_the_meta_model(example, args, needle):
    message = _config_error(example, ["--peft.method=lora", *args], preflight=True)
    assert needle in message, message


def test_export_directories_are_checked(example, tmp_path):
    used = tmp_path / "used"
    used.mkdir()
    (used / "adapter_config.json").write_text("{}")
    message = _config_error(example, ["--peft.method=lora", f"--peft.export_dir={used}"], preflight=True)
    assert "--peft.export_dir" in message and "already holds files (adapter_config.json" in message, message
    ckpt = tmp_path / "ckpt"
    message = _config_error(example, ["--peft.method=lora", f"--checkpoint.checkpoint_dir={ckpt}",
                                      f"--peft.merged_export_dir={ckpt}"])
    assert "--peft.merged_export_dir and --checkpoint.checkpoint_dir are the same path" in message, message
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    message = _config_error(example, ["--peft.method=lora", f"--model.name_or_path={model_dir}",
                                      f"--peft.export_dir={model_dir}"])
    assert f"--peft.export_dir={str(model_dir)!r} is model.name_or_path" in message, message
    message = _config_error(example, ["--peft.method=lora", f"--peft.export_dir={tmp_path / 'x'}",
                                      f"--peft.merged_export_dir={tmp_path / 'x'}"])
    assert "are the same path" in message, message


def test_peft_stays_optional(example, monkeypatch, capsys):
    """Full fine-tuning (the default) never imports peft; LoRA without it is one line naming the extra."""
    monkeypatch.setitem(sys.modules, "peft", None)          # `import peft` now raises ImportError
    assert example.main(["--training.dry_run=true", "--training.dry_run_world_size=2"]) is None
    assert "device peak" in capsys.readouterr().out
    message = _config_error(example, ["--peft.method=lora", "--training.dry_run=true"])
    assert "pip install 'hyperacc[peft]'" in message, message


def test_dry_run_plans_the_lora_memory(example, capsys):
    example.main(["--training.dry_run=true", "--training.dry_run_world_size=2", "--peft.method=lora"])
    text = capsys.readouterr().out
    assert "params (trainable float32 + frozen bfloat16, sharded)" in text, text
    assert "note: trainable 7.17 K of 147.33 K params (4.87 %), frozen 140.16 K (bfloat16" in text, text
    cfg, _ = example.load_config(["--peft.method=lora"])
    lora = example.memory_plan(cfg, 2, _vocab(), "cpu")
    fp32_base = example.memory_plan(dataclasses.replace(cfg, peft=dataclasses.replace(cfg.peft, base_dtype="fp32")),
                                    2, _vocab(), "cpu")
    full = example.memory_plan(example.load_config([])[0], 2, _vocab(), "cpu")
    assert lora.trainable_params == 7168 and full.trainable_params == full.total_params
    assert lora.bytes["grads"] * 10 < full.bytes["grads"]
    assert lora.bytes["params"] < fp32_base.bytes["params"] < full.bytes["params"] * 1.1
    assert lora.device_bytes < full.device_bytes


# ----------------------------------------------------------------------------- the planner (hyperacc.tools.dry_run)
def _lora_model(**lora):
    from peft import LoraConfig, get_peft_model

    base = build_causal_lm(qwen3_moe_config(), meta_device=True)
    for param in base.parameters():
        param.data = param.data.to(torch.bfloat16)
    return get_peft_model(base, LoraConfig(r=8, target_modules=sorted(TARGETS), **lora))


def test_plan_counts_frozen_parameters_in_their_dtype_without_grads_or_states():
    from hyperacc.tools.dry_run import format_plan, plan_report, plan_sharding

    model = _lora_model()
    plan = plan_sharding(model, world_size=2, device_type="cpu")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    # Every tensor of this model has an even dim 0: each of the 2 ranks holds exactly half.
    assert plan.trainable_params == trainable == 7168 and plan.total_params == trainable + frozen
    assert plan.bytes["params"] == 4 * trainable / 2 + 2 * frozen / 2     # fp32 adapters, bf16 base
    assert plan.bytes["grads"] == 4 * trainable / 2
    assert plan.bytes["optimizer states"] == 8 * trainable / 2
    assert plan.bytes["optimizer step"] == 4 * 2 * max(p.numel() // 2 for p in model.parameters() if p.requires_grad)
    assert any(n.startswith("trainable 7.17 K of 147.33 K params") for n in plan.notes), plan.notes
    assert "frozen bfloat16" in format_plan(plan) and plan_report(plan)["trainable_params"] == trainable
    # The same base trained whole: every parameter in fp32 with gradients and moments.
    whole = plan_sharding(build_causal_lm(qwen3_moe_config(), meta_device=True), world_size=2, device_type="cpu")
    assert whole.bytes["params"] == whole.bytes["grads"] == 4 * frozen / 2
    assert whole.trainable_params == whole.total_params and not any("frozen" in n for n in whole.notes)


MEASURE = """
import json, sys, torch
from peft import LoraConfig, get_peft_model
import hyperacc
from hyperacc.tools.dry_run import plan_sharding
from hyperacc.models import build_causal_lm, qwen3_moe_config

def local(t):
    return t.to_local() if hasattr(t, "to_local") else t

base = build_causal_lm(qwen3_moe_config(), meta_device=True)
for param in base.parameters():
    param.data = param.data.to(torch.bfloat16)
model = get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
plan = plan_sharding(model, world_size=1, device_type="cpu")
acc = hyperacc.Accelerator(checkpoint=hyperacc.CheckpointConfig(save_ckpt=False))
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
model, optimizer = acc.prepare(model, optimizer)
ids = torch.randint(0, 512, (2, 16))
acc.backward(model(input_ids=ids, labels=ids).loss)
optimizer.step()
nbytes = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)
measured = {"params": nbytes(model.parameters()),
            "grads": nbytes(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer states": nbytes(v for s in optimizer.state.values() for k, v in s.items() if k != "step")}
json.dump({"planned": {k: plan.bytes[k] for k in measured}, "measured": measured}, open(sys.argv[1], "w"))
acc.end_training()
"""


def test_plan_is_what_prepare_stores(tmp_path):
    """The persistent bytes the planner counts for a PEFT model (bf16 base, fp32 adapters and
    modules_to_save copy) are the bytes prepare, backward and AdamW hold, on one process."""
    from dist_utils import run_python

    script, out = tmp_path / "measure.py", tmp_path / "out.json"
    script.write_text(MEASURE)
    run_python(script, [out], timeout=300)
    result = json.loads(out.read_text())
    assert result["planned"] == result["measured"], result


def test_plan_of_frozen_parameters_outside_peft_and_refused_layouts():
    from hyperacc.tools.dry_run import plan_sharding

    model = build_causal_lm(qwen3_moe_config(), meta_device=True)
    model.model.embed_tokens.weight.requires_grad_(False)        # prepare casts it (no PEFT): the recipe's dtype
    embed = model.model.embed_tokens.weight.numel()
    plan = plan_sharding(model, world_size=2, precision="bf16", device_type="cpu")
    total = plan.total_params
    assert plan.bytes["params"] == 2 * total / 2 and plan.bytes["grads"] == 2 * (total - embed) / 2
    assert any("cast to the recipe" in n for n in plan.notes), plan.notes
    for layout in ({"tp": 2}, {"ep": 2}):
        with pytest.raises(ValueError, match="PEFT adapters with (tp|ep)_size=2 are not supported"):
            plan_sharding(_lora_model(), world_size=2, device_type="cpu", **layout)
