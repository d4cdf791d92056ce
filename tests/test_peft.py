"""PEFT (LoRA) under FSDP2 on real processes (torchrun, gloo) with real `peft`: dtypes of frozen and
trainable tensors, the first loss equal to the base model's, 1 vs 2 processes, adapters-only
checkpoints (SIGKILL and resume bitwise; 2 -> 1 processes), exports loaded back by PEFT and
transformers in this (fresh) process, and the refusals. The one-process unit tests are in
tests/test_peft_units.py.

Launches (tests/scripts/peft_run.py), module-scoped and shared by the tests:
  checks  2 procs  several Accelerators in one launch: dtypes (dense and MoE, fp32_master and
                   bf16_sr, bf16 bases on the meta device), one step, refusals, cross-loading,
                   HSDP vs FSDP, pretrained bases with tied embeddings
  A       2 procs  pretrained fp32 base (save_pretrained here), LoRA on every projection +
                   modules_to_save=['lm_head'], 10 steps, checkpoints at steps 5 and 10 (with
                   save_consolidated='every'), every export; in the same launch as the checks
The default run makes that one launch; the slow set (HYPERACC_SLOW_TESTS=1) adds:
  B       1 proc   the same as A (no checkpoint, no export)
  K / R   2 procs  A until step 5, SIGKILLed after its save / resumed from LATEST to step 10
                   (R: in A's launch, after A; K before it)
  C (K's checkpoint resumed on 1 process), the meta-device path on 1 and 2 processes, a bf16
pretrained base under bf16 compute (merged export vs PEFT's merge), a refused tp_size=2 launch end to end.
"""
import json
import math
import time

import pytest
import torch

pytest.importorskip("peft")

from conftest import SLOW  # noqa: E402
from dist_utils import REPO, max_rel, run_python, run_together, run_torchrun  # noqa: E402

SCRIPT = REPO / "tests" / "scripts" / "peft_run.py"
STEPS, SAVE_AT = 10, 5
CASES = ["dense_fp32_master", "dense_bf16_sr", "moe_fp32_master", "moe_bf16_sr"]


def _script():
    import sys

    sys.path.insert(0, str(REPO / "tests" / "scripts"))
    import peft_run

    return peft_run


def _record(path):
    return json.loads(path.read_text())


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def _launch(nproc, args, check=True):
    if nproc == 1:
        return run_python(SCRIPT, args, timeout=300, check=check)
    return run_torchrun(SCRIPT, nproc, args, timeout=300, check=check)


def _save_base(directory, dtype):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_script().dense_config(), dtype=dtype, attn_implementation="eager")
    model.save_pretrained(directory)
    return directory


def _load_base(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), attn_implementation="eager").eval()


@torch.no_grad()
def _logits(model):
    return model(input_ids=_script().first_step_batch(256)["input_ids"]).logits.float()


# ----------------------------------------------------------------------------- launches
@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("peft")


@pytest.fixture(scope="module")
def base_dir(tmp):
    return _save_base(tmp / "base_fp32", torch.float32)


def _train_args(out, base, *more):
    return ["train", out, "--base", base, "--modules-to-save", "--steps", STEPS, *more]


@pytest.fixture(scope="module")
def run_a(tmp, base_dir, request):
    """One launch (start-up is most of a launch): the checks (their own Accelerators), then run A; with the
    slow set, then run R (--then): K's checkpoint resumed from LATEST to step 10."""
    then = []
    if SLOW:
        request.getfixturevalue("killed")
        then = ["--then", *_train_args(tmp / "r.json", base_dir, "--ckpt", tmp / "ck_k", "--save-steps", SAVE_AT,
                                       "--restore", "LATEST")]
    (tmp / "checks").mkdir()
    _launch(2, [*_train_args(tmp / "a.json", base_dir, "--ckpt", tmp / "ck_a", "--save-steps", SAVE_AT,
                             "--export", tmp / "exports", "--consolidated", "--checks", "--tmp", tmp / "checks"),
                *then])
    return _record(tmp / "a.json"), torch.load(tmp / "a.json.pt")


