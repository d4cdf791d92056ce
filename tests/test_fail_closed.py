"""Fail closed, on every rank: faults planted the way a user would, on real 2-process launches.

  * bad paths / optimizer / parallel sizes, a tokenizer that does not exist: found before the
    process group is used; rank 0 prints one `config error:` line, and rank 1's own output (torchrun
    --redirects, one file per rank) is quiet: no second copy, no traceback, no gloo "Connection closed"
    (examples/exit_report.py: every rank fails alike, rank 0 speaks for them);
  * a dataset that only rank 0 reads (after the process group exists) and cannot: the same;
  * a Megatron dataset whose token ids exceed the model's vocabulary: one clear error before the
    first forward, naming the max id and the vocab size;
  * SIGKILL of the launcher: the workers die with it and write nothing more;
  * a NaN loss in production mode: the job stops naming step and rank; LATEST stays at the last
    finite checkpoint.
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dist_utils import REPO, _env, free_port, run_accelerate

SCRIPT = REPO / "examples" / "train_qwen.py"
NAN_SCRIPT = REPO / "tests" / "scripts" / "train_qwen_nan.py"
CPU2 = REPO / "accelerate_configs" / "cpu_fsdp2_2proc.yaml"
QUIET = ["--logging.progress_bar=false", "--eval.eval_steps=0"]


def _torchrun_per_rank(args, tmp_path, timeout=240):
    """2 processes under torchrun, each rank's stderr in a file of its own; returns
    (returncode, {rank: stderr text})."""
    logs = tmp_path / "rank_logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", f"--log-dir={logs}", "--redirects=3", str(SCRIPT), *QUIET, *map(str, args)]
    proc = subprocess.run(cmd, env=_env(), cwd=str(REPO), capture_output=True, text=True, timeout=timeout)
    per_rank = {}
    for rank in (0, 1):
        found = sorted(logs.rglob(f"{rank}/stderr.log"))
        assert found, f"no stderr.log for rank {rank} under {logs}: {proc.stderr[-3000:]}"
        per_rank[rank] = found[-1].read_text()
    return proc.returncode, per_rank


def _one_error_line(text, prefix):
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, text[-4000:]
    _no_crash(text)
    return lines[0]


def _no_crash(text):
    for bad in ("Traceback", "Connection closed", "IndexError"):
        assert bad not in text, text[-4000:]


def _quiet(text, prefix):
    """Rank 1's output when rank 0 printed the error for both: no line of its own, no crash."""
    assert not [line for line in text.splitlines() if line.startswith(prefix)], text[-4000:]
    _no_crash(text)


def test_bad_paths_and_settings_one_line_on_every_rank(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    args = [f"--data.tokenizer={tmp_path / 'no_such_tokenizer'}",          # missing tokenizer
            f"--data.dataset={tmp_path / 'missing.jsonl'}",                # missing dataset
            f"--logging.metrics_file={tmp_path}",                           # a directory, not a file
            f"--logging.tensorboard_dir={a_file}",                          # a file, not a directory
            "--checkpoint.save_ckpt=true", f"--checkpoint.checkpoint_dir={a_file / 'ckpt'}",  # under a file
            "--optimizer.lr=-1",
            "--parallel.dp_shard_size=3"]                                   # 3 shards, 2 processes
    start = time.time()
    rc, per_rank = _torchrun_per_rank(args, tmp_path)
    assert rc != 0
    line0 = _one_error_line(per_rank[0], "config error:")
    _quiet(per_rank[1], "config error:")
    for needle in ("7 problems", "no_such_tokenizer", "missing.jsonl' not found", "--logging.metrics_file=",
                   "is a directory", "--logging.tensorboard_dir=", "exists and is not a directory",
                   f"'{a_file}' is a regular file", "Invalid learning rate: -1", "dp_shard=3",
                   "the world has 2 processes"):
        assert needle in line0, (needle, line0)
    assert not os.path.exists(a_file / "ckpt") and os.path.isfile(a_file)
    assert time.time() - start < 60   # found before any model or process group work


def _example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_qwen_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args, needle", [
    (["--model.overrides.num_attention_heads=3"], "num_attention_heads=3 is not a multiple of num_key_value_heads=2"),
    (["--model.overrides.num_experts_per_tok=9"], "num_experts_per_tok=9 > num_experts=4"),
    (["--model.overrides.vocab_size=100"], "vocab_size=100 is smaller than the tokenizer (512 entries)"),
])
def test_model_overrides_checked_before_any_model(args, needle):
    example = _example()
    cfg, world = example.load_config(args)
    with pytest.raises(example.ConfigError) as info:
        example.preflight(cfg, world)
    assert needle in str(info.value)


def test_config_error_is_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    """The example's main() in this process (example_utils.run_main; the interpreter's exit code for a
    config error: tests/test_example.py::test_config_error_exits_2_in_one_line): one line and exit 2;
    with HYPERACC_DEBUG=1 the error itself escapes main, so the interpreter prints its traceback."""
    from example_utils import run_main

    example, args = _example(), ["--model.overrides.num_attention_heads=3"]
    code, _, stderr = run_main(example, args, capsys)
    assert code == 2
    assert "num_attention_heads=3 is not a multiple" in _one_error_line(stderr, "config error:")
    monkeypatch.setenv("HYPERACC_DEBUG", "1")
    with pytest.raises(example.ConfigError, match="num_attention_heads=3"):
        example.main(args)


