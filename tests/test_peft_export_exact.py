"""Adapter exports hold exactly what PEFT's own ``get_peft_model_state_dict`` keeps (trained biases,
``modules_to_save``, DoRA magnitudes), adapters-only checkpoints keep the trained biases, and the
merged / full exports are models a user can generate from (tokenizer, generation config, eos/pad ids,
the model's own ``use_cache``).

One 2-process launch (tests/scripts/peft_export_exact.py, FSDP2 over gloo, ~30 s) trains a tiny Qwen2
(q/k/v biases) several ways and exports each; this process reloads every export with PEFT and
transformers and compares with the trained model's logits (fp32, max abs <= 1e-5). The unit tests
below it run in this process, without a process group.
"""
import json

import pytest
import torch

peft = pytest.importorskip("peft")

from dist_utils import REPO, run_torchrun  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "peft_export_exact.py"
TOL = 1e-5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def qwen2_config(vocab=512, **overrides):
    from transformers import Qwen2Config

    return Qwen2Config(**{**dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                 max_position_embeddings=128), **overrides})


def tokenizer():
    from hyperacc.data.default_corpus import load_default_tokenizer

    return load_default_tokenizer()


def base_from(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory)).eval()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny Qwen2 with biases (``use_cache`` true, no eos/pad ids in its config) and its tokenizer."""
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("peft_exact") / "base"
    tok = tokenizer()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(qwen2_config(len(tok))).save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def launched(base_dir):
    out = base_dir.parent / "out"
    run_torchrun(SCRIPT, 2, [base_dir, out], timeout=300)
    return out, json.loads((out / "record.json").read_text())


def probe(vocab=512):
    import peft_export_exact

    return peft_export_exact.probe_ids(vocab)


@pytest.fixture(scope="module", autouse=True)
def _script_path():
    import sys

    sys.path.insert(0, str(REPO / "tests" / "scripts"))


@pytest.mark.parametrize("run, folder", [("all", "adapter"), ("all", "accelerate"), ("lora_only", "adapter"),
                                         ("dora", "adapter"), ("trainer", "save_model")])
def test_exported_adapter_reloaded_by_peft_gives_the_trained_logits(launched, base_dir, run, folder):
    out, _ = launched
    model = peft.PeftModel.from_pretrained(base_from(base_dir), str(out / run / folder)).eval()
    with torch.no_grad():
        got = model(input_ids=probe()).logits.float()
    trained = torch.load(out / run / "logits.pt")
    assert (got - trained).abs().max().item() <= TOL
    with torch.no_grad():       # and the check can fail: without the adapter the logits differ
        assert (base_from(base_dir)(input_ids=probe()).logits - trained).abs().max().item() > 1e-3


@pytest.mark.parametrize("run, folder", [("all", "adapter"), ("lora_only", "adapter"), ("dora", "adapter"),
                                         ("trainer", "save_model")])
def test_adapter_file_holds_the_keys_peft_itself_saves(launched, base_dir, tmp_path, run, folder):
    """The reloaded adapter saved again by PEFT's own save_pretrained: the same keys, the same values."""
    from safetensors.torch import load_file

    out, _ = launched
    ours = load_file(str(out / run / folder / "adapter_model.safetensors"))
    model = peft.PeftModel.from_pretrained(base_from(base_dir), str(out / run / folder))
    model.save_pretrained(str(tmp_path / "peft"))
    theirs = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    config = json.loads((out / run / folder / "adapter_config.json").read_text())
    if config["bias"] != "none":
        assert any(k.endswith("base_layer.bias") for k in ours)
    if config.get("modules_to_save"):
        assert "base_model.model.lm_head.weight" in ours
    if config.get("use_dora"):
        assert any(k.endswith("lora_magnitude_vector") for k in ours)


