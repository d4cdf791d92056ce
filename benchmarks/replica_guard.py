"""What does `hyperacc.ReplicaGuard` cost, and does it catch a one-ulp replica drift?

    .venv/bin/python benchmarks/replica_guard.py [--steps 100] [--calls 20]

One torchrun launch of 2 CPU processes (gloo) trains a Qwen3-MoE (twice the test preset's width,
8 experts: 0.76 M parameters) under HSDP (``ParallelConfig(dp_replicate_size=2)``: every parameter is
replicated over the two ranks, the most the guard has to compare), precision ``bf16_sr``, with
`hyperacc.Accelerator`, `MicroBatchDataLoader` and `hyperacc.precision.adamw.AdamW`.

1. Step time. Steps are interleaved round-robin between three variants, ``--steps`` each: no guard,
   a guard with ``every=100`` (the default) and one with ``every=1`` (the worst case); each guard
   counts its own variant's steps, so ``every=100`` checks ``steps / 100`` times. A step is the
   wall time of one iteration of the training loop from a barrier (batch, forward/backward, clip,
   AdamW, the guard's ``maybe_check``, ``step_end``), the slower rank's.
2. One check: ``guard.check(step)`` called ``--calls`` times after a barrier (slower rank's time,
   median), against the median step without a guard: the amortised overhead at every=100 is
   ``check / (100 * step)`` (goal from the issue: <= 1 %).
3. Detection: at a global step that is a multiple of 5, a guard with ``every=5`` is installed and
   rank 1's copy of one replicated parameter moves by one ulp after the 3rd step; the guard must
   raise `ReplicaMismatchError` at the 5th.

Printed: a table, and last the ratios guard/none and the amortised overhead.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODEL = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
             num_experts_per_tok=2, vocab_size=1024)
SEQ, GBS, MBS, WARMUP = 64, 4, 2, 6
VARIANTS = ("none", "every=100", "every=1")


class Tokens:
    """Counting sequences from a random start (as tests/scripts/precision_run.py), many of them."""

    def __len__(self):
        return 1 << 16

    def __getitem__(self, i):
        start = torch.randint(0, MODEL["vocab_size"], (1,), generator=torch.Generator().manual_seed(100 + i))
        ids = (start + torch.arange(SEQ)) % MODEL["vocab_size"]
        return {"input_ids": ids, "labels": ids.clone()}


def perturb_one_ulp(model):
    """Rank 1's copy of the first parameter replicated over dp_replicate moves by one ulp
    (the same as tests/scripts/precision_run.py). Returns its name."""
    for name, param in model.named_parameters():
        if any(pl.is_replicate() for pl in getattr(param, "placements", ())):
            local = param.to_local().detach().view(-1)
            with torch.no_grad():
                local[0] = torch.nextafter(local[0], local[0] + 1)
            return name
    raise RuntimeError("no replicated parameter")


def worker(steps: int, calls: int, out: str) -> None:
    import torch.distributed as dist

    import hyperacc
    from hyperacc.models import build_causal_lm, qwen3_moe_config
    from hyperacc.precision.adamw import AdamW

    acc = hyperacc.Accelerator(fsdp=hyperacc.FSDPConfig(precision="bf16_sr"),
                               parallel=hyperacc.ParallelConfig(dp_replicate_size=2),
                               checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=3)
    model = build_causal_lm(qwen3_moe_config(**MODEL), meta_device=True, router_aux_loss=False)
    optimizer = AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    loader = hyperacc.MicroBatchDataLoader(Tokens(), global_batch_size=GBS, micro_batch_size=MBS, seed=5)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    guards = {"none": None, "every=100": hyperacc.ReplicaGuard(acc, every=100),
              "every=1": hyperacc.ReplicaGuard(acc, every=1)}
    counts = dict.fromkeys(VARIANTS, 0)
    times = {v: [] for v in VARIANTS}
    batches = iter(loader)

    def train_step():
        batch = next(batches)
        with acc.accumulate(model, batch) as micro_batches:
            for mb in micro_batches:
                acc.backward(model(**mb).loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    # 1. step time, variants interleaved step by step; the order rotates every round so that each
    # variant follows each other one equally often, and every step starts from a barrier (else a
    # step would also absorb the ranks' skew left by the previous one: a check ends synchronised)
    total = WARMUP + steps * len(VARIANTS)
    for index in range(total):
        rnd, slot = divmod(index, len(VARIANTS))
        variant = VARIANTS[(slot + rnd) % len(VARIANTS)]
        dist.barrier()
        start = time.perf_counter()
        train_step()
        if guards[variant] is not None and index >= WARMUP:
            counts[variant] += 1
            guards[variant].maybe_check(counts[variant], loss=acc.step_loss)
        acc.step_end()
        if index >= WARMUP:
            times[variant].append(time.perf_counter() - start)

    checks_run = {v: (g.checks if g is not None else 0) for v, g in guards.items()}

    # 2. one check, timed alone
    guard = guards["every=100"]
    layout = guard._parameter_layout()
    check_times = []
    for call in range(calls):
        dist.barrier()
        start = time.perf_counter()
        guard.check(acc.progress.global_step, loss=acc.step_loss)
        check_times.append(time.perf_counter() - start)

    # 3. detection: every=5 from a multiple of 5, one ulp on rank 1 after the 3rd step
    while acc.progress.global_step % 5:
        train_step()
        acc.step_end()
    origin = acc.progress.global_step
    detector = hyperacc.ReplicaGuard(acc, every=5)
    detected, perturbed, message = None, None, None
    for _ in range(10):
        train_step()
        step = acc.progress.global_step
        if step - origin == 3 and acc.process_index == 1:
            perturbed = perturb_one_ulp(model)
        try:
            detector.maybe_check(step, loss=acc.step_loss)
        except hyperacc.ReplicaMismatchError as err:
            detected, message = step, str(err)
            break
        acc.step_end()

    record = {"times": times, "check_times": check_times, "checks_run": checks_run,
              "compared": len(layout), "compared_elements": sum(p.to_local().numel() if hasattr(p, "to_local")
                                                                else p.numel() for _, p, _ in layout),
              "all_params": sum(1 for _ in model.parameters()),
              "origin": origin, "detected": detected, "perturbed": perturbed, "message": message}
    rank = int(os.environ.get("RANK", 0))
    with open(f"{out}.rank{rank}", "w") as handle:
        json.dump(record, handle)
    acc.end_training()


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per variant (>= 100: every=100 checks once)")
    parser.add_argument("--calls", type=int, default=20, help="timed guard.check calls")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        return worker(args.steps, args.calls, args.out)

    import tempfile
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=str(REPO),
               HYPERACC_DEVICE="cpu", HF_HUB_OFFLINE="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", __file__, "--worker", "--steps", str(args.steps),
               "--calls", str(args.calls), "--out", str(out)]
        began = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode:
            sys.exit(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        wall = time.perf_counter() - began
        ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]

    # A step (or a check) takes as long as its slower rank.
    steps = {v: [max(t) for t in zip(*(r["times"][v] for r in ranks))] for v in VARIANTS}
    check = statistics.median(max(t) for t in zip(*(r["check_times"] for r in ranks)))
    mean = {v: statistics.mean(t) for v, t in steps.items()}
    median = {v: statistics.median(t) for v, t in steps.items()}
    amortised = check / (100 * median["none"])
    first = ranks[0]
    print(f"model: Qwen3-MoE {MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, "
          f"{MODEL['num_experts']} experts, vocab {MODEL['vocab_size']}; seq {SEQ}, global batch {GBS}, "
          f"micro-batch {MBS}; bf16_sr; HSDP dp_replicate=2 on 2 CPU processes (gloo); {args.steps} steps per "
          f"variant, interleaved; {wall:.0f} s in all")
    print(f"compared per check: {first['compared']} of {first['all_params']} parameters (all replicated), "
          f"{first['compared_elements'] / 1e6:.2f} M elements per rank, + step counter and loss\n")
    # noise of a ratio of means: two standard errors of the difference, relative to none's mean
    noise = {v: 2 * (statistics.variance(steps[v]) / len(steps[v])
                     + statistics.variance(steps["none"]) / len(steps["none"])) ** 0.5 / mean["none"]
             for v in VARIANTS}
    print("| variant | checks run | mean step (ms) | median step (ms) | mean / none (± 2 s.e.) |")
    print("|---|---|---|---|---|")
    for v in VARIANTS:
        spread = f" ± {noise[v]:.3f}" if v != "none" else ""
        print(f"| {v} | {first['checks_run'][v]} | {mean[v] * 1e3:.1f} | {median[v] * 1e3:.1f} | "
              f"{mean[v] / mean['none']:.3f}{spread} |")
    print(f"\none guard.check (median of {args.calls}): {check * 1e3:.2f} ms = {check / median['none'] * 100:.2f} % "
          f"of a median step; amortised at every=100: {amortised * 100:.3f} % (goal <= 1 %)")
    detected = first["detected"]
    print(f"detection (every=5 from global step {first['origin']}, one ulp on rank 1's "
          f"{ranks[1]['perturbed']} after step {first['origin'] + 3}): ReplicaMismatchError at step "
          f"{detected} = {None if detected is None else detected - first['origin']} steps in (expected 5)")
    if first["message"]:
        print(f"  {first['message'].split('. ')[0]}.")
    print(f"\nratios guard/none (mean step): every=100 {mean['every=100'] / mean['none']:.3f}, every=1 "
          f"{mean['every=1'] / mean['none']:.3f}; amortised check at every=100: {amortised * 100:.3f} % of a step "
          f"(goal <= 1 %); one-ulp drift caught at step {None if detected is None else detected - first['origin']} "
          "of 5")


if __name__ == "__main__":
    main()
