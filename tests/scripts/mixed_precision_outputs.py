"""One forward of a tiny Qwen3 under ``mixed_precision="bf16"``, prepared by hyperacc or by accelerate
itself (one process, CPU); writes the output dtypes and the loss as JSON.

    python mixed_precision_outputs.py OUT.json --engine hyperacc|accelerate [--mixed-precision bf16|no]
        [--precision RECIPE]

Why two processes: accelerate's state objects are process-wide, so each engine gets its own.
The weights and the batch depend on fixed seeds only, so both engines see the same model. Several
hyperacc runs with the same --mixed-precision share one process (``OUT.json --engine hyperacc --then
OUT2.json --engine hyperacc ...``, run_sequence.py; the process state keeps its mixed precision): each
builds its own Accelerator and model.
"""
import argparse
import json

import torch
from transformers import Qwen3Config

from hyperacc.models import build_causal_lm
from run_sequence import run_all


def tiny_qwen3():
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return build_causal_lm(config, seed=4)


def parse_args(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--engine", choices=["hyperacc", "accelerate"], required=True)
    parser.add_argument("--mixed-precision", default="bf16")
    parser.add_argument("--precision", default=None, help="hyperacc's recipe (FSDPConfig.precision)")
    return parser.parse_args(argv)


def main():
    run_all(forward, parse_args)


def forward(args):
    model = tiny_qwen3()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    if args.engine == "hyperacc":
        import hyperacc

        # a given FSDPConfig is complete (the constructor's mixed_precision= applies only without one)
        fsdp = {} if args.precision is None else {"fsdp": hyperacc.FSDPConfig(
            precision=args.precision, mixed_precision=args.mixed_precision)}
        acc = hyperacc.Accelerator(mixed_precision=args.mixed_precision,
                                   checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), **fsdp)
    else:
        import accelerate

        acc = accelerate.Accelerator(mixed_precision=args.mixed_precision, cpu=True)
    model = acc.prepare(model)
    blocks = []         # what a transformer block hands the next one
    model.model.layers[0].register_forward_hook(lambda module, inputs, output: blocks.append(
        (output[0] if isinstance(output, tuple) else output).dtype))
    out = model(input_ids=ids, labels=ids)
    acc.backward(out.loss)          # the fp32 loss still reaches the parameters' gradients
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    record = {"logits_dtype": str(out.logits.dtype), "loss_dtype": str(out.loss.dtype), "loss": out.loss.item(),
              "logits_mean": out.logits.float().mean().item(), "grads": len(grads),
              "param_dtype": str(next(model.parameters()).dtype), "block_output_dtype": str(blocks[0])}
    with open(args.out, "w") as handle:
        json.dump(record, handle)
    acc.end_training()


if __name__ == "__main__":
    main()