def test_adapter_config_records_its_base(launched, base_dir):
    out, _ = launched
    for folder in ("all/adapter", "lora_only/adapter", "trainer/save_model"):
        config = json.loads((out / folder / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(base_dir), folder


def test_adapters_only_checkpoint_resume_keeps_the_trained_biases_bitwise(launched):
    _, record = launched
    run = record["all"]
    assert len(run["biases"]) == 6                       # q, k, v of 2 layers
    assert run["biases_moved"] == run["biases"]          # they trained (the comparison means something)
    assert run["bitwise"] == run["trainable"]            # every trainable tensor restored bitwise


def test_what_cannot_be_exported_exactly_is_refused_in_one_line_on_every_rank(launched):
    _, record = launched
    ranks = record["refusals_every_rank"]
    assert len(ranks) == 2
    for rank in ranks:
        dora, vblora = rank["dora_meta"], rank["vblora_topk"]
        assert dora["type"] == "ValueError" and "DoRA" in dora["message"] and "Fix:" in dora["message"]
        assert vblora["type"] == "NotImplementedError" and "save_only_topk_weights=False" in vblora["message"]
        assert "\n" not in dora["message"] and "\n" not in vblora["message"]
        assert rank["vblora_written"] is False           # refused before anything was written
    assert ranks[0]["dora_meta"]["message"] == ranks[1]["dora_meta"]["message"]
    assert ranks[0]["vblora_topk"]["message"] == ranks[1]["vblora_topk"]["message"]


def test_merged_export_loads_with_autotokenizer_and_generates_like_the_trained_model(launched, base_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out, _ = launched
    merged_dir = out / "all" / "merged"
    tok = AutoTokenizer.from_pretrained(str(merged_dir))
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir)).eval()
    assert merged.config.eos_token_id == tok.eos_token_id and merged.config.pad_token_id == tok.pad_token_id
    assert merged.config.use_cache is True               # the base's own value, not training's False
    generation = GenerationConfig.from_pretrained(str(merged_dir))
    assert generation.eos_token_id == tok.eos_token_id and generation.use_cache is True
    with torch.no_grad():
        assert (merged(input_ids=probe()).logits - torch.load(out / "all" / "logits.pt")).abs().max().item() <= 1e-4
    # The trained model, merged by PEFT itself from the exact adapter export.
    reference = peft.PeftModel.from_pretrained(base_from(base_dir), str(out / "all" / "adapter")).merge_and_unload()
    prompt = tok("the quick brown fox", return_tensors="pt")
    options = dict(max_new_tokens=8, do_sample=False, generation_config=generation)
    with torch.no_grad():
        ours = merged.generate(**prompt, **options)
        theirs = reference.eval().generate(**prompt, **options)
    assert ours.shape[1] > prompt["input_ids"].shape[1]
    assert torch.equal(ours, theirs)


def test_trainer_save_model_writes_the_tokenizer(launched):
    from transformers import AutoTokenizer

    out, record = launched
    assert record["trainer"]["steps"] == 3
    tok = AutoTokenizer.from_pretrained(str(out / "trainer" / "save_model"))
    assert len(tok) == len(tokenizer())


# --------------------------------------------------------------------------- one process, no process group
def _lora_model(**kwargs):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = peft.LoraConfig(**{"r": 2, "target_modules": TARGETS, **kwargs})
    return peft.get_peft_model(AutoModelForCausalLM.from_config(qwen2_config(128)), config)


@pytest.mark.parametrize("kwargs", [dict(bias="all"), dict(bias="lora_only", modules_to_save=["lm_head"]),
                                    dict(use_dora=True), dict(target_modules=["embed_tokens", "q_proj"]),
                                    dict(trainable_token_indices=[1, 2, 3])])
def test_the_choice_is_peft_own(kwargs):
    """The keys chosen over placeholders are those PEFT's function returns on the real tensors."""
    from peft.utils import get_peft_model_state_dict

    from hyperacc.integrations.peft_saved import adapter_files

    model = _lora_model(**kwargs)
    chosen = adapter_files(model)["default"]
    real = get_peft_model_state_dict(model)
    assert sorted(chosen) == sorted(real)
    state = model.state_dict()
    assert all(torch.equal(state[chosen[k]], real[k]) for k in real)


def test_checkpoint_state_holds_every_tensor_peft_keeps_even_a_frozen_one():
    from hyperacc.checkpoint.buckets import model_state

    model = _lora_model(bias="all")
    frozen = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias"
    model.get_parameter(frozen).requires_grad_(False)
    assert frozen in model_state(model, trainable_only=True)


def test_a_trained_tensor_peft_does_not_keep_is_refused_before_anything_is_written(tmp_path):
    from hyperacc.integrations.peft import export_adapter

    model = _lora_model()
    model.base_model.model.model.norm.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"model\.norm\.weight trains.*modules_to_save"):
        export_adapter(model, str(tmp_path / "adapter"))
    assert not (tmp_path / "adapter").exists()


