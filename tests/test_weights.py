"""Pretrained weights at scale (issue 13): sharded load, sharded export, offline conversion.

Real processes (torchrun/accelerate launch, gloo): the load at 1, 2 (expert-parallel) and 4
processes equals `from_pretrained` bitwise and gives its first-step loss, and each export reloads
bitwise (tests/scripts/weights_check.py; 1 and 4 processes in the slow set); the example (one plain
process by default, `accelerate launch` on 2 in the slow set) loads a hub id from a fake local cache,
saves a checkpoint with its in-job export, `to-hf` of that checkpoint equals the export, and a run
started from `from-hf`'s model-only checkpoint has the first loss of the run that loaded the HF
directory. Bad inputs are checked in-process (no process group): one clear error each.
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_utils import REPO, run_accelerate, run_python, run_torchrun  # tests/ is on sys.path (conftest)

CHECK = REPO / "tests" / "scripts" / "weights_check.py"
EXAMPLE = REPO / "examples" / "train_qwen.py"
CPU2 = REPO / "accelerate_configs" / "cpu_fsdp2_2proc.yaml"
HUB_ID = "hyperacc-test/tiny-moe"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """An untied tiny Qwen3-MoE (the example's preset, the default tokenizer's vocabulary), a
    tied dense Qwen3, both saved by transformers' save_pretrained; and a fake hub cache."""
    from transformers import Qwen3Config

    from hyperacc.models import build_causal_lm, qwen3_moe_config

    root = tmp_path_factory.mktemp("weights")
    moe = build_causal_lm(qwen3_moe_config(vocab_size=512), seed=3)
    moe.save_pretrained(root / "moe")
    moe.save_pretrained(root / "moe_sharded", max_shard_size="100KB")
    dense = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    build_causal_lm(dense, seed=4).save_pretrained(root / "dense")
    repo = root / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    moe.save_pretrained(repo / "snapshots" / COMMIT)
    return root


def _checked(out, n):
    results = json.load(open(out))
    assert len(results) == n
    for r in results:
        assert r["params_equal"] and r["buffers_equal"] and r["export_equal"], r
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6, abs=0), r
        assert r["loss2"] == pytest.approx(r["ref_loss2"], rel=1e-5, abs=0) and r["loss2"] != r["loss"], r
    return results


# By default the loader runs at 2 processes only (test_load_two_processes_expert_parallel loads the multi-file
# checkpoint, test_load_two_processes_tensor_parallel_tied_and_untied the tied and untied models, each bitwise
# against from_pretrained, exported and reloaded) and in this process (test_in_process_load_equals_from_pretrained).
@pytest.mark.slow
def test_load_one_process_tied_and_untied(models, tmp_path):
    run_python(CHECK, ["--model", models / "dense", models / "moe_sharded", "--out", tmp_path / "r.json",
                       "--export", tmp_path / "exp"], timeout=300)
    dense, moe = _checked(tmp_path / "r.json", 2)
    assert "lm_head.weight" not in _read(tmp_path / "exp" / "0")      # tied: written once, as save_pretrained does
    assert "model.safetensors.index.json" in moe["export_files"]


@pytest.fixture(scope="module")
def two_processes(models, tmp_path_factory):
    """One 2-process launch (weights_check.py --then, a start-up costs more than a load): expert parallel
    (ep 2) of the multi-file checkpoint, then tensor parallel (tp 2), each with its own Accelerator."""
    tmp = tmp_path_factory.mktemp("two_processes")
    run_torchrun(CHECK, 2, ["--model", models / "moe_sharded", "--out", tmp / "ep.json", "--export", tmp / "ep", "--ep", 2,
                            "--then", "--model", models / "dense", models / "moe", "--out", tmp / "tp.json",
                            "--export", tmp / "tp", "--tp", 2], timeout=300)
    return tmp


def test_load_two_processes_expert_parallel(two_processes):
    (moe,) = _checked(two_processes / "ep.json", 1)
    assert "model.safetensors.index.json" in moe["export_files"]


def test_load_two_processes_tensor_parallel_tied_and_untied(two_processes):
    # tp 2: the tied dense model's lm_head shares the vocab-split embedding (sharded once, re-tied)
    dense, _ = _checked(two_processes / "tp.json", 2)
    assert "lm_head.weight" not in _read(two_processes / "tp" / "0")      # still tied in the export


@pytest.mark.slow          # 1 and 2 processes run by default; the same loader at 4 in the slow set
def test_load_four_processes(models, tmp_path):
    run_torchrun(CHECK, 4, ["--model", models / "moe_sharded", "--out", tmp_path / "r.json",
                            "--export", tmp_path / "exp"], timeout=300)
    _checked(tmp_path / "r.json", 1)


