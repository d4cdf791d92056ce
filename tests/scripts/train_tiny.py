"""Train the tiny Qwen3-MoE with hyperacc through the DESIGN.md loop and dump what tests compare.

Data: sample i is a deterministic random token sequence from its own generator, read through
MicroBatchDataLoader (global order independent of the world size) and `accumulate(model, batch)`.
Usage: train_tiny.py OUT.json [--steps N] [--gbs G] [--mbs M] [--recompute] [--replicate R]
       [--pad] [--meta] [--repeat] [--reduce-every] [--lr 1e-3] [--clip 1.0]
       [--grads GRADS.pt]   (the full gradients of step 1, before the optimizer step)
       Several runs in one job: ``train_tiny.py A.json --meta --then B.json --meta --recompute``
       (tests/scripts/run_sequence.py).
"""
import argparse
import json

import torch

import hyperacc
from hyperacc.data.collate import pad_collate
from hyperacc.models import build_causal_lm, qwen3_moe_config
from run_sequence import run_all

SEQ, VOCAB, DATASET_SIZE = 32, 512, 160


class TokenDataset(torch.utils.data.Dataset):
    """Sample i: deterministic random tokens. ``pad``: a per-sample number of valid tokens.
    ``repeat``: only the first ``repeat`` samples exist, cycled (every step sees the same ones)."""

    def __init__(self, size: int, pad: bool, repeat: int = 0):
        self.size, self.pad, self.repeat = size, pad, repeat

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        index = index % self.repeat if self.repeat else index
        gen = torch.Generator().manual_seed(1000 + index)
        length = 4 + (index * 7) % (SEQ - 4) if self.pad else SEQ
        ids = torch.randint(0, VOCAB, (length,), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--replicate", type=int, default=1)
    parser.add_argument("--pad", action="store_true")
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--repeat", action="store_true", help="every step trains on the same gbs samples")
    parser.add_argument("--reduce-every", action="store_true")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--grads")
    return parser.parse_args(argv)


def checksum(model) -> float:
    return sum(float(p.detach().full_tensor().double().sum()) for p in model.parameters())


def main():
    run_all(train, parse_args)       # one run, or several separated by --then (run_sequence.py)


def train(args):
    acc = hyperacc.Accelerator(
        parallel=hyperacc.ParallelConfig(dp_replicate_size=args.replicate),
        fsdp=hyperacc.FSDPConfig(activation_checkpointing=args.recompute,
                                 reduce_every_micro_batch=args.reduce_every),
        checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=7)
    # the router aux loss is a per-batch statistic, not a token mean: off for the exact-accumulation checks
    model = build_causal_lm(qwen3_moe_config(), meta_device=args.meta, seed=7, router_aux_loss=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    loader = hyperacc.MicroBatchDataLoader(
        TokenDataset(DATASET_SIZE, args.pad, args.gbs if args.repeat else 0),
        global_batch_size=args.gbs, micro_batch_size=args.mbs, collate_fn=pad_collate, seed=3)
    model, optimizer, scheduler, loader = acc.prepare(model, optimizer, scheduler, loader)

    first = model.model.embed_tokens.weight
    record = {
        "world": acc.num_processes, "dp_size": acc.dp_size, "dp_rank": acc.dp_rank,
        "micro_batches": loader.micro_batches_per_step,
        "param_is_dtensor": all(type(p).__name__ == "DTensor" for p in model.parameters()),
        "placements": str(first.placements), "mesh_dims": list(acc.mesh.mesh_dim_names),
        "local_param_bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
        "total_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "init_checksum": checksum(model), "losses": [], "grad_norms": [], "lrs": [],
    }
    while acc.progress.global_step < args.steps:
        for batch in loader:
            with acc.accumulate(model, batch) as micro_batches:
                for mb in micro_batches:
                    acc.backward(model(**mb).loss)
            if args.grads and acc.progress.global_step == 0:
                grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
                if acc.is_main_process:
                    torch.save(grads, args.grads)
            record["grad_norms"].append(float(acc.clip_grad_norm_(model.parameters(), args.clip)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            record["losses"].append(acc.step_loss)
            record["lrs"].append(scheduler.get_last_lr()[0])
            if acc.progress.global_step == args.steps:
                break
    record.update(optimizer_steps=acc.progress.global_step, scheduler_steps=scheduler.scheduler.last_epoch,
                  tokens=acc.progress.consumed_tokens, final_checksum=checksum(model))
    if acc.is_main_process:
        with open(args.out, "w") as handle:
            json.dump(record, handle)
    acc.end_training()


if __name__ == "__main__":
    main()
