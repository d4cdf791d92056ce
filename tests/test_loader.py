"""MicroBatchDataLoader and collators, single process: DP ranks are simulated with bind(r, n)."""
import gc
import json
import io
import random
import threading
import time

import numpy as np
import pytest
import torch

from hyperacc.data import MicroBatchDataLoader
from hyperacc.data.collate import check_batch, default_collate, pad_collate


class IndexDataset:
    """Sample i carries its own index; nothing is materialised up front."""

    def __init__(self, n, width=3):
        self.n, self.width = n, width
        self.reads = 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        return {"idx": torch.tensor(i), "x": torch.full((self.width,), float(i))}


def make(n=40, gbs=8, mbs=2, **kw):
    return MicroBatchDataLoader(IndexDataset(n), global_batch_size=gbs, micro_batch_size=mbs, **kw)


def item_ids(item):
    return [i for mb in item for i in mb["idx"].tolist()]


def run_ranks(loaders):
    """Iterate one epoch-remainder of every rank's loader in lock-step; ids per step, rank order."""
    steps = []
    for items in zip(*loaders):
        steps.append([i for item in items for i in item_ids(item)])
    return steps


def ranks(dp, **kw):
    return [make(**kw).bind(r, dp) for r in range(dp)]


# ---------------------------------------------------------------- shape and split
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_items_shapes_len_and_rank_slices(dp):
    loaders = ranks(dp, n=40, gbs=8, mbs=2)
    assert all(len(l) == 5 for l in loaders)
    assert loaders[0].micro_batches_per_step == 8 // (2 * dp)
    per_step = []
    for s, items in enumerate(zip(*loaders)):
        for r, item in enumerate(items):
            assert isinstance(item, list) and len(item) == 8 // (2 * dp)
            for mb in item:
                assert set(mb) == {"idx", "x"} and mb["idx"].shape == (2,) and mb["x"].shape == (2, 3)
            # rank r gets the r-th contiguous block of the global step
            expected = loaders[r].global_step_indices(0, s)[r * (8 // dp):(r + 1) * (8 // dp)]
            assert item_ids(item) == expected
        ids = [i for item in items for i in item_ids(item)]
        assert sorted(ids) == sorted(loaders[0].global_step_indices(0, s)) and len(set(ids)) == 8
        per_step.append(ids)
    assert len(per_step) == 5
    everything = [i for ids in per_step for i in ids]
    assert sorted(everything) == list(range(40))       # one epoch = a permutation of the data
    assert [l.dp_rank for l in loaders] == list(range(dp)) and loaders[0].dp_size == dp
    assert loaders[0].global_batch_size == 8 and loaders[0].micro_batch_size == 2
    assert isinstance(loaders[0].dataset, IndexDataset)


def test_global_order_independent_of_dp_size_and_micro_batch():
    ref = run_ranks(ranks(1, n=48, gbs=8, mbs=1, seed=3))
    for dp, mbs in [(2, 2), (4, 1), (4, 2), (8, 1)]:
        assert run_ranks(ranks(dp, n=48, gbs=8, mbs=mbs, seed=3)) == ref
    # and it is a function of (seed, epoch): another seed gives another order, epochs differ
    other = run_ranks(ranks(1, n=48, gbs=8, mbs=1, seed=4))
    assert other != ref
    loader = make(n=48, gbs=8, mbs=1, seed=3)
    assert loader.global_step_indices(0, 0) != loader.global_step_indices(1, 0)


def test_no_shuffle_is_sequential_and_epochs_advance():
    loader = make(n=20, gbs=4, mbs=2, shuffle=False)
    assert loader.global_step_indices(0, 2) == [8, 9, 10, 11]
    seen = []
    for epoch in range(2):
        assert loader.epoch == epoch and loader.step_in_epoch == 0
        for item in loader:
            seen.append(item_ids(item))
    assert seen[:5] == [[4 * s + k for k in range(4)] for s in range(5)] and seen[5:] == seen[:5]
    assert loader.state_dict()["epoch"] == 2 and loader.state_dict()["step"] == 0


def test_global_rng_untouched():
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    for kw in ({}, {"prefetch": True}, {"num_workers": 1}):
        loader = make(n=40, gbs=8, mbs=2, **kw)
        for _ in range(2):
            for _item in loader:
                pass
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])


