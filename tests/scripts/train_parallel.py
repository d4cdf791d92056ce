"""Train a tiny 8-expert Qwen3-MoE at several parallel layouts in one job and dump what tests compare.

The process group is created here, once; each layout builds its own Accelerator on it (meshes,
FSDP2 + TP/EP sharding), trains ``--steps`` AdamW steps from the same seeded meta-device init on
the same global batches, and records per-step loss, aux loss, grad norm and token counts.
Usage: train_parallel.py OUT.json LAYOUT [LAYOUT ...] [--steps N] [--recompute LAYOUT ...]
       [--ckpt DIR] [--save-step K]
       [--no-aux] [--pad-multiple M] [--precision RECIPE] [--optim torch|hyperacc] [--compile BACKEND]
       LAYOUT: e.g. dp4, dp2tp2, dp4ep2, dp2tp2ep4, rep2dp2ep2, dp2cp2, dp1 (letters then sizes);
       "mb<N>" sets that layout's micro-batch size (default --mbs), e.g. dp1mb4, dp2mb1; a trailing
       "na" turns the router aux loss off for that layout (as --no-aux does for all);
       "dp2tp2<dp4" resumes from the checkpoint layout dp4 saved in DIR (DIR/dp4) and trains on;
       a "+c" suffix compiles the layout's blocks with --compile's backend (default aot_eager), e.g.
       "dp2+c", "dp2+c<dp2" (compiled, resumed from the eager dp2's checkpoint).
       --save-step K: every layout saves its step-K state to DIR/<layout>.
"""
import argparse
import functools
import json
import os
import re

import torch
import torch.distributed as dist

import hyperacc
from hyperacc.precision import adamw as hyperacc_optim
from hyperacc.sharding.compile import compiled_frames
from hyperacc.data.collate import pad_collate
from hyperacc.models import build_causal_lm, qwen3_moe_config
from train_tiny import TokenDataset

EXPERTS = 8


def parse_layout(text):
    sizes = {"dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": 1, "ep_size": 1, "cp_size": 1}
    names = {"rep": "dp_replicate_size", "dp": "dp_shard_size", "tp": "tp_size", "ep": "ep_size", "cp": "cp_size",
             "mb": "micro_batch_size"}
    for key, value in re.findall(r"([a-z]+)(\d+)", text):
        sizes[names[key]] = int(value)
    return sizes


def model_config(aux=True, coef=0.01):
    return qwen3_moe_config(num_experts=EXPERTS, num_experts_per_tok=2, output_router_logits=aux,
                            router_aux_loss_coef=coef)


def expert_bytes(model):
    local = total = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            local += p.to_local().numel() * p.element_size()
            total += p.numel() * p.element_size()
    return local, total


def train(spec, args):
    layout, _, source = spec.partition("<")
    compiled = layout.endswith("+c")
    layout = layout.removesuffix("+c")
    aux = not (args.no_aux or layout.endswith("na"))
    sizes = parse_layout(layout)
    micro_batch_size = sizes.pop("micro_batch_size", args.mbs)
    acc = hyperacc.Accelerator(
        parallel=hyperacc.ParallelConfig(**sizes),
        fsdp=hyperacc.FSDPConfig(activation_checkpointing=spec in args.recompute, compile=compiled,
                                 compile_backend=args.compile, precision=args.precision),
        checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=7, router_aux_loss=args.aux_mode)
    model = build_causal_lm(model_config(aux, args.aux_coef), meta_device=True, router_aux_loss=aux)
    optimizer = (hyperacc_optim.AdamW if args.optim == "hyperacc" else torch.optim.AdamW)(model.parameters(), lr=args.lr)
    loader = hyperacc.MicroBatchDataLoader(TokenDataset(160, True), global_batch_size=args.gbs,
                                           micro_batch_size=micro_batch_size, collate_fn=functools.partial(pad_collate, pad_to_multiple_of=args.pad_multiple), seed=3)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    if source:
        acc.load_state(os.path.join(args.ckpt, source))
    params = dict(model.named_parameters())
    local, total = expert_bytes(model)
    record = {"layout": spec, "start_step": acc.progress.global_step, "dp_size": acc.dp_size, "micro_batches": loader.micro_batches_per_step,
              "placements": {name: f"{p.device_mesh.mesh_dim_names}:{p.placements}" for name, p in params.items()
                             if name.startswith("model.layers.0.") or "embed" in name or "lm_head" in name},
              "expert_bytes_share": local / total,
              "losses": [], "aux_losses": [], "step_aux_losses": [], "grad_norms": [], "tokens": [],
              "compiled_frames": []}
    while acc.progress.global_step < args.steps:
        for batch in loader:
            aux = 0.0
            with acc.accumulate(model, batch) as micro_batches:
                for mb in micro_batches:
                    out = model(**mb)
                    aux += float(out.aux_loss.detach()) if out.aux_loss is not None else 0.0
                    acc.backward(out.loss, aux_loss=out.aux_loss)
            record["grad_norms"].append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
            record["losses"].append(acc.step_loss)
            record["aux_losses"].append(aux)
            record["step_aux_losses"].append(acc.step_aux_loss)
            record["tokens"].append(acc.accumulator.step_tokens)
            record["compiled_frames"].append(compiled_frames())
            if args.save_step and acc.progress.global_step == args.save_step and not source:
                acc.save_state(os.path.join(args.ckpt, spec))
            if acc.progress.global_step == args.steps:
                break
    record["consumed_tokens"] = acc.progress.consumed_tokens
    acc.end_training()
    return record


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("layouts", nargs="+")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--recompute", nargs="*", default=[])
    parser.add_argument("--ckpt")
    parser.add_argument("--save-step", type=int, default=0)
    parser.add_argument("--no-aux", action="store_true")
    parser.add_argument("--compile", default="aot_eager", help="torch.compile backend of the '+c' layouts")
    parser.add_argument("--precision", default=None, help="FSDPConfig.precision of every layout")
    parser.add_argument("--optim", default="torch", choices=["torch", "hyperacc"],
                        help="torch.optim.AdamW, or hyperacc.precision.adamw.AdamW (which the bf16 recipes need)")
    parser.add_argument("--aux-mode", default=None, help="Accelerator(router_aux_loss=...): sequence | micro_batch")
    parser.add_argument("--aux-coef", type=float, default=0.01)
    parser.add_argument("--pad-multiple", type=int, default=None)
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    records = [train(layout, args) for layout in args.layouts]
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(args.out, "w") as handle:
            json.dump(records, handle)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
