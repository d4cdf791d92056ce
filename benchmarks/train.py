"""Throughput of examples/train_qwen.py's training step vs a raw FSDP2 loop.

    python benchmarks/train.py [--steps 20] [--warmup 5] [--rounds 3]

CPU: starts itself on 2 processes (torchrun, gloo) and measures, on the same tiny Qwen3-MoE, data,
global batch (8 x 128 tokens) and micro-batching (2 per rank):
  raw      - plain `fully_shard` per decoder layer + root, AdamW, token-mean loss by hand
             (one all-reduce of the token count, loss scaled per micro-batch), no_sync via
             set_requires_gradient_sync, global-norm clipping; step time measured as the example's
             (from the previous step's end to this one's, data loading included; slowest rank);
  example  - examples/train_qwen.main() itself (production mode, no eval, no checkpoint),
             tokens/s from its JSONL (step_time = the slowest rank's);
alternating raw, example, raw, ... (--rounds example runs); prints the median tokens/s of each and
the example/raw ratio of the medians (last).
GPU (when CUDA is available): tokens/s and MFU of the example on one GPU with a larger
Qwen3-MoE in bf16 (peak FLOP/s from HYPERACC_PEAK_TFLOPS, default 989 = H100/H200 dense bf16);
skipped with a message on a CPU-only machine.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "examples"))

GBS, MBS, SEQ, LR = 8, 2, 128, 3e-3


def _raw_loop(steps: int, warmup: int) -> float:
    """tokens/s of a hand-written FSDP2 loop (this rank's view; times are the max over ranks)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from hyperacc.data.loader import MicroBatchDataLoader
    from hyperacc.data.text import build_train_dataset
    from hyperacc.models import build_causal_lm, qwen3_moe_config

    rank, world = dist.get_rank(), dist.get_world_size()
    dataset, tok = build_train_dataset(seq_len=SEQ)
    model = build_causal_lm(qwen3_moe_config(vocab_size=len(tok), use_cache=False), seed=42)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    loader = MicroBatchDataLoader(dataset, global_batch_size=GBS, micro_batch_size=MBS, seed=42).bind(rank, world)
    times, tokens = [], []
    start = time.perf_counter()   # step time = previous step's end to this one's (data loading included),
    for index, batch in enumerate(loader):    # the example's step_time definition
        if index == warmup + steps:
            break
        local = torch.tensor([float(sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in batch))])
        dist.all_reduce(local)
        total = float(local)
        for i, mb in enumerate(batch):
            model.set_requires_gradient_sync(i == len(batch) - 1)
            n = int((mb["labels"][:, 1:] != -100).sum())
            loss = model(**mb).loss * (n * world / total)      # FSDP averages over ranks
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        end = time.perf_counter()
        times.append(end - start)
        tokens.append(total)   # the step's valid label tokens over all ranks: what the example reports
        start = end
    slowest = torch.tensor(times[warmup:])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)   # per step, the slowest rank (as the example's JSONL)
    return sum(tokens[warmup:]) / float(slowest.sum())


def _example(steps: int, warmup: int, extra=()) -> tuple:
    """(tokens/s, records) of train_qwen.main() over the steps after ``warmup``."""
    import torch.distributed as dist
    import train_qwen

    directory = tempfile.mkdtemp(prefix="hyperacc_bench_")
    metrics = os.path.join(directory, "metrics.jsonl")
    train_qwen.main([f"--training.max_steps={warmup + steps}", "--eval.eval_steps=0",
                     "--checkpoint.save_ckpt=false", "--logging.progress_bar=false",
                     "--logging.logging_steps=1000", f"--logging.metrics_file={metrics}", *extra])
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        return None, None
    with open(metrics) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    timed = [r for r in records if "loss" in r][warmup:]
    return sum(r["tokens"] for r in timed) / sum(r["step_time"] for r in timed), timed


def worker(args) -> None:
    import statistics

    import torch.distributed as dist

    dist.init_process_group("gloo")
    # On a shared machine the load drifts by more than the effect measured: alternate the two
    # (raw, example, raw, example, ..., raw) and compare medians.
    raw, example = [_raw_loop(args.steps, args.warmup)], []
    for _ in range(args.rounds):
        example.append(_example(args.steps, args.warmup)[0])   # the example reuses this process group
        raw.append(_raw_loop(args.steps, args.warmup))
    if dist.get_rank() == 0:
        print(json.dumps({"raw_tokens_per_s": statistics.median(raw), "raw_runs": raw,
                          "example_tokens_per_s": statistics.median(example), "example_runs": example}), flush=True)
    dist.destroy_process_group()


def gpu(args) -> None:
    import torch

    if not torch.cuda.is_available():
        print("GPU: skipped (no CUDA device on this machine)")
        return
    overrides = {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
                 "num_key_value_heads": 4, "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4,
                 "moe_intermediate_size": 512, "max_position_embeddings": 2048}
    flags = [f"--model.overrides={json.dumps(overrides)}", "--data.seq_len=1024",
             "--training.global_batch_size=16", "--training.micro_batch_size=4",
             "--fsdp.mixed_precision=bf16", "--model.attn_implementation=sdpa"]
    rate, records = _example(args.steps, args.warmup, flags)
    from hyperacc.models import build_causal_lm, qwen3_moe_config
    model = build_causal_lm(qwen3_moe_config(**overrides, vocab_size=512), meta_device=True)
    total = sum(p.numel() for n, p in model.named_parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * overrides["num_experts_per_tok"] / overrides["num_experts"]
    peak = float(os.environ.get("HYPERACC_PEAK_TFLOPS", "989")) * 1e12
    mfu = 6 * active * rate / peak   # attention FLOPs left out: a lower bound
    print(f"GPU ({torch.cuda.get_device_name()}): example tokens/s={rate:.0f}  active params={active / 1e6:.1f} M  "
          f"MFU={100 * mfu:.2f}% of {peak / 1e12:.0f} TFLOP/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="example runs, alternating with raw runs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gpu-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.gpu_only:
        return gpu(args)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           __file__, "--worker", f"--steps={args.steps}", f"--warmup={args.warmup}", f"--rounds={args.rounds}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("{") and "raw_tokens_per_s" in line:
            result = json.loads(line)
    if proc.returncode or result is None:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"CPU benchmark failed (exit {proc.returncode})")
    gpu_proc = subprocess.run([sys.executable, __file__, "--gpu-only", f"--steps={args.steps}",
                               f"--warmup={args.warmup}"], capture_output=True, text=True)
    gpu_lines = [line for line in gpu_proc.stdout.splitlines() if line.startswith("GPU")]
    print(f"CPU, 2 processes, tiny Qwen3-MoE, {GBS} x {SEQ} tokens/step, micro-batch {MBS}, "
          f"{args.steps} timed steps after {args.warmup}:")
    runs = lambda key: ", ".join(f"{v:.0f}" for v in result[key])  # noqa: E731
    print(f"  raw FSDP2 loop      {result['raw_tokens_per_s']:10.0f} tokens/s  (median of {runs('raw_runs')})")
    print(f"  example step        {result['example_tokens_per_s']:10.0f} tokens/s  (median of {runs('example_runs')})")
    print("\n".join(gpu_lines) or f"GPU: failed ({gpu_proc.stderr[-500:]})")
    print(f"ratio example/raw (CPU): {result['example_tokens_per_s'] / result['raw_tokens_per_s']:.3f}")


if __name__ == "__main__":
    main()
