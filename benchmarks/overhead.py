"""hyperacc's per-step overhead against a hand-written raw FSDP2 loop.

    .venv/bin/python benchmarks/overhead.py [--rounds 2] [--steps 12] [--nproc 2]

The same Qwen3-MoE (bigger than the test preset so compute dominates), the same mesh (2 CPU
processes, gloo), the same micro-batches and AdamW. The raw loop is what an engineer writes by
hand: `fully_shard` per decoder layer and on the root, gradient sync only on the last
micro-batch, loss divided by the number of micro-batches, clip, step. Runs alternate
(hyperacc, raw, hyperacc, raw, ...), each in its own launch so that peak memory is per variant.
Printed: median step time of each variant, per-rank peak RSS, and the ratio hyperacc/raw last.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODEL = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=8,
             num_experts_per_tok=2, vocab_size=4096)
SEQ, GBS, MBS, WARMUP = 256, 8, 2, 2


def micro_batches(step: int, dp_rank: int, dp_size: int):
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, MODEL["vocab_size"], (GBS, SEQ), generator=gen)
    mine = ids.chunk(dp_size)[dp_rank]
    return [{"input_ids": chunk, "labels": chunk} for chunk in mine.split(MBS)]


def run_hyperacc(steps: int):
    import hyperacc
    from hyperacc.models import build_causal_lm, qwen3_moe_config

    acc = hyperacc.Accelerator(checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=0)
    model = build_causal_lm(qwen3_moe_config(**MODEL), meta_device=os.environ.get("BENCH_META", "1") == "1")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.prepare(model, optimizer)
    times = []
    for step in range(steps):
        batch = micro_batches(step, acc.dp_rank, acc.dp_size)
        start = time.perf_counter()
        with acc.accumulate(model, batch) as mbs:
            for mb in mbs:
                acc.backward(model(**mb).loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    acc.end_training()
    return times


def run_raw(steps: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from hyperacc.models import build_causal_lm, qwen3_moe_config

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = build_causal_lm(qwen3_moe_config(**MODEL))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(steps):
        batch = micro_batches(step, rank, world)
        start = time.perf_counter()
        for index, mb in enumerate(batch):
            model.set_requires_gradient_sync(index == len(batch) - 1)
            (model(**mb).loss / len(batch)).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), 1.0, norm)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    return times


def worker(variant: str, steps: int, out: str) -> None:
    times = (run_hyperacc if variant == "hyperacc" else run_raw)(steps)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    record = {"times": times[WARMUP:], "peak_mib": peak_mib}
    rank = int(os.environ.get("RANK", 0))
    with open(f"{out}.rank{rank}", "w") as handle:
        json.dump(record, handle)


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(variant: str, steps: int, nproc: int, out: Path) -> list:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=str(REPO), HYPERACC_DEVICE="cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", __file__, "--worker", variant,
           "--steps", str(steps), "--out", str(out)]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=900)
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(nproc)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", choices=["hyperacc", "raw"])
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.out)

    import tempfile
    times = {"hyperacc": [], "raw": []}
    peaks = {"hyperacc": [], "raw": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for variant in ("hyperacc", "raw"):
                ranks = launch(variant, args.steps, args.nproc, Path(tmp) / f"{variant}{round_index}")
                # A step takes as long as its slowest rank.
                times[variant] += [max(step) for step in zip(*(r["times"] for r in ranks))]
                peaks[variant].append([r["peak_mib"] for r in ranks])
    median = {v: statistics.median(t) for v, t in times.items()}
    print(f"model: Qwen3-MoE {MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, "
          f"{MODEL['num_experts']} experts; seq {SEQ}, global batch {GBS}, micro-batch {MBS}, "
          f"{args.nproc} CPU processes (gloo), {args.rounds} alternated rounds x {args.steps - WARMUP} steps")
    for variant in ("raw", "hyperacc"):
        peak = [max(p[r] for p in peaks[variant]) for r in range(args.nproc)]
        print(f"{variant:9s} median step {median[variant] * 1000:8.1f} ms   peak RSS per rank (MiB): "
              + ", ".join(f"{p:.0f}" for p in peak))
    print(f"step-time ratio hyperacc/raw: {median['hyperacc'] / median['raw']:.3f} (goal <= 1.03)")


if __name__ == "__main__":
    main()
