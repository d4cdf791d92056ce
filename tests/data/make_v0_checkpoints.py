"""Checkpoints written by hyperacc before issue 39's package reorganisation, and the resume they promise.

The fixtures under ``tests/data/v0_checkpoints/`` were written by this script running the code of commit
f56f13a (the main branch before issue 39), checked out as a worktree and put first on ``sys.path``:

    git worktree add /tmp/h3-old f56f13a
    python -m torch.distributed.run --nproc_per_node=2 tests/data/make_v0_checkpoints.py \\
        generate --code /tmp/h3-old --out tests/data/v0_checkpoints

(2 processes, CPU, gloo; torch 2.13, transformers 5.25, peft 0.21.2). Each fixture is a tiny model trained
through the public API for two optimizer steps and saved with ``Accelerator.save_state()`` (all six
buckets: model, optimizer, lr_scheduler, dataloader, rng, progress), then trained two more steps;
``expected.json`` records what those two steps produced (losses, learning rates, the random draws right
after the save, the final parameters' sha256) and what the checkpoint holds by name (``layout``).
``tests/test_checkpoint_v0.py`` runs ``resume`` with the current code: the same model, optimizer,
scheduler and loader rebuilt, ``load_state`` of the stored checkpoint (the loaded state saved again into
``<fixture>/reloaded_step_2``, which must hold the stored tensors bit for bit), the same two steps, which
must reproduce ``expected.json``'s draws, learning rates and epochs exactly and its losses to float
rounding (bit for bit on a CPU with the writer's kernels; another instruction set, e.g. AVX-512, sums in
another order). The fixtures are never regenerated with newer code (a fixture
written by the code under test proves nothing about old checkpoints): a change meant to stay compatible
has to load these files as they are.

The fixtures:
- ``full``: a Qwen3-MoE (fp32, untied embeddings, router aux loss, attention dropout so that the rng
  bucket decides the losses) and an object registered with ``register_for_checkpointing``
  (``custom_checkpoint_0.pkl``);
- ``tied``: the same with ``tie_word_embeddings=True``, without the registered object; f56f13a stores the
  tied parameter once (``model.embed_tokens.weight``) and names the tie in ``hyperacc_checkpoint.json``;
  resumed through ``load_state("LATEST")`` (``latest_checkpoint_iteration.txt``);
- ``lora``: a PEFT LoRA model (q_proj, v_proj) on a tied base built from a seed: the checkpoint holds the
  trainable tensors, the frozen base is checked against its fingerprint at load. (f56f13a also stores the
  frozen tied head there, under ``lm_head.weight``: torch's ``ignore_frozen_params`` keeps a tied alias.)

After the resumed steps ``resume`` saves once more into the copy (``<fixture>/resaved_step_4``): its
``layout`` must equal the stored one (what the current code writes for the same state).
Models are built from configs (no download), the data is an in-memory list of seeded token rows, and the
script imports public paths only (``hyperacc``, ``hyperacc.models``, ``peft``), so that it runs against
the code before and after a reorganisation of the package; hyperacc is imported inside the functions
because ``--code`` has to be on ``sys.path`` first. Generating twice writes the same files but for DCP's
``.metadata`` (and the same ``expected.json``).
"""
import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import traceback

import numpy as np
import torch

SEQ = 16
VOCAB = 128
SAMPLES = 12                 # 3 optimizer steps per epoch: the two resumed steps cross an epoch boundary
GLOBAL_BATCH, MICRO_BATCH = 4, 1
SAVE_AT, STEPS = 2, 4
FIXTURES = ("full", "tied", "lora")
SEED = 7


def tiny_config(tied: bool):
    from hyperacc.models import qwen3_moe_config

    return qwen3_moe_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
                            tie_word_embeddings=tied, attention_dropout=0.1)


def dataset():
    """Arithmetic token sequences from seeded random starts (an in-memory list: the same on every run)."""
    rows = []
    for i in range(SAMPLES):
        start = torch.randint(0, VOCAB, (1,), generator=torch.Generator().manual_seed(100 + i))
        ids = (start * 7 + torch.arange(SEQ) * 3) % VOCAB
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


class Counter:
    """A user's own stateful object (accelerate's ``register_for_checkpointing``)."""

    def __init__(self):
        self.steps, self.trace = 0, torch.zeros(STEPS)

    def state_dict(self):
        return {"steps": self.steps, "trace": self.trace.clone()}

    def load_state_dict(self, state):
        self.steps, self.trace = int(state["steps"]), state["trace"].clone()


