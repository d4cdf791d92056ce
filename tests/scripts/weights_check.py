"""One sharded-load + sharded-export round trip on however many processes launched it.

Each rank loads ``--model`` with `load_pretrained(accelerator=)` + `prepare`, the full weights are
gathered and compared bitwise with `from_pretrained` on rank 0, the first-step loss on a fixed
batch is compared with the single-process `from_pretrained` model's, then `save_model` exports and
rank 0 reloads the export with `from_pretrained`. Rank 0 writes the verdicts to ``--out`` (JSON).
"""
import argparse
import json

import torch
from torch.distributed.tensor import DTensor

import hyperacc
from hyperacc.models import load_pretrained


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--export")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    args = parser.parse_args()

    acc = hyperacc.Accelerator(parallel=hyperacc.ParallelConfig(tp_size=args.tp, ep_size=args.ep))
    model = load_pretrained(args.model, accelerator=acc)
    assert all(p.is_meta for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    if args.export:          # before the step: the export must hold exactly the loaded weights
        acc.save_model(model, args.export, max_shard_size="200KB")
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, model.config.vocab_size, (2, 16), generator=generator)
    loss = model(input_ids=batch, labels=batch).loss
    acc.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    loss2 = model(input_ids=batch, labels=batch).loss.item()
    result = {}
    if acc.is_main_process:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager")
        params = dict(ref.named_parameters())
        result["params_equal"] = sorted(params) == sorted(full) and all(torch.equal(full[n], params[n]) for n in params)
        result["buffers_equal"] = all(torch.equal(buffers[n], b) for n, b in ref.named_buffers())
        result["dtype"] = str(next(iter(full.values())).dtype)
        ref_loss = ref(input_ids=batch, labels=batch).loss
        result["loss"], result["ref_loss"] = loss.item(), ref_loss.item()
        result["loss2"] = loss2
        if args.export:
            again = dict(AutoModelForCausalLM.from_pretrained(args.export).named_parameters())
            result["export_equal"] = sorted(again) == sorted(full) and all(
                torch.equal(again[n], full[n]) for n in again)
        with open(args.out, "w") as handle:
            json.dump(result, handle)
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
