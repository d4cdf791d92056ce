"""Chat data end to end: `hyperacc.data.chat_dataset` from local files, and examples/train_qwen.py with
--data.format=chat on 2 real processes (accelerate launch, gloo, fp32, validate mode):
  - packing never changes what a step trains on: per-step losses packed vs padded within 1e-5 for an MoE
    model (eager, sequence-wise aux loss on, the embedded chat corpus) and, in the slow set, a dense model
    (packed_sdpa vs sdpa, on Megatron chat files from the converter); packed under TP 2 / EP 2 = padded
    under DP (slow set);
  - a chat run stopped after step 3 and resumed continues bitwise; resumed padded on ONE process it
    continues within 1e-5 (packing and the DP size are layout, not data) (both in the slow set);
  - bad input: one config error line naming the fix, before any process group.
"""
import json

import pytest

from conftest import SLOW
from dist_utils import REPO, max_rel, run_accelerate, run_together
from example_utils import config_error, load_example

SCRIPT = REPO / "examples" / "train_qwen.py"
CPU2 = REPO / "accelerate_configs" / "cpu_fsdp2_2proc.yaml"
STEPS, STOP = 6, 3
COMMON = ["--logging.progress_bar=false", "--data.format=chat", "--data.seq_len=192", "--training.mode=validate",
          "--training.global_batch_size=8", "--training.micro_batch_size=2", "--eval.eval_steps=0",
          f"--lr_scheduler.total_steps={STEPS}"]
RECORDS = [
    {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                  {"role": "assistant", "content": f"{2 * i}. " + "Adding a number to itself doubles it. " * (i % 5)}]}
    for i in range(40)] + [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a collective."},
                  {"role": "assistant", "content": "all-gather"}, {"role": "user", "content": "Another?"},
                  {"role": "assistant", "content": "reduce-scatter"}]},
    {"messages": [{"role": "user", "content": "Repeat after me: " + "all work and no play " * 20},
                  {"role": "assistant", "content": "No."}]}]


def _losses(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle if '"loss"' in line and "eval_loss" not in line]


def _launch(out, *args, num_processes=None, env=None):
    return run_accelerate(SCRIPT, CPU2, [*COMMON, f"--logging.metrics_file={out / 'metrics.jsonl'}", *args],
                          timeout=400, num_processes=num_processes, env=env)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    """A dense Qwen3 config directory (no weights: random init from the seed, the same in every run)."""
    from transformers import Qwen3Config

    path = tmp_path_factory.mktemp("dense")
    Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """packed to STEPS, saving at STOP; padded to STEPS; a new run restored from the packed run's step-STOP
    checkpoint, packed to STEPS (the run that was stopped there, continued)."""
    root = tmp_path_factory.mktemp("chat_moe")
    runs = {}

    def run(name, packing):
        (root / name).mkdir()
        # the step-STOP checkpoint feeds the slow set's resumed run only
        save = ["--checkpoint.save_ckpt=true", f"--checkpoint.checkpoint_dir={root / name / 'ckpt'}",
                f"--checkpoint.save_steps={STOP}"] if name == "packed" and SLOW else []
        _launch(root / name, f"--data.packing={packing}", f"--training.max_steps={STEPS}", *save)
        runs[name] = _losses(root / name / "metrics.jsonl")

    # side by side (run_together: independent, deterministic runs)
    run_together(lambda: run("packed", "true"), lambda: run("padded", "false"))
    return root, runs


@pytest.fixture(scope="module")
def moe_resumed(moe_runs):
    """A new run restored from the packed run's step-STOP checkpoint, packed to STEPS (slow set)."""
    root, runs = moe_runs
    stop = root / "stop"
    stop.mkdir()
    resumed = _launch(stop, "--data.packing=true", f"--training.max_steps={STEPS}", "--checkpoint.save_ckpt=false",
                      f"--checkpoint.restore_from={root / 'packed' / 'ckpt' / f'global_step_{STOP}'}")
    assert f"resumed at step {STOP}" in resumed.stdout
    return _losses(stop / "metrics.jsonl")


def test_packed_and_padded_steps_agree_moe(moe_runs):
    _, runs = moe_runs
    packed, padded = runs["packed"], runs["padded"]
    assert [r["step"] for r in packed] == list(range(1, STEPS + 1))
    assert max_rel([r["loss"] for r in packed], [r["loss"] for r in padded]) <= 1e-5
    assert max_rel([r["aux_loss"] for r in packed], [r["aux_loss"] for r in padded]) <= 1e-5
    assert max_rel([r["grad_norm"] for r in packed], [r["grad_norm"] for r in padded]) <= 1e-5
    # the same samples and trained tokens per step: packing is layout only
    assert [(r["samples"], r["tokens"]) for r in packed] == [(r["samples"], r["tokens"]) for r in padded]
    assert all(r["samples"] == 8 for r in packed)
    assert packed[-1]["loss"] < packed[0]["loss"]


