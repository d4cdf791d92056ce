"""Depend, don't rewrite (issue 39): hyperacc's data / schedule / logging pieces against the maintained
libraries that could replace them, in one run (~1 min on 2 CPU cores). Prints, per piece, the
library / ours ratio of the time (> 1: the library is slower) and, for equality, the largest difference.

  packing   `hyperacc.data.packing.pack_collate` vs transformers' `DataCollatorWithFlattening`:
            the same rows (max |diff| over input_ids / labels / position_ids) and the collate time per
            micro-batch of tensors (the library's list round trip is what costs);
  blend     `hyperacc.data.packed.BlendedDataset` (weights 0.7 / 0.3 over two Megatron prefixes) vs
            `datasets.interleave_datasets(probabilities=, seed=0, stopping_strategy=)` over the same windows
            as Arrow tables: rows equal to ours at the same index (the order), the largest deviation of a
            prefix's share from the weights (samples), the build time (ours: the index; the library: the
            copy of every window into Arrow + interleave) and the time per random `ds[i]`;
  lr        `hyperacc.training.loop.lr_lambda_scheduler` with the example's `LRSchedulerConfig` (warm-up
            (s+1)/w, cosine / linear / constant decay to min_lr_ratio) vs transformers' schedules: the
            largest |lr difference| over every step (lr 3e-4) per candidate, and the per-step time;
  metrics   `hyperacc.training.metrics_sinks.TensorBoardSink` (accelerate's `TensorBoardTracker`) vs the
            former hand-written sink (torch's `SummaryWriter.add_scalar` per key, no flush per record):
            the same scalars (max |diff|) and the time per record; skipped without `tensorboard`.

    python benchmarks/libraries_data.py
"""
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# benchmarks/peft.py would shadow the peft package that transformers.optimization imports; the example's
# LRSchedulerConfig (examples/config_schema.py) is the schedule compared
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "examples")]

from hyperacc.data.megatron_writer import IndexedDatasetWriter  # noqa: E402
from hyperacc.data.packed import build_packed_dataset  # noqa: E402
from hyperacc.data.packing import pack_collate  # noqa: E402
from hyperacc.training.loop import lr_lambda_scheduler  # noqa: E402


