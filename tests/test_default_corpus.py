"""The embedded default corpus (stdlib docstrings) and its byte-level BPE tokenizer."""
import hashlib
import os
import sys

import numpy as np
import pytest

from hyperacc.data import default_corpus as dc
from hyperacc.data.megatron import IndexedDataset


def _hashes(directory):
    return {f: hashlib.sha256(open(os.path.join(directory, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(directory))}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    a = dc.build_default_corpus(cache_dir=str(tmp_path_factory.mktemp("cache_a")))
    b = dc.build_default_corpus(cache_dir=str(tmp_path_factory.mktemp("cache_b")))
    return a, b


def test_corpus_is_deterministic_and_real_text():
    before = set(sys.modules)
    docs = dc.collect_documents()
    assert docs == dc.collect_documents()
    assert tuple(docs) == dc._collect.__wrapped__(dc.DEFAULT_MODULES, dc.MIN_DOC_CHARS)  # fresh, not memoised
    assert "turtle" not in set(sys.modules) - before  # read with ast, nothing imported
    assert list(dc.DEFAULT_MODULES) == sorted(dc.DEFAULT_MODULES)
    assert len(docs) > 1000 and sum(map(len, docs)) > 300_000
    assert all(len(d) >= dc.MIN_DOC_CHARS for d in docs)
    assert any("argument" in d for d in docs[:50])


def test_two_builds_are_byte_identical(built):
    a, b = built
    assert os.path.basename(a) == os.path.basename(b)  # same key: hash of corpus + settings
    ha, hb = _hashes(a), _hashes(b)
    assert ha == hb
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "corpus.bin", "corpus.idx"} <= set(ha)
    # a second call finds the cache instead of rebuilding
    assert dc.build_default_corpus(cache_dir=os.path.dirname(os.path.dirname(a))) == a


def test_tokenizer_round_trip_with_auto_tokenizer(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built[0])
    assert len(tok) == dc.DEFAULT_VOCAB_SIZE == 512
    assert tok.eos_token == dc.EOS_TOKEN and tok.eos_token_id is not None and tok.pad_token == tok.eos_token
    for text in ("Return the number of items in a container.", "  tabs\tand\nnewlines  ",
                 "naïve café — ünïcode ✓ 日本語", "x = f(a, b=2)  # comment"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert max(ids) < 512 and tok.decode(ids) == text
    assert tok("abc")["input_ids"] == tok("abc", add_special_tokens=False)["input_ids"]  # no BOS added


def test_token_files_hold_the_corpus(built):
    from tokenizers import Tokenizer

    docs = dc.collect_documents()
    ds = IndexedDataset(os.path.join(built[0], "corpus"))
    assert ds.dtype == np.uint16 and ds.num_documents == len(docs)
    tok = Tokenizer.from_file(os.path.join(built[0], "tokenizer.json"))
    eos = tok.token_to_id(dc.EOS_TOKEN)
    for k in (0, 1, len(docs) // 2, len(docs) - 1):
        ids = ds.document(k).tolist()
        assert ids[-1] == eos and eos not in ids[:-1]
        assert tok.decode(ids[:-1]) == docs[k]


def test_vocab_size_is_configurable_and_cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPERACC_CACHE", str(tmp_path))
    assert dc.default_cache_dir() == str(tmp_path)
    d = dc.default_tokenizer_dir(vocab_size=1024)
    assert d.startswith(str(tmp_path)) and os.path.basename(d).startswith("v1024-")
    tok = dc.load_default_tokenizer(vocab_size=1024)
    assert len(tok) == 1024
    with pytest.raises(ValueError, match="vocab_size"):
        dc.build_default_corpus(vocab_size=100)


def test_default_train_and_validation_splits(built, monkeypatch):
    from hyperacc.data.text import build_train_dataset

    monkeypatch.setenv("HYPERACC_CACHE", os.path.dirname(os.path.dirname(built[0])))
    train, tok = build_train_dataset(seq_len=64)
    val, _ = build_train_dataset(seq_len=64, split="validation")
    assert len(tok) == 512
    a, cut = train.token_range
    assert a == 0 and val.token_range[0] == cut  # disjoint, adjacent, cut at a document start
    total = val.token_range[1]
    assert 0.03 < (total - cut) / total < 0.07
    s = train[0]
    assert s["input_ids"].shape == (64,) and int(s["input_ids"].max()) < 512
    assert len(val) > 100