# Slow set (a third launch): a resumed run of the example continuing bitwise is kept by default by
# tests/test_streaming.py::test_killed_after_a_save_resumes_bitwise[chat] (chat records, packed, killed after a
# save and resumed on 2 processes) and tests/test_example.py::test_resume_continues_exactly (the example).
@pytest.mark.slow
def test_resumed_chat_run_continues_bitwise(moe_runs, moe_resumed):
    _, runs = moe_runs
    resumed, packed = moe_resumed, runs["packed"]
    assert [r["step"] for r in resumed] == list(range(STOP + 1, STEPS + 1))
    for a, b in zip(resumed, packed[STOP:]):
        assert (a["step"], a["loss"], a["grad_norm"], a["aux_loss"]) == (b["step"], b["loss"], b["grad_norm"], b["aux_loss"])


@pytest.mark.skipif(not SLOW, reason="slow: set HYPERACC_SLOW_TESTS=1 (make test-all)")
def test_packed_checkpoint_resumes_padded_on_one_process(moe_runs, tmp_path):
    root, runs = moe_runs
    _launch(tmp_path, "--data.packing=false", f"--training.max_steps={STEPS}", "--checkpoint.save_ckpt=false",
            f"--checkpoint.restore_from={root / 'packed' / 'ckpt' / f'global_step_{STOP}'}", num_processes=1)
    after = _losses(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in after] == list(range(STOP + 1, STEPS + 1))
    assert max_rel([r["loss"] for r in after], [r["loss"] for r in runs["packed"][STOP:]]) <= 1e-5


@pytest.mark.skipif(not SLOW, reason="slow: set HYPERACC_SLOW_TESTS=1 (make test-all)")
@pytest.mark.parametrize("layout", ["--parallel.tp_size=2", "--parallel.ep_size=2"])
def test_packed_rows_under_tp_and_ep(moe_runs, layout, tmp_path):
    _, runs = moe_runs
    _launch(tmp_path, "--data.packing=true", f"--training.max_steps={STEPS}", layout)
    run = _losses(tmp_path / "metrics.jsonl")
    assert max_rel([r["loss"] for r in run], [r["loss"] for r in runs["padded"]]) <= 1e-5
    assert max_rel([r["grad_norm"] for r in run], [r["grad_norm"] for r in runs["padded"]]) <= 1e-5


# Slow set: the same guarantee as test_packed_and_padded_steps_agree_moe (packing never changes what a step trains
# on, end to end through the example on 2 processes), on a dense model with Megatron chat files; by default
# packed_sdpa == sdpa is proved in-process by tests/test_packing.py (forward and gradients, dense and MoE) and the
# converter's chat files by tests/test_megatron_chat.py.
@pytest.mark.slow
def test_packed_and_padded_steps_agree_dense(dense_dir, tmp_path, hyperacc_cache):
    """On Megatron chat files (ids + loss mask, written by the converter) and a dense model: padded with sdpa,
    packed with packed_sdpa (attention on each conversation's slice: hyperacc.models.packed_attention)."""
    from hyperacc.data.convert import convert

    records = tmp_path / "chat.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    convert(str(records), str(tmp_path / "sft"), format="chat", progress=False, log=None)
    losses = {}
    for packing, attn in (("true", "packed_sdpa"), ("false", "sdpa")):
        out = tmp_path / packing
        out.mkdir()
        _launch(out, f"--data.packing={packing}", f"--training.max_steps={STOP}", f"--model.name_or_path={dense_dir}",
                "--data.tokenizer=default", f"--model.attn_implementation={attn}", "--model.router_aux_loss=off",
                f"--data.dataset={tmp_path / 'sft'}", env={"HYPERACC_CACHE": hyperacc_cache})
        losses[packing] = _losses(out / "metrics.jsonl")
    assert len(losses["true"]) == STOP and "aux_loss" not in losses["true"][0]
    assert max_rel([r["loss"] for r in losses["true"]], [r["loss"] for r in losses["false"]]) <= 1e-5
    assert max_rel([r["grad_norm"] for r in losses["true"]], [r["grad_norm"] for r in losses["false"]]) <= 1e-5


# ------------------------------------------------------------------------------ the data source
@pytest.fixture(scope="module")
def chat_tokenizer(hyperacc_cache):
    from hyperacc.data.chat import prepare_chat_tokenizer
    from hyperacc.data.text import load_tokenizer

    return prepare_chat_tokenizer(load_tokenizer("default"), "chatml")


