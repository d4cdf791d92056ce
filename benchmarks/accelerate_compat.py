"""One accelerate-style training script under accelerate's Accelerator and under hyperacc's.

    .venv/bin/python benchmarks/accelerate_compat.py [--steps 12] [--warmup 3]

The worker (this file with --worker) is a plain accelerate training loop — Accelerator(), prepare of
model/optimizer/DataLoader/scheduler, backward, clip_grad_norm_, step, gather of the loss — whose
only hyperacc-specific line is the import, chosen by ACCEL_IMPL, exactly as in
tests/accel_scripts/. The model is a ~50 M-parameter Llama in fp32 built from a config (big enough
that optimizer state and gradients dominate memory), the data a seeded synthetic token set.
Four launches, one after the other:
  accelerate 1 process   python benchmarks/accelerate_compat.py --worker
  hyperacc   1 process   same, ACCEL_IMPL=hyperacc
  accelerate 2 processes accelerate launch --config_file accelerate_configs/cpu_fsdp2_2proc.yaml ...
                         with ACCELERATE_USE_CPU=true: DDP over gloo, every rank holds everything
  hyperacc   2 processes the same launch without it: FSDP2 over gloo, every rank holds a shard
Printed: median wall time per step (after the warm-up steps; the slowest rank's), peak RSS of each
rank, the final loss (mean over ranks of the last step), then the ratios hyperacc/accelerate last.
Not a test: timings are noisy on a shared machine.
"""
import os
if os.environ.get("ACCEL_IMPL") == "hyperacc":
    from hyperacc import Accelerator
else:
    from accelerate import Accelerator

import argparse
import json
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "accelerate_configs" / "cpu_fsdp2_2proc.yaml"
VOCAB, SEQ, BATCH, SAMPLES = 8192, 64, 2, 256
MODEL = dict(vocab_size=VOCAB, hidden_size=640, intermediate_size=1728, num_hidden_layers=8,
             num_attention_heads=10, num_key_value_heads=5, max_position_embeddings=SEQ,
             tie_word_embeddings=False)


def synthetic_tokens(n: int, seed: int = 0):
    """Arithmetic progressions mod VOCAB (random start, one of 8 strides): learnable, so the loss falls."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=gen)
    stride = torch.randint(1, 9, (n, 1), generator=gen)
    return (start + stride * torch.arange(SEQ)[None, :]) % VOCAB


def worker(args) -> None:
    """The accelerate-style training script that is measured."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import AutoModelForCausalLM, LlamaConfig, get_cosine_schedule_with_warmup, set_seed

    accelerator = Accelerator()
    set_seed(42)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**MODEL))
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loader = DataLoader(TensorDataset(synthetic_tokens(SAMPLES)), batch_size=BATCH, shuffle=True)
    total = args.warmup + args.steps
    scheduler = get_cosine_schedule_with_warmup(optimizer, 2 * accelerator.num_processes,
                                                total * accelerator.num_processes)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    model.train()
    times, losses = [], []
    iterator = iter(loader)
    for step in range(total):
        (input_ids,) = next(iterator)
        start = time.perf_counter()
        loss = model(input_ids=input_ids, labels=input_ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        mean_loss = accelerator.gather(loss.detach()[None]).mean().item()
        elapsed = torch.tensor([time.perf_counter() - start])
        elapsed = accelerator.gather(elapsed).max().item()     # the slowest rank's step
        if step >= args.warmup:
            times.append(elapsed)
        losses.append(mean_loss)

    peak_kib = torch.tensor([float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)])
    peaks = accelerator.gather(peak_kib).tolist()
    if accelerator.is_main_process:
        print("RESULT " + json.dumps({
            "impl": os.environ.get("ACCEL_IMPL", "accelerate"), "num_processes": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type), "params": params,
            "median_step_s": statistics.median(times), "peak_rss_mib": [p / 1024 for p in peaks],
            "final_loss": losses[-1], "first_loss": losses[0],
        }), flush=True)
    accelerator.end_training()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(impl: str, nproc: int, args) -> dict:
    env = {**os.environ, "ACCEL_IMPL": impl, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    worker_args = [__file__, "--worker", f"--steps={args.steps}", f"--warmup={args.warmup}"]
    if nproc == 1:
        cmd = [sys.executable, *worker_args]
    else:
        if impl == "accelerate":
            env["ACCELERATE_USE_CPU"] = "true"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
               "--main_process_port", str(_free_port()), *worker_args]
    stdout, stderr, code, hung = _run_until_result(cmd, env)
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT "):]), "hung_at_exit": hung}
    tail = (stdout[-1500:] + stderr[-2500:]).strip().splitlines()
    return {"impl": impl, "num_processes": nproc, "failed": f"exit {code}", "tail": tail[-6:]}


def _run_until_result(cmd, env, grace_s: float = 45.0):
    """Run cmd; once it has printed its RESULT line, give it grace_s to exit, then kill its process tree
    (DDP over gloo can deadlock at interpreter exit; torchrun workers live in sessions of their own)."""
    import psutil

    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path = Path(tmp) / "out", Path(tmp) / "err"
        with open(out_path, "w") as out_f, open(err_path, "w") as err_f:
            # An empty working directory: whatever a run writes without being asked stays out of the repo.
            proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=out_f, stderr=err_f)
            seen, hung = None, False
            while proc.poll() is None:
                time.sleep(0.5)
                if seen is None and "RESULT " in out_path.read_text():
                    seen = time.monotonic()
                if seen is not None and time.monotonic() - seen > grace_s:
                    hung = True
                    tree = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
                    for pid in reversed(tree):
                        try:
                            os.kill(pid, 9)
                        except ProcessLookupError:
                            pass
                    proc.wait()
        return out_path.read_text(), err_path.read_text(), proc.returncode, hung


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    results = {}
    for nproc in (1, 2):
        for impl in ("accelerate", "hyperacc"):
            results[impl, nproc] = launch(impl, nproc, args)
    any_ok = next((r for r in results.values() if "failed" not in r), None)
    params = f"{any_ok['params'] / 1e6:.1f} M params" if any_ok else "?"
    print(f"Llama {params} fp32, batch {BATCH} x {SEQ} tokens per process, AdamW, "
          f"{args.steps} timed steps after {args.warmup}:")
    for (impl, nproc), r in results.items():
        if "failed" in r:
            print(f"  {impl:10s} {nproc}p  FAILED ({r['failed']}): " + " | ".join(r["tail"]))
            continue
        rss = " / ".join(f"{m:.0f}" for m in r["peak_rss_mib"])
        print(f"  {impl:10s} {nproc}p  {r['distributed_type']:28s} step {1000 * r['median_step_s']:8.1f} ms  "
              f"peak RSS per rank {rss} MiB  loss {r['first_loss']:.4f} -> {r['final_loss']:.4f}"
              + ("  (hung at exit, killed)" if r.get("hung_at_exit") else ""))
    for nproc in (1, 2):
        a, h = results["accelerate", nproc], results["hyperacc", nproc]
        if "failed" in a or "failed" in h:
            print(f"ratios hyperacc/accelerate, {nproc} process(es): n/a (a run failed)")
            continue
        print(f"ratios hyperacc/accelerate, {nproc} process(es): step time {h['median_step_s'] / a['median_step_s']:.3f}  "
              f"peak RSS (max rank) {max(h['peak_rss_mib']) / max(a['peak_rss_mib']):.3f}  "
              f"final loss {h['final_loss'] / a['final_loss']:.6f}")


if __name__ == "__main__":
    main()
