"""Checkpoint edges: a loop saves only when asked, another tool's checkpoint is never written into (and
load_state's fix for it works), a tied weight is stored once. Real processes, real accelerate/DCP/transformers;
the scripts are in tests/scripts/ckpt_edges.py (one launch per concern, several assertions each)."""
import hashlib
import json
import os

import pytest
import torch

from dist_utils import REPO, run_python, run_together, run_torchrun

SCRIPT = REPO / "tests/scripts/ckpt_edges.py"


def _hashes(root):
    """relative path -> sha256 of every file under ``root`` (the directory's whole content)."""
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as handle:
                out[os.path.relpath(path, root)] = hashlib.sha256(handle.read()).hexdigest()
    return out


# ------------------------------------------------------------------------------ 1. saves only when asked
@pytest.fixture(scope="module")
def one_process_launches(tmp_path_factory):
    """The policy runs beside accelerate's own save_state (2./3. below) followed, in the same process, by
    load_state's fix for it (tests/scripts/ckpt_edges_then.py: a new Accelerator, model and optimizer
    loading the directory from disk): two independent 1-process launches side by side (run_together)."""
    work, dist, fix = (tmp_path_factory.mktemp(name) for name in ("policy", "dist", "fix"))
    (work / "runs").mkdir()
    run_together(lambda: run_python(SCRIPT, ["policy", work / "runs", work / "record.json"]),
                 lambda: run_python(SCRIPT.parent / "ckpt_edges_then.py",
                                    ["accelerate_save", dist / "accelerate",
                                     "--then", "accelerate_fix", dist / "accelerate", fix / "fix.json"]))
    return work, dist, fix


@pytest.fixture(scope="module")
def policy(one_process_launches):
    return json.loads((one_process_launches[0] / "record.json").read_text())


def _steps(files, root):
    return sorted({int(f.split("/")[len(root.split("/"))].split("_")[-1]) for f in files
                   if f.startswith(root + "/") and f.endswith("/.metadata")})


def test_a_loop_left_at_the_defaults_writes_no_checkpoint_anywhere(policy):
    """step_end every step over two epochs, then end_training: accelerate never saves unless asked."""
    for name in ("default", "default_config", "restore_only", "project_dir", "accelerate_style", "save_ckpt_false"):
        assert policy[name] == {"files": [], "returned": []}, (name, policy[name])


@pytest.mark.parametrize("name, root, steps", [
    ("checkpoint_dir", "mine", [5, 8]),                      # the epoch save (noticed at the next step) and the final one
    ("save_steps", "checkpoints", [3, 6, 8]),                # a cadence given: <cwd>/checkpoints
    ("save_steps_project", "proj/checkpoints", [3, 6, 8]),   # ... under accelerate's project_dir when it has one
    ("env_dir", "envdir", [5, 8]),                           # HYPERACC_CHECKPOINT_CHECKPOINT_DIR
    ("env_steps", "checkpoints", [4, 8]),                    # HYPERACC_CHECKPOINT_SAVE_STEPS
])
def test_a_loop_that_asks_saves_where_it_asked(policy, name, root, steps):
    files = policy[name]["files"]
    assert _steps(files, root) == steps, files
    assert all(f.startswith(root + "/") for f in files), files          # nowhere else
    assert f"{root}/latest_checkpoint_iteration.txt" in files


def test_automatic_checkpoint_naming_saves_as_accelerate_names_them(policy):
    files = policy["automatic"]["files"]
    dirs = sorted({f.split("/")[2] for f in files})
    assert dirs == ["checkpoint_0", "checkpoint_1"], files            # the epoch save, then the final one
    assert all(f.startswith("proj/checkpoints/checkpoint_") for f in files), files      # no lock file, no LATEST
    assert "needs a project_dir" in policy["automatic_no_project_dir"]


def test_explicit_save_state_still_saves_and_end_training_adds_nothing(policy):
    record = policy["explicit_only"]
    assert record["returned"] == ["checkpoints/global_step_8", "mine"]
    assert _steps(record["files"], "checkpoints") == [8] and "mine/.metadata" in record["files"]