# --------------------------------------------------------------------------- the example, conversion
def _example(args, env=None, nproc=2):
    args = ["--logging.progress_bar=false", "--training.max_steps=1", "--data.tokenizer=default", *map(str, args)]
    if nproc == 1:
        run_python(EXAMPLE, args, env=env, timeout=300)
    else:
        run_accelerate(EXAMPLE, CPU2, args, env=env, timeout=300)


def _first_loss(path):
    return [json.loads(line) for line in open(path) if '"loss"' in line][0]["loss"]


def _read(directory):
    out = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def _same_safetensors(a, b):
    x, y = _read(a), _read(b)
    assert sorted(x) == sorted(y)
    for key in x:
        assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), key


# One plain process by default: the sharded load and export at 2 processes are
# test_load_two_processes_expert_parallel's and test_load_two_processes_tensor_parallel_tied_and_untied's.
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_example_hub_id_to_hf_and_from_hf(models, tmp_path, monkeypatch, nproc):
    from hyperacc.checkpoint.convert import from_hf, to_hf

    hub = {"HF_HUB_CACHE": str(models / "hub")}
    _example([f"--model.name_or_path={HUB_ID}", "--checkpoint.save_ckpt=true", f"--checkpoint.checkpoint_dir={tmp_path / 'a'}",
              "--checkpoint.save_consolidated=final", f"--logging.metrics_file={tmp_path / 'a.jsonl'}"], env=hub,
             nproc=nproc)
    step = tmp_path / "a" / "global_step_1"
    # to-hf of the checkpoint equals the in-job export (config from the run's config.yaml: the hub id).
    monkeypatch.setenv("HF_HUB_CACHE", hub["HF_HUB_CACHE"])
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", hub["HF_HUB_CACHE"])
    to_hf(str(step), str(tmp_path / "converted"), max_shard_bytes=150_000, progress=False)
    _same_safetensors(step / "hf", tmp_path / "converted")
    assert json.load(open(tmp_path / "converted" / "config.json"))["architectures"] == ["Qwen3MoeForCausalLM"]
    # from-hf of the hub id writes the HF weights bitwise: its model-only checkpoint converted back is the files
    # (in-process; a run of the example restored from it is test_a_run_restored_from_from_hf_starts_at_the_hf_loss).
    from_hf(HUB_ID, str(tmp_path / "b"), progress=False)
    to_hf(str(tmp_path / "b"), str(tmp_path / "back"), config_from=HUB_ID, progress=False)
    _same_safetensors(models / "moe", tmp_path / "back")


@pytest.mark.slow   # by default: test_example_hub_id_to_hf_and_from_hf (the hub id, to-hf, from-hf's weights bitwise)
def test_a_run_restored_from_from_hf_starts_at_the_hf_loss(models, tmp_path):
    """from-hf -> a run of the preset model restored from it: the first loss of the run that loaded the HF weights."""
    from hyperacc.checkpoint.convert import from_hf

    hub = {"HF_HUB_CACHE": str(models / "hub")}
    _example([f"--model.name_or_path={HUB_ID}", f"--logging.metrics_file={tmp_path / 'a.jsonl'}"], env=hub)
    from_hf(str(models / "moe"), str(tmp_path / "b"), progress=False)
    _example([f"--checkpoint.restore_from={tmp_path / 'b'}", f"--logging.metrics_file={tmp_path / 'b.jsonl'}"])
    assert _first_loss(tmp_path / "b.jsonl") == pytest.approx(_first_loss(tmp_path / "a.jsonl"), rel=1e-6, abs=0)


