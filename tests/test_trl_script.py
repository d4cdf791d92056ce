"""TRL's own `trl/scripts/sft.py`, unchanged but for its `SFTTrainer` import, on hyperacc.

The test copies the installed script, moves `SFTTrainer` to `hyperacc.integrations.trl` (one line of
the diff, checked), and runs it on 2 CPU processes (gloo) with its own command line options against a
local model directory (a tiny Qwen3 saved with `save_pretrained`, the offline default tokenizer with
TRL's Qwen3 training chat template beside it) and a local JSONL dataset of conversations. Nothing is
downloaded (HF_HUB_OFFLINE=1).

What is checked: the script exits 0; it trained (per-step losses in `trainer_state.json`, finite, not
constant); hyperacc checkpointed (`global_step_<N>/` with `trainer_state.json` and LATEST, no
Trainer-style `checkpoint-<N>/`); the model (or LoRA adapter, with `--use_peft`) it saved last loads
with transformers (or peft) and differs from the initial weights.
"""
from __future__ import annotations

import difflib
import json
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("trl")

from dist_utils import run_accelerate, run_torchrun  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MAX_STEPS, SAVE_STEPS = 4, 2
TRL_LINE = re.compile(r"^(\s*)from trl import (.*)$")


def _patched_script(dest: Path, name: str = "sft", trainer: str = "SFTTrainer") -> Path:
    """trl/scripts/<name>.py with ``trainer`` imported from hyperacc: exactly one line differs."""
    import trl

    source = Path(trl.__file__).parent / "scripts" / f"{name}.py"
    lines = source.read_text().splitlines(keepends=True)
    patched, done = [], 0
    for line in lines:
        match = TRL_LINE.match(line.rstrip("\n"))
        names = [n.strip() for n in match.group(2).split(",")] if match else []
        if trainer in names:
            rest = [n for n in names if n != trainer]
            new = (match.group(1) + (f"from trl import {', '.join(rest)}; " if rest else "")
                   + f"from hyperacc.integrations.trl import {trainer}\n")
            patched.append(new)
            done += 1
        else:
            patched.append(line)
    assert done == 1, f"{source}: expected one `from trl import ... {trainer} ...` line, found {done}"
    diff = [d for d in difflib.unified_diff(lines, patched, n=0)
            if d[:1] in "+-" and not d.startswith(("+++", "---"))]
    assert len(diff) == 2 and diff[0].startswith("-") and diff[1].startswith("+"), diff
    assert trainer in diff[0] and f"from hyperacc.integrations.trl import {trainer}" in diff[1], diff
    script = dest / f"{name}.py"
    script.write_text("".join(patched))
    return script


@pytest.fixture(scope="module")
def setup(tmp_path_factory, hyperacc_cache):
    """(the patched script, the model directory, the dataset directory, the initial state dict)."""
    import torch
    import trl
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hyperacc.data.default_corpus import collect_documents, load_default_tokenizer

    root = tmp_path_factory.mktemp("trl_script")
    script = _patched_script(root)

    tokenizer = load_default_tokenizer()
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3_training.jinja").read_text()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = Qwen3ForCausalLM(config)
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    data_dir = root / "data"
    data_dir.mkdir()
    docs = [d for d in collect_documents() if len(d) > 120][:96]
    with open(data_dir / "train.jsonl", "w") as handle:
        for doc in docs:
            head, _, body = doc.partition("\n")
            messages = [{"role": "user", "content": f"Explain: {head[:80]}"},
                        {"role": "assistant", "content": (body.strip() or doc)[:300]}]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return script, model_dir, data_dir, initial


def _common_args(model_dir: Path, data_dir: Path, out: Path):
    return ["--model_name_or_path", model_dir, "--dataset_name", data_dir, "--output_dir", out,
            "--use_cpu", "--max_steps", MAX_STEPS, "--logging_steps", 1, "--save_steps", SAVE_STEPS,
            "--report_to", "none", "--packing", "--max_length", 128, "--per_device_train_batch_size", 2,
            "--gradient_accumulation_steps", 2, "--learning_rate", "1e-3", "--seed", 0,
            "--dtype", "float32", "--disable_tqdm", "true"]


def _check_run(proc, out: Path):
    assert "Training completed" in proc.stdout + proc.stderr, proc.stdout[-3000:]
    ckpt = out / f"global_step_{MAX_STEPS}"
    assert (ckpt / "trainer_state.json").is_file(), sorted(p.name for p in out.iterdir())
    assert (out / f"global_step_{SAVE_STEPS}" / "trainer_state.json").is_file()
    assert not list(out.glob("checkpoint-*")), "a Trainer-style checkpoint-<N>/ was written: not hyperacc's"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["global_step"] == MAX_STEPS
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert len(losses) == MAX_STEPS, state["log_history"]
    assert all(math.isfinite(x) for x in losses), losses
    assert max(losses) - min(losses) > 1e-4, losses
    return losses


