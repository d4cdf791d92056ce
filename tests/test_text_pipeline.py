"""The datasets.load_dataset + AutoTokenizer path on local files, save_to_disk directories and the
locally saved default tokenizer (offline), and build_train_dataset's dispatch."""
import json
import os

import numpy as np
import pytest

from hyperacc.data import default_corpus as dc
from hyperacc.data.megatron_writer import IndexedDatasetWriter
from hyperacc.data.packed import BlendedDataset, PackedDataset, TokenWindows
from hyperacc.data.text import (build_text_dataset, build_train_dataset, flatten_tokens, load_text_dataset,
                                load_tokenizer, tokenize_dataset)

TEXTS = [f"Document {i}: the quick brown fox jumps over {i % 7} lazy dogs." for i in range(60)] + [""]


@pytest.fixture(scope="module")
def tok_dir(hyperacc_cache):
    return dc.default_tokenizer_dir()


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)  # the from_pretrained path, on a local directory


@pytest.fixture
def jsonl(tmp_path):
    p = tmp_path / "docs.jsonl"
    with open(p, "w") as f:
        for i, t in enumerate(TEXTS):
            f.write(json.dumps({"text": t, "id": i}) + "\n")
    return str(p)


def _expected_stream(tok, texts):
    out = []
    for t in texts:
        out += tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return np.array(out)


def test_from_pretrained_tokenizer_matches_default(tok, tok_dir):
    assert load_tokenizer(tok_dir).name_or_path == tok.name_or_path
    default = load_tokenizer(None)
    assert len(default) == len(tok) == 512
    assert default("hello world", add_special_tokens=False)["input_ids"] == tok("hello world", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="cannot load tokenizer.*'default'"):
        load_tokenizer(os.path.join(tok_dir, "no_such_tokenizer"))


def test_a_weights_directory_without_tokenizer_files_is_refused(tmp_path):
    # transformers builds an empty tokenizer from a directory with only config.json: text -> no tokens
    from hyperacc.models import qwen3_moe_config
    qwen3_moe_config().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="is empty .* no tokenizer files"):
        load_tokenizer(str(tmp_path))


def test_jsonl_samples_equal_concatenated_stream(tok, jsonl):
    ds = build_text_dataset(jsonl, tok, 16, holdout_fraction=0.0)
    stream = _expected_stream(tok, TEXTS)
    np.testing.assert_array_equal(ds.tokens, stream)
    assert isinstance(ds, TokenWindows) and len(ds) == (len(stream) - 1) // 15
    for i in (0, 1, len(ds) - 1):
        s = ds[i]
        np.testing.assert_array_equal(s["input_ids"].numpy(), stream[15 * i:15 * i + 16])
        assert (s["labels"] == s["input_ids"]).all() and s["attention_mask"].sum() == 16


def test_save_to_disk_and_other_formats(tok, tmp_path):
    import datasets

    stream = _expected_stream(tok, TEXTS)
    d = datasets.Dataset.from_dict({"body": TEXTS})
    d.save_to_disk(str(tmp_path / "saved"))
    ds = build_text_dataset(str(tmp_path / "saved"), tok, 16, text_column="body", holdout_fraction=0.0)
    np.testing.assert_array_equal(ds.tokens, stream)
    datasets.DatasetDict({"train": d, "validation": d.select(range(5))}).save_to_disk(str(tmp_path / "dd"))
    v = load_text_dataset(str(tmp_path / "dd"), split="validation", text_column="body")
    assert len(v) == 5  # an existing validation split is used as is
    d.to_parquet(str(tmp_path / "x.parquet"))
    d.to_csv(str(tmp_path / "x.csv"), index=False)
    (tmp_path / "x.txt").write_text("\n".join(t for t in TEXTS if t) + "\n")
    assert len(load_text_dataset(str(tmp_path / "x.parquet"), text_column="body", holdout_fraction=0)) == 61
    assert load_text_dataset(str(tmp_path / "x.csv"), text_column="body", holdout_fraction=0).column_names == ["body"]
    assert len(load_text_dataset(str(tmp_path / "x.txt"), holdout_fraction=0)) == 60


def test_holdout_split_and_slicing(jsonl):
    tr = load_text_dataset(jsonl, split="train", holdout_fraction=0.1)
    va = load_text_dataset(jsonl, split="validation", holdout_fraction=0.1)
    assert len(tr) == 55 and len(va) == 6
    assert list(tr["id"]) + list(va["id"]) == list(range(61))
    assert len(load_text_dataset(jsonl, split="train[:10]")) == 10


