"""What do step hooks cost per step, against calling the same objects one by one?

    .venv/bin/python benchmarks/step_hooks.py [--steps 200] [--warmup 10]

One process trains the tiny Qwen3-MoE (the example's default preset, 2 micro-batches per step) twice,
the steps interleaved round-robin so that both see the same machine load:

* ``calls`` (before issue 39): the example's old loop, which called each object itself: the step
  checks (``watch_loss`` per micro-batch, ``check`` before ``optimizer.step()``), the learning-rate
  read, the replica guard, the compile watch and metrics record, the periodic cleanup, and the save
  policy (what ``step_end`` ran then: ``_sync_epoch`` + ``_policy_step_end``);
* ``hooks`` (now): the same objects registered with ``acc.add_step_hook``, run by the optimizer's
  step pre-hook (``before_optimizer_step``) and ``acc.step_end()``.

Cadences as in the example's defaults for a production run: checks and metrics every 5 steps
(``logging.logging_steps``), the replica guard every 100, no gc/cache cadence, compile off, no saves
(a save's seconds would drown the microseconds measured here). Timed per step with ``perf_counter``:
the bookkeeping (``calls``: the calls above; ``hooks``: the pre-hook plus ``step_end``), and the whole
step (batch to ``step_end``). Printed: median and mean microseconds per step, and the difference.
Last, the dispatch alone: ``before_optimizer_step`` + ``step_end`` of six hooks whose bodies do nothing
(the save policy's included, saves off), timed over 20,000 calls on the ``hooks`` Accelerator.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import hyperacc  # noqa: E402
from hyperacc.models import build_causal_lm, qwen3_moe_config  # noqa: E402
from hyperacc.runtime.housekeeping import PeriodicCleanup  # noqa: E402
from hyperacc.sharding.compile import CompileWatch  # noqa: E402
from hyperacc.training.metrics import MetricsLogger  # noqa: E402
from hyperacc.training.step_checks import StepChecks  # noqa: E402

SEQ, VOCAB, LOGGING = 32, 512, 5


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, index):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


class Variant:
    """One Accelerator, model, optimizer, loader and the per-step objects; ``step()`` runs one step."""

    def __init__(self, name: str, out: str):
        self.name = name
        self.acc = acc = hyperacc.Accelerator(checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=1)
        model = build_causal_lm(qwen3_moe_config(), seed=1, router_aux_loss=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        loader = hyperacc.MicroBatchDataLoader(Tokens(), global_batch_size=8, micro_batch_size=4, seed=1)
        self.model, self.optimizer, self.loader, self.scheduler = acc.prepare(model, optimizer, loader, scheduler)
        self.metrics = MetricsLogger(metrics_file=os.path.join(out, f"{name}.jsonl"), logging_steps=LOGGING,
                                     progress_bar=False, log_fn=lambda *_: None)
        self.checks = StepChecks(acc, validate=False, check_every=LOGGING)
        self.guard = hyperacc.ReplicaGuard(acc, every=100)
        self.compiles = CompileWatch(False)
        self.cleanup = PeriodicCleanup(0, 0, acc.runtime.device_type)
        if name == "hooks":
            for hook in (self.checks, self.guard, self.compiles, self.metrics, self.cleanup):
                acc.add_step_hook(hook)
        self.pre_hook_s = 0.0       # the optimizer's step pre-hook (in ``calls`` too: it runs with no hooks)
        original = acc.step_hooks.before_optimizer_step

        def timed(optimizer):
            start = time.perf_counter()
            original(optimizer)
            self.pre_hook_s += time.perf_counter() - start
        acc.step_hooks.before_optimizer_step = timed
        self.batches = iter(self.loader)
        self.bookkeeping, self.steps, self.pre_hook = [], [], []

    def step(self) -> None:
        acc, model = self.acc, self.model
        start, kept, self.pre_hook_s = time.perf_counter(), 0.0, 0.0
        batch = next(self.batches)
        with acc.accumulate(model, batch) as micro_batches:
            for i, mb in enumerate(micro_batches):
                loss = model(**mb).loss
                if self.name == "calls":
                    tick = time.perf_counter()
                    self.checks.watch_loss(loss, i)
                    kept += time.perf_counter() - tick
                acc.backward(loss)
        grad_norm = acc.clip_grad_norm_(model.parameters(), 1.0)
        if self.name == "calls":
            step = acc.progress.global_step
            tick = time.perf_counter()
            epoch = self.loader.epoch
            self.checks.check(step + 1, lambda: acc.step_loss, grad_norm)
            lr = self.optimizer.param_groups[0]["lr"]
            kept += time.perf_counter() - tick
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
            tick = time.perf_counter()
            step = acc.progress.global_step
            self.guard.maybe_check(step, loss=lambda: acc.step_loss)
            self.metrics.log_step(step=step, epoch=epoch, grad_norm=grad_norm, lr=lr, extra=self.compiles.step(step),
                                  **acc.accumulator.step_metrics())
            self.cleanup.maybe_run(step)
            acc._sync_epoch()
            if acc._policy_step_end():
                self.metrics.flush()
            kept += time.perf_counter() - tick
        else:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
            tick = time.perf_counter()
            acc.step_end()
            kept = time.perf_counter() - tick + self.pre_hook_s
        self.steps.append(time.perf_counter() - start)
        self.bookkeeping.append(kept)
        self.pre_hook.append(self.pre_hook_s)


def dispatch_us(variant: Variant, calls: int = 20000) -> float:
    """Microseconds per step of running the hooks when they do nothing: the protocol's own cost."""
    hooks = variant.acc.step_hooks
    hooks._entries = [entry for entry in hooks._entries if type(entry[2]).__name__ == "SavePolicyHook"]

    class Nothing:
        def before_optimizer_step(self, state):
            pass

        def on_step_end(self, state):
            pass
    for _ in range(5):
        variant.acc.add_step_hook(Nothing())
    raw = variant.optimizer.optimizer
    start = time.perf_counter()
    for _ in range(calls):
        hooks.before_optimizer_step(raw)
        variant.acc.step_end()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        variants = [Variant("calls", out), Variant("hooks", out)]
        for index in range(args.warmup + args.steps):
            for variant in variants if index % 2 else variants[::-1]:
                variant.step()
        print(f"{args.steps} steps each (after {args.warmup} warm-up), tiny Qwen3-MoE, 1 process, "
              f"{torch.get_num_threads()} thread, logging/check every {LOGGING} steps, guard every 100")
        print("| variant | bookkeeping µs/step, median | mean | of it / besides it: the optimizer pre-hook, "
              "median µs | whole step ms, median |")
        print("|---|---|---|---|---|")
        rows = {}
        for variant in variants:
            kept = [s * 1e6 for s in variant.bookkeeping[args.warmup:]]
            pre = [s * 1e6 for s in variant.pre_hook[args.warmup:]]
            steps = [s * 1e3 for s in variant.steps[args.warmup:]]
            rows[variant.name] = (statistics.median(kept), statistics.mean(kept), statistics.median(steps))
            print(f"| {variant.name} | {rows[variant.name][0]:.1f} | {rows[variant.name][1]:.1f} | "
                  f"{statistics.median(pre):.1f} | {rows[variant.name][2]:.2f} |")
            variant.metrics.close()
        diff = rows["hooks"][0] - rows["calls"][0]
        print(f"hooks - calls: {diff:+.1f} µs/step median ({100 * diff / (rows['calls'][2] * 1e3):+.3f} % of a step)")
        print(f"dispatch alone, six no-op hooks: {dispatch_us(variants[1]):.2f} µs/step")
        variants[-1].acc.end_training()     # once: it takes down the process group both share (no saves to finish)


if __name__ == "__main__":
    main()