# ------------------------------------------------------------------------ 2./3. another tool's checkpoint
@pytest.fixture(scope="module")
def dist_run(one_process_launches):
    """accelerate's own save_state output and a transformers Trainer checkpoint layout, then one 2-rank run
    that tries to save into / load from them and checkpoints a tied model; the files are hashed around it."""
    from transformers import AutoModelForCausalLM
    import transformers

    work = one_process_launches[1]                    # accelerate's save_state output is in work / "accelerate"
    trainer = work / "trainer"                  # checkpoint-N as transformers' Trainer lays it out on accelerate
    model = AutoModelForCausalLM.from_config(transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8))
    model.save_pretrained(trainer)
    for name, text in [("trainer_state.json", '{"global_step": 1}'), ("optimizer.pt", "x"), ("scheduler.pt", "x"),
                       ("rng_state.pth", "x"), ("training_args.bin", "x")]:
        (trainer / name).write_text(text)
    before = {name: _hashes(work / name) for name in ("accelerate", "trainer")}
    run_torchrun(SCRIPT, 2, ["dist", work, work / "record"])
    after = {name: _hashes(work / name) for name in ("accelerate", "trainer")}
    records = [json.loads((work / f"record.rank{r}").read_text()) for r in range(2)]
    return work, before, after, records


def test_save_state_refuses_another_tools_checkpoint_in_load_states_words(dist_run):
    work, before, after, records = dist_run
    assert before == after and before["accelerate"], "a refused save touched the user's files"
    for name, what in [("accelerate", "a checkpoint written by accelerate's save_state"),
                       ("trainer", "a checkpoint written by transformers' Trainer on plain accelerate (trainer_state.json)")]:
        saved, loaded = records[0][f"save_{name}"], records[0][f"load_{name}"]
        words = f"{str(work / name)!r} is {what}, not a hyperacc checkpoint"
        for err in (saved, loaded):
            assert err["type"] == "ForeignCheckpointError" and err["message"].startswith(words), err
            assert "\n" not in err["message"] and "Fix:" in err["message"], err
        assert "hyperacc never writes into it" in saved["message"]
        assert [r[f"save_{name}"] for r in records] == [saved, saved]          # every rank alike
        assert [r[f"load_{name}"] for r in records] == [loaded, loaded]
    assert "hyperacc.models.load_pretrained(" in records[0]["load_trainer"]["message"]     # it has config.json
    assert "accelerator.load_state(" in records[0]["load_accelerate"]["message"]


def test_load_states_fix_for_an_accelerate_checkpoint_works(one_process_launches):
    """The fix, as the message words it: accelerate's own loader, save_pretrained, load_pretrained (run
    right after accelerate's save_state, in its launch)."""
    fix = json.loads((one_process_launches[2] / "fix.json").read_text())
    assert fix["equal"] and fix["compared"] == fix["saved_keys"] and fix["tied"], fix


# ------------------------------------------------------------------------------------- 4. tied weights
def test_a_tied_weight_is_stored_once_and_resumes_bitwise(dist_run):
    from hyperacc.checkpoint import storage

    records = dist_run[3]
    record = records[0]
    keys = storage.read_dcp_metadata(record["new"]).state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.") and ("embed_tokens" in k or "lm_head" in k)]
    assert model_keys == ["model.model.embed_tokens.weight"], model_keys
    assert not [k for k in keys if "lm_head" in k]                              # optimizer state once too
    assert record["sentinel_tied"] == [{"lm_head.weight": "model.embed_tokens.weight"}]
    for r in records:
        assert r["tie_kept"] and r["restored_bitwise"] and r["resumed_losses_equal"] and r["resumed_end_bitwise"], r


def test_an_old_checkpoint_with_both_keys_still_loads(dist_run):
    work, _, _, records = dist_run
    from hyperacc.checkpoint import storage

    assert "model.lm_head.weight" in storage.read_dcp_metadata(str(work / "old_format")).state_dict_metadata
    for r in records:
        assert r["old_loaded_bitwise"] and r["old_tie_kept"], r
        # the same two keys with different values: a model without the tie saved it; refused, nothing loaded
        assert r["untied"]["type"] == "RuntimeError" and "tie_word_embeddings=False" in r["untied"]["message"], r
        assert r["untied"] == records[0]["untied"] and r["untied_untouched"], r


def test_a_tied_checkpoint_converts_to_what_transformers_loads(dist_run, tmp_path):
    """convert to-hf writes the weight once, and from_pretrained ties the head to it again."""
    from transformers import AutoModelForCausalLM
    import transformers
    from safetensors.torch import load_file

    from hyperacc.checkpoint import convert

    record = dist_run[3][0]
    config_dir = tmp_path / "config"
    transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             tie_word_embeddings=True).save_pretrained(config_dir)
    out = convert.to_hf(record["new"], str(tmp_path / "hf"), config_from=str(config_dir), progress=False)
    written = load_file(os.path.join(out, "model.safetensors"))
    assert "lm_head.weight" not in written and "model.embed_tokens.weight" in written
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight.detach(), written["model.embed_tokens.weight"])
