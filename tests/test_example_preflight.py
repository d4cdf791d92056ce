"""examples/train_qwen.py's preflight (issue 38): what a resume may change is checked from the checkpoint's
saved config before anything is built; flags that cannot run or would be ignored are refused; the defaults
fit a dense model; TRL's string prompt-completion records train; every row is checked; a config error is
one line, printed once, in the example's flag names.

Launches (the rest runs in this process): one 2-process training run of a dense Qwen3 on string
prompt-completion records that saves a checkpoint (`trained`); two 1-process resumes after the data file
changed in place (refused by the loader at load_state as one line; resumed with resume_mismatch=restart);
in the slow set, one 2-process resume with changed data (the config error: exit 2 from the worker, one
line, once).
"""
import hashlib
import json
import re

import pytest

from dist_utils import REPO, run_accelerate, run_python
from example_utils import config_error, load_example

SCRIPT = REPO / "examples" / "train_qwen.py"
CPU2 = REPO / "accelerate_configs" / "cpu_fsdp2_2proc.yaml"
STEPS = 2
RECORDS = [{"prompt": f"Question {i}: what does rank {i % 4} hold?",
            "completion": f" Shard {i % 4} of {4 + i % 3} slices, gathered before use."} for i in range(40)]


@pytest.fixture(scope="module")
def example():
    return load_example("train_qwen_preflight")


def _tree_digest(*roots, skip=()):
    """{path: sha256} of every file under ``roots`` (a file root: itself)."""
    out = {}
    for root in roots:
        for path in sorted([root] if root.is_file() else root.rglob("*")):
            if path.is_file() and path.name not in skip:
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, hyperacc_cache):
    """A dense Qwen3 (config only: random init) trained STEPS steps on string prompt-completion records
    with the example's defaults (no aux-loss flag, evaluation off), saving at the last step."""
    from transformers import Qwen3Config

    root = tmp_path_factory.mktemp("preflight")
    dense = root / "dense"
    Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16).save_pretrained(dense)
    data = root / "pc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    common = ["--logging.progress_bar=false", "--eval.eval_steps=0", f"--model.name_or_path={dense}",
              "--data.tokenizer=default", "--data.format=chat", f"--data.dataset={data}",
              f"--checkpoint.checkpoint_dir={root / 'ckpt'}", f"--training.max_steps={STEPS}"]
    proc = run_accelerate(SCRIPT, CPU2, [*common, "--checkpoint.save_ckpt=true", f"--checkpoint.save_steps={STEPS}",
                                         f"--logging.metrics_file={root / 'metrics.jsonl'}"],
                          env={"HYPERACC_CACHE": hyperacc_cache}, timeout=400)
    return {"root": root, "data": data, "ckpt": root / "ckpt", "common": common, "proc": proc,
            "env": {"HYPERACC_CACHE": hyperacc_cache}}


def _with(common, *flags):
    """``common`` with ``flags`` replacing those of the same name (a flag may be given once)."""
    names = {flag.split("=")[0] for flag in flags}
    return [flag for flag in common if flag.split("=")[0] not in names] + list(flags)


def _metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines() if '"loss"' in line]


def test_a_dense_model_trains_on_string_records_with_default_flags(trained):
    rows = _metrics(trained["root"] / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and "aux_loss" not in rows[0]          # dense: no aux loss
    assert (trained["ckpt"] / "global_step_2" / ".metadata").is_file()
    # the accelerate config names no block class: the dense model's own blocks are wrapped, no warning
    assert "No module of class" not in trained["proc"].stderr, trained["proc"].stderr[-3000:]


# ------------------------------------------------------------------- resume refusals, before anything is built
@pytest.mark.parametrize("change, needle", [
    (["--data.seq_len=64"], "data.seq_len: 128 -> 64"),
    (["--training.global_batch_size=4"], "training.global_batch_size: 8 -> 4"),
    (["--data.dataset=OTHER"], "data.dataset:"),
    (["--data.format=text", "--data.dataset=OTHER_TEXT"], "data.format: 'chat' -> 'text'"),
    (["--model.overrides.hidden_size=32"], "hidden_size: 64 -> 32"),
    (["--training.max_steps=5"], "schedule length"),
    (["--peft.method=lora"], "peft.method: 'none' -> 'lora'"),
])
def test_resume_refusals_are_preflight_config_errors(example, trained, tmp_path, change, needle):
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[::-1]))
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": r["prompt"]}) + "\n" for r in RECORDS))
    change = [c.replace("OTHER_TEXT", str(text)).replace("OTHER", str(other)) for c in change]
    before = _tree_digest(trained["ckpt"], trained["data"])
    message = config_error(example, _with(trained["common"], "--checkpoint.save_ckpt=true",
                                          "--checkpoint.restore_from=LATEST", *change), preflight=True)
    assert needle in message, message
    if "data" in needle or "global_batch" in needle:
        assert "--data.resume_mismatch=restart" in message
    assert _tree_digest(trained["ckpt"], trained["data"]) == before