def test_drop_last_false_pads_final_step_by_wrapping():
    loader = make(n=20, gbs=8, mbs=2, drop_last=False)
    assert len(loader) == 3
    order = loader.global_step_indices(0, 0) + loader.global_step_indices(0, 1)
    tail = loader.global_step_indices(0, 2)
    assert len(tail) == 8
    assert sorted(order + tail[:4]) == list(range(20))      # 4 new samples ...
    assert tail[4:] == order[:4]                             # ... completed from the epoch's start
    items = list(loader)
    assert len(items) == 3 and all(len(it) == 4 and it[-1]["idx"].shape == (2,) for it in items)
    assert loader.epoch == 1 and loader.step_in_epoch == 0
    # also when the dataset is smaller than one global batch
    small = make(n=5, gbs=8, mbs=4, drop_last=False, shuffle=False)
    assert len(small) == 1 and small.global_step_indices(0, 0) == [0, 1, 2, 3, 4, 0, 1, 2]


# ---------------------------------------------------------------- resume
def uninterrupted(n, gbs, epochs=2, seed=0):
    loader = make(n=n, gbs=gbs, mbs=1, seed=seed)
    out = []
    for _ in range(epochs):
        for item in loader:
            out.append(item_ids(item))
    return out


def consume(loaders, k):
    """Take k steps from every rank (crossing epochs as needed); ids per step."""
    out = []
    while len(out) < k:
        its = [iter(l) for l in loaders]
        for items in zip(*its):
            out.append([i for item in items for i in item_ids(item)])
            if len(out) == k:
                break
    return out