def best_of(fn, reps, rounds=3):
    """Seconds per call, the best of ``rounds`` rounds of ``reps`` calls (a shared machine: the least disturbed)."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - start) / reps)
    return min(times)


def packing():
    from transformers import DataCollatorWithFlattening

    library = DataCollatorWithFlattening(return_tensors="pt")
    gen = torch.Generator().manual_seed(0)
    for count, (low, high) in [(4, (8, 32)), (8, (256, 1024)), (16, (1024, 4096))]:
        samples = []
        for _ in range(count):
            n = int(torch.randint(low, high, (1,), generator=gen))
            ids = torch.randint(0, 150_000, (n,), generator=gen)
            labels = ids.clone()
            labels[: n // 3] = -100
            samples.append({"input_ids": ids, "labels": labels})
        a, b = pack_collate(samples), library(samples)
        same_fields = sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype for k in a)
        diff = max(int((a[k] - b[k]).abs().max()) for k in a)
        ours, theirs = best_of(lambda: pack_collate(samples), 20), best_of(lambda: library(samples), 20)
        tokens = sum(len(s["input_ids"]) for s in samples)
        print(f"packing   {count:2d} samples, {tokens:6d} tokens: same fields/dtypes "
              f"{same_fields}, max |diff| {diff}; ours {ours * 1e3:.3f} ms, library {theirs * 1e3:.3f} ms, "
              f"ratio {theirs / ours:.1f}")


def blend(tmp):
    import datasets

    datasets.disable_progress_bars()
    rng = np.random.default_rng(0)
    prefixes = []
    for name, tokens in (("a", 2_000_000), ("b", 500_000)):
        with IndexedDatasetWriter(os.path.join(tmp, name), vocab_size=50_000) as writer:
            for doc in np.array_split(rng.integers(0, 50_000, tokens), tokens // 1000):
                writer.add_document(doc)
        prefixes.append(os.path.join(tmp, name))
    spec = f"0.7 {prefixes[0]} 0.3 {prefixes[1]}"
    start = time.perf_counter()
    ours = build_packed_dataset(spec, 128)
    build_ours = time.perf_counter() - start
    parts = ours.datasets
    start = time.perf_counter()
    tables = [datasets.Dataset.from_dict({"input_ids": np.stack([p.window(i) for i in range(len(p))]).astype(np.int64)})
              for p in parts]
    library = datasets.interleave_datasets(tables, probabilities=ours.weights.tolist(), seed=0,
                                           stopping_strategy="first_exhausted").with_format("torch")
    build_library = time.perf_counter() - start
    # which source each of the library's first rows came from (windows are distinct random tokens)
    first = {parts[0].window(i).tobytes(): i for i in range(len(parts[0]))}
    n = 4000
    rows = library[:n]["input_ids"].numpy().astype(parts[0].tokens.dtype)
    picks = np.array([0 if row.tobytes() in first else 1 for row in rows])
    equal = sum(np.array_equal(rows[i], ours.datasets[ours.dataset_index[i]].window(int(ours.dataset_sample_index[i])))
                for i in range(n))
    k = np.arange(1, n + 1)
    deviation = {"ours": float(np.max(np.abs(np.cumsum(ours.dataset_index[:n] == 0) - ours.weights[0] * k))),
                 "library": float(np.max(np.abs(np.cumsum(picks == 0) - ours.weights[0] * k)))}
    index = np.random.default_rng(1).integers(0, min(len(ours), len(library)), 2000)
    access = {}
    for name, ds in (("ours", ours), ("library", library)):
        def read_all(ds=ds):
            for i in index:
                ds[int(i)]
        access[name] = best_of(read_all, 1) / len(index)
    print(f"blend     {len(ours)} samples (library: {len(library)}): rows equal to ours at the same index {equal}/{n}; "
          f"largest prefix deviation from the weights ours {deviation['ours']:.1f}, library {deviation['library']:.1f} "
          f"samples; build ours {build_ours * 1e3:.1f} ms, library {build_library * 1e3:.0f} ms (Arrow copy + "
          f"interleave), ratio {build_library / build_ours:.0f}; random ds[i] ours {access['ours'] * 1e6:.1f} us, "
          f"library {access['library'] * 1e6:.1f} us, ratio {access['library'] / access['ours']:.1f}")


def lr():
    import transformers.optimization as schedules
    from config_schema import LRSchedulerConfig

    def optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)

    def run(scheduler, steps):
        out = []
        for _ in range(steps):
            out.append(scheduler.get_last_lr()[0])
            scheduler.optimizer.step()
            scheduler.step()
        return out

    candidates = {
        "get_constant_schedule_with_warmup": lambda o, w, t, m: schedules.get_constant_schedule_with_warmup(o, w),
        "get_linear_schedule_with_warmup": lambda o, w, t, m: schedules.get_linear_schedule_with_warmup(o, w, t),
        "get_cosine_schedule_with_warmup": lambda o, w, t, m: schedules.get_cosine_schedule_with_warmup(o, w, t),
        "get_cosine_with_min_lr_schedule_with_warmup": lambda o, w, t, m:
            schedules.get_cosine_with_min_lr_schedule_with_warmup(o, w, t, min_lr_rate=m),
        "get_cosine_with_min_lr_schedule_with_warmup_lr_rate": lambda o, w, t, m:
            schedules.get_cosine_with_min_lr_schedule_with_warmup_lr_rate(o, w, t, min_lr_rate=m),
        "get_wsd_schedule(decay=cosine)": lambda o, w, t, m:
            schedules.get_wsd_schedule(o, w, t - w, num_stable_steps=0, decay_type="cosine", min_lr_ratio=m),
        "get_wsd_schedule(decay=linear)": lambda o, w, t, m:
            schedules.get_wsd_schedule(o, w, t - w, num_stable_steps=0, decay_type="linear", min_lr_ratio=m),
    }
    total = 2000
    for decay in ("cosine", "linear", "constant"):
        for warmup in (0, 100):
            config = LRSchedulerConfig(warmup_steps=warmup, min_lr_ratio=0.1, decay=decay)
            ours = run(lr_lambda_scheduler(optimizer(), config, total), total + 10)
            diffs = {name: max(abs(a - b) for a, b in zip(ours, run(make(optimizer(), warmup, total, 0.1), total + 10)))
                     for name, make in candidates.items()}
            best = min(diffs, key=diffs.get)
            print(f"lr        decay={decay:8s} warmup={warmup:3d}: closest {best} max |lr diff| {diffs[best]:.2e}; "
                  + ", ".join(f"{name.replace('_schedule', '').replace('get_', '')} {d:.1e}"
                              for name, d in diffs.items()))
    config = LRSchedulerConfig(warmup_steps=100, min_lr_ratio=0.1, decay="cosine")
    ours = best_of(lambda: run(lr_lambda_scheduler(optimizer(), config, total), total), 1)
    library = candidates["get_cosine_with_min_lr_schedule_with_warmup"]
    theirs = best_of(lambda: run(library(optimizer(), 100, total, 0.1), total), 1)
    print(f"lr        time per step ours {ours / total * 1e6:.1f} us, library {theirs / total * 1e6:.1f} us, "
          f"ratio {theirs / ours:.2f}")


def metrics(tmp):
    try:
        import tensorboard  # noqa: F401
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("metrics   skipped: tensorboard is not installed (pip install tensorboard)")
        return
    from accelerate import PartialState

    from hyperacc.training.metrics_sinks import _TB_STEP_KEYS, TensorBoardSink

    PartialState()
    records = [{"step": s, "epoch": 0, "loss": 1.0 / s, "grad_norm": 2.0, "lr": 1e-4, "step_time": 0.5,
                "tokens_per_second": 128.0, "tokens": 64, "samples": 2, "memory_rss_gib": 1.5, "time": 0.0}
               for s in range(1, 1001)]
    evaluation = {"step": 1000, "eval_loss": 2.0, "eval_ppl": math.exp(2.0)}

    def former(path):               # the hand-written sink this replaced
        writer = SummaryWriter(log_dir=path)
        for record in records:
            for key in _TB_STEP_KEYS:
                if record.get(key) is not None:
                    writer.add_scalar(f"train/{key}", record[key], record["step"])
        writer.add_scalar("eval/loss", evaluation["eval_loss"], 1000)
        writer.add_scalar("eval/ppl", evaluation["eval_ppl"], 1000)
        writer.flush()
        writer.close()

    def current(path):
        sink = TensorBoardSink(path, main_process_only=False)
        for i in range(0, len(records), 10):
            sink.write(records[i:i + 10], "step")
        sink.write([evaluation], "eval")
        sink.close()

    times, runs = {"former": [], "current": []}, 0
    for _ in range(3):
        for name, fn in (("former", former), ("current", current)):
            runs += 1
            start = time.perf_counter()
            fn(os.path.join(tmp, f"tb{runs}-{name}"))
            times[name].append(time.perf_counter() - start)

    def scalars(path):
        acc = EventAccumulator(path)
        acc.Reload()
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

    a, b = scalars(os.path.join(tmp, "tb1-former")), scalars(os.path.join(tmp, "tb2-current"))
    diff = max(abs(x[1] - y[1]) + abs(x[0] - y[0]) for tag in a for x, y in zip(a[tag], b.get(tag, [])))
    print(f"metrics   TensorBoard, {len(records)} step records + 1 eval: same tags {sorted(a) == sorted(b)}, "
          "max |diff| "
          f"{diff:.1e}; former sink {min(times['former']) / len(records) * 1e3:.3f} ms/record, accelerate's tracker "
          f"{min(times['current']) / len(records) * 1e3:.3f} ms/record, "
          f"ratio {min(times['current']) / min(times['former']):.2f}")


def main():
    torch.set_num_threads(1)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        packing()
        blend(tmp)
        lr()
        metrics(tmp)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