@pytest.fixture(scope="module")
def checks(tmp, run_a):
    return tmp / "checks", _record(tmp / "checks" / "checks.json")


@pytest.fixture(scope="module")
def killed_and_b(tmp, base_dir):
    """K beside B (run_together: independent runs, K killed at a step, not a time)."""
    return run_together(
        lambda: _launch(2, _train_args(tmp / "k.json", base_dir, "--ckpt", tmp / "ck_k", "--save-steps", SAVE_AT,
                                       "--kill-after", SAVE_AT), check=False),
        lambda: _launch(1, _train_args(tmp / "b.json", base_dir)))


@pytest.fixture(scope="module")
def run_b(tmp, killed_and_b):
    return _record(tmp / "b.json"), torch.load(tmp / "b.json.pt")


@pytest.fixture(scope="module")
def killed(tmp, killed_and_b):
    return killed_and_b[0], _record(tmp / "k.json")


@pytest.fixture(scope="module")
def resumed(tmp, run_a):
    """R: made in run A's launch (slow set only)."""
    assert SLOW, "R runs in run A's launch with HYPERACC_SLOW_TESTS=1 only"
    return _record(tmp / "r.json"), torch.load(tmp / "r.json.pt")


# ----------------------------------------------------------------------------- dtypes, gradients, state
@pytest.mark.parametrize("case", CASES)
def test_frozen_base_keeps_its_dtype_gets_no_grad_and_no_optimizer_state(checks, case):
    _, record = checks
    run = record[case]
    trainable = "float32" if case.endswith("fp32_master") else "bfloat16"
    assert run["dtypes"]["frozen"] == ["bfloat16"]              # a bf16 base stays bf16, even under fp32_master
    assert run["dtypes"]["trainable"] == [trainable]
    assert run["dtypes"]["n_trainable"] > 0 and run["dtypes"]["n_frozen"] > 0
    assert run["grads"]["frozen_with_grad"] == []               # after backward, before the step
    assert run["grads"]["trainable_without_grad"] == []
    assert run["grads"]["grad_dtypes"] == [trainable]
    # the optimizer was given model.parameters(), frozen ones included: state for the adapters only
    assert run["state"]["frozen_with_state"] == []
    assert len(run["state"]["with_state"]) == run["dtypes"]["n_trainable"]
    assert all(".lora_A." in n or ".lora_B." in n for n in run["state"]["with_state"])
    assert run["state"]["state_dtypes"] == [trainable]
    with_adapters, base = run["probe_after"]
    assert base == run["probe"][1]                               # the frozen base did not move
    assert with_adapters < base                                  # the adapters did (and learned)


@pytest.mark.parametrize("case", CASES)
def test_meta_device_adapters_start_at_peft_init_so_the_first_loss_is_the_base_models(checks, case):
    _, record = checks
    run = record[case]
    assert run["lora_B_max"] == 0.0 and run["lora_A_max"] > 0.0     # PEFT's init, not _init_weights'
    with_adapters, base = run["probe"]
    assert with_adapters == base                                  # bitwise: B = 0 adds exact zeros
    assert abs(run["step_loss"] - base) <= 1e-6 * base            # step 1 (2 ranks, token-weighted) = base loss


def test_pretrained_base_first_loss_is_the_base_models(run_a, base_dir, request):
    """The base read from the files into each rank's shards under PEFT's names is the base itself:
    step 1 with the adapters equals the plain base model's loss computed here (run A; with the slow set,
    the 1-process run B too)."""
    batch = _script().first_step_batch(256)
    with torch.no_grad():
        reference = _load_base(base_dir)(**batch).loss.item()
    for record, _ in [run_a] + ([request.getfixturevalue("run_b")] if SLOW else []):
        assert record["dtypes"]["frozen"] == record["dtypes"]["trainable"] == ["float32"]
        assert record["probe"][0] == record["probe"][1]
        assert abs(record["probe"][1] - reference) <= 1e-6 * reference
        assert abs(record["steps"]["1"] - reference) <= 1e-6 * reference
    assert run_a[0]["grads"]["frozen_with_grad"] == [] and run_a[0]["grads"]["trainable_without_grad"] == []
    assert run_a[0]["state"]["frozen_with_state"] == []