def build(kind: str, checkpoint_dir: str):
    """The Accelerator and the prepared model, optimizer, scheduler, loader (and Counter) of ``kind``.
    ``save_ckpt=False``: nothing is saved but by ``save_state`` (no final save at ``end_training``)."""
    import hyperacc
    from hyperacc.models import build_causal_lm

    acc = hyperacc.Accelerator(
        seed=SEED, parallel=hyperacc.ParallelConfig(), fsdp=hyperacc.FSDPConfig(precision="fp32_master"),
        checkpoint=hyperacc.CheckpointConfig(checkpoint_dir=checkpoint_dir, save_ckpt=False))
    model = build_causal_lm(tiny_config(tied=kind != "full"), seed=SEED, router_aux_loss=kind != "lora")
    lr = 3e-3
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"]))
        lr = 1e-2
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    loader = hyperacc.MicroBatchDataLoader(dataset(), global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
                                           shuffle=True, seed=5)
    model, optimizer, scheduler, loader = acc.prepare(model, optimizer, scheduler, loader)
    counter = None
    if kind == "full":
        counter = Counter()
        acc.register_for_checkpointing(counter)
    return acc, model, optimizer, scheduler, loader, counter


def train_until(acc, model, optimizer, scheduler, loader, counter, last_step: int):
    """Optimizer steps up to ``last_step``; {step: {"loss", "lr", "epoch"}}."""
    steps = {}
    while acc.progress.global_step < last_step:
        for batch in loader:
            with acc.accumulate(model, batch) as micro_batches:
                for mb in micro_batches:
                    acc.backward(model(**mb).loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
            step = acc.progress.global_step
            steps[str(step)] = {"loss": acc.step_loss, "lr": scheduler.get_last_lr()[0], "epoch": loader.epoch}
            if counter is not None:
                counter.trace[counter.steps] = acc.step_loss
                counter.steps += 1
            acc.step_end()
            if step >= last_step:
                break
    return steps


def draws():
    """One draw from each generator the rng bucket holds (torch, python, numpy), as exact floats."""
    return [torch.rand(()).item(), random.random(), float(np.random.rand())]


def parameter_hashes(model):
    """sha256 of every full parameter (a collective: every rank, same order) and of all of them."""
    total, each = hashlib.sha256(), {}
    for name, param in model.named_parameters():
        tensor = param.detach()
        tensor = (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).cpu().contiguous()
        data = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        each[name] = hashlib.sha256(data).hexdigest()
        total.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}:".encode() + data)
    return total.hexdigest(), each


def gather(acc, value):
    """``value`` of every rank (a list, rank order)."""
    import torch.distributed as dist

    values = [None] * acc.num_processes
    dist.all_gather_object(values, value)
    return values


def after_restart(acc, model, optimizer, scheduler, loader, counter):
    """What follows the save: the draws of each rank, the next steps, the final parameters."""
    record = {"global_step": acc.progress.global_step, "epoch": loader.epoch, "draws": gather(acc, draws())}
    record["steps"] = train_until(acc, model, optimizer, scheduler, loader, counter, STEPS)
    record["params_sha256"], record["param_sha256"] = parameter_hashes(model)
    if counter is not None:
        record["counter"] = {"steps": counter.steps, "trace": counter.trace.tolist()}
    record["final_global_step"] = acc.progress.global_step
    return record


