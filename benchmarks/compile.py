"""`FSDPConfig(compile=True)`: step time, compile time, recompiles and loss against eager.

hyperacc compiles each transformer block's forward with torch.compile before FSDP2 shards it
(hyperacc/compilation.py). This measures what that buys and costs on CPU, for two models:
  tiny   the tiny Qwen3-MoE preset (`hyperacc.models.qwen3_moe_config()`, hidden 64)
  wide   a Qwen3-MoE at hidden 1024 (2 layers, 8 experts x 768 top-2, vocab 8192: the blocks, not the
         embedding and head, hold most of the work)
One torchrun launch of 2 CPU processes (gloo, dp_shard=2, fp32, eager attention, no recompute), and
per model, each run from the same seed and the same batches (`MicroBatchDataLoader`, global batch
8, micro-batch 2, `pad_collate`), AdamW:
  eager     fixed sequences of SEQ tokens, WARMUP + STEPS steps
  inductor  the same with compile=True, compile_backend="inductor"
  var/pN    compiled (inductor), VAR_STEPS steps of random lengths 32..256 padded per micro-batch
            (pad_to_multiple_of None, then 64): dynamo's compiled frames after the warm-up (goal 0)
            and in all (`hyperacc.compilation.compiled_frames()` before and after each step)
Step time = the slower rank's, each step starting after a barrier. Printed last, per model:
median step time compiled / eager over the STEPS steps after the warm-up (goal <= 0.9 on the wide
model), compile time (compiled warm-up steps' wall time minus eager's), recompiles, and the largest
relative difference of the step losses compiled vs eager (inductor reorders float sums).
Inductor's on-disk caches go to a fresh directory per launch, so compile times are cold;
torch._dynamo.reset() starts every compiled run with empty in-memory caches.

    python benchmarks/compile.py [--steps 20] [--var-steps 50] [--models tiny wide] [--pads none 64]
"""
import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {
    "tiny": {},
    "wide": dict(vocab_size=8192, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=768,
                 num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                 num_experts=8, num_experts_per_tok=2),
}
GBS, MBS, SEQ, WARMUP, VAR_WARMUP, MIN_LEN, MAX_LEN = 4, 2, 128, 3, 5, 32, 256


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
        from hyperacc.compilation import compiled_frames, recompile_limit_hits
        from hyperacc.data.collate import pad_collate
        from hyperacc.models import build_causal_lm, qwen3_moe_config

        if compiled:
            torch._dynamo.reset()       # empty in-memory caches: this run compiles from scratch
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
        import torch
        import torch.distributed as dist

        batch = next(self.batches)
        dist.barrier()
        start = time.perf_counter()
        with self.acc.accumulate(self.model, batch) as micro_batches:
            for mb in micro_batches:
                self.acc.backward(self.model(**mb).loss)
        self.optimizer.step()
        self.optimizer.zero_grad()
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        self.record["times"].append(float(took))
        self.record["losses"].append(self.acc.step_loss)
        self.record["frames"].append(self.frames() - self.frames0)
        self.record["lengths"].append([mb["input_ids"].shape[1] for mb in batch])

    def finish(self) -> dict:
        self.acc.end_training()
        return {**self.record, "limit_hits": self.limit_hits() - self.limit0}