def test_restart_lets_changed_data_through_preflight(example, trained):
    cfg, world = example.load_config(_with(trained["common"], "--checkpoint.restore_from=LATEST", "--data.seq_len=64",
                                           "--data.resume_mismatch=restart"))
    example.preflight(cfg, world)      # the loader restarts the data; the schedule and model are unchanged


# Slow set: the refusal itself is checked in this process above (test_resume_refusals_are_preflight_config_errors,
# data.seq_len among them), and the exit path under accelerate launch (exit 2 from the worker, one line, no
# traceback) by default in tests/test_flag_fuzz.py::test_the_config_yaml_refusal_exits_2_once_under_accelerate.
@pytest.mark.slow
def test_changed_data_resume_exits_2_once_under_accelerate(trained):
    before = _tree_digest(trained["ckpt"], trained["data"])
    proc = run_accelerate(SCRIPT, CPU2, [*trained["common"], "--checkpoint.save_ckpt=true",
                                         "--checkpoint.restore_from=LATEST", "--data.seq_len=64"],
                          env=trained["env"], timeout=300, check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "config error" in line]
    assert len(lines) == 1 and lines[0].startswith("config error: resuming"), proc.stderr[-4000:]
    assert "data.seq_len: 128 -> 64" in lines[0] and "--data.resume_mismatch=restart" in lines[0]
    # the worker's own exit code (torchrun's report), and no worker traceback (the launcher's own is torchrun's)
    assert re.search(r"rank\s+: 0 .*\n\s+exitcode\s+: 2 ", proc.stderr), proc.stderr[-3000:]
    worker_part = proc.stderr.split("ChildFailedError")[0]
    assert "train_qwen.py\", line" not in worker_part and "/hyperacc/" not in worker_part, worker_part[-3000:]
    assert _tree_digest(trained["ckpt"], trained["data"]) == before


# ------------------------------------------------------------------- what preflight cannot see: a file changed in place
@pytest.fixture(scope="module")
def changed_in_place(trained):
    """The same data path, one record more (its datasets fingerprint and length change; the config does not)."""
    with open(trained["data"], "a") as handle:
        handle.write(json.dumps({"prompt": "One more?", "completion": " Yes."}) + "\n")
    return trained


