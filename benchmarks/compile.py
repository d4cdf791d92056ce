"""`FSDPConfig(compile=True)`: step time, compile time, recompiles and loss against eager.

hyperacc compiles each transformer block's forward with torch.compile before FSDP2 shards it
(hyperacc/sharding/compile.py). This measures what that buys and costs on CPU, for two models:
  tiny   the tiny Qwen3-MoE preset (`hyperacc.models.qwen3_moe_config()`, hidden 64)
  wide   a Qwen3-MoE at hidden 1024 (2 layers, 16 / 8 heads of 64, 4 experts x 512 top-2, vocab 4096:
         few parameters for the compute, since FSDP's gloo all-gathers and reduce-scatters, which
         compilation does not touch, grow with the parameters; the blocks do most of the work)
One torchrun launch of 2 CPU processes (gloo, dp_shard=2, fp32, eager attention, no recompute, one
thread per core). Per model, every run from the same seed and the same batches (AdamW,
`MicroBatchDataLoader` with global batch 4 and micro-batch 2, `pad_collate`):
  eager     fixed sequences of SEQ tokens, WARMUP + STEPS steps
  inductor  the same with compile=True, compile_backend="inductor"; its steps alternate with eager's
            (so that other load on a shared machine slows both alike)
  var/pN    compiled, VAR_STEPS steps of random lengths MIN_LEN..MAX_LEN padded per micro-batch
            (pad_to_multiple_of None, then 64): the frames dynamo compiles after the warm-up (goal 0)
            and in all (`hyperacc.sharding.compile.compiled_frames()` after each step, summed over the ranks:
            each compiles for the lengths it meets)
Every compiled run starts from torch._dynamo.reset() and an empty inductor cache directory
(`torch._inductor.utils.fresh_cache`): compile times are cold. Step time = the slower rank's, each
step starting after a barrier. Printed last, per model: median step time compiled / eager over the
STEPS steps after the warm-up (goal <= 0.9 on the wide model), compile time (the compiled warm-up
steps' wall time minus eager's), recompiles, and the largest relative difference of the step losses,
compiled vs eager (inductor reorders float sums, so they are close, not equal).

    python benchmarks/compile.py [--steps 20] [--var-steps 50] [--models tiny wide] [--pads none 64] [--json F]
"""
import argparse
import contextlib
import functools
import json
import os
import statistics
import tempfile
import time

from step_timing import finish_workers, launch_workers, threads, timed_step

MODELS = {
    "tiny": {},
    "wide": dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
                 num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                 num_experts=4, num_experts_per_tok=2),
}
GBS, MBS, SEQ, WARMUP, VAR_WARMUP, MIN_LEN, MAX_LEN = 4, 2, 256, 3, 5, 32, 256


class Tokens:
    """Sample i: seeded random tokens, SEQ of them, or (``variable``) MIN_LEN..MAX_LEN of them."""

    def __init__(self, size: int, vocab: int, variable: bool):
        self.size, self.vocab, self.variable = size, vocab, variable

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        import torch

        gen = torch.Generator().manual_seed(1000 + index)
        length = int(torch.randint(MIN_LEN, MAX_LEN + 1, (1,), generator=gen)) if self.variable else SEQ
        ids = torch.randint(0, self.vocab, (length,), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}


