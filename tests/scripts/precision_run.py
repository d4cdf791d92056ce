"""Train a tiny Qwen3-MoE under a precision recipe on real FSDP2 processes; report dtypes and losses.

    torchrun --nproc_per_node=2 precision_run.py OUT.json --precision bf16_sr --ckpt DIR --steps 4
        [--save-steps 2] [--restore PATH] [--export DIR] [--replicate 2] [--guard-every N]
        [--perturb STEP] [--dump DIR] [--then OUT2.json ...]   (several runs in one job: run_sequence.py)
Rank 0 writes OUT.json: per-step loss and grad norm, the dtypes of parameters, gradients and AdamW
states as they are during training, and the warnings raised by load_state.
"""
import argparse
import json
import warnings

import torch

import hyperacc
from hyperacc.models import build_causal_lm, qwen3_moe_config
from hyperacc.precision.adamw import AdamW
from run_sequence import run_all

SEQ, VOCAB = 16, 512


class Tokens:
    def __len__(self):
        return 64

    def __getitem__(self, i):      # counting from a random start: learnable in a few steps
        start = torch.randint(0, VOCAB, (1,), generator=torch.Generator().manual_seed(100 + i))
        ids = (start + torch.arange(SEQ)) % VOCAB
        return {"input_ids": ids, "labels": ids.clone()}


def dtypes(tensors):
    return sorted({str(t.dtype).replace("torch.", "") for t in tensors})


def perturb_one_ulp(model, name=None):
    """Rank 1's copy of parameter ``name`` (default: the first one replicated over a mesh dimension)
    moves by one ulp."""
    for param_name, param in model.named_parameters():
        replicated = any(pl.is_replicate() for pl in getattr(param, "placements", ()))
        if param_name == name or (name is None and replicated):
            local = param.to_local().detach().view(-1)
            with torch.no_grad():
                local[0] = torch.nextafter(local[0], local[0] + 1)
            return


def parse_args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--precision", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--restore", default=None)
    p.add_argument("--export", default=None)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--replicate", type=int, default=1, help="dp_replicate_size (HSDP)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--guard-every", type=int, default=None, help="a hyperacc.ReplicaGuard checking every N steps")
    p.add_argument("--perturb", type=int, default=None, help="after this step, move one element of rank 1's "
                   "copy of the first replicated parameter by one ulp")
    p.add_argument("--perturb-param", default=None, help="the parameter --perturb moves (default: the first "
                   "one replicated over a mesh dimension)")
    p.add_argument("--dump", default=None, help="write each rank's local parameter shards to DIR/rank<R>.pt")
    return p.parse_args(argv)


def main():
    run_all(run, parse_args)         # one run, or several separated by --then (run_sequence.py)


def run(args):
    acc = hyperacc.Accelerator(
        fsdp=hyperacc.FSDPConfig(precision=args.precision),
        parallel=hyperacc.ParallelConfig(ep_size=args.ep, dp_replicate_size=args.replicate, tp_size=args.tp),
        checkpoint=hyperacc.CheckpointConfig(checkpoint_dir=args.ckpt, save_steps=args.save_steps, save_epochs=0,
                                             restore_from=args.restore), seed=3)
    model = build_causal_lm(qwen3_moe_config(), meta_device=True, router_aux_loss=False)
    optimizer = AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    loader = hyperacc.MicroBatchDataLoader(Tokens(), global_batch_size=4, micro_batch_size=1, seed=5)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    guard = hyperacc.ReplicaGuard(acc, every=args.guard_every) if args.guard_every is not None else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state()
    record = {"start": acc.progress.global_step, "steps": {}, "warnings": [str(w.message) for w in caught],
              "param_dtypes": dtypes(model.parameters())}
    stopped = False
    while acc.progress.global_step < args.steps and not stopped:      # epochs of 16 steps
        for batch in loader:
            if acc.progress.global_step >= args.steps:
                break
            with acc.accumulate(model, batch) as micro_batches:
                for mb in micro_batches:
                    acc.backward(model(**mb).loss)
            record["grad_dtypes"] = dtypes(p.grad for p in model.parameters() if p.grad is not None)
            norm = acc.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            optimizer.zero_grad()
            record["steps"][acc.progress.global_step] = {"loss": acc.step_loss, "grad_norm": float(norm)}
            if args.perturb == acc.progress.global_step and acc.process_index == 1:
                perturb_one_ulp(model, args.perturb_param)
            if guard is not None:
                try:
                    guard.maybe_check(acc.progress.global_step, loss=acc.step_loss)
                except hyperacc.ReplicaMismatchError as err:
                    record["mismatch"] = {"step": acc.progress.global_step, "error": str(err)}
                    stopped = True
                    break
            acc.step_end()
    if args.dump:
        local = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}
        torch.save(local, f"{args.dump}/rank{acc.process_index}.pt")
    record["state_dtypes"] = dtypes(v for s in optimizer.optimizer.state.values() for k, v in s.items() if k != "step")
    record["stochastic_rounding"] = optimizer.optimizer.stochastic_rounding
    if args.export:
        acc.save_model(model, args.export)
    acc.end_training()
    if acc.is_main_process:
        with open(args.out, "w") as handle:
            json.dump(record, handle)


if __name__ == "__main__":
    main()
