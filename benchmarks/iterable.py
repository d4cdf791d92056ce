"""A stream (iterable dataset without len()) through prepare(): hyperacc.Accelerator vs accelerate.Accelerator.

    .venv/bin/python benchmarks/iterable.py [--steps 30] [--warmup 5] [--rounds 2]

One torchrun launch of 2 processes measures both engines in the same processes, in alternating rounds
(accelerate, hyperacc, accelerate, ...; accelerate's singletons are reset between them, the process
group stays), on the same seeded model, stream and loop:
  loader   iterating the prepared loader alone (accelerate's DataLoaderDispatcher, the default for an
           iterable dataset: rank 0 reads, every rank gets its slice; hyperacc wraps it in its resumable
           proxy), time per batch, for a torch IterableDataset and a `datasets` stream of a local jsonl
  train    one accelerate-style step per batch (forward, backward, clip, AdamW step) of a tiny Qwen3
           (fp32) on the torch stream: accelerate runs DDP over gloo (ACCELERATE_USE_CPU; accelerate
           alone does not shard on CPU), hyperacc FSDP2 over gloo
Printed: the median over rounds of each median time (the slowest rank's), then hyperacc/accelerate.
Not a test: timings are noisy on a shared machine.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_timing import finish_workers, launch_workers  # noqa: E402

SEQ, BATCH, VOCAB, SAMPLES = 128, 4, 512, 4096


def token_row(i: int) -> dict:
    start, stride = (7919 * i) % VOCAB, 1 + i % 8
    return {"input_ids": [(start + stride * t) % VOCAB for t in range(SEQ)]}


def torch_stream():
    import torch
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            for i in range(SAMPLES):
                yield {"input_ids": torch.tensor(token_row(i)["input_ids"])}

    return Stream()


def hf_stream(path: str):
    from datasets import load_dataset

    return load_dataset("json", data_files=path, split="train", streaming=True).with_format("torch")


def make_accelerator(engine: str):
    if engine == "accelerate":
        import accelerate

        return accelerate.Accelerator(cpu=True)
    import hyperacc

    return hyperacc.Accelerator()


def reset_accelerate_state() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def slowest(acc, seconds: float) -> float:
    import torch

    return float(acc.gather(torch.tensor([seconds])).max())


def time_loader(engine: str, dataset, batches: int, warmup: int) -> float:
    from torch.utils.data import DataLoader

    acc = make_accelerator(engine)
    loader = acc.prepare(DataLoader(dataset, batch_size=BATCH))
    times, iterator = [], iter(loader)
    for step in range(warmup + batches):
        acc.wait_for_everyone()
        start = time.perf_counter()
        next(iterator)
        elapsed = slowest(acc, time.perf_counter() - start)
        if step >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def time_training(engine: str, steps: int, warmup: int) -> dict:
    import torch
    from torch.utils.data import DataLoader
    from transformers import Qwen3Config, Qwen3ForCausalLM

    acc = make_accelerator(engine)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                         max_position_embeddings=SEQ, tie_word_embeddings=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = acc.prepare(model, optimizer, DataLoader(torch_stream(), batch_size=BATCH))
    times, losses, iterator = [], [], iter(loader)
    for step in range(warmup + steps):
        batch = next(iterator)
        acc.wait_for_everyone()
        start = time.perf_counter()
        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        elapsed = slowest(acc, time.perf_counter() - start)
        losses.append(float(acc.gather(loss.detach()[None]).mean()))
        if step >= warmup:
            times.append(elapsed)
    return {"step_s": statistics.median(times), "first_loss": losses[0], "last_loss": losses[-1]}


def worker(out: str, steps: int, warmup: int, rounds: int) -> None:
    import torch.distributed as dist

    os.environ["ACCELERATE_USE_CPU"] = "true"      # accelerate: DDP over gloo (MULTI_CPU)
    dist.init_process_group("gloo")
    folder = os.path.dirname(out)
    path = os.path.join(folder, "stream.jsonl")
    if dist.get_rank() == 0:
        with open(path, "w") as handle:
            handle.writelines(json.dumps(token_row(i)) + "\n" for i in range(SAMPLES))
    dist.barrier()
    results = {}
    for _ in range(rounds):
        for engine in ("accelerate", "hyperacc"):
            record = results.setdefault(engine, {"torch_loader_s": [], "hf_loader_s": [], "train": []})
            record["torch_loader_s"].append(time_loader(engine, torch_stream(), steps, warmup))
            record["hf_loader_s"].append(time_loader(engine, hf_stream(path), steps, warmup))
            record["train"].append(time_training(engine, steps, warmup))
            reset_accelerate_state()
    finish_workers(out, results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed batches / steps per measurement")
    parser.add_argument("--warmup", type=int, default=5, help="untimed ones first")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of both engines")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.worker:
        return worker(args.worker, args.steps, args.warmup, args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        results = launch_workers(__file__, os.path.join(tmp, "result.json"),
                                 [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--rounds={args.rounds}"])

    def median(engine, key):
        values = results[engine][key] if key != "train" else [r["step_s"] for r in results[engine]["train"]]
        return statistics.median(values)

    print(f"2 processes (gloo), batch {BATCH} x {SEQ} tokens per rank, {args.steps} timed after {args.warmup}, "
          f"{args.rounds} alternating rounds; median ms (slowest rank):")
    for key, label in (("torch_loader_s", "loader, torch IterableDataset"), ("hf_loader_s", "loader, datasets stream"),
                       ("train", "train step, tiny Qwen3")):
        a, h = median("accelerate", key), median("hyperacc", key)
        print(f"  {label:32s} accelerate {1000 * a:8.2f}  hyperacc {1000 * h:8.2f}  ratio {h / a:.3f}")
    for engine in ("accelerate", "hyperacc"):
        run = results[engine]["train"][-1]
        print(f"  {engine:10s} loss {run['first_loss']:.4f} -> {run['last_loss']:.4f}")


if __name__ == "__main__":
    main()