def _assert_changed(initial: dict, loaded: dict, names) -> None:
    import torch

    changed = [n for n in names if not torch.equal(initial[n], loaded[n])]
    assert changed, "the saved model equals the initial one: nothing was trained or saved"


def test_sft_script_full(setup, tmp_path):
    """Full fine-tuning, `torchrun --nproc_per_node=2 sft.py ...`, with assistant-only loss."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    script, model_dir, data_dir, initial = setup
    out = tmp_path / "out"
    proc = run_torchrun(script, 2, [*_common_args(model_dir, data_dir, out), "--assistant_only_loss"],
                        timeout=300)
    _check_run(proc, out)
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors")), sorted(p.name for p in out.iterdir())
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    loaded = model.state_dict()
    assert set(loaded) == set(initial)
    assert all(loaded[n].shape == initial[n].shape for n in initial)
    _assert_changed(initial, loaded, initial)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == model.config.vocab_size


@pytest.mark.slow     # LoRA through SFTTrainer is in test_trainer.py's default run
def test_sft_script_lora(setup, tmp_path):
    """`--use_peft --lora_r 4` under `accelerate launch` with hyperacc's 2-process FSDP2 config."""
    import peft
    from transformers import AutoModelForCausalLM

    script, model_dir, data_dir, initial = setup
    out = tmp_path / "out"
    proc = run_accelerate(script, REPO / "accelerate_configs" / "cpu_fsdp2_2proc.yaml",
                          [*_common_args(model_dir, data_dir, out), "--use_peft", "--lora_r", 4,
                           "--lora_alpha", 8], timeout=300)
    _check_run(proc, out)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    assert not (out / "model.safetensors").exists(), "a LoRA run saved the whole model, not its adapter"
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    model = peft.PeftModel.from_pretrained(base, out)
    lora_b = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b.values()), "LoRA B matrices are still zero: not trained"
    merged = model.merge_and_unload().state_dict()
    _assert_changed(initial, merged, initial)


WORDS = "red green blue cyan amber violet white black grey pink".split()