def test_data_changed_in_place_is_one_line_from_the_loader(changed_in_place):
    t = changed_in_place
    before = _tree_digest(t["ckpt"])
    proc = run_python(SCRIPT, [*t["common"], "--checkpoint.restore_from=LATEST"], env=t["env"], timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(lines) == 1 and "cannot resume the data loader exactly" in lines[0], proc.stderr[-3000:]
    assert "--data.resume_mismatch=restart" in lines[0] and "MicroBatchDataLoader" not in lines[0]
    assert "Traceback" not in proc.stderr
    assert _tree_digest(t["ckpt"]) == before


def test_restart_resumes_the_weights_and_restarts_the_data(changed_in_place, tmp_path):
    t = changed_in_place
    before = _tree_digest(t["ckpt"])
    metrics = tmp_path / "m.jsonl"
    proc = run_python(SCRIPT, _with(t["common"], "--checkpoint.restore_from=LATEST", "--data.resume_mismatch=restart",
                                    f"--training.max_steps={STEPS + 2}", f"--lr_scheduler.total_steps={STEPS}",
                                    f"--logging.metrics_file={metrics}"), env=t["env"], timeout=300)
    assert f"resumed at step {STEPS}" in proc.stdout                    # model, optimizer, progress restored
    assert "restarting epoch 0 at step 0" in proc.stderr, proc.stderr[-3000:]   # the data position restarted
    rows = _metrics(metrics)
    assert [r["step"] for r in rows] == [STEPS + 1, STEPS + 2]
    assert rows[0]["consumed_samples"] == (STEPS + 1) * 8                # progress continues from the checkpoint
    assert _tree_digest(t["ckpt"]) == before                            # save_ckpt=false: nothing written


# ------------------------------------------------------------------- flags that cannot run or would be ignored
def test_attention_and_experts_names_are_checked(example):
    message = config_error(example, ["--model.attn_implementation=packed_spda"], preflight=True)
    assert "Did you mean 'packed_sdpa'" in message and "sdpa" in message
    message = config_error(example, ["--model.experts_implementation=grouped_m"], preflight=True)
    assert "Did you mean 'grouped_mm'" in message
    for name in ("packed_sdpa", "sdpa", "eager"):
        cfg, world = example.load_config([f"--model.attn_implementation={name}"])
        example.preflight(cfg, world)


@pytest.mark.parametrize("args, needle", [
    (["--fsdp.compile_backend=aot_eager"], "--fsdp.compile=true"),
    (["--fsdp.compile_mode=max-autotune"], "fsdp.compile=false"),
    (["--checkpoint.save_steps=5"], "--checkpoint.save_ckpt=true"),          # the tiny YAML saves nothing
    (["--checkpoint.keep_last_n=2"], "--checkpoint.save_ckpt=true"),
    (["--checkpoint.restore_optimizer=false"], "--checkpoint.restore_from=LATEST"),
    (["--eval.eval_steps=0", "--eval.eval_batches=2"], "eval.eval_steps=0"),
    (["--lr_scheduler.decay=constant", "--lr_scheduler.min_lr_ratio=0.5"], "lr_scheduler.decay=constant"),
    (["--data.messages_column=conversation"], "--data.format=chat"),
])
def test_options_of_a_switch_that_is_off_are_refused(example, args, needle):
    message = config_error(example, args)
    assert needle in message and "ignored" in message, message


def test_a_flag_may_switch_off_what_the_yaml_configures(example, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("fsdp:\n  compile: true\n  compile_backend: aot_eager\neval:\n  eval_steps: 5\n  eval_batches: 2\n")
    cfg, _ = example.load_config([str(config), "--fsdp.compile=false", "--eval.eval_steps=0"])
    assert cfg.fsdp.compile is False and cfg.eval.eval_steps == 0
    # both on the command line: the option is refused (the switch is not turned off after it)
    assert "fsdp.compile" in config_error(example, ["--fsdp.compile_backend=aot_eager", "--fsdp.compile=false"])


def test_router_aux_default_adapts_and_an_explicit_mode_on_a_dense_model_is_refused(example, trained):
    common = [f"--model.name_or_path={trained['root'] / 'dense'}", "--data.tokenizer=default"]
    cfg, world = example.load_config(common)
    assert cfg.model.router_aux_loss is None
    example.preflight(cfg, world)
    assert "is a dense model" in config_error(example, [*common, "--model.router_aux_loss=sequence"], preflight=True)


# ------------------------------------------------------------------- records
@pytest.fixture(scope="module")
def tokenizer(hyperacc_cache):
    from hyperacc.data.chat import prepare_chat_tokenizer
    from hyperacc.data.text import load_tokenizer

    return prepare_chat_tokenizer(load_tokenizer("default"), "chatml")


def test_string_prompt_completion_labels_equal_trls(tokenizer, tmp_path):
    """TRL's own SFTTrainer dataset preparation (completion_only_loss) of the same string records."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hyperacc.data.chat import IGNORE_INDEX, render_record

    records = RECORDS[:3] + [{"prompt": "Ends with EOS:", "completion": " done" + tokenizer.eos_token}]
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    args = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], packing=False, max_length=None,
                         bf16=False, dataset_num_proc=None, completion_only_loss=True)
    prepared = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(records),
                              processing_class=tokenizer).train_dataset
    ours = [render_record(tokenizer, r) for r in records]
    assert [s["input_ids"] for s in ours] == [list(row["input_ids"]) for row in prepared]
    assert [s["labels"] for s in ours] == [list(row["labels"]) for row in prepared]
    trained_text = tokenizer.decode([t for t in ours[0]["labels"] if t != IGNORE_INDEX])
    assert "Shard 0" in trained_text and "Question" not in trained_text and ours[0]["labels"][-1] == tokenizer.eos_token_id


@pytest.mark.parametrize("record, needle", [
    ({"prompt": "q", "completion": [{"role": "assistant", "content": "a"}]}, "'prompt' is str and 'completion' list"),
    ({"messages": "just text"}, "'messages' holds str 'just text'"),
    ({"messages": ["hi"]}, "where a list of {'role': ..., 'content': ...} messages is expected"),
])
def test_other_record_forms_are_refused_naming_the_forms(tokenizer, record, needle):
    from hyperacc.data.chat import render_row

    with pytest.raises(ValueError) as info:
        render_row(tokenizer, record, where="record 7 of data.jsonl")
    assert needle in str(info.value) and "{'prompt': 'text', 'completion': 'text'}" in str(info.value)
    assert str(info.value).startswith("record 7 of data.jsonl")


def test_a_malformed_held_out_row_is_refused_with_evaluation_off(tokenizer, tmp_path):
    """The last rows are the held-out share of 'train' (no validation split): never trained on, and with
    evaluation off never read for it either -- checked all the same, chat and text."""
    from hyperacc.data.chat_dataset import build_chat_dataset
    from hyperacc.data.text import build_text_dataset

    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:-1]) + json.dumps({"prompt": "q", "completion": 3}) + "\n")
    with pytest.raises(ValueError, match=r"record 39 of .*chat.jsonl \(its held-out share\)"):
        build_chat_dataset(str(chat), tokenizer, seq_len=128)          # split 'train': row 39 is held out
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": r["prompt"]}) + "\n" for r in RECORDS[:-1]) + '{"text": 5}\n')
    with pytest.raises(ValueError, match="row 39 of text column 'text'"):
        build_text_dataset(str(text), tokenizer, 16)


# ------------------------------------------------------------------- the error printer
def test_library_names_become_the_example_flags():
    import sys
    sys.path.insert(0, str(REPO / "examples"))
    from exit_report import as_flags

    text = ("checkpoint_dir /c already holds checkpoints of another run. Fix: resume that run with "
            "CheckpointConfig.restore_from='LATEST' (load_state('LATEST')), or use another "
            "CheckpointConfig.checkpoint_dir. Or MicroBatchDataLoader.resume_mismatch='restart'; "
            "FSDPConfig.compile_backend=aot_eager, ParallelConfig.tp_size=1.")
    assert as_flags(text) == ("checkpoint_dir /c already holds checkpoints of another run. Fix: resume that run with "
                              "--checkpoint.restore_from=LATEST, or use another --checkpoint.checkpoint_dir. Or "
                              "--data.resume_mismatch=restart; --fsdp.compile_backend=aot_eager, --parallel.tp_size=1.")
    assert as_flags("Fix: resume that run (CheckpointConfig.restore_from='LATEST', or load_state('LATEST')).") == \
        "Fix: resume that run (--checkpoint.restore_from=LATEST)."
    # accelerate's own method is what it is; hyperacc's loader of weights is the example's model flag
    assert as_flags("accelerator.load_state('/x'), then hyperacc.models.load_pretrained(DIR).") == \
        "accelerator.load_state('/x'), then --model.name_or_path=DIR."
    assert as_flags("FSDPConfig.compile=True; CheckpointConfig.restore_from=None.") == \
        "--fsdp.compile=true; --checkpoint.restore_from=null."


def test_restore_from_a_file_or_another_tools_checkpoint_is_one_line(example, tmp_path):
    a_file = tmp_path / "trainer_state.json"
    a_file.write_text("{}")
    cfg, world = example.load_config([f"--checkpoint.restore_from={a_file}"])
    with pytest.raises(example.ConfigError, match="is a file, not a checkpoint: pass the global_step_<N> directory"):
        example.preflight(cfg, world)             # was a NotADirectoryError traceback
    accelerate_ckpt = tmp_path / "acc"
    accelerate_ckpt.mkdir()
    for name in ("model.safetensors", "optimizer.bin"):
        (accelerate_ckpt / name).write_bytes(b"")
    message = config_error(example, [f"--checkpoint.restore_from={accelerate_ckpt}"], preflight=True)
    assert "accelerate" in message and "--model.name_or_path=DIR" in message, message