# ----------------------------------------------------------------------------- world sizes, checkpoints
# By default: test_hsdp_replicas_agree_and_train_as_fsdp (LoRA's losses on two layouts agree) and
# tests/test_trainer.py::test_one_and_two_processes_and_ga_2_vs_4_agree (1 vs 2 processes).
@pytest.mark.slow
def test_one_and_two_processes_agree(run_a, run_b):
    (a, a_pt), (b, b_pt) = run_a, run_b
    assert a["world"] == 2 and b["world"] == 1
    assert sorted(map(int, a["steps"])) == sorted(map(int, b["steps"])) == list(range(1, STEPS + 1))
    series_a = [a["steps"][str(s)] for s in range(1, STEPS + 1)]
    series_b = [b["steps"][str(s)] for s in range(1, STEPS + 1)]
    assert max_rel(series_a, series_b) <= 1e-5, (series_a, series_b)
    assert series_a[-1] < series_a[0] - 0.05                     # it trained
    # adapters seeded by layer name: the same initial values at every world size
    assert a_pt["initial"].keys() == b_pt["initial"].keys()
    assert all(torch.equal(a_pt["initial"][k], b_pt["initial"][k]) for k in a_pt["initial"])
    assert any(".modules_to_save.default." in k for k in a_pt["initial"])


def test_adapters_only_checkpoint_holds_no_base_tensor(tmp, run_a, checks):
    """is_peft is left unset: a PeftModel is detected and only trainable tensors (adapters, the
    modules_to_save copy, their AdamW state) are saved."""
    from torch.distributed.checkpoint import FileSystemReader

    lora_only = set(checks[1]["dense_fp32_master"]["state"]["with_state"])      # its trainable tensors
    for path, names in ((tmp / "ck_a" / f"global_step_{SAVE_AT}", set(run_a[1]["final"])),
                        (checks[0] / "ck_peft" / "global_step_1", lora_only)):
        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        model_keys = {k[len("model."):] for k in keys if k.startswith("model.")}
        assert model_keys == names, sorted(model_keys ^ names)[:5]
        assert not any(".base_layer." in k or ".original_module." in k for k in keys)
        state = {k.split(".state.", 1)[1].rsplit(".", 1)[0] for k in keys if k.startswith("optimizer.state.")}
        assert state == names
        assert json.loads((path / "hyperacc_checkpoint.json").read_text())["peft"] is True


# By default: test_adapters_only_checkpoint_holds_no_base_tensor and test_load_state_after_an_evaluation_forward
# (adapters-only checkpoints saved and loaded) and tests/test_trainer.py::test_killed_after_mid_epoch_save_resumes_bitwise
# (a kill after a save, resumed bitwise).
@pytest.mark.slow
def test_sigkill_after_a_save_then_resume_from_latest_is_bitwise(run_a, killed, resumed):
    (a, a_pt), (proc, k), (r, r_pt) = run_a, killed, resumed
    assert proc.returncode != 0 and "SIGKILL" in proc.stderr        # killed right after step 5's save
    assert {s: k["steps"][s] for s in map(str, range(1, SAVE_AT + 1))} == \
        {s: a["steps"][s] for s in map(str, range(1, SAVE_AT + 1))}
    assert r["restored"].endswith(f"global_step_{SAVE_AT}") and r["start"] == SAVE_AT
    assert r["steps"] == {s: a["steps"][s] for s in map(str, range(SAVE_AT + 1, STEPS + 1))}   # bitwise
    assert r_pt["final"].keys() == a_pt["final"].keys()
    assert all(torch.equal(r_pt["final"][n], a_pt["final"][n]) for n in a_pt["final"])
    assert torch.equal(r_pt["logits"], a_pt["logits"])
    assert not all(torch.equal(a_pt["initial"][n], a_pt["final"][n]) for n in a_pt["final"])


