"""Bad parallel inputs, one launch: each case builds an Accelerator and prepares (and, for context
parallelism, steps) a tiny model the wrong way; every rank prints ``case NAME: <error>`` to stderr,
then all ranks meet at a monitored barrier, which fails within seconds if one rank hung in a
collective the others never joined. Usage: parallel_errors.py CASE [CASE ...]
"""
import datetime
import sys

import torch
import torch.distributed as dist

import hyperacc
from hyperacc.models import build_causal_lm, qwen3_moe_config


def dense():
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)


CASES = {   # name: (ParallelConfig sizes, model config, sequence length of the batch)
    "ep_ranks": (dict(ep_size=3), qwen3_moe_config(), 16),
    "ep_experts": (dict(ep_size=2), qwen3_moe_config(num_experts=3), 16),
    "tp_heads": (dict(tp_size=2), qwen3_moe_config(num_attention_heads=3, num_key_value_heads=1), 16),
    "dense_ep": (dict(ep_size=2), dense(), 16),
    "cp_seq": (dict(cp_size=2), qwen3_moe_config(), 15),
    "cp_heads": (dict(cp_size=2), qwen3_moe_config(num_attention_heads=3, num_key_value_heads=1), 16),
    "cp_unwrappable": (dict(cp_size=2), None, 16),     # a plain torch module: no AttentionInterface
}


def run(name):
    sizes, config, seq = CASES[name]
    acc = hyperacc.Accelerator(parallel=hyperacc.ParallelConfig(**sizes),
                               checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=1)
    model = build_causal_lm(config, meta_device=True) if config is not None else torch.nn.Sequential(torch.nn.Linear(4, 4))
    model = acc.prepare(model)
    ids = torch.randint(0, 64, (1, seq))
    with acc.accumulate(model, [{"input_ids": ids, "labels": ids.clone()}]) as micro_batches:
        for mb in micro_batches:
            acc.backward(model(**mb).loss)
    acc.end_training()


def main():
    dist.init_process_group("gloo")
    for name in sys.argv[1:]:
        try:
            run(name)
            print(f"case {name}: no error", file=sys.stderr, flush=True)
        except Exception as err:  # noqa: BLE001 - the message is what the test reads
            print(f"case {name}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