def test_local_jsonl_gives_the_rendered_samples(chat_tokenizer, tmp_path):
    from hyperacc.data.chat import fit_sample, render_record
    from hyperacc.data.chat_dataset import build_chat_dataset

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    seq_len = 40
    with pytest.warns(UserWarning, match="no assistant token within seq_len=40"):
        ds = build_chat_dataset(str(path), chat_tokenizer, seq_len=seq_len, holdout_fraction=0)
    expected = [fit_sample(**render_record(chat_tokenizer, r), seq_len=seq_len) for r in RECORDS]
    kept = [e for e in expected if e is not None]
    assert ds.skipped == len(expected) - len(kept) >= 1 and len(ds) == len(kept)
    assert [ds[i]["input_ids"].tolist() for i in range(len(ds))] == [e["input_ids"] for e in kept]
    assert [ds[i]["labels"].tolist() for i in range(len(ds))] == [e["labels"] for e in kept]
    assert max(len(e["input_ids"]) for e in kept) == seq_len          # some were cut
    train = build_chat_dataset(str(path), chat_tokenizer, seq_len=512)
    held = build_chat_dataset(str(path), chat_tokenizer, seq_len=512, split="validation")
    assert len(train) + len(held) == len(RECORDS) and len(held) >= 1
    assert train.fingerprint() != build_chat_dataset(str(path), chat_tokenizer, seq_len=511).fingerprint()


def test_records_without_the_column_are_named(chat_tokenizer, tmp_path):
    from hyperacc.data.chat_dataset import build_chat_dataset

    path = tmp_path / "conv.jsonl"
    path.write_text("".join(json.dumps({"conversation": r["messages"]}) + "\n" for r in RECORDS))
    with pytest.raises(ValueError, match="no 'messages' column .*messages_column=NAME"):
        build_chat_dataset(str(path), chat_tokenizer, seq_len=64)
    assert len(build_chat_dataset(str(path), chat_tokenizer, seq_len=64, messages_column="conversation")) > 0


def test_a_pretraining_megatron_prefix_is_not_chat(chat_tokenizer):
    from hyperacc.data.chat_dataset import build_chat_dataset
    from hyperacc.data.default_corpus import default_token_prefix

    with pytest.raises(ValueError, match="token ids only .*--format chat"):
        build_chat_dataset(default_token_prefix(), chat_tokenizer, seq_len=64)


# ------------------------------------------------------------------------------ bad configurations
@pytest.fixture(scope="module")
def example():
    return load_example("train_qwen_chat_checks")


def test_bad_chat_configs_are_one_line(example, tmp_path, hyperacc_cache, monkeypatch):
    assert "data.format=text" in config_error(example, ["--data.packing=true"])
    assert "data.format=text" in config_error(example, ["--data.chat_template=chatml"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = config_error(example, ["--data.format=chat", "--data.packing=true", "--parallel.cp_size=2"],
                           preflight=True)
    assert "does not split packed rows" in message and "--data.packing=false" in message
    monkeypatch.setenv("WORLD_SIZE", "1")
    missing = tmp_path / "nope.jinja"
    assert "neither a built-in template" in config_error(
        example, ["--data.format=chat", f"--data.chat_template={missing}"], preflight=True)
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert "generation" in config_error(example, ["--data.format=chat", f"--data.chat_template={plain}"],
                                        preflight=True)
    not_a_template = tmp_path / "notes.txt"
    not_a_template.write_text("hello")
    assert "no Jinja" in config_error(example, ["--data.format=chat", f"--data.chat_template={not_a_template}"],
                                      preflight=True)


def test_mixed_records_and_a_broken_row(chat_tokenizer, tmp_path):
    """A file mixing messages and prompt/completion records (datasets fills the missing columns with None);
    a record the template cannot render is named by its row."""
    from hyperacc.data.chat import render_record
    from hyperacc.data.chat_dataset import build_chat_dataset

    pc = {"prompt": [{"role": "user", "content": "Two plus two?"}], "completion": [{"role": "assistant", "content": "Four."}]}
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps(pc) + "\n")
    ds = build_chat_dataset(str(path), chat_tokenizer, seq_len=256, holdout_fraction=0)
    assert [ds[i]["labels"].tolist() for i in range(2)] == [render_record(chat_tokenizer, r)["labels"] for r in (RECORDS[0], pc)]
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps({"messages": [{"role": "user"},
                                                                                {"role": "assistant", "content": "c"}]}) + "\n")
    with pytest.raises(ValueError, match="record 1 of .*broken.jsonl.* cannot be rendered .*not a string"):   # no content
        build_chat_dataset(str(broken), chat_tokenizer, seq_len=256, holdout_fraction=0)
