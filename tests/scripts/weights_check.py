"""Sharded-load + sharded-export round trips on however many processes launched it.

For each ``--model`` every rank loads it with `load_pretrained(accelerator=)` + `prepare`, the
full weights are gathered and compared bitwise with `from_pretrained` on rank 0, the first-step
loss on a fixed batch is compared with the single-process `from_pretrained` model's, and (before
the step) `save_model` exports it and rank 0 reloads the export with `from_pretrained`. Rank 0
writes the verdicts to ``--out`` (JSON, one object per model). Several layouts in one launch:
``--model A --out R1 --export E1 --ep 2 --then --model B --out R2 --export E2 --tp 2`` (run_sequence.py).
"""
import argparse
import json
import os

import torch
from torch.distributed.tensor import DTensor

import hyperacc
from hyperacc.models import load_pretrained
from run_sequence import run_all


def check(acc, path, export):
    model = load_pretrained(path, accelerator=acc)
    assert all(p.is_meta for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    acc.save_model(model, export, max_shard_size="200KB")       # before the step: the loaded weights
    batch = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=batch, labels=batch).loss
    acc.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    loss2 = model(input_ids=batch, labels=batch).loss       # after one SGD step: the gradients were right
    result = {}
    if acc.is_main_process:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
        params = dict(ref.named_parameters())
        result["params_equal"] = sorted(params) == sorted(full) and all(torch.equal(full[n], params[n]) for n in params)
        result["buffers_equal"] = all(torch.equal(buffers[n], b) for n, b in ref.named_buffers())
        ref_loss = ref(input_ids=batch, labels=batch).loss
        result["loss"], result["ref_loss"] = loss.item(), ref_loss.item()
        ref_loss.backward()
        torch.optim.SGD(ref.parameters(), lr=0.1).step()
        result["loss2"], result["ref_loss2"] = loss2.item(), ref(input_ids=batch, labels=batch).loss.item()
        again = dict(AutoModelForCausalLM.from_pretrained(export).named_parameters())
        result["export_equal"] = sorted(again) == sorted(full) and all(torch.equal(again[n], full[n]) for n in again)
        result["export_files"] = sorted(os.listdir(export))
    return result


def parse_args(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--export", required=True, help="a directory; export i goes to <export>/<i>")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    return parser.parse_args(argv)


def main():
    run_all(run, parse_args)      # one run, or several separated by --then (run_sequence.py)


def run(args):
    # the reference is transformers' own model: its own (per-forward) MoE load-balancing loss
    acc = hyperacc.Accelerator(parallel=hyperacc.ParallelConfig(tp_size=args.tp, ep_size=args.ep),
                               router_aux_loss="micro_batch")
    results = [check(acc, path, os.path.join(args.export, str(i))) for i, path in enumerate(args.model)]
    if acc.is_main_process:
        with open(args.out, "w") as handle:
            json.dump(results, handle)
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