# ----------------------------------------------------------------------------- exports
def test_adapter_export_loads_with_peft_in_a_fresh_process(tmp, run_a, base_dir):
    from peft import PeftModel

    _, a_pt = run_a
    model = PeftModel.from_pretrained(_load_base(base_dir), str(tmp / "exports" / "adapter")).eval()
    loaded = dict(model.named_parameters())
    assert all(torch.equal(loaded[n], a_pt["final"][n]) for n in a_pt["final"])    # every trained tensor, exactly
    logits = _logits(model)
    assert (logits - a_pt["logits"]).abs().max().item() <= 1e-5
    assert not torch.allclose(_logits(_load_base(base_dir)), a_pt["logits"], atol=1e-3)    # the adapters matter
    saved = _tensors(tmp / "exports" / "adapter" / "adapter_model.safetensors")
    assert any("lm_head" in k for k in saved) and not any("base_layer" in k for k in saved)


def test_merged_export_loads_with_transformers_and_equals_peft_merge(tmp, run_a, base_dir):
    from peft import PeftModel

    _, a_pt = run_a
    merged_dir = tmp / "exports" / "merged"
    assert not (merged_dir / "adapter_config.json").exists()
    merged = _load_base(merged_dir)
    assert (_logits(merged) - a_pt["logits"]).abs().max().item() <= 1e-5
    reference = PeftModel.from_pretrained(_load_base(base_dir), str(tmp / "exports" / "adapter")).merge_and_unload()
    ours, theirs = merged.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)                  # W + delta, as PEFT merges
    base = _load_base(base_dir).state_dict()
    assert not torch.equal(ours["lm_head.weight"], base["lm_head.weight"])        # the trained copy
    assert not torch.equal(ours["model.layers.0.mlp.down_proj.weight"], base["model.layers.0.mlp.down_proj.weight"])


def _same_adapter_files(first, second):
    a, b = _tensors(first / "adapter_model.safetensors"), _tensors(second / "adapter_model.safetensors")
    assert a and a.keys() == b.keys(), sorted(set(a) ^ set(b))
    assert all(torch.equal(a[k], b[k]) for k in a)
    config_a, config_b = (json.loads((d / "adapter_config.json").read_text()) for d in (first, second))
    assert config_a["r"] == config_b["r"] and set(config_a["target_modules"]) == set(config_b["target_modules"])


def test_save_model_and_accelerates_save_pattern_write_the_exported_adapter(tmp, run_a, checks):
    exports = tmp / "exports"
    _same_adapter_files(exports / "adapter", exports / "save_model")
    _same_adapter_files(exports / "adapter", tmp / "ck_a" / f"global_step_{STEPS}" / "hf")    # save_consolidated
    _same_adapter_files(exports / "adapter", exports / "accelerate")      # as rank 0 wrote it
    lora_only = checks[0] / "exports"                                    # LoRA without modules_to_save
    _same_adapter_files(lora_only / "adapter", lora_only / "save_model")
    _same_adapter_files(lora_only / "adapter", lora_only / "accelerate")
    assert checks[1]["dense_fp32_master"]["accelerate_errors"] == [None, None]
    trained = torch.load(lora_only / "adapters.pt")
    saved = _tensors(lora_only / "adapter" / "adapter_model.safetensors")
    assert len(saved) == len(trained)
    assert all(torch.equal(saved[n.replace(".default.", ".")], t) for n, t in trained.items())


