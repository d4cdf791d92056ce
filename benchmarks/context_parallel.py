"""Context-parallel benchmark on CPU processes (gloo): peak memory per rank vs sequence length, cp 1/2/4.

``python benchmarks/context_parallel.py`` launches one job per cp size (cp processes, dp 1, so each
rank holds 1/cp of every sequence) and prints a Markdown table and the ratios last.
Each job runs a Qwen3-MoE of hidden 256, 2 layers, 8 heads / 2 KV heads of 32, 8 experts top-2,
fp32, sdpa attention, AdamW, one sequence per step at increasing lengths (two steps each, the
second timed). ru_maxrss only grows, and the peak grows with the length, so the high-water mark
after a length is that length's peak; the activation peak is that minus the mark after a warm-up
step at 256 tokens (model, optimizer states and the runtime). The slowest/largest rank counts.
Budget: cp 1's activation peak at BUDGET_LEN tokens; "longest that fits" interpolates linearly.
"""
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from hyperacc.config.launch_env import free_port  # noqa: E402
LENGTHS = (512, 1024, 2048, 4096)
BUDGET_LEN, TIME_LEN = 2048, 2048
CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
              max_position_embeddings=8192, tie_word_embeddings=False, use_cache=False)


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(out, cp):
    import hyperacc
    from hyperacc.models import build_causal_lm, qwen3_moe_config

    acc = hyperacc.Accelerator(parallel=hyperacc.ParallelConfig(cp_size=cp),
                               checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=0)
    model = build_causal_lm(qwen3_moe_config(**CONFIG), meta_device=True, attn_implementation="sdpa",
                            router_aux_loss=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.prepare(model, optimizer)

    def step(length):
        ids = torch.randint(0, CONFIG["vocab_size"], (1, length), generator=torch.Generator().manual_seed(length))
        start = time.perf_counter()
        with acc.accumulate(model, [{"input_ids": ids, "labels": ids.clone()}]) as micro_batches:
            for mb in micro_batches:
                acc.backward(model(**mb).loss)
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    step(256)
    rows = {"base": _maxrss_mib()}
    for length in LENGTHS:
        step(length)
        rows[length] = {"seconds": step(length), "maxrss": _maxrss_mib()}
    table = [None] * dist.get_world_size() if dist.is_initialized() else None
    if table is not None:
        dist.all_gather_object(table, rows)
    else:
        table = [rows]
    if acc.is_main_process:
        with open(out, "w") as handle:
            json.dump({"base": max(r["base"] for r in table),
                       "lengths": {str(n): {"peak": max(r[n]["maxrss"] - r["base"] for r in table),
                                            "seconds": max(r[n]["seconds"] for r in table)} for n in LENGTHS}},
                      handle)
    acc.end_training()


def launch(cp, out):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    me = os.path.abspath(__file__)
    if cp == 1:
        cmd = [sys.executable, me, "--worker", out, "1"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cp}", f"--master_port={free_port()}",
               "--master_addr=127.0.0.1", me, "--worker", out, str(cp)]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    with open(out) as handle:
        return json.load(handle)


def longest_within(result, budget):
    """The longest sequence whose activation peak stays within ``budget`` (linear between measured points)."""
    points = [(0, 0.0)] + [(int(n), v["peak"]) for n, v in result["lengths"].items()]
    best = 0.0
    for (n0, p0), (n1, p1) in zip(points, points[1:]):
        if p1 <= budget:
            best = n1
        elif p0 <= budget:
            best = n0 + (n1 - n0) * (budget - p0) / max(p1 - p0, 1e-9)
            break
    else:
        n0, p0 = points[-2]
        n1, p1 = points[-1]
        best = n1 + (n1 - n0) * (budget - p1) / max(p1 - p0, 1e-9)   # extrapolated past the longest run
    return best


def main():
    with tempfile.TemporaryDirectory() as tmp:
        results = {cp: launch(cp, os.path.join(tmp, f"cp{cp}.json")) for cp in (1, 2, 4)}
    budget = results[1]["lengths"][str(BUDGET_LEN)]["peak"]
    print("| cp | " + " | ".join(f"{n} tokens: peak MiB / s" for n in LENGTHS) + " |")
    print("|---|" + "---|" * len(LENGTHS))
    for cp, result in results.items():
        cells = [f"{result['lengths'][str(n)]['peak']:.0f} / {result['lengths'][str(n)]['seconds']:.2f}" for n in LENGTHS]
        print(f"| {cp} | " + " | ".join(cells) + " |")
    base = longest_within(results[1], budget)
    for cp, result in results.items():
        fits = longest_within(result, budget)
        time_ratio = result["lengths"][str(TIME_LEN)]["seconds"] / results[1]["lengths"][str(TIME_LEN)]["seconds"]
        print(f"cp {cp}: longest sequence within {budget:.0f} MiB of activations per rank ~{fits:.0f} tokens "
              f"({fits / base:.2f}x cp 1); step time at {TIME_LEN} tokens {time_ratio:.2f}x cp 1")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group("gloo")
        worker(sys.argv[2], int(sys.argv[3]))
    else:
        main()
