"""Megatron-format chat data: `python -m hyperacc.data.convert --format chat` writes token ids + a loss mask
(checked byte for byte against `render_record`, and read back by megatron-core), `ChatIndexedDataset` reads
them as `fit_sample` would cut the records, and bad inputs fail before anything is written or read wrongly."""
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from hyperacc.data import convert as cv
from hyperacc.data.chat import IGNORE_INDEX, fit_sample, prepare_chat_tokenizer, render_record
from hyperacc.data.megatron import IndexedDataset
from hyperacc.data.megatron_chat import ChatIndexedDataset, has_loss_mask, loss_mask_prefix
from hyperacc.data.megatron_writer import IndexedDatasetWriter

ROOT = Path(__file__).resolve().parent.parent
SEQ_LEN = 40


def _m(*turns):
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


MESSAGES = [
    _m(("user", "What is FSDP?"), ("assistant", "Sharded data parallelism.")),
    _m(("system", "Be brief."), ("user", "Name a collective."), ("assistant", "all-gather"),
       ("user", "And another?"), ("assistant", "reduce-scatter, which sums and shards.")),
    # the assistant's turn lies entirely past SEQ_LEN: dropped when read
    _m(("user", "Please explain in great detail, with examples, " * 4 + "why sharding helps."), ("assistant", "Memory.")),
    # a long answer: cut to SEQ_LEN, kept
    _m(("system", "You count."), ("user", "Count."),
       ("assistant", "one two three four five six seven eight nine ten eleven twelve thirteen fourteen")),
    _m(("user", "A question nobody answers.")),       # nothing trained at all: dropped when read
] + [_m(("user", f"Question {i}?"), ("assistant", f"Answer number {i}.")) for i in range(10)]
PROMPT_COMPLETION = [
    {"prompt": [{"role": "user", "content": "Two plus two?"}], "completion": [{"role": "assistant", "content": "Four."}]},
    {"prompt": [{"role": "system", "content": "One word."}, {"role": "user", "content": "Sky colour?"}],
     "completion": [{"role": "assistant", "content": "Blue."}]},
    {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}], "completion": [{"role": "assistant", "content": "Goodbye."}]},
]


def _jsonl(path, records):
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _files(prefix):
    return [prefix + s for s in (".bin", ".idx", "_loss_mask.bin", "_loss_mask.idx")]


def _snapshot(prefix):
    return {p: Path(p).read_bytes() for p in _files(prefix)}


@pytest.fixture(scope="module")
def tok(hyperacc_cache):
    from hyperacc.data.default_corpus import load_default_tokenizer

    return prepare_chat_tokenizer(load_default_tokenizer(), "chatml")


@pytest.fixture(scope="module")
def data(tok, tmp_path_factory):
    """The MESSAGES records converted with the CLI defaults (embedded tokenizer -> ChatML)."""
    d = tmp_path_factory.mktemp("chat")
    prefix = str(d / "sft")
    summary = cv.convert(_jsonl(d / "chats.jsonl", MESSAGES), prefix, format="chat", batch_size=4,
                         progress=False, log=None)
    return prefix, summary


def _expected(tok, records):
    rendered = [render_record(tok, r) for r in records]
    return [np.array(s["input_ids"]) for s in rendered], [np.array(s["labels"]) != IGNORE_INDEX for s in rendered]


def _check_raw(prefix, ids, masks):
    """Both pairs, compared on the raw arrays of their files."""
    np.testing.assert_array_equal(np.fromfile(prefix + ".bin", dtype=np.uint16), np.concatenate(ids))
    np.testing.assert_array_equal(np.fromfile(prefix + "_loss_mask.bin", dtype=np.uint8),
                                  np.concatenate(masks).astype(np.uint8))
    for p in (prefix, loss_mask_prefix(prefix)):
        ds = IndexedDataset(p)
        np.testing.assert_array_equal(ds.sequence_lengths, [len(x) for x in ids])
        np.testing.assert_array_equal(ds.document_indices, np.arange(len(ids) + 1))
    assert IndexedDataset(prefix).dtype == np.uint16 and IndexedDataset(loss_mask_prefix(prefix)).dtype == np.uint8


def test_messages_round_trip_byte_exact(tok, data):
    prefix, summary = data
    ids, masks = _expected(tok, MESSAGES)
    _check_raw(prefix, ids, masks)
    assert has_loss_mask(prefix) and has_loss_mask(prefix + ".idx")
    assert summary["documents"] == len(MESSAGES) and summary["tokens"] == sum(map(len, ids))
    assert summary["trained_tokens"] == int(sum(m.sum() for m in masks)) > 0


def test_prompt_completion_round_trip_via_cli_two_workers(tok, tmp_path, capsys):
    prefix = str(tmp_path / "pc")
    rc = cv.main(["--format", "chat", "--input", _jsonl(tmp_path / "pc.jsonl", PROMPT_COMPLETION),
                  "--output-prefix", prefix, "--workers", "2", "--batch-size", "1", "--no-progress"])
    assert rc == 0
    ids, masks = _expected(tok, PROMPT_COMPLETION)
    _check_raw(prefix, ids, masks)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    trained = int(sum(m.sum() for m in masks))
    assert last.startswith(f"converted {len(ids)} documents, {sum(map(len, ids))} tokens ({trained} trained) in ")