def test_data_failure_on_rank_0_is_every_ranks_one_line(tmp_path):
    # The file exists (the early check passes); only rank 0 reads it first, after the process group
    # exists, and finds it is not UTF-8. Rank 1 must not be left with gloo's "Connection closed".
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(("plain ascii line\n" * 50 + "caf\xe9\n").encode("latin-1"))
    rc, per_rank = _torchrun_per_rank([f"--data.dataset={bad}"], tmp_path)
    assert rc != 0
    line0 = _one_error_line(per_rank[0], "config error:")
    _quiet(per_rank[1], "config error:")
    assert "building the data failed on rank 0" in line0 and f"file '{bad}' is not valid UTF-8: line 51" in line0


# The check runs on every rank; one plain process by default (its one line before the forward). Rank 1
# quiet while rank 0 speaks for both, after the process group exists: test_data_failure_on_rank_0_is_every_ranks_one_line.
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_megatron_ids_beyond_the_vocab_stop_before_the_forward(tmp_path, nproc):
    from hyperacc.data.megatron_writer import IndexedDatasetWriter

    prefix = str(tmp_path / "wide_vocab")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, vocab_size=50000) as writer:   # a tokenizer of 50000 entries
        for _ in range(200):
            writer.add_document(rng.integers(0, 1000, size=int(rng.integers(50, 200))))
    args = [f"--data.dataset={prefix}", "--training.max_steps=2"]
    if nproc == 1:
        proc = subprocess.run([sys.executable, str(SCRIPT), *QUIET, *args], env=_env(), cwd=str(REPO),
                              capture_output=True, text=True, timeout=240)
        rc, per_rank = proc.returncode, {0: proc.stderr}
    else:
        rc, per_rank = _torchrun_per_rank(args, tmp_path)
        _quiet(per_rank[1], "error:")
    assert rc != 0
    line0 = _one_error_line(per_rank[0], "error:")
    assert "the batch of step 1 holds token id 99" in line0 and "vocab_size is 512" in line0, line0


def _children(pid):
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry))
    return kids


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _snapshot(directory):
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            out[path] = (st.st_size, st.st_mtime_ns)
    return out


def test_sigkill_of_the_launcher_stops_the_workers(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU2), "--main_process_port",
           str(free_port()), str(SCRIPT), *QUIET, "--training.max_steps=400", "--checkpoint.save_ckpt=true",
           f"--checkpoint.checkpoint_dir={ckpt}", "--checkpoint.save_steps=1"]
    with open(tmp_path / "launcher.log", "w") as log:
        launcher = subprocess.Popen(cmd, env=_env(), cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT)
    workers = []
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (ckpt / "latest_checkpoint_iteration.txt").exists():
            assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            time.sleep(0.2)
        assert (ckpt / "latest_checkpoint_iteration.txt").exists(), "no checkpoint was written"
        workers = _children(launcher.pid)
        assert len(workers) == 2, workers
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.time() + 10
        while time.time() < deadline and any(_running(p) for p in workers):
            time.sleep(0.1)
        assert not any(_running(p) for p in workers), "the workers outlived their launcher"
        before = _snapshot(ckpt)
        time.sleep(2.0)
        assert _snapshot(ckpt) == before   # nothing more is written into checkpoint_dir
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in workers or _children(launcher.pid):   # never leave orphans behind if the test fails
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


# (logging_steps, save_steps) -> (checkpoints kept, JSONL steps). Every step checked: the NaN step 3
# stops before its update. Checked every 5 steps: the device record is read at the step-4 save (the
# save guard), which names step 3; step 4 ran in memory on NaN weights, was logged, never saved.
@pytest.mark.parametrize("logging_steps, save_steps, kept, logged", [
    pytest.param(1, 1, ["global_step_1", "global_step_2"], [1, 2], marks=pytest.mark.slow),  # stop-at-once: also
    (5, 2, ["global_step_2"], [1, 2, 3, 4]),                                 # test_example's validate-mode run
])
def test_nan_in_production_never_becomes_latest(tmp_path, logging_steps, save_steps, kept, logged):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = run_accelerate(NAN_SCRIPT, CPU2, [*QUIET, "--training.mode=production", "--training.max_steps=6",
                                             "--checkpoint.save_ckpt=true", f"--checkpoint.checkpoint_dir={ckpt}",
                                             f"--checkpoint.save_steps={save_steps}", f"--logging.metrics_file={metrics}",
                                             f"--logging.logging_steps={logging_steps}"],
                          env={"NAN_AT_STEP": "3", "NAN_RANK": "1"}, timeout=400, check=False)
    assert proc.returncode != 0, proc.stderr[-4000:]
    expected = "error: non-finite loss at step 3 on rank 1 micro-batch 0 (loss nan)"
    assert proc.stderr.count(expected) == 1, proc.stderr[-4000:]        # both ranks stop; rank 0 says it once
    assert (ckpt / "latest_checkpoint_iteration.txt").read_text().strip() == "2"
    assert sorted(p.name for p in ckpt.glob("global_step_*")) == kept
    import json
    records = [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line]
    assert [r["step"] for r in records] == logged
    assert all(r["loss"] == r["loss"] for r in records if r["step"] < 3)          # finite before the NaN
    assert all(r["loss"] != r["loss"] for r in records if r["step"] >= 3)         # NaN from it on
