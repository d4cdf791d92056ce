"""Megatron MMIDIDX v1 files: interop with megatron-core both ways, validation errors, and the packed
/ blended datasets built on top of them."""
import os
import pickle
import struct
import warnings

import numpy as np
import pytest

from hyperacc.data.megatron import IndexedDataset, IndexedDatasetError, optimal_dtype
from hyperacc.data.megatron_writer import IndexedDatasetWriter
from hyperacc.data.packed import BlendedDataset, PackedDataset, TokenWindows, build_packed_dataset, holdout_cut


def _mcore():
    warnings.filterwarnings("ignore")
    from megatron.core.datasets import indexed_dataset as mi

    return mi


def _docs(seed, n=40, vocab=500, max_len=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(0, max_len))) for _ in range(n)]


def _write(prefix, docs, **kw):
    with IndexedDatasetWriter(prefix, **kw) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


@pytest.mark.parametrize("vocab,dtype", [(512, np.uint16), (100_000, np.int32)])
def test_ours_read_by_megatron_core(tmp_path, vocab, dtype):
    mi = _mcore()
    docs = _docs(0, vocab=vocab)
    prefix = str(tmp_path / "ours")
    with IndexedDatasetWriter(prefix, vocab_size=vocab) as w:
        for d in docs[:30]:
            w.add_document(d)
        w.add_document(np.concatenate(docs[30:33]), lengths=[len(x) for x in docs[30:33]])  # 3 sequences
        for d in docs[33:]:
            w.add_item(d)
        w.end_document()
    theirs = mi.IndexedDataset(prefix)
    assert theirs.index.dtype == dtype
    seqs = docs[:30] + docs[30:33] + docs[33:]
    assert len(theirs) == len(seqs)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(theirs[i], s)
    expected_docs = list(range(31)) + [33, len(seqs)]
    np.testing.assert_array_equal(theirs.document_indices, expected_docs)
    ours = IndexedDataset(prefix)
    np.testing.assert_array_equal(ours.document_indices, expected_docs)
    np.testing.assert_array_equal(ours.document(30), np.concatenate(docs[30:33]))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_core_files_read_by_ours(tmp_path, dtype):
    import torch

    mi = _mcore()
    docs = _docs(1)
    prefix = str(tmp_path / "theirs")
    b = mi.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs[:35]:
        b.add_document(torch.tensor(d, dtype=torch.int64), [len(d)])
    for d in docs[35:]:  # one document of several sequences
        b.add_item(torch.tensor(d, dtype=torch.int64))
    b.end_document()
    b.finalize(prefix + ".idx")
    ours = IndexedDataset(prefix)
    theirs = mi.IndexedDataset(prefix)
    assert ours.dtype == dtype and len(ours) == len(docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ours[i], d)
        np.testing.assert_array_equal(ours[i], theirs[i])
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    assert ours.num_documents == 36
    # the bytes we would write for the same content are identical to megatron-core's
    mine = str(tmp_path / "mine")
    with IndexedDatasetWriter(mine, dtype=dtype) as w:
        for d in docs[:35]:
            w.add_document(d)
        for d in docs[35:]:
            w.add_item(d)
    for ext in (".bin", ".idx"):
        assert open(mine + ext, "rb").read() == open(prefix + ext, "rb").read()


def test_dtype_rule_and_overflow(tmp_path):
    assert optimal_dtype(65499) == np.uint16 and optimal_dtype(65500) == np.int32 and optimal_dtype(None) == np.int32
    w = IndexedDatasetWriter(tmp_path / "o", vocab_size=512)
    w.add_document([1, 2, 3])
    with pytest.raises(OverflowError, match="70000.*uint16"):
        w.add_document([5, 70000])
    with pytest.raises(OverflowError, match="-1"):
        w.add_document([-1])
    w.abort()
    assert os.listdir(tmp_path) == []  # no final files, no temporary leftovers
    with pytest.raises(OverflowError):
        with IndexedDatasetWriter(tmp_path / "p", vocab_size=512) as w2:
            w2.add_document([1, 65536])
    assert os.listdir(tmp_path) == []