def test_megatron_core_reads_ids_and_mask(tok, data):
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MCore

    prefix, _ = data
    ids, masks = _expected(tok, MESSAGES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs_ids, theirs_mask = MCore(prefix), MCore(loss_mask_prefix(prefix))
    assert len(theirs_ids) == len(theirs_mask) == len(MESSAGES)
    for i in range(len(MESSAGES)):
        np.testing.assert_array_equal(theirs_ids[i], ids[i])
        np.testing.assert_array_equal(theirs_mask[i], masks[i].astype(np.uint8))
    np.testing.assert_array_equal(theirs_mask.document_indices, theirs_ids.document_indices)


def test_samples_equal_fit_sample_and_splits_cover_all(tok, data, tmp_path):
    prefix, _ = data
    fitted = [fit_sample(**render_record(tok, r), seq_len=SEQ_LEN) for r in MESSAGES]
    rendered = [render_record(tok, r) for r in MESSAGES]
    # the premises: some conversations are cut and kept, one is dropped because its answer is cut off
    assert any(f is not None and len(r["input_ids"]) > SEQ_LEN for f, r in zip(fitted, rendered))
    assert fitted[2] is None and any(x != IGNORE_INDEX for x in rendered[2]["labels"]) and fitted[4] is None
    with pytest.warns(UserWarning, match="skipped"):
        ds = ChatIndexedDataset(prefix, SEQ_LEN)
    kept = [i for i, f in enumerate(fitted) if f is not None]
    assert ds.skipped == len(MESSAGES) - len(kept) == 2 and len(ds) == len(kept)
    assert ds.documents.tolist() == kept
    for i, k in enumerate(kept):
        sample = ds[i]
        assert sample["input_ids"].dtype == sample["labels"].dtype == torch.int64
        assert sample["input_ids"].tolist() == fitted[k]["input_ids"]
        assert sample["labels"].tolist() == fitted[k]["labels"]
    assert ds[-1]["input_ids"].tolist() == fitted[kept[-1]]["input_ids"]
    with pytest.raises(IndexError):
        ds[len(ds)]

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*skipped")
        train = ChatIndexedDataset(prefix, SEQ_LEN, split="train", holdout_fraction=0.3)
        val = ChatIndexedDataset(prefix, SEQ_LEN, split="validation", holdout_fraction=0.3)
        longer = ChatIndexedDataset(prefix, SEQ_LEN + 1)
    assert len(train) and len(val) and not set(train.documents) & set(val.documents)
    assert sorted([*train.documents, *val.documents]) == kept and max(train.documents) < min(val.documents)
    assert train.skipped + val.skipped == ds.skipped
    assert val[0]["labels"].tolist() == fitted[int(val.documents[0])]["labels"]

    # picklable (DataLoader workers); the fingerprint is the files' content + seq_len + split, not their path
    clone = pickle.loads(pickle.dumps(val))
    assert clone[0]["input_ids"].tolist() == val[0]["input_ids"].tolist() and clone.fingerprint() == val.fingerprint()
    copy = str(tmp_path / "copy")
    for src, dst in zip(_files(prefix), _files(copy)):
        shutil.copyfile(src, dst)
    with pytest.warns(UserWarning, match="skipped"):
        assert ChatIndexedDataset(copy, SEQ_LEN).fingerprint() == ds.fingerprint()
    assert len({ds.fingerprint(), train.fingerprint(), val.fingerprint(), longer.fingerprint()}) == 4


def _write_mask(prefix, documents, dtype=np.uint8):
    with IndexedDatasetWriter(loss_mask_prefix(prefix), dtype=dtype, overwrite=True) as w:
        for d in documents:
            w.add_document(d)


def test_bad_files_refused(data, tmp_path):
    prefix, _ = data
    bad = str(tmp_path / "bad")
    shutil.copyfile(prefix + ".bin", bad + ".bin")
    shutil.copyfile(prefix + ".idx", bad + ".idx")
    assert not has_loss_mask(bad)
    with pytest.raises(ValueError, match="no loss mask.*--format chat"):
        ChatIndexedDataset(bad, SEQ_LEN)
    good = [np.array(x) for x in IndexedDataset(loss_mask_prefix(prefix))]
    _write_mask(bad, good[:5] + [np.append(good[5], 0)] + good[6:])          # one document one value longer
    with pytest.raises(ValueError, match=r"does not match .*document 5 has \d+ mask values.*--format chat"):
        ChatIndexedDataset(bad, SEQ_LEN)
    _write_mask(bad, good[:-1])                                                  # one document fewer
    with pytest.raises(ValueError, match=f"{len(good) - 1} documents, the ids {len(good)}"):
        ChatIndexedDataset(bad, SEQ_LEN)
    _write_mask(bad, good[:3] + [np.where(good[3] == 1, 2, 0)] + good[4:])      # a value that is not 0/1
    with pytest.raises(ValueError, match="loss-mask value 2 .*only 0 and 1"):
        ChatIndexedDataset(bad, SEQ_LEN)
    for seq_len in (1, 0, "8"):
        with pytest.raises(ValueError, match="seq_len"):
            ChatIndexedDataset(prefix, seq_len)
    with pytest.raises(ValueError, match="split"):
        ChatIndexedDataset(prefix, SEQ_LEN, split="test")


def test_existing_outputs_refused_and_failed_conversion_changes_nothing(data, tmp_path):
    prefix, _ = data
    out = str(tmp_path / "out")
    for src, dst in zip(_files(prefix), _files(out)):
        shutil.copyfile(src, dst)
    before = _snapshot(out)
    chats = _jsonl(tmp_path / "pc.jsonl", PROMPT_COMPLETION)
    with pytest.raises(FileExistsError, match="--overwrite"):
        cv.convert(chats, out, format="chat", progress=False, log=None)
    # a record that cannot be rendered, half way through an --overwrite conversion: old files untouched
    broken = _jsonl(tmp_path / "broken.jsonl", MESSAGES[:6] + [{"conversation": [{"role": "user", "content": "x"}]}])
    with pytest.raises(ValueError, match="record 6 .*'messages'.*--messages-column"):
        cv.convert(broken, out, format="chat", batch_size=2, overwrite=True, progress=False, log=None)
    assert _snapshot(out) == before and sorted(os.listdir(tmp_path)) == sorted(
        ["broken.jsonl", "pc.jsonl"] + [os.path.basename(p) for p in _files(out)])
    # the mask pair alone is an existing output too
    lone = str(tmp_path / "lone")
    shutil.copyfile(out + "_loss_mask.bin", lone + "_loss_mask.bin")
    with pytest.raises(FileExistsError, match="lone_loss_mask.bin"):
        cv.convert(chats, lone, format="chat", progress=False, log=None)
    assert not os.path.exists(lone + ".bin")


def test_template_and_column_problems_before_anything_is_written(hyperacc_cache, tmp_path):
    from hyperacc.data.chat import CHATML_TRAINING_TEMPLATE
    from hyperacc.data.default_corpus import load_default_tokenizer

    (tmp_path / "in").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    chats = _jsonl(tmp_path / "in" / "chats.jsonl", MESSAGES)
    plain = load_default_tokenizer()
    plain.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    plain.chat_template = CHATML_TRAINING_TEMPLATE.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    with pytest.raises(ValueError, match=r"generation %\}.*--format text") as e:
        cv.convert(chats, str(out / "x"), tokenizer=plain, format="chat", progress=False, log=None)
    assert "--data." not in str(e.value)
    template = tmp_path / "plain.jinja"
    template.write_text(plain.chat_template)
    with pytest.raises(ValueError, match="generation"):
        cv.convert(chats, str(out / "x"), format="chat", chat_template=str(template), progress=False, log=None)
    with pytest.raises(ValueError, match="no chat template.*--chat-template chatml"):
        cv.convert(chats, str(out / "x"), tokenizer=load_default_tokenizer(), format="chat", progress=False, log=None)
    convo = _jsonl(tmp_path / "in" / "convo.jsonl", [{"conversation": r["messages"]} for r in MESSAGES])
    with pytest.raises(ValueError, match="no 'messages' column.*'conversation'.*--messages-column"):
        cv.convert(convo, str(out / "x"), format="chat", progress=False, log=None)
    assert os.listdir(out) == []


def test_cli_error_exit_code(hyperacc_cache, tmp_path):
    """One subprocess: the flags reach convert() and an error is exit code 2 with one message."""
    chats = _jsonl(tmp_path / "chats.jsonl", MESSAGES)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HYPERACC_CACHE": hyperacc_cache,
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "hyperacc.data.convert", "--format", "chat", "--input", chats,
                        "--messages-column", "conversation", "--chat-template", "chatml", "--output-prefix",
                        str(tmp_path / "x"), "--no-progress"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "no 'conversation' column" in r.stderr and "--messages-column" in r.stderr and "Traceback" not in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["chats.jsonl"]


def test_trained_counts_across_chunk_boundaries():
    """The chunked pass that selects conversations (corpora of any size) counts as one cumsum would."""
    from hyperacc.data.megatron_chat import _counts_at

    rng = np.random.default_rng(0)
    mask = (rng.random(1000) < 0.3).astype(np.uint8)
    positions = np.sort(rng.integers(0, len(mask) + 1, size=300))
    expected = np.concatenate([[0], np.cumsum(mask)])[positions]
    for chunk in (1, 3, 64, 999, 1000, 1 << 22):
        np.testing.assert_array_equal(_counts_at(mask, positions, "m", chunk=chunk), expected)
    np.testing.assert_array_equal(_counts_at(mask[:0], np.zeros(2, np.int64), "m"), [0, 0])
