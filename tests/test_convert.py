"""The offline converter: CLI round trips (jsonl, save_to_disk), atomic output, and bad inputs."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hyperacc.data import convert as cv
from hyperacc.data import default_corpus as dc
from hyperacc.data.megatron import IndexedDataset

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [f"Line {i}: pack my box with {i * 3} dozen liquor jugs." for i in range(300)] + ["", "ünïcode ✓"]


@pytest.fixture(scope="module")
def cache(hyperacc_cache):
    dc.build_default_corpus()
    return hyperacc_cache


@pytest.fixture(scope="module")
def tok_dir(cache):
    return dc.default_tokenizer_dir()


@pytest.fixture(scope="module")
def expected(tok_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    eos = tok.token_to_id(dc.EOS_TOKEN)
    return [np.array(e.ids + [eos]) for e in tok.encode_batch(TEXTS, add_special_tokens=False)]


@pytest.fixture
def jsonl(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps({"content": t, "n": i}) + "\n" for i, t in enumerate(TEXTS)))
    return str(p)


def _check(prefix, expected):
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and len(ds) == len(expected) == ds.num_documents
    for i, e in enumerate(expected):
        np.testing.assert_array_equal(ds[i], e)
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MCore

    theirs = MCore(prefix)
    np.testing.assert_array_equal(theirs[len(expected) - 1], expected[-1])
    np.testing.assert_array_equal(theirs.document_indices, np.arange(len(expected) + 1))


def _run_cli(args, cache, **kw):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HYPERACC_CACHE": cache,
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "hyperacc.data.convert", *args], env=env, capture_output=True,
                          text=True, timeout=120, **kw)


def test_cli_round_trip_jsonl_two_workers(cache, tok_dir, expected, jsonl, tmp_path):
    out = str(tmp_path / "out" / "corpus")  # the output directory is created
    r = _run_cli(["--input", jsonl, "--text-column", "content", "--tokenizer", tok_dir, "--output-prefix", out,
                  "--workers", "2", "--batch-size", "64"], cache)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith(f"converted {len(TEXTS)} documents, {sum(map(len, expected))} tokens in ")
    assert "tokens/s" in last
    assert "doc" in r.stderr  # the tqdm progress bar
    _check(out, expected)
    # refusing an existing output: files untouched, clear message, exit code 2
    before = open(out + ".bin", "rb").read()
    r2 = _run_cli(["--input", jsonl, "--text-column", "content", "--output-prefix", out, "--workers", "1"], cache)
    assert r2.returncode == 2 and "already exists" in r2.stderr and "--overwrite" in r2.stderr
    assert open(out + ".bin", "rb").read() == before


def test_save_to_disk_round_trip_default_tokenizer_and_overwrite(cache, expected, tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS[:10]}),
                          "validation": datasets.Dataset.from_dict({"text": TEXTS})}).save_to_disk(str(tmp_path / "saved"))
    out = str(tmp_path / "o")
    assert cv.main(["--input", str(tmp_path / "saved"), "--split", "validation", "--output-prefix", out,
                    "--workers", "1", "--no-progress"]) == 0  # --tokenizer omitted: the default one
    _check(out, expected)
    s = cv.convert(str(tmp_path / "saved"), out, tokenizer="default", overwrite=True, workers=2, progress=False,
                   log=None)
    assert s["documents"] == 10 and s["tokens"] == sum(map(len, expected[:10])) and s["dtype"] == "uint16"
    assert len(IndexedDataset(out)) == 10
    assert sorted(os.listdir(tmp_path)) == ["o.bin", "o.idx", "saved"]


def test_failure_midway_leaves_no_output(cache, jsonl, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = cv._Encoder.encode

    def failing(self, texts):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("tokenizer exploded")
        return real(self, texts)

    monkeypatch.setattr(cv._Encoder, "encode", failing)
    with pytest.raises(RuntimeError, match="exploded"):
        cv.convert(jsonl, str(tmp_path / "half"), text_column="content", batch_size=50, progress=False, log=None)
    assert calls["n"] == 3
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]  # no final names, no temporary leftovers


@pytest.mark.parametrize("fmt", ["text", "chat"])
def test_an_interrupt_just_after_a_writer_made_its_file_leaves_nothing(cache, jsonl, tmp_path, monkeypatch, fmt):
    # A signal landing after the writer created its temporary file but before convert() held the
    # writer (the window test_sigterm_midway hit under load): its abort cannot run; nothing may remain.
    from hyperacc.data import megatron_writer

    real = megatron_writer.IndexedDatasetWriter.__init__

    def interrupted(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self._closed = True            # as if the signal came before the writer was marked open
        raise KeyboardInterrupt("signal 15")

    monkeypatch.setattr(megatron_writer.IndexedDatasetWriter, "__init__", interrupted)
    records = tmp_path / "chat.jsonl"
    records.write_text(json.dumps({"prompt": "q", "completion": "a"}) + "\n")
    source = str(records) if fmt == "chat" else jsonl
    with pytest.raises(KeyboardInterrupt):
        cv.convert(source, str(tmp_path / "out"), text_column="content", format=fmt, batch_size=50,
                   progress=False, log=None)
    assert sorted(os.listdir(tmp_path)) == sorted({"in.jsonl", "chat.jsonl"} & set(os.listdir(tmp_path)))
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f or f.startswith("out")]


def test_sigterm_midway_leaves_no_final_file(cache, jsonl, tmp_path):
    # A conversion slowed down in its encoder, terminated while its temporary .bin exists.
    script = ("import sys, time\n"
              "from hyperacc.data import convert as cv\n"
              "real = cv._Encoder.encode\n"
              "def slow(self, texts):\n"
              "    time.sleep(0.5)\n"
              "    return real(self, texts)\n"
              "cv._Encoder.encode = slow\n"
              "sys.exit(cv.main(sys.argv[1:]))\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HYPERACC_CACHE": cache,
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", script, "--input", jsonl, "--text-column", "content",
                             "--output-prefix", str(out), "--workers", "1", "--batch-size", "10", "--no-progress"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 90
    while time.time() < deadline and not any(".tmp-" in f for f in os.listdir(tmp_path)):
        time.sleep(0.05)
    assert any(".tmp-" in f for f in os.listdir(tmp_path)), "the conversion never started writing"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]


class _OverflowTokenizer:
    """A (slow-path) tokenizer that claims 100 entries but emits an id that uint16 cannot hold."""
    eos_token_id = 1
    name_or_path = "overflow"

    def __len__(self):
        return 100

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[5, 70000] if "7" in t else [5] for t in texts]}


def test_bad_inputs(cache, jsonl, tmp_path, capsys):
    def run(*args):
        rc = cv.main(["--no-progress", "--workers", "1", *args])
        return rc, capsys.readouterr().err

    out = str(tmp_path / "x")
    rc, err = run("--input", jsonl, "--output-prefix", out)  # default column "text" is absent
    assert rc == 2 and "text column 'text' not found" in err and "content, n" in err
    rc, err = run("--input", jsonl, "--text-column", "content", "--split", "test", "--output-prefix", out)
    assert rc == 2 and "unknown split 'test'" in err and "available splits: train" in err
    rc, err = run("--input", str(tmp_path / "missing.jsonl"), "--output-prefix", out)
    assert rc == 2 and "not found" in err
    (tmp_path / "empty.jsonl").write_text("")
    rc, err = run("--input", str(tmp_path / "empty.jsonl"), "--output-prefix", out)
    assert rc == 2 and "empty" in err
    rc, err = run("--input", jsonl, "--text-column", "content", "--tokenizer", str(tmp_path / "no_tok"),
                  "--output-prefix", out)
    assert rc == 2 and "cannot load tokenizer" in err
    with pytest.raises(OverflowError, match="70000.*uint16"):
        cv.convert(jsonl, out, tokenizer=_OverflowTokenizer(), text_column="content", progress=False, log=None)
    assert sorted(os.listdir(tmp_path)) == ["empty.jsonl", "in.jsonl"]  # nothing written, nothing left over


def test_import_is_light():
    code = ("import sys, hyperacc.data.convert, hyperacc.data.megatron\n"
            "heavy = [m for m in ('torch', 'transformers', 'datasets', 'torch.distributed') if m in sys.modules]\n"
            "print(heavy)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_unreadable_inputs_name_file_and_line(cache, tmp_path, capsys):
    def run(path, prefix="o"):
        rc = cv.main(["--no-progress", "--workers", "1", "--input", str(path), "--output-prefix",
                      str(tmp_path / "out" / prefix)])
        return rc, capsys.readouterr().err

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("first line\ncaf\xe9 au lait\n".encode("latin-1"))
    rc, err = run(latin1)
    assert rc == 2 and f"file '{latin1}' is not valid UTF-8: line 2" in err and "0xe9" in err, err
    assert "Traceback" not in err and "DatasetGenerationError" not in err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n{"text": "d"}\n')
    rc, err = run(broken)
    assert rc == 2 and f"file '{broken}' line 3 is not valid JSON" in err, err
    # ints and nulls in the text column: an error naming the row, never str(5) / "" silently
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"text": "a"}\n{"text": 5}\n')
    rc, err = run(mixed)
    assert rc == 2 and "row 1 of text column 'text'" in err and "int 5, not a string" in err, err
    nulls = tmp_path / "nulls.jsonl"
    nulls.write_text('{"text": "a"}\n{"text": "b"}\n{"text": null}\n')
    rc, err = run(nulls)
    assert rc == 2 and "row 2 of text column 'text'" in err and "is null" in err, err
    # --output-prefix naming a directory: refused, nothing (hidden .bin/.idx) written
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"text": "hello"}\n')
    rc, err = run(ok, prefix="")
    assert rc == 2 and "names a directory" in err and "--output-prefix" in err, err
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def test_stale_temp_files_of_a_killed_conversion_are_removed_by_the_next_run(cache, jsonl, tmp_path, capsys):
    # A conversion slowed down in its encoder, SIGKILLed while its temporary files exist: no Python
    # cleanup runs, the .tmp-* files stay behind.
    script = ("import sys, time\n"
              "from hyperacc.data import convert as cv\n"
              "real = cv._Encoder.encode\n"
              "def slow(self, texts):\n"
              "    time.sleep(0.5)\n"
              "    return real(self, texts)\n"
              "cv._Encoder.encode = slow\n"
              "sys.exit(cv.main(sys.argv[1:]))\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HYPERACC_CACHE": cache,
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = tmp_path / "corpus"
    proc = subprocess.Popen([sys.executable, "-c", script, "--input", jsonl, "--text-column", "content",
                             "--output-prefix", str(out), "--workers", "1", "--batch-size", "10", "--no-progress"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 90
    while time.time() < deadline and not any(".tmp-" in f for f in os.listdir(tmp_path)):
        time.sleep(0.05)
    proc.kill()
    proc.wait(timeout=30)
    stale = sorted(f for f in os.listdir(tmp_path) if f.startswith("corpus.bin.tmp-"))
    assert stale, "the killed conversion left no temporary file to clean up"
    # a live writer's temporary file (this test process) is never touched
    live = tmp_path / f"corpus.idx.tmp-{os.getpid()}-abc"
    live.write_bytes(b"in progress")
    rc = cv.main(["--no-progress", "--workers", "1", "--input", jsonl, "--text-column", "content",
                  "--output-prefix", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert f"removed stale temporary file {tmp_path / stale[0]}" in captured.out
    assert sorted(os.listdir(tmp_path)) == ["corpus.bin", "corpus.idx", live.name, "in.jsonl"]
    assert len(IndexedDataset(str(out))) == len(TEXTS)
