"""Train a tiny Qwen3-MoE with hyperacc for a few steps and dump what tests compare (JSON).

Data: sample i is a deterministic random token sequence (its own generator), so the samples of a
global step do not depend on the world size. Each DP rank takes its contiguous slice of the step.
Usage: train_tiny.py OUT.json [--steps N] [--gbs G] [--mbs M] [--recompute] [--replicate R]
       [--pad] [--meta] [--optimizer-before] [--lr 1e-3]
"""
import argparse
import json

import torch

import hyperacc
from hyperacc.models import build_causal_lm, qwen3_moe_config

SEQ = 32
VOCAB = 512


def sample(index: int, pad: bool) -> dict:
    gen = torch.Generator().manual_seed(1000 + index)
    ids = torch.randint(0, VOCAB, (SEQ,), generator=gen)
    labels = ids.clone()
    mask = torch.ones(SEQ, dtype=torch.long)
    if pad:  # a different number of valid tokens per sample
        valid = 4 + (index * 7) % (SEQ - 4)
        labels[valid:] = -100
        mask[valid:] = 0
        ids[valid:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def step_batch(step, gbs, mbs, dp_rank, dp_size, pad):
    per_rank = gbs // dp_size
    start = step * gbs + dp_rank * per_rank
    samples = [sample(i, pad) for i in range(start, start + per_rank)]
    return [{k: torch.stack([s[k] for s in samples[j:j + mbs]]) for k in samples[0]}
            for j in range(0, per_rank, mbs)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--replicate", type=int, default=1)
    parser.add_argument("--pad", action="store_true")
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--repeat", action="store_true", help="train on step 0's batch every step")
    args = parser.parse_args()

    acc = hyperacc.Accelerator(
        parallel=hyperacc.ParallelConfig(dp_replicate_size=args.replicate),
        fsdp=hyperacc.FSDPConfig(activation_checkpointing=args.recompute),
        checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=7)
    model = build_causal_lm(qwen3_moe_config(), meta_device=args.meta, seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)

    first = model.model.embed_tokens.weight
    record = {
        "world": acc.num_processes, "dp_size": acc.dp_size, "dp_rank": acc.dp_rank,
        "param_is_dtensor": all(type(p).__name__ == "DTensor" for p in model.parameters()),
        "placements": str(first.placements), "mesh_dims": list(acc.mesh.mesh_dim_names),
        "local_param_bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
        "total_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "losses": [], "grad_norms": [], "lrs": [],
    }
    record["init_checksum"] = sum(float(p.detach().full_tensor().double().sum()) for p in model.parameters())
    for step in range(args.steps):
        batch = step_batch(0 if args.repeat else step, args.gbs, args.mbs, acc.dp_rank, acc.dp_size, args.pad)
        with acc.accumulate(model, batch) as micro_batches:
            for mb in micro_batches:
                acc.backward(model(**mb).loss)
        record["grad_norms"].append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        record["losses"].append(acc.step_loss)
        record["lrs"].append(scheduler.get_last_lr()[0])
    record["optimizer_steps"] = acc.progress.global_step
    record["scheduler_steps"] = scheduler.scheduler.last_epoch
    record["final_checksum"] = sum(float(p.detach().full_tensor().double().sum()) for p in model.parameters())
    if acc.is_main_process:
        with open(args.out, "w") as handle:
            json.dump(record, handle)
    acc.end_training()


if __name__ == "__main__":
    main()