def layout(path: str) -> dict:
    """What a checkpoint directory holds, by name: files, DCP keys, the sentinel but for its step and epoch."""
    import torch.distributed.checkpoint as dcp

    files = sorted(os.path.relpath(os.path.join(root, name), path)
                   for root, _, names in os.walk(path) for name in names)
    keys = sorted(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    with open(os.path.join(path, "hyperacc_checkpoint.json")) as handle:
        sentinel = {k: v for k, v in json.load(handle).items() if k not in ("global_step", "epoch")}
    return {"files": files, "dcp_keys": keys, "sentinel": sentinel}


def provenance() -> dict:
    """The commit of the hyperacc that wrote the fixture and the library versions it ran with."""
    import subprocess

    import hyperacc
    import peft
    import transformers

    code = os.path.dirname(os.path.dirname(os.path.abspath(hyperacc.__file__)))
    commit = subprocess.run(["git", "-C", code, "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    return {"hyperacc_commit": commit, "torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__}


def generate(kind: str, out: str):
    folder = os.path.join(out, kind)
    acc, model, optimizer, scheduler, loader, counter = build(kind, os.path.join(folder, "ckpt"))
    before = train_until(acc, model, optimizer, scheduler, loader, counter, SAVE_AT)
    saved = acc.save_state()
    record = {"fixture": kind, "saved_at": SAVE_AT, "checkpoint": os.path.relpath(saved, folder),
              "layout": layout(saved), "steps_before_save": before,
              **after_restart(acc, model, optimizer, scheduler, loader, counter)}
    if acc.is_main_process:
        record["written_by"] = provenance()
        os.remove(os.path.join(folder, "ckpt", ".hyperacc.lock"))     # this run's single-writer lock
        with open(os.path.join(folder, "expected.json"), "w") as handle:
            json.dump(record, handle, indent=1, sort_keys=True)
            handle.write("\n")
    return record, acc


def resume(kind: str, fixtures: str):
    """Rebuild ``kind`` with the importable hyperacc, load its stored checkpoint, train the steps after it,
    then save (what this code writes for the same state: ``layout``)."""
    folder = os.path.join(fixtures, kind)
    with open(os.path.join(folder, "expected.json")) as handle:
        expected = json.load(handle)
    acc, model, optimizer, scheduler, loader, counter = build(kind, os.path.join(folder, "ckpt"))
    loaded = acc.load_state("LATEST" if kind == "tied" else os.path.join(folder, expected["checkpoint"]))
    # the state as loaded, written by this code (the test compares its tensors with the stored ones bit for
    # bit: a check no CPU's kernels can move); saved before the draws, as generate's draws follow its save
    again = acc.save_state(os.path.join(folder, f"reloaded_step_{SAVE_AT}"))
    record = {"fixture": kind, "loaded": os.path.relpath(loaded, folder) if loaded else None,
              "stored_path": loaded, "reloaded_path": again,
              **after_restart(acc, model, optimizer, scheduler, loader, counter)}
    # a directory of its own (checkpoint_dir holds the stored run's history, which this run does not own)
    record["layout"] = layout(acc.save_state(os.path.join(folder, f"resaved_step_{STEPS}")))
    return record, acc


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("generate", "resume"))
    parser.add_argument("--code", default=None, help="a hyperacc checkout to import (first on sys.path)")
    parser.add_argument("--out", help="generate: the fixtures folder to write")
    parser.add_argument("--fixtures", help="resume: a copy of the fixtures folder (a save is written into it)")
    parser.add_argument("--result", help="resume: where rank 0 writes {fixture: record}")
    parser.add_argument("--only", nargs="*", default=list(FIXTURES), choices=FIXTURES)
    args = parser.parse_args()
    if args.code:
        # ahead of an editable install of another checkout (its import finder comes after sys.path)
        sys.path.insert(0, os.path.abspath(args.code))
    import hyperacc

    if args.code and not hyperacc.__file__.startswith(os.path.abspath(args.code) + os.sep):
        raise SystemExit(f"hyperacc imported from {hyperacc.__file__}, not from --code {args.code}")
    records, acc = {}, None
    for kind in args.only:
        if args.mode == "generate":
            if int(os.environ.get("RANK", "0")) == 0:
                shutil.rmtree(os.path.join(args.out, kind), ignore_errors=True)
                os.makedirs(os.path.join(args.out, kind))
            records[kind], acc = generate(kind, args.out)
        else:
            try:
                records[kind], acc = resume(kind, args.fixtures)
            except Exception as err:  # noqa: BLE001 - recorded: the test names the fixture that failed
                # hyperacc raises its load errors on every rank alike, so the next fixture still runs
                records[kind] = {"fixture": kind, "error": "".join(traceback.format_exception(err)[-6:])}
    if args.mode == "resume" and int(os.environ.get("RANK", "0")) == 0:
        with open(args.result, "w") as handle:
            json.dump({"hyperacc": hyperacc.__file__, "records": records}, handle, indent=1, sort_keys=True)
    # once, at the end: it releases the process group, which a later Accelerator could not re-create under
    # torchrun (the fixtures share one launch); save_ckpt=False, so it saves nothing
    if acc is not None:
        acc.end_training()


if __name__ == "__main__":
    main()
