"""The example on a stream: ``--data.streaming=true`` under ``accelerate launch`` (2 processes, FSDP2).

One launch trains chat records streamed from a local JSONL (the hub stands in as a local file), packed,
saving at step 3; a second resumes that checkpoint and must log steps 4-6 bitwise as the first did. A
stream with a malformed record stops with one config-error line naming the record and the flag that skips
such rows (the launch in the slow set; the message's translation here). Preflight refusals in-process.
"""
import json

import pytest

from dist_utils import REPO, run_accelerate
from example_utils import config_error, load_example

SCRIPT = REPO / "examples" / "train_qwen.py"
CPU2 = REPO / "accelerate_configs" / "cpu_fsdp2_2proc.yaml"


def records(n):
    words = "shard gather reduce scatter rank mesh step token".split()
    out = []
    for i in range(n):
        q = " ".join(words[(i + k) % len(words)] for k in range(2 + i % 5))
        a = " ".join(words[(i * 3 + k) % len(words)] for k in range(3 + i % 7))
        out.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    return out


def metrics(path):
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r and "step" in r}


def common_flags(root, records_file):
    return ["--logging.progress_bar=false", "--eval.eval_steps=0", "--data.format=chat", "--data.packing=true",
            "--data.streaming=true", "--data.stream_window=16", "--data.seq_len=64", "--training.max_steps=6",
            "--training.global_batch_size=4", "--training.micro_batch_size=1", "--logging.logging_steps=1",
            f"--data.dataset={records_file}"]


@pytest.fixture(scope="module")
def first(tmp_path_factory, hyperacc_cache):
    """One launch: 6 steps on the streamed chat records, packed, saving at step 3 (and 6)."""
    root = tmp_path_factory.mktemp("stream_example")
    data = root / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records(40)))
    common, env = common_flags(root, data), {"HYPERACC_CACHE": hyperacc_cache}
    proc = run_accelerate(SCRIPT, CPU2, [*common, "--checkpoint.save_ckpt=true", "--checkpoint.save_steps=3",
                                         f"--checkpoint.checkpoint_dir={root / 'ckpt'}",
                                         f"--logging.metrics_file={root / 'first.jsonl'}"], env=env, timeout=400)
    return {"root": root, "common": common, "env": env, "proc": proc}


def test_a_streamed_chat_run_trains_and_saves_the_stream_position(first):
    """The example on a stream under accelerate launch: 6 steps, and its checkpoint's loader state is the
    stream's (StreamingDataLoader's position, not a map-style step)."""
    import torch

    assert sorted(metrics(first["root"] / "first.jsonl")) == [1, 2, 3, 4, 5, 6]
    for rank in (0, 1):
        extra = torch.load(first["root"] / "ckpt" / "global_step_3" / "extra_state" / f"extra_state_rank_{rank}.pt",
                           weights_only=False)
        loader = extra["loader"]
        assert loader["kind"] == "stream" and loader["global_batch_size"] == 4, loader
        assert loader["position"]["records_before"] + loader["position"]["record"] > 0, loader


@pytest.mark.slow
def test_a_streamed_chat_run_resumes_bitwise_under_accelerate(first):
    """Resumed from step 3 under accelerate launch: steps 4-6 bitwise (the default run keeps
    tests/test_streaming.py::test_killed_after_a_save_resumes_bitwise for the library, on 2 processes)."""
    root = first["root"]
    restore = f"--checkpoint.restore_from={root / 'ckpt' / 'global_step_3'}"
    resumed = run_accelerate(SCRIPT, CPU2, [*first["common"], restore,
                                            f"--logging.metrics_file={root / 'resumed.jsonl'}"], env=first["env"],
                             timeout=400)
    got, want = metrics(root / "resumed.jsonl"), metrics(root / "first.jsonl")
    assert sorted(got) == [4, 5, 6]
    assert got == {step: want[step] for step in (4, 5, 6)}
    assert "resumed at step 3" in resumed.stdout


def test_the_bad_row_error_reads_in_flags():
    """The library's StreamRowError as the example prints it (the launch: the slow test below)."""
    import sys
    sys.path.insert(0, str(REPO / "examples"))
    from exit_report import as_flags

    text = ("record 9 of epoch 0 of the stream ({'messages': 'not a list'}) cannot be made into samples: ValueError: "
            "... Fix: correct or remove the row, or pass bad_rows='skip' to skip and count such rows")
    assert as_flags(text).endswith("or pass --data.bad_rows=skip to skip and count such rows")
    assert as_flags("StreamingDataLoader.resume_mismatch='restart', StreamingDataLoader.window=8") == \
        "--data.resume_mismatch=restart, --data.stream_window=8"


@pytest.mark.slow
def test_a_bad_row_is_one_line_naming_its_place_and_the_flag(tmp_path, hyperacc_cache):
    """Under accelerate launch (the default run keeps test_the_bad_row_error_reads_in_flags and
    tests/test_streaming.py::test_bad_rows_named_or_skipped)."""
    rows = records(40)
    rows[9] = {"messages": "not a list"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_accelerate(SCRIPT, CPU2, common_flags(tmp_path, bad), env={"HYPERACC_CACHE": hyperacc_cache},
                          timeout=400, check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "config error" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "record 9 of epoch 0 of the stream" in lines[0] and "--data.bad_rows=skip" in lines[0], lines[0]
    worker_part = proc.stderr.split("ChildFailedError")[0]      # the launcher's own traceback is torchrun's
    assert "train_qwen.py\", line" not in worker_part and "/hyperacc/" not in worker_part, worker_part[-3000:]


@pytest.fixture(scope="module")
def example():
    return load_example("train_qwen_streaming")


def test_preflight_refusals(example, tmp_path):
    (tmp_path / "tokens.bin").write_bytes(b"")
    (tmp_path / "tokens.idx").write_bytes(b"")
    message = config_error(example, ["--data.streaming=true", f"--data.dataset={tmp_path / 'tokens'}"], preflight=True)
    assert "Megatron prefix" in message and "--data.streaming=false" in message
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "a b c"}) + "\n")
    message = config_error(example, ["--data.streaming=true", f"--data.dataset={tmp_path / 'd.jsonl'}",
                                     "--eval.eval_steps=5"], preflight=True)
    assert "no held-out tail" in message and "--data.eval_split=" in message
    message = config_error(example, ["--data.bad_rows=skip"])
    assert "data.streaming" in message
    message = config_error(example, ["--data.streaming=true", "--data.stream_window=0"])
    assert "--data.stream_window=1024" in message