def test_existing_output_refused_unless_overwrite(tmp_path):
    prefix = _write(tmp_path / "x", [[1, 2]], vocab_size=10)
    before = open(prefix + ".bin", "rb").read()
    with pytest.raises(FileExistsError, match="overwrite"):
        IndexedDatasetWriter(prefix, vocab_size=10)
    assert open(prefix + ".bin", "rb").read() == before
    _write(prefix, [[3, 4, 5]], vocab_size=10, overwrite=True)
    np.testing.assert_array_equal(IndexedDataset(prefix)[0], [3, 4, 5])


def _corrupt(tmp_path, mutate):
    prefix = _write(tmp_path / "c", _docs(2, n=5), vocab_size=512)
    mutate(prefix)
    return prefix


@pytest.mark.parametrize("case,match", [
    ("truncated_header", r"c\.idx.*truncated index"),
    ("truncated_body", r"c\.idx.*truncated or corrupt"),
    ("foreign", r"c\.idx.*not a Megatron MMIDIDX"),
    ("version", r"c\.idx.*version 2"),
    ("dtype", r"c\.idx.*dtype code 99"),
    ("bin_size", r"c\.bin.*size mismatch"),
    ("last_doc", r"c\.idx.*last document index"),
    ("pointer", r"c\.idx.*sequence pointer 1"),
    ("missing_bin", r"c\.bin.*not found"),
])
def test_reader_rejects_bad_files(tmp_path, case, match):
    def mutate(prefix):
        idx, bin_ = prefix + ".idx", prefix + ".bin"
        raw = bytearray(open(idx, "rb").read())
        if case == "truncated_header":
            raw = raw[:20]
        elif case == "truncated_body":
            raw = raw[:-3]
        elif case == "foreign":
            raw[:9] = b"NOTMEGATR"
        elif case == "version":
            raw[9:17] = struct.pack("<Q", 2)
        elif case == "dtype":
            raw[17] = 99
        elif case == "bin_size":
            with open(bin_, "ab") as f:
                f.write(b"\0\0")
        elif case == "last_doc":
            raw[-8:] = struct.pack("<q", 3)
        elif case == "pointer":
            n = struct.unpack("<Q", raw[18:26])[0]
            off = 34 + 4 * n + 8
            raw[off:off + 8] = struct.pack("<q", 1)
        elif case == "missing_bin":
            os.remove(bin_)
        open(idx, "wb").write(bytes(raw))

    prefix = _corrupt(tmp_path, mutate)
    with pytest.raises(IndexedDatasetError, match=match):
        IndexedDataset(prefix)


def test_reader_misc(tmp_path):
    docs = _docs(3, n=6)
    prefix = _write(tmp_path / "m", docs, vocab_size=512)
    ds = IndexedDataset(prefix + ".idx")  # PREFIX.idx is accepted as well
    assert ds.prefix == prefix and len(ds) == 6 and ds.num_tokens == sum(map(len, docs))
    ds2 = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(ds2[5], docs[5])
    np.testing.assert_array_equal(ds.get(2, offset=1, length=2), docs[2][1:3])
    assert [len(x) for x in ds[1:4]] == [len(x) for x in docs[1:4]]
    empty = _write(tmp_path / "e", [], vocab_size=512)
    e = IndexedDataset(empty)
    assert len(e) == 0 and e.num_documents == 0 and list(e.document_indices) == [0]