def test_accelerates_save_pattern_with_modules_to_save_runs_on_every_rank(run_a):
    assert run_a[0]["accelerate_errors"] == [None, None]


# ----------------------------------------------------------------------------- refusals
def test_refusals_are_one_line_and_leave_no_rank_behind(checks):
    _, record = checks
    assert record["world"] == 2          # written after a collective every rank reached after the refusals
    for key, size in (("tp", "tp_size=2"), ("ep", "ep_size=2")):
        err = record[key]
        assert err["type"] == "NotImplementedError" and "\n" not in err["message"]
        assert f"PEFT adapters with {size} are not supported" in err["message"] and "Fix:" in err["message"]
        assert "prepare_model" in err["where"] and err["seconds"] < 5
    for init in ("pissa", "olora"):
        err = record[init]
        assert err["type"] == "ValueError"
        assert f"init_lora_weights='{init}'" in err["message"] and "meta device" in err["message"]
    for key, hint in (("peft_ckpt_into_plain", "holds the trainable tensors of a PEFT run only"),
                      ("plain_ckpt_into_peft", "holds a full model, not adapters")):
        err = record[key]
        assert err["type"] == "RuntimeError" and "missing model key" in err["message"] and hint in err["message"]
    err = record["peft_ckpt_onto_another_base"]                  # same config, another seed: another base
    assert err["type"] == "RuntimeError" and "adapters trained on another base model" in err["message"]


def test_hsdp_replicas_agree_and_train_as_fsdp(checks):
    """dp_replicate_size=2 on 2 processes: both ranks hold whole, identical adapters, and the losses
    are FSDP's (3 steps of LoRA + a modules_to_save copy on a meta-device fp32 base)."""
    _, record = checks
    assert record["hsdp"]["ranks_alike"] is True
    assert record["fsdp"]["ranks_alike"] is False               # FSDP: each rank its own shard
    assert max_rel(record["hsdp"]["losses"], record["fsdp"]["losses"]) <= 1e-6
    assert record["fsdp"]["losses"][-1] < record["fsdp"]["losses"][0]


@pytest.mark.parametrize("case", ["tied", "tied_embed_tokens"])
def test_tied_embeddings_pretrained_base(checks, case):
    """A base whose files hold no lm_head.weight (tie_word_embeddings, as Qwen3-0.6B): loaded
    sharded under PEFT, step 1 is the plain base model's loss, and the adapters train."""
    _, record = checks
    assert record[case]["error"] is None, record[case]["error"]
    run = record[case]["result"]
    assert run["probe"][0] == run["probe"][1]
    assert abs(run["probe"][1] - run["reference"]) <= 1e-6 * run["reference"]
    assert abs(run["step_loss"] - run["reference"]) <= 1e-6 * run["reference"]
    assert run["grads"]["frozen_with_grad"] == [] and run["grads"]["trainable_without_grad"] == []
    assert run["probe_after"][1] == run["probe"][1] and run["probe_after"][0] < run["probe"][0]


def test_tied_embeddings_with_modules_to_save_lm_head(checks):
    assert checks[1]["tied_lm_head"]["error"] is None, checks[1]["tied_lm_head"]["error"]["message"]


def test_load_state_after_an_evaluation_forward(checks):
    assert checks[1]["load_after_evaluation"] is None


# ----------------------------------------------------------------------------- slow: more layouts
@pytest.mark.slow
def test_resume_two_processes_on_one(tmp, base_dir, run_a, killed):
    _launch(1, _train_args(tmp / "c.json", base_dir, "--ckpt", tmp / "ck_c", "--restore",
                           tmp / "ck_k" / f"global_step_{SAVE_AT}"))
    a, a_pt = run_a
    c, c_pt = _record(tmp / "c.json"), torch.load(tmp / "c.json.pt")
    assert c["world"] == 1 and c["start"] == SAVE_AT
    steps = [str(s) for s in range(SAVE_AT + 1, STEPS + 1)]
    assert sorted(c["steps"], key=int) == steps
    assert max_rel([a["steps"][s] for s in steps], [c["steps"][s] for s in steps]) <= 1e-6
    worst = max((a_pt["final"][n] - c_pt["final"][n]).abs().max().item() for n in a_pt["final"])
    assert worst <= 1e-6, worst


