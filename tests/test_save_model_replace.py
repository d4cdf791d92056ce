"""`Accelerator.save_model` into a directory it saved into before (`Trainer.save_model` does so every
time): hyperacc's own earlier export is replaced, with no moment where the directory loads as a mix
of old and new files and no crash that leaves it without a loadable model; weights hyperacc did not
write are refused; nothing else in the directory is touched. Also: a model that fits one file is one
``model.safetensors``, and ``safe_serialization=False`` is refused with the fix.

In-process (no process group: the export then runs on one rank); the 2-process runs are
tests/scripts/save_model_replace.py.
"""
import json
import os

import pytest
import torch

from dist_utils import REPO, run_torchrun  # tests/ is on sys.path (conftest)
from hyperacc.weights import publish
from hyperacc.weights.export import export_sharded, save_model_sharded
from hyperacc.weights.files import WeightFiles
from hyperacc.weights.writer import Entry, plan_files

SCRIPT = REPO / "tests" / "scripts" / "save_model_replace.py"
OTHERS = {"tokenizer.json": "{}", "latest_checkpoint_iteration.txt": "7", "training_args.bin": "args"}
SHARDED, SINGLE = "100KB", "10GB"         # the tiny model is ~370 KB: 4 shards, or one file


def tiny(seed):
    from transformers import Qwen3Config

    from hyperacc.models import build_causal_lm

    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return build_causal_lm(config, seed=seed)


@pytest.fixture(scope="module")
def versions():
    """Three models of one architecture with different weights: what successive saves hold."""
    return [tiny(seed) for seed in (4, 5, 6)]


def trainer_dir(path):
    """An output_dir as `Trainer` leaves it: a checkpoint, the pointer, a tokenizer, its arguments."""
    (path / "global_step_7").mkdir(parents=True)
    (path / "global_step_7" / ".metadata").write_text("dcp")
    for name, text in OTHERS.items():
        (path / name).write_text(text)
    return path


def assert_others_intact(path):
    assert all((path / n).read_text() == text for n, text in OTHERS.items())
    assert os.listdir(path / "global_step_7") == [".metadata"]