def worker(out: str, models: list, steps: int, var_steps: int, pads: list) -> None:
    """Per model: eager and compiled fixed-length runs, their steps alternated (so that load on a
    shared machine hits both alike), then the variable-length compiled runs."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {}
    for name in models:
        start = time.perf_counter()
        runs = {"eager": Run(name, False, WARMUP + steps), "inductor": Run(name, True, WARMUP + steps)}
        for _ in range(WARMUP + steps):
            for run in runs.values():
                run.step()
        r = results[name] = {key: run.finish() for key, run in runs.items()}
        for pad in pads:
            run = Run(name, True, var_steps, variable=True, pad=None if pad == "none" else int(pad))
            for _ in range(var_steps):
                run.step()
            r[f"var/p{pad}"] = run.finish()
        if dist.get_rank() == 0:
            print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(results, handle)
    dist.barrier()
    dist.destroy_process_group()


def launch(args, tmp: str) -> dict:
    out = os.path.join(tmp, "compile.json")
    # 2 processes, 1 thread each: nproc (2 here) cores; more threads than cores only contend.
    threads = max(1, (os.cpu_count() or 2) // 2)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor"),
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           "--worker", out, "--steps", str(args.steps), "--var-steps", str(args.var_steps),
           "--models", *args.models, "--pads", *args.pads]
    subprocess.run(cmd, check=True, env=env, cwd=REPO)
    with open(out) as handle:
        return json.load(handle)


def median_after_warmup(run: dict) -> float:
    return statistics.median(run["times"][WARMUP:])


def rel_diff(a: list, b: list) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def report(results: dict, args) -> None:
    print(f"\n2 CPU processes (gloo, FSDP2 dp_shard=2, fp32), global batch {GBS} x micro-batch {MBS}; "
          f"fixed runs: {SEQ} tokens, {WARMUP} warm-up + {args.steps} steps; variable runs: {args.var_steps} "
          f"steps of {MIN_LEN}..{MAX_LEN} tokens, warm-up {VAR_WARMUP}. Step time: slower rank, median after "
          "warm-up.")
    print("| model | run | median step (ms) | warm-up (s) | compiled frames: warm-up / after / total "
          "| limit hits | distinct lengths | max rel. loss diff vs eager |")
    print("|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        eager = runs["eager"]
        for run_name, run in runs.items():
            variable = run_name.startswith("var")
            warm = VAR_WARMUP if variable else WARMUP
            frames = run["frames"]
            after = frames[-1] - frames[warm - 1]
            lengths = len({n for step in run["lengths"] for n in step})
            step = "-" if variable else f"{1000 * median_after_warmup(run):.1f}"
            diff = "-" if variable or run is eager else f"{rel_diff(run['losses'], eager['losses']):.2e}"
            print(f"| {name} | {run_name} | {step} | {sum(run['times'][:warm]):.1f} | {frames[warm - 1]} / "
                  f"{after} / {frames[-1]} | {run['limit_hits']} | {lengths} | {diff} |")
    print()
    for name, runs in results.items():
        eager, compiled = runs["eager"], runs["inductor"]
        ratio = median_after_warmup(compiled) / median_after_warmup(eager)
        compile_s = sum(compiled["times"][:WARMUP]) - sum(eager["times"][:WARMUP])
        goal = " (goal <= 0.9)" if name == "wide" else ""
        print(f"{name}: compiled / eager median step time {ratio:.3f}{goal}; compile time {compile_s:.1f} s; "
              f"max rel. loss diff {rel_diff(compiled['losses'], eager['losses']):.2e}")
        for run_name, run in runs.items():
            if run_name.startswith("var"):
                added = run["frames"][-1] - run["frames"][VAR_WARMUP - 1]
                print(f"{name} {run_name}: frames compiled after warm-up {added} (goal 0), in all "
                      f"{run['frames'][-1]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--var-steps", type=int, default=50)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--pads", nargs="*", default=["none", "64"])
    parser.add_argument("--json", help="also write the raw per-step figures here")
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hyperacc_compile_bench_") as tmp:
        results = launch(args, tmp)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    report(results, args)
    print(f"\nbenchmark wall time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        p = argparse.ArgumentParser()
        p.add_argument("out")
        p.add_argument("--steps", type=int)
        p.add_argument("--var-steps", type=int)
        p.add_argument("--models", nargs="+")
        p.add_argument("--pads", nargs="*")
        a = p.parse_args(sys.argv[2:])
        worker(a.out, a.models, a.steps, a.var_steps, a.pads)
    else:
        main()