@pytest.mark.slow
def test_meta_device_base_on_one_and_two_processes(tmp):
    """The meta path: base initialised from the seed, adapters by PEFT's init seeded by layer name, an
    optimizer over the trainable parameters only; 10 steps on 1 and 2 processes agree."""
    runs = {}
    for nproc in (2, 1):
        out = tmp / f"meta{nproc}.json"
        _launch(nproc, ["train", out, "--steps", STEPS, "--trainable-only"])
        runs[nproc] = _record(out), torch.load(f"{out}.pt")
    (two, two_pt), (one, one_pt) = runs[2], runs[1]
    for record in (one, two):
        assert record["probe"][0] == record["probe"][1]
        assert abs(record["steps"]["1"] - record["probe"][1]) <= 1e-6 * record["probe"][1]
    assert two["probe"] == one["probe"]                           # the same base at both world sizes
    series = [[r["steps"][str(s)] for s in range(1, STEPS + 1)] for r in (two, one)]
    assert max_rel(*series) <= 1e-5 and series[0][-1] < series[0][0]
    assert all(torch.equal(two_pt["initial"][n], one_pt["initial"][n]) for n in two_pt["initial"])


@pytest.mark.slow
def test_bf16_pretrained_base_under_bf16_compute(tmp):
    """A bf16 base under fp32_master + mixed_precision='bf16' (the usual recipe): the base stays bf16,
    the adapters and their state fp32, step 1 is the base model's loss, and the merged export (adapter
    deltas folded into bf16 weights) equals PEFT's own merge_and_unload bit for bit."""
    from peft import PeftModel

    base = _save_base(tmp / "base_bf16", torch.bfloat16)
    out, exports = tmp / "bf16.json", tmp / "bf16_exports"
    _launch(2, ["train", out, "--base", base, "--dtype", "bf16", "--mixed-precision", "bf16", "--steps", 3,
                "--modules-to-save", "--export", exports])
    record = _record(out)
    assert record["dtypes"]["frozen"] == ["bfloat16"] and record["dtypes"]["trainable"] == ["float32"]
    assert record["state"]["frozen_with_state"] == [] and record["state"]["state_dtypes"] == ["float32"]
    assert record["grads"]["frozen_with_grad"] == [] and record["grads"]["grad_dtypes"] == ["float32"]
    assert record["probe"][0] == record["probe"][1]
    with torch.no_grad():
        reference = _load_base(base)(**_script().first_step_batch(256)).loss.item()
    assert abs(record["steps"]["1"] - reference) <= 2e-3 * reference
    assert all(math.isfinite(v) for v in record["steps"].values()) and record["steps"]["3"] < record["steps"]["1"]
    ours = _load_base(exports / "merged").state_dict()
    theirs = PeftModel.from_pretrained(_load_base(base), str(exports / "adapter")).merge_and_unload().state_dict()
    assert ours.keys() == theirs.keys() and all(v.dtype == torch.bfloat16 for v in ours.values())
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.slow
def test_tensor_parallel_peft_launch_fails_fast_in_one_line(tmp):
    started = time.perf_counter()
    proc = _launch(2, ["train", tmp / "tp.json", "--tp", 2, "--steps", 1], check=False)
    elapsed = time.perf_counter() - started
    assert proc.returncode != 0 and elapsed < 120
    lines = [line for line in proc.stderr.splitlines() if "NotImplementedError: PEFT adapters with tp_size=2" in line]
    assert len(lines) == 2, proc.stderr[-3000:]                  # one line per rank, both ranks refused
    assert "Traceback" in proc.stderr and not (tmp / "tp.json").exists()
