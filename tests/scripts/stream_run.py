"""Training on a stream (`StreamingDataLoader` over `load_dataset(..., streaming=True)`), killed and resumed.

    stream_run.py --out FILE --kind text|chat --data JSONL --ckpt DIR --steps N
                  [--save-at K] [--kill-after K2] [--resume] [--then ...]

A tiny dense Qwen3 (fp32, built from its config with a seed) trains on the local JSONL streamed by
``datasets`` and shuffled by the loader in windows of 8 records (seed 5): ``text`` = the documents tokenized
and cut into 32-token windows (``TextWindows``), ``chat`` = conversations rendered with the ChatML template,
labels on the assistant's tokens (``ChatRecords``, 96 tokens), packed into one row per micro-batch.
Global batch 4, micro-batch 1. Per optimizer step rank 0 records the loss and a digest of the step's
samples in global order (gathered from every rank, so it does not depend on the number of processes).

``--save-at K`` saves at step K (``CheckpointConfig(save_steps=K)``); ``--kill-after K2`` SIGKILLs every
rank right after step K2 (the launch fails; the checkpoint of step K is what survives); ``--end-after K2``
stops there without another save (as a kill, for a run that is not the job's last). ``--resume``
starts with ``load_state`` of ``--ckpt``'s LATEST. Rank 0 writes ``--out``: {"steps": {step: [loss,
digest]}, "params": sha256 of the final parameters, "skipped": rows skipped}. Several runs in one job:
``--then`` (tests/scripts/run_sequence.py).
"""
import argparse
import hashlib
import json
import os
import signal
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_sequence import run_all  # noqa: E402

SEQ = {"text": 32, "chat": 96}


def parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kind", choices=("text", "chat"), required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--kill-after", type=int, default=0)
    p.add_argument("--end-after", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    return p.parse_args(argv)


def gathered(value):
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def digest(batch) -> str:
    """The step's samples in global order: rank 0's micro-batches, then rank 1's (one row per sample, or the
    packed row's ids cut at each position_ids restart)."""
    mine = []
    for mb in batch:
        for row in range(mb["input_ids"].shape[0]):
            mine.append(mb["input_ids"][row].tolist())
    flat = [ids for rank in gathered(mine) for ids in rank]
    return hashlib.sha256(json.dumps(flat).encode()).hexdigest()[:16]


def run(a):
    import datasets

    import hyperacc
    from hyperacc.data import ChatRecords, StreamingDataLoader, TextWindows, chat_collate, prepare_chat_tokenizer
    from hyperacc.data.text import load_tokenizer
    from transformers import Qwen3Config

    from hyperacc.models import build_causal_lm

    acc = hyperacc.Accelerator(seed=11, checkpoint=hyperacc.CheckpointConfig(
        checkpoint_dir=a.ckpt, save_steps=a.save_at, save_epochs=0, save_ckpt=bool(a.save_at),
        restore_from="LATEST" if a.resume else None))
    tok = load_tokenizer("default")
    if a.kind == "chat":
        tok = prepare_chat_tokenizer(tok, "chatml")
        transform, collate = ChatRecords(tok, SEQ["chat"]), chat_collate(tok, packing=True)
    else:
        transform, collate = TextWindows(tok, SEQ["text"]), None
    stream = datasets.load_dataset("json", data_files=a.data, split="train", streaming=True)
    loader = StreamingDataLoader(stream, global_batch_size=4, micro_batch_size=1, transform=transform,
                                 collate_fn=collate, shuffle=True, seed=5, window=8)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    model = build_causal_lm(config, seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    model.train()
    acc.save_on_end = False               # only the --save-at checkpoint: what a kill after it leaves
    acc.load_state()
    last = a.end_after or a.steps
    steps = {}
    while acc.progress.global_step < last:
        for batch in loader:
            with acc.accumulate(model, batch) as micro_batches:
                for mb in micro_batches:
                    acc.backward(model(**mb).loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            acc.step_end()
            step = acc.progress.global_step
            steps[step] = [acc.step_loss, digest(batch)]
            if acc.is_main_process:                    # each step: a killed run leaves its record too
                with open(a.out, "w") as handle:
                    json.dump({"steps": steps}, handle)
            if step == a.kill_after:
                acc.wait_for_everyone()
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= last:
                break
    params = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        params.update(name.encode() + t.contiguous().view(torch.uint8).numpy().tobytes())
    if acc.is_main_process:
        with open(a.out, "w") as handle:
            json.dump({"steps": steps, "params": params.hexdigest(), "skipped": loader.skipped_rows,
                       "epoch": loader.epoch}, handle)
    acc.end_training()


if __name__ == "__main__":
    run_all(run, parse)
