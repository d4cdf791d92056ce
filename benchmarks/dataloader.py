"""Benchmark MicroBatchDataLoader: throughput vs torch DataLoader, and resume cost at step 1e6 vs 1.

    .venv/bin/python benchmarks/dataloader.py [--seq-len 512] [--items 300] [--repeats 3]

Throughput: the same in-memory token dataset and the same collate function, one item = the same
number of samples (global_batch_size) for both loaders: torch's DataLoader with
batch_size=global_batch_size, ours with micro_batch_size=global_batch_size // 4 (4 micro-batches
per item), both shuffling, num_workers=0; also torch's DataLoader with
batch_size=micro_batch_size, grouped 4 per item (the same collate calls as ours). Prefetch is
also timed with a simulated GIL-free training step after each item. Resume: load_state_dict + the
first item of a fresh loader, at step 1 and at step 10**6, for an index-only dataset (shuffle=False, 10**9 samples) and
for a shuffled one (the epoch's permutation is drawn once, at either step). The ratios come last.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hyperacc.data import MicroBatchDataLoader  # noqa: E402
from hyperacc.data.collate import default_collate  # noqa: E402


class TokenDataset:
    """n samples of seq_len tokens, stored in one tensor (so loading cost is the loader's own)."""

    def __init__(self, n: int, seq_len: int):
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 32000, (n, seq_len), generator=gen)

    def __len__(self):
        return self.tokens.shape[0]

    def __getitem__(self, i):
        row = self.tokens[i]
        return {"input_ids": row, "labels": row}


class IndexOnly:
    """Looks like a huge dataset; builds each sample on demand."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"idx": torch.tensor(i)}


def with_step(make_iter, seconds: float):
    """Wrap a loader so that each item is followed by a simulated training step that releases the GIL
    (as accelerator work does); this is where prefetching can hide the collate time."""
    def make():
        for item in make_iter():
            yield item
            time.sleep(seconds)
    return make


def items_per_second(makers: dict, items: int, repeats: int) -> dict:
    """Median items/s per loader; one untimed warm-up round, then rounds interleaving the loaders."""
    rates = {name: [] for name in makers}
    for round_ in range(repeats + 1):
        for name, make_iter in makers.items():
            it = make_iter()
            t0 = time.perf_counter()
            for _ in range(items):
                next(it)
            if round_:
                rates[name].append(items / (time.perf_counter() - t0))
            del it
    return {name: statistics.median(r) for name, r in rates.items()}


def resume_seconds(make_loader, step: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        loader = make_loader()
        state = loader.state_dict() | {"step": step}
        t0 = time.perf_counter()
        loader.load_state_dict(state)
        next(iter(loader))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--items", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shuffled-resume-samples", type=int, default=10_000_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = args.global_batch_size
    n = g * args.items
    dataset = TokenDataset(n, args.seq_len)

    def ours():
        loader = MicroBatchDataLoader(dataset, global_batch_size=g, micro_batch_size=g // 4,
                                      collate_fn=default_collate, shuffle=True, seed=0)
        return iter(loader)

    def ours_prefetch():
        loader = MicroBatchDataLoader(dataset, global_batch_size=g, micro_batch_size=g // 4,
                                      collate_fn=default_collate, shuffle=True, seed=0, prefetch=True)
        return iter(loader)

    def torch_dl():
        loader = torch.utils.data.DataLoader(dataset, batch_size=g, shuffle=True, drop_last=True,
                                             collate_fn=default_collate,
                                             generator=torch.Generator().manual_seed(0))
        return iter(loader)

    def torch_dl_micro():
        # the same micro-batches as ours: 4 torch batches of global_batch_size // 4 make one item
        loader = torch.utils.data.DataLoader(dataset, batch_size=g // 4, shuffle=True, drop_last=True,
                                             collate_fn=default_collate,
                                             generator=torch.Generator().manual_seed(0))
        it = iter(loader)
        return (list(group) for group in zip(it, it, it, it))

    rates = items_per_second({"torch": torch_dl, "torch_micro": torch_dl_micro, "ours": ours,
                              "prefetch": ours_prefetch}, args.items, args.repeats)
    rate_torch, rate_torch_micro, rate_ours, rate_pref = (rates[k] for k in ("torch", "torch_micro", "ours",
                                                                                "prefetch"))
    print(f"throughput ({g} samples x {args.seq_len} tokens per item, {args.items} items):")
    print(f"  torch DataLoader           {rate_torch:10.1f} items/s")
    print(f"  torch DataLoader, 4 x {g // 4:<4d} {rate_torch_micro:10.1f} items/s")
    print(f"  MicroBatchDataLoader       {rate_ours:10.1f} items/s")
    print(f"  MicroBatchDataLoader+pref. {rate_pref:10.1f} items/s")

    def flat():
        return MicroBatchDataLoader(IndexOnly(10 ** 9), global_batch_size=8, micro_batch_size=2, shuffle=False)

    def shuffled():
        return MicroBatchDataLoader(IndexOnly(args.shuffled_resume_samples), global_batch_size=8,
                                    micro_batch_size=2, shuffle=True)

    reps = max(args.repeats, 5)
    flat_1, flat_big = resume_seconds(flat, 1, reps), resume_seconds(flat, 10 ** 6, reps)
    shuf_1, shuf_big = resume_seconds(shuffled, 1, args.repeats), resume_seconds(shuffled, 10 ** 6, args.repeats)
    step_s = 1.0 / rate_ours          # a training step as long as one item's collate
    sim = items_per_second({"ours": with_step(ours, step_s), "prefetch": with_step(ours_prefetch, step_s)},
                           args.items // 2, args.repeats)
    print(f"with a simulated {step_s * 1e6:.0f} us GIL-free training step after each item:")
    print(f"  MicroBatchDataLoader       {sim['ours']:10.1f} items/s")
    print(f"  MicroBatchDataLoader+pref. {sim['prefetch']:10.1f} items/s")
    print("resume (load_state_dict + first item), median:")
    print(f"  index-only, 1e9 samples, shuffle=False: step 1 {flat_1 * 1e6:9.1f} us, "
          f"step 1e6 {flat_big * 1e6:9.1f} us")
    print(f"  {args.shuffled_resume_samples:.0e} samples, shuffle=True (incl. randperm): "
          f"step 1 {shuf_1 * 1e3:7.1f} ms, step 1e6 {shuf_big * 1e3:7.1f} ms")
    print("ratios:")
    print(f"  throughput MicroBatchDataLoader / torch DataLoader = {rate_ours / rate_torch:.3f}")
    print(f"  throughput with prefetch / torch DataLoader        = {rate_pref / rate_torch:.3f}")
    print(f"  throughput MicroBatchDataLoader / torch 4 x micro  = {rate_ours / rate_torch_micro:.3f}")
    print(f"  with simulated step: prefetch / no prefetch        = {sim['prefetch'] / sim['ours']:.3f}")
    print(f"  resume step 1e6 / step 1 (shuffle=False)           = {flat_big / flat_1:.3f}   (goal <= 1.5)")
    print(f"  resume step 1e6 / step 1 (shuffle=True)            = {shuf_big / shuf_1:.3f}   (goal <= 1.5)")


if __name__ == "__main__":
    main()