def test_tokenize_is_cached_and_num_proc(tok, jsonl):
    d = load_text_dataset(jsonl, holdout_fraction=0)
    t1 = tokenize_dataset(d, tok)
    t2 = tokenize_dataset(d, tok)
    assert t1._fingerprint == t2._fingerprint and t1.cache_files == t2.cache_files and t1.cache_files
    import datasets

    fresh = datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(61))})  # in memory: no cache
    t3 = tokenize_dataset(fresh, tok, num_proc=2)
    assert not t3.cache_files and t3.column_names == ["input_ids"]
    np.testing.assert_array_equal(flatten_tokens(t3, len(tok)), flatten_tokens(t1, len(tok)))
    np.testing.assert_array_equal(flatten_tokens(t1, len(tok)), _expected_stream(tok, TEXTS))


def test_bad_inputs(tok, jsonl, tmp_path):
    with pytest.raises(ValueError, match="text column 'body' not found.*available columns: text, id"):
        build_text_dataset(jsonl, tok, 16, text_column="body")
    with pytest.raises(ValueError, match="unknown split 'test'.*available splits: train"):
        build_text_dataset(jsonl, tok, 16, split="test")
    with pytest.raises(ValueError, match="longer than the whole"):
        build_text_dataset(jsonl, tok, 10**6)
    with pytest.raises(ValueError, match="not found"):
        build_text_dataset(str(tmp_path / "missing.jsonl"), tok, 16)
    with pytest.raises(ValueError, match="no such file"):
        build_text_dataset("relative/missing.jsonl", tok, 16)
    with pytest.raises(ValueError, match="nope/nothing"):
        build_text_dataset("nope/nothing", tok, 16)  # hub name, offline and not cached
    import datasets

    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="empty"):
        build_text_dataset(str(tmp_path / "empty"), tok, 16)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty"):
        build_text_dataset(str(tmp_path / "empty.jsonl"), tok, 16)
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(ValueError, match="longer than the whole"):  # one EOS token only
        build_text_dataset(str(tmp_path / "blank.jsonl"), tok, 16, holdout_fraction=0)


def test_build_train_dataset_dispatch(tok, tok_dir, jsonl, tmp_path):
    ds, t = build_train_dataset(jsonl, tok_dir, seq_len=16, holdout_fraction=0.0)
    assert isinstance(ds, TokenWindows) and len(t) == 512
    # a Megatron prefix, and a weighted blend of two
    stream = _expected_stream(tok, TEXTS)
    for name in ("m1", "m2"):
        with IndexedDatasetWriter(tmp_path / name, vocab_size=len(tok)) as w:
            w.add_document(stream)
    p1, p2 = str(tmp_path / "m1"), str(tmp_path / "m2")
    pk, _ = build_train_dataset(p1, tok_dir, seq_len=16, split="all")
    assert isinstance(pk, PackedDataset)
    np.testing.assert_array_equal(pk[0]["input_ids"].numpy(), ds[0]["input_ids"].numpy())
    bl, _ = build_train_dataset(f"0.5 {p1} 0.5 {p2}", tok_dir, seq_len=16, split="all")
    assert isinstance(bl, BlendedDataset) and bl.counts[0] == bl.counts[1]
    bl2, _ = build_train_dataset([p1, p2], tok_dir, seq_len=16, split="all", weights=[3, 1], num_samples=40)
    assert bl2.counts.tolist() == [30, 10]


def test_hub_path_loads_only_needed_splits(monkeypatch):
    """The hub branch (simulated: no network here) asks for split names, then loads one split."""
    import datasets

    calls = []
    monkeypatch.setattr(datasets, "get_dataset_split_names", lambda path, name=None: ["train", "test"])

    def fake_load(path, name=None, split=None, **kw):
        calls.append((path, name, split))
        return datasets.Dataset.from_dict({"text": TEXTS})

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    va = load_text_dataset("owner/corpus", name="en", split="validation", holdout_fraction=0.1)
    assert len(va) == 6 and calls == [("owner/corpus", "en", "train")]
    assert len(load_text_dataset("owner/corpus", name="en", split="test")) == 61
    with pytest.raises(ValueError, match="unknown split 'dev'.*available splits: train, test"):
        load_text_dataset("owner/corpus", split="dev")