def test_converter_cli_errors(models, tmp_path, capsys):
    from hyperacc.checkpoint.convert import main

    assert main(["from-hf", "--model", str(models / "dense"), "--output", str(tmp_path / "c")]) == 0
    capsys.readouterr()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("user data")
    assert main(["to-hf", "--checkpoint", str(tmp_path / "c"), "--output", str(tmp_path / "busy"),
                 "--config-from", str(models / "dense")]) == 2
    assert "not empty" in capsys.readouterr().err and (tmp_path / "busy" / "keep.txt").exists()
    # a checkpoint of another architecture: one line naming the key
    assert main(["to-hf", "--checkpoint", str(tmp_path / "c"), "--output", str(tmp_path / "o"),
                 "--config-from", str(models / "moe")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.embed_tokens.weight" in err and not (tmp_path / "o").exists()
    assert main(["to-hf", "--checkpoint", str(tmp_path / "nowhere"), "--output", str(tmp_path / "o")]) == 2
    assert "not a complete checkpoint" in capsys.readouterr().err
    # dense round trip through the CLI, tied head written once
    assert main(["to-hf", "--checkpoint", str(tmp_path / "c"), "--output", str(tmp_path / "o"),
                 "--config-from", str(models / "dense")]) == 0
    _same_safetensors(models / "dense", tmp_path / "o")


# --------------------------------------------------------------------------- bad input, in-process
def _load_in_process(directory):
    from hyperacc.models.build import build_for_sharded_load
    from hyperacc.weights.load import fill_shards

    model = build_for_sharded_load(str(directory))
    model.to_empty(device="cpu")
    fill_shards(model)
    return model


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_in_process_load_equals_from_pretrained(models):
    from transformers import AutoModelForCausalLM
    model = _load_in_process(models / "moe_sharded")
    ref = AutoModelForCausalLM.from_pretrained(models / "moe")
    for (n, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), n
    bf16 = __import__("hyperacc.models.build", fromlist=["x"]).build_for_sharded_load(str(models / "moe"), dtype=torch.bfloat16)
    assert next(bf16.parameters()).dtype == torch.bfloat16


def test_bad_input_one_clear_error_each(models, tmp_path):
    from hyperacc.weights.files import WeightsError

    missing = _copy(models / "moe_sharded", tmp_path / "missing")
    shard = sorted(n for n in os.listdir(missing) if n.endswith(".safetensors"))[1]
    os.remove(missing / shard)
    with pytest.raises(WeightsError, match=f"shard file {shard} .* is missing"):
        _load_in_process(missing)

    def edited(name, edit):
        d = _copy(models / "moe", tmp_path / name)
        tensors = load_file(str(d / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d

    key = "model.layers.1.self_attn.q_proj.weight"
    wrong_key = edited("key", lambda t: t.__setitem__(key.replace("q_proj", "qq_proj"), t.pop(key)))
    with pytest.raises(WeightsError, match=f"key '{key}' is missing"):
        _load_in_process(wrong_key)
    wrong_shape = edited("shape", lambda t: t.__setitem__(key, t[key][:8].clone()))
    with pytest.raises(WeightsError, match=rf"key '{key}' has shape \[8, 64\] .* \[64, 64\]"):
        _load_in_process(wrong_shape)
    expert = "model.layers.0.mlp.experts.2.up_proj.weight"
    wrong_expert = edited("expert", lambda t: t.__setitem__(expert, t[expert][:, :8].clone()))
    with pytest.raises(WeightsError, match=f"key '{expert}' has shape"):
        _load_in_process(wrong_expert)
    extra = edited("extra", lambda t: t.__setitem__("model.layers.0.mlp.shared_expert.weight", torch.zeros(2)))
    with pytest.raises(WeightsError, match="key 'model.layers.0.mlp.shared_expert.weight' in the checkpoint matches no"):
        _load_in_process(extra)
    other = _copy(models / "moe", tmp_path / "other")        # a dense Qwen3's config over MoE weights
    (other / "config.json").write_text((models / "dense" / "config.json").read_text())
    with pytest.raises(WeightsError, match="another (model size or )?architecture"):
        _load_in_process(other)
    with pytest.raises(WeightsError, match="neither a local directory nor a model in the local Hugging Face cache"):
        _load_in_process("nobody/nothing-cached")


def test_a_truncated_file_is_refused_when_the_table_is_built(models, tmp_path):
    """An interrupted copy (a shard a few bytes short) fails where the file table is built -- on
    every rank alike, before any rank reads a slice -- not at the read of whichever rank owns the
    missing rows (safetensors' own header check, issue 39)."""
    from hyperacc.errors import WeightsError
    from hyperacc.weights.files import WeightFiles, header_metadata

    damaged = _copy(models / "moe_sharded", tmp_path / "truncated")
    shard = sorted(n for n in os.listdir(damaged) if n.endswith(".safetensors"))[-1]
    with open(damaged / shard, "r+b") as handle:
        handle.truncate(os.path.getsize(damaged / shard) - 4)
    with pytest.raises(WeightsError, match=f"{shard} is not a readable safetensors file .*incomplete"):
        WeightFiles(str(damaged))
    assert header_metadata(str(damaged / shard)) is None
    assert header_metadata(str(models / "moe" / "model.safetensors")) == {"format": "pt"}


def test_docs_snippet_runs(tmp_path_factory):
    """The first snippet of docs/guides/weights.md (test_docs runs it only in the slow set), in a process and
    an empty directory of its own, in the one launch of every snippet (tests/snippet_runs.py)."""
    from snippet_runs import assert_ran, weights_snippet

    assert_ran(tmp_path_factory, weights_snippet())
