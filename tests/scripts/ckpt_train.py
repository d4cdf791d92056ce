"""Train a tiny Qwen3-MoE with hyperacc's Accelerator + MicroBatchDataLoader, checkpointing as told.

Writes OUT.rank<R>.json per rank (per-step loss, lr and one random draw per generator after each
step, the saves made) and, with --dump-params, the final full parameters (rank 0, torch.save).
--kill-during-save K: SIGKILL rank 0 while it finishes the save of step K (data files written,
.metadata not yet), i.e. a crash in the middle of a save.
--tp N: dp_shard x tp N layout (tensor parallelism, meta-device init). --hold-after K: after step K
every rank writes OUT.pid<R> and sleeps, for the test to SIGKILL the whole job.
Several runs in one job: ``OUT ARGS --then OUT2 ARGS ...`` (run_sequence.py).
"""
import argparse
import json
import os
import random
import signal
import time

import numpy as np
import torch

import hyperacc
from hyperacc.models import build_causal_lm, qwen3_moe_config
from run_sequence import run_all

SEQ, VOCAB = 16, 512


class Tokens:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(100 + i))
        return {"input_ids": ids, "labels": ids.clone()}


def parse_args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--save-epochs", type=int, default=0)
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--restore", default=None)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--embedded", action="store_true", help="save_extra_state_per_rank=False")
    p.add_argument("--export", default="none")
    p.add_argument("--kill-during-save", type=int, default=0)
    p.add_argument("--dump-params", default=None)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--hold-after", type=int, default=0)
    return p.parse_args(argv)


def main():
    run_all(run, parse_args)          # one run, or several separated by --then (run_sequence.py)


def run(args):
    if args.kill_during_save:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        original_finish = FileSystemWriter.finish

        def finish(self, *a, **kw):
            if os.path.basename(str(self.path)) == f"global_step_{args.kill_during_save}":
                os.kill(os.getpid(), signal.SIGKILL)
            return original_finish(self, *a, **kw)
        FileSystemWriter.finish = finish

    config = hyperacc.CheckpointConfig(
        save_ckpt=not args.no_save, checkpoint_dir=args.ckpt, save_steps=args.save_steps,
        save_epochs=args.save_epochs, is_async=args.async_save, restore_from=args.restore,
        save_consolidated=args.export, save_extra_state_per_rank=not args.embedded)
    acc = hyperacc.Accelerator(checkpoint=config, seed=7, parallel=hyperacc.ParallelConfig(tp_size=args.tp))
    model = build_causal_lm(qwen3_moe_config(), seed=7, meta_device=args.tp > 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    loader = hyperacc.MicroBatchDataLoader(Tokens(24), global_batch_size=4, micro_batch_size=1,
                                           shuffle=True, seed=5)
    model, optimizer, scheduler, loader = acc.prepare(model, optimizer, scheduler, loader)
    restored = acc.load_state()

    record = {"restored": restored, "start_step": acc.progress.global_step, "steps": {}, "saves": [],
              "world": acc.num_processes}
    while acc.progress.global_step < args.steps:
        for batch in loader:
            with acc.accumulate(model, batch) as micro_batches:
                for mb in micro_batches:
                    acc.backward(model(**mb).loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
            step = acc.progress.global_step
            record["steps"][step] = {
                "loss": acc.step_loss, "lr": scheduler.get_last_lr()[0], "epoch": loader.epoch,
                "draws": [torch.rand(()).item(), random.random(), float(np.random.rand())]}
            saved = acc.step_end()
            if saved:
                record["saves"].append(step)
            if args.hold_after and step == args.hold_after:
                with open(f"{args.out}.pid{acc.process_index}", "w") as handle:
                    handle.write(str(os.getpid()))
                time.sleep(600)
            if step == args.steps:
                break
    record["progress"] = acc.progress.state_dict()
    if args.dump_params:
        full = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
        if acc.is_main_process:
            torch.save(full, args.dump_params)
    acc.end_training()
    with open(f"{args.out}.rank{acc.process_index}.json", "w") as handle:
        json.dump(record, handle)


if __name__ == "__main__":
    main()