def _script_and_data(tmp_path_factory, name: str, trainer: str, rows: list):
    """(a fresh folder, trl/scripts/<name>.py patched in it, its data folder with ``rows`` as train.jsonl)."""
    root = tmp_path_factory.mktemp(f"trl_{name}")
    script = _patched_script(root, name, trainer)
    data_dir = root / "data"
    data_dir.mkdir()
    (data_dir / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root, script, data_dir


@pytest.fixture(scope="module")
def dpo_setup(setup, tmp_path_factory):
    """trl/scripts/dpo.py patched, and a local JSONL dataset of preference pairs (the SFT model directory)."""
    rows = [{"prompt": [{"role": "user", "content": f"Name a colour ({i})."}],
             "chosen": [{"role": "assistant", "content": WORDS[i % 5]}],
             "rejected": [{"role": "assistant", "content": WORDS[5 + i % 5]}]} for i in range(32)]
    root, script, data_dir = _script_and_data(tmp_path_factory, "dpo", "DPOTrainer", rows)
    return script, setup[1], data_dir, setup[3]


def _dpo_args(model_dir: Path, data_dir: Path, out: Path):
    return ["--model_name_or_path", model_dir, "--dataset_name", data_dir, "--output_dir", out,
            "--use_cpu", "--max_steps", MAX_STEPS, "--logging_steps", 1, "--save_steps", SAVE_STEPS,
            "--report_to", "none", "--max_length", 64, "--per_device_train_batch_size", 2,
            "--learning_rate", "1e-3", "--seed", 0, "--dtype", "float32", "--disable_tqdm", "true"]


@pytest.mark.slow     # by default the same 2-process DPO full fine-tune: test_preference.py's launch
def test_dpo_script_full(dpo_setup, tmp_path):
    """TRL's dpo.py, full fine-tune (its reference loaded from the same path and sharded by hyperacc),
    `torchrun --nproc_per_node=2`: the failure the issue reports ('fsdp_dim_names') is this run."""
    import torch
    from transformers import AutoModelForCausalLM

    script, model_dir, data_dir, initial = dpo_setup
    out = tmp_path / "out"
    proc = run_torchrun(script, 2, _dpo_args(model_dir, data_dir, out), timeout=300)
    losses = _check_run(proc, out)
    assert abs(losses[0] - math.log(2)) < 1e-5, losses
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert set(loaded) == set(initial)
    _assert_changed(initial, loaded, initial)


@pytest.mark.slow     # LoRA DPO is in test_preference.py's default run
def test_dpo_script_lora(dpo_setup, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    script, model_dir, data_dir, initial = dpo_setup
    out = tmp_path / "out"
    proc = run_accelerate(script, REPO / "accelerate_configs" / "cpu_fsdp2_2proc.yaml",
                          [*_dpo_args(model_dir, data_dir, out), "--use_peft", "--lora_r", 4, "--lora_alpha", 8],
                          timeout=300)
    losses = _check_run(proc, out)
    assert abs(losses[0] - math.log(2)) < 1e-5, losses
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out)
    _assert_changed(initial, model.merge_and_unload().state_dict(), initial)


TOY_REWARD = '''"""The reward of the grpo.py/rloo.py script tests: the share of even token ids in a completion."""


def even_share(completions, completion_ids, **kwargs):
    return [sum(1 for t in ids if t % 2 == 0) / max(1, len(ids)) for ids in completion_ids]
'''


@pytest.fixture(scope="module")
def grpo_setup(setup, tmp_path_factory):
    """trl/scripts/grpo.py patched, a local JSONL dataset of prompts, the toy reward as an importable module."""
    rows = [{"prompt": f"{WORDS[i % 10]} {WORDS[(3 * i) % 10]} and"} for i in range(32)]
    root, script, data_dir = _script_and_data(tmp_path_factory, "grpo", "GRPOTrainer", rows)
    (root / "toy_rewards.py").write_text(TOY_REWARD)
    return script, setup[1], data_dir, setup[3], root


def _grpo_args(model_dir: Path, data_dir: Path, out: Path):
    return ["--model_name_or_path", model_dir, "--dataset_name", data_dir, "--output_dir", out,
            "--use_cpu", "--max_steps", MAX_STEPS, "--logging_steps", 1, "--save_steps", SAVE_STEPS,
            "--report_to", "none", "--per_device_train_batch_size", 4, "--num_generations", 4,
            "--max_completion_length", 8, "--reward_funcs", "toy_rewards.even_share", "--beta", "0.04",
            "--learning_rate", "1e-2", "--seed", 0, "--dtype", "float32", "--disable_tqdm", "true"]


def _grpo_env(root: Path) -> dict:
    return {"PYTHONPATH": f"{root}:{REPO}"}        # grpo.py imports a dotted reward path


def _check_grpo_run(proc, out: Path) -> None:
    """As `_check_run`, on the gradient norms: on-policy GRPO's loss is ~0 by construction."""
    assert "Training completed" in proc.stdout + proc.stderr, proc.stdout[-3000:]
    ckpt = out / f"global_step_{MAX_STEPS}"
    assert (ckpt / "trainer_state.json").is_file() and (out / f"global_step_{SAVE_STEPS}").is_dir()
    assert not list(out.glob("checkpoint-*"))
    history = [e for e in json.loads((ckpt / "trainer_state.json").read_text())["log_history"] if "loss" in e]
    assert len(history) == MAX_STEPS and all(math.isfinite(e["loss"]) and e["grad_norm"] > 0 for e in history)


@pytest.mark.slow     # by default GRPO full and LoRA on 2 processes: test_preference.py's launch
def test_grpo_script_full(grpo_setup, tmp_path):
    """TRL's grpo.py, full fine-tune (beta > 0: its reference loaded from the same path, sharded by hyperacc),
    `torchrun --nproc_per_node=2`; the saved model loads with transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    script, model_dir, data_dir, initial, root = grpo_setup
    out = tmp_path / "out"
    proc = run_torchrun(script, 2, _grpo_args(model_dir, data_dir, out), env=_grpo_env(root), timeout=300)
    _check_grpo_run(proc, out)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert set(loaded) == set(initial)
    _assert_changed(initial, loaded, initial)


@pytest.mark.slow     # LoRA GRPO is in test_preference.py's default run
def test_grpo_script_lora(grpo_setup, tmp_path):
    """grpo.py --use_peft under `accelerate launch` (hyperacc's 2-process FSDP2 config): the adapter loads."""
    import peft
    from transformers import AutoModelForCausalLM

    script, model_dir, data_dir, initial, root = grpo_setup
    out = tmp_path / "out"
    proc = run_accelerate(script, REPO / "accelerate_configs" / "cpu_fsdp2_2proc.yaml",
                          [*_grpo_args(model_dir, data_dir, out), "--use_peft", "--lora_r", 4, "--lora_alpha", 8],
                          env=_grpo_env(root), timeout=300)
    _check_grpo_run(proc, out)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out)
    _assert_changed(initial, model.merge_and_unload().state_dict(), initial)