class Run:
    """One training run (its own Accelerator, model, optimizer and loader); `step` trains one step and
    records the slower rank's wall time, the loss and dynamo's frames compiled since `prepare`."""

    def __init__(self, model_name: str, compiled: bool, steps: int, variable: bool = False, pad=None):
        import torch

        import hyperacc
        from hyperacc.sharding.compile import compiled_frames, recompile_limit_hits
        from hyperacc.data.collate import pad_collate
        from hyperacc.models import build_causal_lm, qwen3_moe_config

        self.caches = contextlib.ExitStack()
        if compiled:        # empty in-memory caches and a fresh on-disk cache: this run compiles from scratch
            torch._dynamo.reset()
            from torch._inductor import utils

            self.caches.enter_context((getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache)())
        self.acc = hyperacc.Accelerator(fsdp=hyperacc.FSDPConfig(compile=compiled, compile_backend="inductor"),
                                        checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=0)
        config = qwen3_moe_config(**MODELS[model_name], use_cache=False)
        model = build_causal_lm(config, meta_device=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = hyperacc.MicroBatchDataLoader(Tokens(GBS * steps, config.vocab_size, variable),
                                               global_batch_size=GBS, micro_batch_size=MBS, seed=3,
                                               collate_fn=functools.partial(pad_collate, pad_to_multiple_of=pad))
        self.model, self.optimizer, loader = self.acc.prepare(model, optimizer, loader)
        self.batches = iter(loader)
        self.frames, self.limit_hits = compiled_frames, recompile_limit_hits
        self.frames0, self.limit0 = compiled_frames(), recompile_limit_hits()
        self.record = {"times": [], "losses": [], "frames": [], "lengths": []}

    def step(self) -> None:
        import torch.distributed as dist

        batch = next(self.batches)
        mine = (timed_step(self.acc, self.model, self.optimizer, batch), self.frames() - self.frames0, [mb["input_ids"].shape[1] for mb in batch])
        ranks = [None] * dist.get_world_size()      # (time, frames compiled so far, lengths) of each rank
        dist.all_gather_object(ranks, mine)
        self.record["times"].append(max(rank[0] for rank in ranks))
        self.record["frames"].append([rank[1] for rank in ranks])
        self.record["lengths"].append(sum((rank[2] for rank in ranks), []))
        self.record["losses"].append(self.acc.step_loss)

    def finish(self) -> dict:
        import torch
        import torch.distributed as dist

        hits = torch.tensor([self.limit_hits() - self.limit0])
        dist.all_reduce(hits)
        self.acc.end_training()
        self.caches.close()
        return {**self.record, "limit_hits": int(hits)}


def worker(out: str, models: list, steps: int, var_steps: int, pads: list) -> None:
    """Per model: eager and compiled fixed-length runs, their steps alternated (so that load on a
    shared machine hits both alike), then the variable-length compiled runs."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {}
    for name in models:
        start = time.perf_counter()
        load = os.getloadavg()[0]       # 1-minute load average before and after (this launch counts ~2)
        runs = {"eager": Run(name, False, WARMUP + steps), "inductor": Run(name, True, WARMUP + steps)}
        for _ in range(WARMUP + steps):
            for run in runs.values():
                run.step()
        r = results[name] = {key: run.finish() for key, run in runs.items()}
        r["load"] = dict.fromkeys(runs, f"{load:.1f} / {os.getloadavg()[0]:.1f}")
        for pad in pads:
            load = os.getloadavg()[0]
            run = Run(name, True, var_steps, variable=True, pad=None if pad == "none" else int(pad))
            for _ in range(var_steps):
                run.step()
            r[f"var/p{pad}"] = run.finish()
            r["load"][f"var/p{pad}"] = f"{load:.1f} / {os.getloadavg()[0]:.1f}"
        if dist.get_rank() == 0:
            print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    finish_workers(out, results)


def launch(args, tmp: str) -> dict:
    return launch_workers(__file__, os.path.join(tmp, "compile.json"),
                          ["--steps", str(args.steps), "--var-steps", str(args.var_steps), "--models", *args.models,
                                  "--pads", *args.pads])


def after_warmup(run: dict, how=statistics.median) -> float:
    return how(run["times"][WARMUP:])


def rel_diff(a: list, b: list) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def frames(run: dict, warmup: int) -> str:
    """Dynamo frames compiled, summed over the ranks (each compiles its own): warm-up / after / in all."""
    warm, total = sum(run["frames"][warmup - 1]), sum(run["frames"][-1])
    return f"{warm} / {total - warm} / {total}"


def late_compiles(run: dict, warmup: int) -> list:
    """(step, rank) of every frame compiled after the warm-up (steps counted from 1)."""
    f = run["frames"]
    return [(step + 1, rank) for step in range(warmup, len(f)) for rank in range(len(f[step]))
            if f[step][rank] > f[step - 1][rank]]


def report(results: dict, args) -> None:
    print(f"\n2 CPU processes (gloo, FSDP2 dp_shard=2, fp32, OMP_NUM_THREADS {threads()}), global batch {GBS} x "
          f"micro-batch {MBS}; fixed runs: {SEQ} tokens, {WARMUP} warm-up + {args.steps} steps, eager and compiled "
          f"alternated; variable runs: {args.var_steps} steps of {MIN_LEN}..{MAX_LEN} tokens, warm-up {VAR_WARMUP}. "
          "Step time: slower rank.")
    print("| model | run | step ms: median (min) after warm-up | warm-up s | compiled frames, both ranks: warm-up / "
          "after / total | limit hits | distinct lengths | max rel. loss diff vs eager | load avg |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        load = runs.pop("load")
        for run_name, run in runs.items():
            variable, eager = run_name.startswith("var"), run_name == "eager"
            warm = VAR_WARMUP if variable else WARMUP
            step = "-" if variable else f"{1000 * after_warmup(run):.1f} ({1000 * after_warmup(run, min):.1f})"
            diff = "-" if variable or eager else f"{rel_diff(run['losses'], runs['eager']['losses']):.2e}"
            lengths = len({n for step_lengths in run["lengths"] for n in step_lengths})
            print(f"| {name} | {run_name} | {step} | {sum(run['times'][:warm]):.1f} | "
                  f"{'-' if eager else frames(run, warm)} | {'-' if eager else run['limit_hits']} | {lengths} | "
                  f"{diff} | {load[run_name]} |")
    print()
    for name, runs in results.items():
        eager, compiled = runs["eager"], runs["inductor"]
        ratio = after_warmup(compiled) / after_warmup(eager)
        compile_s = sum(compiled["times"][:WARMUP]) - sum(eager["times"][:WARMUP])
        goal = " (goal <= 0.9)" if name == "wide" else ""
        print(f"{name}: compiled / eager median step time {ratio:.3f}{goal} (of the fastest steps: "
              f"{after_warmup(compiled, min) / after_warmup(eager, min):.3f}); compile time {compile_s:.1f} s; "
              f"max rel. loss diff {rel_diff(compiled['losses'], eager['losses']):.2e}")
        for run_name, run in runs.items():
            if run_name.startswith("var"):
                late = late_compiles(run, VAR_WARMUP)
                where = f" ({', '.join(f'step {step} on rank {rank}' for step, rank in late)})" if late else ""
                print(f"{name} {run_name}: frames compiled after warm-up {len(late)}{where} (goal 0), in all "
                      f"{sum(run['frames'][-1])} (both ranks)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--var-steps", type=int, default=50)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--pads", nargs="*", default=["none", "64"], help="pad_to_multiple_of of the variable runs")
    parser.add_argument("--json", help="also write the raw per-step figures here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)     # what each torchrun process runs
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.models, args.steps, args.var_steps, args.pads)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hyperacc_compile_bench_") as tmp:
        results = launch(args, tmp)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    report(results, args)
    print(f"\nbenchmark wall time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
