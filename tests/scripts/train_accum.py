"""Train the tiny Qwen3-MoE through MicroBatchDataLoader + accumulate(model, batch); dump results.

Usage: train_accum.py OUT.json [--steps N] [--gbs G] [--mbs M] [--recompute] [--pad]
       [--grads GRADS.pt]   (save the full gradients of step 1, before the optimizer step)
       [--reduce-every]     (reduce-scatter every micro-batch)
"""
import argparse
import json

import torch

import hyperacc
from hyperacc.data.collate import pad_collate
from hyperacc.models import build_causal_lm, qwen3_moe_config

SEQ, VOCAB, DATASET_SIZE = 32, 512, 160


class TokenDataset(torch.utils.data.Dataset):
    """Sample i: deterministic random tokens; with ``pad`` a per-sample number of valid tokens."""

    def __init__(self, size: int, pad: bool):
        self.size, self.pad = size, pad

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        gen = torch.Generator().manual_seed(1000 + index)
        length = 4 + (index * 7) % (SEQ - 4) if self.pad else SEQ
        ids = torch.randint(0, VOCAB, (length,), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--pad", action="store_true")
    parser.add_argument("--reduce-every", action="store_true")
    parser.add_argument("--grads")
    args = parser.parse_args()

    acc = hyperacc.Accelerator(
        fsdp=hyperacc.FSDPConfig(activation_checkpointing=args.recompute,
                                 reduce_every_micro_batch=args.reduce_every),
        checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=7)
    model = build_causal_lm(qwen3_moe_config(), seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = hyperacc.MicroBatchDataLoader(
        TokenDataset(DATASET_SIZE, args.pad), global_batch_size=args.gbs,
        micro_batch_size=args.mbs, collate_fn=pad_collate, seed=3)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)

    record = {"losses": [], "grad_norms": [], "micro_batches": loader.micro_batches_per_step}
    for batch in loader:
        with acc.accumulate(model, batch) as micro_batches:
            for mb in micro_batches:
                acc.backward(model(**mb).loss)
        if args.grads and acc.progress.global_step == 0:
            grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
            if acc.is_main_process:
                torch.save(grads, args.grads)
        record["grad_norms"].append(float(acc.clip_grad_norm_(model.parameters(), 1e9)))
        optimizer.step()
        optimizer.zero_grad()
        record["losses"].append(acc.step_loss)
        if acc.progress.global_step == args.steps:
            break
    record["tokens"] = acc.progress.consumed_tokens
    if acc.is_main_process:
        with open(args.out, "w") as handle:
            json.dump(record, handle)
    acc.end_training()


if __name__ == "__main__":
    main()