def which_version(path, versions):
    """The index of the version ``path`` loads as, both with transformers and with hyperacc's own
    reader; fails on a mix (or on no loadable model)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()
    reader = WeightFiles(str(path))
    ours = {k: reader.read(k, ()) for k in reader.entries}
    reader.close()
    for i, model in enumerate(versions):
        expected = model.state_dict()
        if all(torch.equal(loaded[k], expected[k]) for k in loaded) and \
                all(torch.equal(v, expected[k]) for k, v in ours.items()):
            return i
    raise AssertionError(f"{path} loads as no single version (a mix of exports): {sorted(os.listdir(path))}")


def weight_files(path):
    return sorted(n for n in os.listdir(path) if n.endswith((".safetensors", ".index.json")))


# --------------------------------------------------------------------------- the file plan
def test_plan_one_file_on_one_rank_when_it_fits_else_shards_with_alternating_names():
    groups = [[Entry(f"w{i}", torch.float32, (10, 10))] for i in range(6)]          # 400 bytes each
    (single,) = plan_files(groups, 2, 2400)
    assert single.name == "model.safetensors" and single.rank == 0 and len(single.entries) == 6
    sharded = plan_files(groups, 2, 800)
    assert [f.name for f in sharded] == [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    assert sorted({f.rank for f in sharded}) == [0, 1]                           # both ranks write
    again = plan_files(groups, 2, 800, avoid={f.name for f in sharded})
    assert [f.name for f in again] == [f"model-0000{i}-of-00004-b.safetensors" for i in (1, 2, 3, 4)]
    assert [f.name for f in plan_files(groups, 2, 800, avoid={f.name for f in again})] == [f.name for f in sharded]
    (big,) = plan_files([[Entry("w", torch.float32, (100, 100))]], 2, 800)        # one tensor over the limit
    assert big.name == "model.safetensors"


# --------------------------------------------------------------------------- one file, or shards
def test_small_model_one_file_big_model_shards_both_load(versions, tmp_path):
    save_model_sharded(versions[0], str(tmp_path / "one"))
    assert weight_files(tmp_path / "one") == ["model.safetensors"]
    assert which_version(tmp_path / "one", versions) == 0
    save_model_sharded(versions[1], str(tmp_path / "many"), max_shard_size=SHARDED)
    files = weight_files(tmp_path / "many")
    assert "model.safetensors.index.json" in files and len(files) == 5
    assert which_version(tmp_path / "many", versions) == 1
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["hyperacc_export"] == publish.read_marker(str(tmp_path / "many"))["marks"][0]


def test_safe_serialization_false_is_refused_with_the_fix(versions, tmp_path):
    with pytest.raises(ValueError, match="safetensors only.*Fix: drop safe_serialization=False"):
        save_model_sharded(versions[0], str(tmp_path / "out"), safe_serialization=False)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- replacing our own export
@pytest.mark.parametrize("sizes", [(SHARDED, SHARDED, SINGLE, SHARDED), (SINGLE, SINGLE, SHARDED, SINGLE)],
                         ids=["sharded-first", "single-first"])
def test_saving_again_replaces_our_export_and_nothing_else(versions, tmp_path, sizes):
    out = trainer_dir(tmp_path / "out")
    for step, size in enumerate(sizes):
        version = step % len(versions)
        save_model_sharded(versions[version], str(out), max_shard_size=size)
        assert which_version(out, versions) == version
        assert_others_intact(out)
        files = weight_files(out)
        if size == SINGLE:
            assert files == ["model.safetensors"]           # no stale shard or index beside it
        else:
            assert len(files) == 5 and "model.safetensors" not in files
        marker = publish.read_marker(str(out))
        assert len(marker["marks"]) == 1
        assert set(marker["files"]) == set(files) | {"config.json", "generation_config.json"}
        assert not os.path.exists(f"{out}.tmp-hyperacc-export")


@pytest.mark.parametrize("old, new", [(SHARDED, SHARDED), (SHARDED, SINGLE), (SINGLE, SHARDED), (SINGLE, SINGLE)])
def test_every_intermediate_state_loads_as_the_old_or_the_new_export(versions, tmp_path, monkeypatch, old, new):
    """After each file operation of the replacement the directory loads, as one whole export: first the
    old one, then (from some operation on) the new one, never back."""
    out = trainer_dir(tmp_path / "out")
    save_model_sharded(versions[0], str(out), max_shard_size=old)
    seen = []

    def observed(fn):
        def wrapper(*args, **kwargs):
            result = fn(*args, **kwargs)
            if os.path.isdir(out):
                seen.append(which_version(out, versions))
            return result
        return wrapper

    for name in ("_move", "_remove", "write_marker"):
        monkeypatch.setattr(publish, name, observed(getattr(publish, name)))
    save_model_sharded(versions[1], str(out), max_shard_size=new)
    assert seen and seen == sorted(seen) and seen[-1] == 1, seen
    assert_others_intact(out)


@pytest.mark.parametrize("old, new", [(SHARDED, SHARDED), (SHARDED, SINGLE), (SINGLE, SHARDED)])
def test_a_crash_at_any_point_leaves_a_loadable_model_and_the_next_save_cleans_up(versions, tmp_path, monkeypatch,
                                                                                  old, new):
    class Crash(Exception):
        pass

    for crash_at in range(20):
        out = trainer_dir(tmp_path / f"crash{crash_at}")
        save_model_sharded(versions[0], str(out), max_shard_size=old)
        calls = [0]

        def crashing(fn):
            def wrapper(*args, **kwargs):
                calls[0] += 1
                if calls[0] > crash_at:
                    raise Crash()
                return fn(*args, **kwargs)
            return wrapper

        with monkeypatch.context() as patch:
            for name in ("_move", "_remove", "write_marker"):
                patch.setattr(publish, name, crashing(getattr(publish, name)))
            try:
                save_model_sharded(versions[1], str(out), max_shard_size=new)
                finished = True
            except (Crash, RuntimeError) as err:     # RuntimeError: the export's own report when a group exists
                if "Crash" not in f"{type(err).__name__}: {err}":
                    raise
                finished = False
        assert which_version(out, versions) in (0, 1)
        save_model_sharded(versions[2], str(out), max_shard_size=new)       # the next save: clean
        assert which_version(out, versions) == 2
        assert_others_intact(out)
        clean = tmp_path / f"clean{crash_at}"
        save_model_sharded(versions[2], str(clean), max_shard_size=new)
        plain = lambda names: sorted(n.replace("-b.safetensors", ".safetensors") for n in names)  # noqa: E731
        assert plain(os.listdir(out)) == plain(set(os.listdir(clean)) | set(OTHERS) | {"global_step_7"})
        if finished:
            break
    assert finished, "the replacement did not finish within 20 operations"


# --------------------------------------------------------------------------- what is refused
def test_weights_hyperacc_did_not_write_are_refused_naming_the_file(versions, tmp_path):
    user = trainer_dir(tmp_path / "user")
    versions[0].save_pretrained(user)                     # transformers' own save: no marker
    with pytest.raises(FileExistsError, match=r"holds config\.json, which hyperacc did not write.*Fix: save to"):
        save_model_sharded(versions[1], str(user))
    assert which_version(user, versions) == 0 and not os.path.exists(f"{user}.tmp-hyperacc-export")

    ours = trainer_dir(tmp_path / "ours")
    save_model_sharded(versions[0], str(ours), max_shard_size=SHARDED)
    # a copy of one of our own shards, but no part of the export: not ours to delete
    shard = next(n for n in weight_files(ours) if n.startswith("model-"))
    (ours / "extra.safetensors").write_bytes((ours / shard).read_bytes())
    with pytest.raises(FileExistsError, match="holds extra.safetensors.*does not list it"):
        save_model_sharded(versions[1], str(ours), max_shard_size=SHARDED)
    os.remove(ours / "extra.safetensors")
    versions[1].save_pretrained(ours)                     # written over our export: no mark in it
    with pytest.raises(FileExistsError, match="model.safetensors, which hyperacc did not write"):
        save_model_sharded(versions[2], str(ours))
    assert (ours / "model.safetensors").exists() and which_version(ours, versions) == 1


def test_exports_outside_save_model_still_never_write_into_a_directory(versions, tmp_path):
    from hyperacc.checkpoint.export import export_hf

    export_hf(versions[0], str(tmp_path / "hf"))
    with pytest.raises(FileExistsError, match="not empty"):
        export_hf(versions[1], str(tmp_path / "hf"))
    with pytest.raises(FileExistsError, match="not empty"):
        export_sharded(versions[1], str(tmp_path / "hf"))
    assert which_version(tmp_path / "hf", versions) == 0


# --------------------------------------------------------------------------- PEFT adapters
def test_adapter_saved_again_replaces_our_adapter_and_keeps_the_readme(tmp_path):
    peft = pytest.importorskip("peft")

    model = peft.get_peft_model(tiny(4), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    out = trainer_dir(tmp_path / "out")
    (out / "README.md").write_text("mine")
    for value in (0.25, -0.5):
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.fill_(value)
        save_model_sharded(model, str(out))
        loaded = peft.PeftModel.from_pretrained(tiny(4), str(out))
        b = [p for n, p in loaded.named_parameters() if "lora_B" in n]
        assert b and all(torch.all(p == value) for p in b)
        assert (out / "README.md").read_text() == "mine"
        assert_others_intact(out)
        assert sorted(publish.read_marker(str(out))["files"]) == ["adapter_config.json", "adapter_model.safetensors"]
    foreign = trainer_dir(tmp_path / "foreign")
    model.save_pretrained(foreign)                          # PEFT's own save: no marker
    with pytest.raises(FileExistsError, match="adapter_config.json, which hyperacc did not write"):
        save_model_sharded(model, str(foreign))


# --------------------------------------------------------------------------- 2 processes
def test_two_processes_save_three_times_and_adapters_twice(tmp_path):
    run_torchrun(SCRIPT, 2, [tmp_path / "r.json", tmp_path / "out", "--peft"], timeout=300)
    result = json.loads((tmp_path / "r.json").read_text())
    sharded, again, single = result["model"]
    for record in result["model"] + result["adapter"]:
        assert record["equal"], record
    assert all(r["others_intact"] for r in result["model"])
    assert "model-00001-of-00005.safetensors" in sharded["files"] and "model.safetensors.index.json" in sharded["files"]
    assert "model-00001-of-00005-b.safetensors" in again["files"]
    assert "model-00001-of-00005.safetensors" not in again["files"]
    assert [n for n in single["files"] if n.endswith((".safetensors", ".index.json"))] == ["model.safetensors"]
    assert {".hyperacc_export.json", "config.json", "generation_config.json"} <= set(single["files"])
    assert all(r["readme_kept"] for r in result["adapter"])