@pytest.mark.parametrize("new_dp,new_mbs", [(2, 2), (1, 2), (4, 1), (2, 4)])
@pytest.mark.parametrize("k", [2, 5, 7])     # 5 steps per epoch: mid-epoch, boundary, next epoch
def test_resume_exact_across_dp_and_micro_batch(new_dp, new_mbs, k):
    n, gbs, total = 40, 8, 10
    ref = uninterrupted(n, gbs)
    before = ranks(2, n=n, gbs=gbs, mbs=2)
    first = consume(before, k)
    states = [l.state_dict() for l in before]
    assert all(s == states[0] for s in states)         # identical on every rank
    # the state survives torch.save(weights_only=True) and JSON
    buf = io.BytesIO()
    torch.save(states[0], buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    state = json.loads(json.dumps(state))
    after = [make(n=n, gbs=gbs, mbs=new_mbs) for _ in range(new_dp)]
    for r, l in enumerate(after):
        l.load_state_dict(state)
        l.bind(r, new_dp)                               # bind after load, as prepare() may
    rest = consume(after, total - k)
    assert first + rest == ref
    assert after[0].state_dict() == make(n=n, gbs=gbs, mbs=1).state_dict() | {"epoch": 2, "step": 0}


def test_state_moves_to_next_epoch_after_last_step_and_counts_consumed_only():
    loader = make(n=16, gbs=8, mbs=4)
    it = iter(loader)
    assert loader.state_dict()["step"] == 0          # nothing consumed yet
    next(it)
    assert (loader.epoch, loader.step_in_epoch) == (0, 1)
    next(it)
    assert (loader.epoch, loader.step_in_epoch) == (1, 0)
    with pytest.raises(StopIteration):
        next(it)


def test_resume_cost_is_flat_and_reads_nothing_skipped():
    n = 10 ** 9
    timings = {}
    for step in (1, 10 ** 6):
        ds = IndexDataset(n)
        loader = MicroBatchDataLoader(ds, global_batch_size=8, micro_batch_size=2, shuffle=False)
        state = loader.state_dict() | {"step": step}
        t0 = time.perf_counter()
        loader.load_state_dict(state)
        item = next(iter(loader))
        timings[step] = time.perf_counter() - t0
        assert item_ids(item) == list(range(8 * step, 8 * step + 8))
        assert ds.reads == 8                              # only the first item was read
        assert loader.step_in_epoch == step + 1
    floor = 0.05
    assert max(timings[10 ** 6], floor) / max(timings[1], floor) < 5, timings


def test_resume_with_shuffle_at_large_step():
    n = 200_000
    loader = make(n=n, gbs=8, mbs=2, seed=7)
    state = loader.state_dict() | {"step": 20_000}
    fresh = make(n=n, gbs=8, mbs=2, seed=7).bind(1, 2)
    fresh.load_state_dict(state)
    assert item_ids(next(iter(fresh))) == loader.global_step_indices(0, 20_000)[4:]
    assert fresh.dataset.reads == 4


# ---------------------------------------------------------------- prefetch / workers
def test_prefetch_state_matches_no_prefetch():
    plain, pre = make(n=40, gbs=8, mbs=2), make(n=40, gbs=8, mbs=2, prefetch=True)
    for _ in range(2):
        for a, b in zip(plain, pre):
            assert item_ids(a) == item_ids(b)
            assert plain.state_dict() == pre.state_dict()
            time.sleep(0.002)                              # let the thread read ahead
            assert plain.state_dict() == pre.state_dict()
    # a prefetching loop stopped after 2 steps saves step 2 even though the thread read ahead
    pre2 = make(n=40, gbs=8, mbs=2, prefetch=True)
    for s, _ in enumerate(pre2):
        if s == 1:
            time.sleep(0.05)
            break
    assert pre2.state_dict()["step"] == 2
    resumed = make(n=40, gbs=8, mbs=2)
    resumed.load_state_dict(pre2.state_dict())
    assert item_ids(next(iter(resumed))) == resumed.global_step_indices(0, 2)


class SlowDataset(IndexDataset):
    def __getitem__(self, i):
        time.sleep(0.01)
        return super().__getitem__(i)


def test_prefetch_break_and_delete_returns_promptly():
    base = threading.active_count()
    loader = MicroBatchDataLoader(SlowDataset(64), global_batch_size=4, micro_batch_size=2, prefetch=True)
    t0 = time.perf_counter()
    for _item in loader:
        break
    del loader, _item
    gc.collect()
    assert time.perf_counter() - t0 < 3
    deadline = time.time() + 3
    while threading.active_count() > base and time.time() < deadline:
        time.sleep(0.02)
    assert threading.active_count() == base
    # an iterator dropped without being closed explicitly also stops its thread
    loader = MicroBatchDataLoader(SlowDataset(64), global_batch_size=4, micro_batch_size=2, prefetch=True)
    it = iter(loader)
    next(it)
    del it, loader
    gc.collect()
    deadline = time.time() + 3
    while threading.active_count() > base and time.time() < deadline:
        time.sleep(0.02)
    assert threading.active_count() == base


def test_prefetch_propagates_errors():
    def bad(samples):
        raise RuntimeError("boom in collate")
    loader = make(n=16, gbs=4, mbs=2, collate_fn=bad, prefetch=True)
    with pytest.raises(RuntimeError, match="boom in collate"):
        next(iter(loader))


def test_num_workers_same_items():
    ref = make(n=24, gbs=8, mbs=2, seed=1).bind(1, 2)
    work = make(n=24, gbs=8, mbs=2, seed=1, num_workers=1).bind(1, 2)
    got = [item_ids(item) for item in work]
    assert got == [item_ids(item) for item in ref]
    assert work.state_dict() == ref.state_dict()


def test_stale_iterator_raises():
    loader = make(n=40, gbs=8, mbs=2)
    it = iter(loader)
    next(it)
    loader.load_state_dict(loader.state_dict())
    with pytest.raises(RuntimeError, match="new `for` loop"):
        next(it)


# ---------------------------------------------------------------- bad input
def test_indivisible_batch_sizes():
    with pytest.raises(ValueError, match=r"global_batch_size=10 .*micro_batch_size=4 \* dp_size=1"):
        make(n=40, gbs=10, mbs=4)
    loader = make(n=40, gbs=8, mbs=2)
    with pytest.raises(ValueError, match=r"global_batch_size=8 .*micro_batch_size=2 \* dp_size=3.*multiple of 6"):
        loader.bind(0, 3)
    assert loader.dp_size == 1                            # a failed bind leaves the loader as it was
    with pytest.raises(ValueError, match="dp_rank"):
        loader.bind(2, 2)
    with pytest.raises(ValueError, match="global_batch_size"):
        make(n=40, gbs=0, mbs=1)
    with pytest.raises(ValueError, match="fewer than global_batch_size"):
        make(n=4, gbs=8, mbs=2)
    with pytest.raises(TypeError, match="len"):
        MicroBatchDataLoader(iter(range(3)), global_batch_size=2, micro_batch_size=1)
    with pytest.raises(ValueError, match="resume_mismatch"):
        make(resume_mismatch="ignore")


@pytest.mark.parametrize("collate,match", [
    (lambda s: [1, 2], "mapping"),
    (lambda s: {"ids": torch.zeros(2), "name": ["a", "b"]}, r"'name' of type list"),
    (lambda s: {"ids": np.zeros(2)}, r"'ids' of type ndarray"),
])
def test_bad_collate_output(collate, match):
    with pytest.raises(TypeError, match=match):
        next(iter(make(n=16, gbs=4, mbs=2, collate_fn=collate)))


def test_mismatched_state():
    saved = make(n=40, gbs=8, mbs=2)
    next(iter(saved))
    state = saved.state_dict()
    with pytest.raises(ValueError, match=r"global_batch_size: saved 8, current 16.*resume_mismatch='restart'"):
        make(n=40, gbs=16, mbs=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"dataset_fingerprint: saved \{'length': 40\}, current \{'length': 48\}"):
        make(n=48, gbs=8, mbs=2).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        make().load_state_dict({"epoch": 0})
    state_e1 = state | {"epoch": 1}
    restart = make(n=48, gbs=8, mbs=2, resume_mismatch="restart")
    with pytest.warns(UserWarning, match="restarting epoch 1 at step 0"):
        restart.load_state_dict(state_e1)
    assert (restart.epoch, restart.step_in_epoch) == (1, 0)
    assert item_ids(next(iter(restart))) == restart.global_step_indices(1, 0)


def test_state_is_plain_and_has_the_contract_keys():
    state = make().state_dict()
    assert set(state) == {"epoch", "step", "seed", "global_batch_size", "dataset_fingerprint", "version"}
    assert state["dataset_fingerprint"] == {"length": 40}
    assert json.loads(json.dumps(state)) == state


# ---------------------------------------------------------------- collators
def test_default_collate_types():
    samples = [{"a": torch.tensor([i, i]), "b": np.array([i], dtype=np.int64), "c": i, "d": [i, 1.5], "e": 0.5}
               for i in range(3)]
    out = default_collate(samples)
    assert out["a"].shape == (3, 2) and out["b"].shape == (3, 1) and out["b"].dtype == torch.int64
    assert out["c"].tolist() == [0, 1, 2] and out["d"].shape == (3, 2) and out["e"].dtype == torch.float32
    with pytest.raises(ValueError, match="pad_collate"):
        default_collate([{"a": torch.zeros(2)}, {"a": torch.zeros(3)}])
    with pytest.raises(TypeError, match="'t' has type str"):
        default_collate([{"t": "hello"}])
    with pytest.raises(ValueError, match="same fields"):
        default_collate([{"a": 1}, {"b": 1}])
    with pytest.raises(TypeError, match="'x' of type int"):
        check_batch({"x": 3})


def test_pad_collate():
    samples = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": torch.tensor([8]), "labels": [8]}]
    out = pad_collate(samples, pad_token_id=0, label_pad_id=-100)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert (out["labels"] != -100).sum().item() == 4               # token count for a weighted loss
    out = pad_collate([{"input_ids": [1, 2], "attention_mask": [1, 1], "w": 2.0}, {"input_ids": [3],
                       "attention_mask": [1], "w": 1.0}], pad_token_id=9, pad_to_multiple_of=4)
    assert out["input_ids"].tolist() == [[1, 2, 9, 9], [3, 9, 9, 9]] and out["w"].tolist() == [2.0, 1.0]
    assert out["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
    # as the loader's collate_fn
    class Ragged:
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"input_ids": list(range(1, i + 2)), "labels": list(range(1, i + 2))}
    loader = MicroBatchDataLoader(Ragged(), global_batch_size=4, micro_batch_size=2, collate_fn=pad_collate)
    for item in loader:
        for mb in item:
            assert mb["input_ids"].shape[0] == 2 and mb["labels"].shape == mb["input_ids"].shape


def test_getitems_and_dataset_fingerprint():
    class Batched(IndexDataset):
        fingerprint = "corpus-v1"

        def __init__(self, n):
            super().__init__(n)
            self.batched_calls = 0

        def __getitems__(self, ids):
            self.batched_calls += 1
            return [super(Batched, self).__getitem__(i) for i in ids]

    ds = Batched(16)
    loader = MicroBatchDataLoader(ds, global_batch_size=4, micro_batch_size=2)
    next(iter(loader))
    assert ds.batched_calls == 2
    state = loader.state_dict()
    assert state["dataset_fingerprint"] == {"length": 16, "id": "corpus-v1"}
    other = Batched(16)
    other.fingerprint = "corpus-v2"
    with pytest.raises(ValueError, match="corpus-v1.*corpus-v2"):
        MicroBatchDataLoader(other, global_batch_size=4, micro_batch_size=2).load_state_dict(state)