# -- packed and blended datasets ------------------------------------------------------------------
def test_packed_samples_are_stream_windows(tmp_path):
    docs = _docs(4, n=50)
    prefix = _write(tmp_path / "p", docs, vocab_size=512)
    stream = np.concatenate(docs)
    seq_len = 16
    ds = PackedDataset(prefix, seq_len, split="all")
    assert len(ds) == (len(stream) - 1) // (seq_len - 1)
    predicted = []
    for i in range(len(ds)):
        s = ds[i]
        assert set(s) == {"input_ids", "attention_mask", "labels"}
        for v in s.values():
            assert v.ndim == 1 and v.shape[0] == seq_len
        np.testing.assert_array_equal(s["input_ids"].numpy(), stream[i * 15:i * 15 + 16])
        assert (s["labels"] == s["input_ids"]).all() and (s["attention_mask"] == 1).all()
        predicted.append(s["labels"].numpy()[1:])  # what the model's internal shift predicts
    # every token of the stream after the first is predicted exactly once
    np.testing.assert_array_equal(np.concatenate(predicted), stream[1:1 + 15 * len(ds)])
    assert len(stream) - 1 - 15 * len(ds) < 15
    assert ds[-1]["input_ids"].shape[0] == seq_len
    with pytest.raises(IndexError):
        ds[len(ds)]
    ds2 = pickle.loads(pickle.dumps(ds))
    assert (ds2[3]["input_ids"] == ds[3]["input_ids"]).all()


def test_packed_splits_and_errors(tmp_path):
    docs = [np.full(10, k % 500) for k in range(100)]
    prefix = _write(tmp_path / "s", docs, vocab_size=512)
    tr = PackedDataset(prefix, 8, split="train", holdout_fraction=0.05)
    va = PackedDataset(prefix, 8, split="validation", holdout_fraction=0.05)
    assert tr.token_range == (0, 950) and va.token_range == (950, 1000)  # cut at a document start
    assert holdout_cut(np.array([0, 1000]), 0.1) == 900  # one document: exact cut
    with pytest.raises(ValueError, match="longer than the whole"):
        PackedDataset(prefix, 2000)
    with pytest.raises(ValueError, match="unknown split 'test'.*train, validation, all"):
        PackedDataset(prefix, 8, split="test")
    with pytest.raises(ValueError, match="empty"):
        TokenWindows(np.zeros(0, np.uint16), 8)
    with pytest.raises(ValueError, match="seq_len"):
        TokenWindows(np.zeros(10, np.uint16), 1)


def test_blending_deterministic_and_proportional(tmp_path):
    a = _write(tmp_path / "a", [np.arange(3000) % 500], vocab_size=512)
    b = _write(tmp_path / "b", [np.arange(1000) % 500 + 7], vocab_size=512)
    build = lambda: build_packed_dataset(f"0.7 {a} 0.3 {b}", 11, num_samples=500)
    d1, d2 = build(), build()
    assert isinstance(d1, BlendedDataset) and len(d1) == 500
    np.testing.assert_array_equal(d1.dataset_index, d2.dataset_index)
    np.testing.assert_array_equal(d1.dataset_sample_index, d2.dataset_sample_index)
    assert d1.counts.tolist() == [350, 150]
    picks = d1.dataset_index
    for k in range(1, 501):  # every prefix is in proportion, within one sample
        assert abs((picks[:k] == 0).sum() - 0.7 * k) <= 1.0
    # each source is walked in order, and b (99 samples) wraps around
    assert d1.dataset_sample_index[picks == 1].tolist() == [j % 99 for j in range(150)]
    pa, pb = PackedDataset(a, 11), PackedDataset(b, 11)
    for k in (0, 1, 2, 499):
        src = pa if picks[k] == 0 else pb
        assert (d1[k]["input_ids"] == src[int(d1.dataset_sample_index[k])]["input_ids"]).all()
    # default: one pass over the source that runs out first, natural proportions by tokens
    d3 = build_packed_dataset([a, b], 11)
    assert d3.counts.tolist() == [297, 99] and len(d3) == 396  # b (99 samples) used exactly once
    with pytest.raises(ValueError, match="weights"):
        BlendedDataset([pa, pb], [1.0, -1.0])


def test_packed_dataset_in_microbatch_loader(tmp_path):
    loader_mod = pytest.importorskip("hyperacc.data.loader")
    prefix = _write(tmp_path / "l", _docs(5, n=100), vocab_size=512)
    ds = PackedDataset(prefix, 8)
    loader = loader_mod.MicroBatchDataLoader(ds, global_batch_size=4, micro_batch_size=2, shuffle=True, seed=1)
    step = next(iter(loader))
    assert len(step) == 2 and step[0]["input_ids"].shape == (2, 8) and step[0]["labels"].shape == (2, 8)