def test_prompt_learning_is_refused_before_peft_runs_its_prompt_encoder(tmp_path):
    from transformers import AutoModelForCausalLM

    from hyperacc.integrations.peft import export_adapter

    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    model = peft.get_peft_model(AutoModelForCausalLM.from_config(qwen2_config(128)), config)
    with pytest.raises(NotImplementedError, match="prompt-learning adapters .* Fix:"):
        export_adapter(model, str(tmp_path / "adapter"))
    assert not (tmp_path / "adapter").exists()


def test_named_adapters_are_exported_each_as_peft_saves_them(tmp_path):
    """No "default" adapter: PEFT writes one sub-directory per adapter, each with its own choice."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hyperacc.integrations.peft import export_adapter

    torch.manual_seed(0)
    model = peft.get_peft_model(AutoModelForCausalLM.from_config(qwen2_config(128)),
                                peft.LoraConfig(r=2, target_modules=["q_proj"], bias="all"), adapter_name="one")
    model.add_adapter("two", peft.LoraConfig(r=2, target_modules=["v_proj"]))
    export_adapter(model, str(tmp_path / "out"))
    one = load_file(str(tmp_path / "out" / "one" / "adapter_model.safetensors"))
    two = load_file(str(tmp_path / "out" / "two" / "adapter_model.safetensors"))
    assert any(k.endswith("q_proj.base_layer.bias") for k in one) and not any(k.endswith("bias") for k in two)
    assert all("v_proj.lora_" in k for k in two)


def test_full_export_carries_tokenizer_generation_config_ids_and_own_use_cache(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from hyperacc.weights.export import save_model_sharded

    tok = tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(qwen2_config(len(tok), use_cache=False))   # training's override
    save_model_sharded(model, str(tmp_path / "full"), tokenizer=tok)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "full"))
    assert loaded.config.use_cache is True                      # transformers' default for Qwen2
    assert (loaded.config.eos_token_id, loaded.config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert GenerationConfig.from_pretrained(str(tmp_path / "full")).eos_token_id == tok.eos_token_id
    assert len(AutoTokenizer.from_pretrained(str(tmp_path / "full"))) == len(tok)
    assert model.config.use_cache is False                      # the live model is untouched


def test_own_use_cache_reads_the_pretrained_config(tmp_path):
    from hyperacc.weights.hf_metadata import export_config

    config = qwen2_config(use_cache=False)
    config.save_pretrained(str(tmp_path))                       # a pretrained model that says false itself
    config._name_or_path = str(tmp_path)
    assert export_config(config).use_cache is False
    config.use_cache, config.eos_token_id = False, 7            # a config's own ids are kept
    config._name_or_path = ""
    exported = export_config(config, tokenizer=tokenizer())
    assert exported.use_cache is True and exported.eos_token_id == 7 and exported.pad_token_id == 0


# --------------------------------------------------------------------------- the example (2 processes)
@pytest.mark.slow   # one more launch: the library path above is the default run's
def test_example_merged_export_loads_with_autotokenizer_and_generates(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from dist_utils import run_accelerate

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    run_accelerate(REPO / "examples" / "train_qwen.py", REPO / "accelerate_configs" / "cpu_fsdp2_2proc.yaml",
                   ["--logging.progress_bar=false", "--eval.eval_steps=0", "--peft.method=lora",
                    "--training.max_steps=2", "--checkpoint.save_ckpt=false",
                    f"--checkpoint.checkpoint_dir={tmp_path / 'ckpt'}", f"--peft.export_dir={adapter}",
                    f"--peft.merged_export_dir={merged}"], timeout=400)
    tok = AutoTokenizer.from_pretrained(str(merged))
    model = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    assert model.config.use_cache is True               # the example trains with use_cache=False
    assert GenerationConfig.from_pretrained(str(merged)).eos_token_id == tok.eos_token_id
    prompt = tok("the quick brown fox", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 4
    assert len(AutoTokenizer.from_pretrained(str(adapter))) == len(tok)      # the adapter's tokenizer too
