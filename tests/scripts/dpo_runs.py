"""TRL's DPO, KTO and reward trainers on hyperacc (or plain TRL on accelerate), on real processes; writes
what each run did.

    dpo_runs.py BASE_DIR OUT_DIR RUN [RUN ...]

BASE_DIR: a tiny causal LM saved with ``save_pretrained`` and its tokenizer beside it; the policy is loaded
from it by path (TRL's own loading, as `trl/scripts/dpo.py` does), and so is the reference of a full
fine-tune. The data: 16 fixed preference pairs. Global batch 4 (per device 4 / processes), fp32, 3 AdamW
steps, seed 7. Each RUN, one after another in this launch:

  full        hyperacc.integrations.trl.DPOTrainer, full fine-tune (reference sharded frozen by hyperacc)
  precompute  the same with ``precompute_ref_log_probs=True`` (no reference in memory while training)
  lora        the same with ``peft_config=LoraConfig(...)`` (the reference: the base with adapters disabled)
  trl         plain `trl.DPOTrainer` on accelerate (1 process only: the baseline)
  sync        full with ``sync_ref_model=True`` (the sharded reference mixed with the policy every step,
              alpha 0.5, by TRL's own callback); trl_sync: the same on plain TRL
  kto         hyperacc.integrations.trl.KTOTrainer, full fine-tune, on the pairs unpaired (chosen: label
              True, rejected: False); trl_kto: plain `trl.KTOTrainer`
  reward      hyperacc.integrations.trl.RewardTrainer (a sequence-classification head on the base, loaded
              by path), on prompt + chosen / prompt + rejected; trl_reward: plain `trl.RewardTrainer`
  full4       full, 4 steps, checkpoints at steps 2 and 4 (save_steps=2): the uninterrupted run
  save        the same, but the process dies (os._exit) right after the step-2 save; with RESUME=1 in the
              environment it resumes from LATEST instead and finishes (OUT/save_resumed.json)
  grpo...     GRPO and RLOO runs: tests/scripts/grpo_runs.py
  uneven      tests/scripts/uneven_generate.py's check, writing OUT/uneven/rank<r>.json

Rank 0 writes OUT/<run>.json: per-step losses and rewards (the Trainer's log history), the trained
parameters' sha256 (full tensors), the reference's parameter count on this rank, seconds.
"""
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def pairs(out):
    """The pairs as a JSONL file read with `load_dataset` (a dataset with a cache directory: TRL's
    precompute_ref_log_probs caches its log-probs there, where every rank finds rank 0's file; an in-memory
    dataset's cache is per process, and TRL's precompute then fails on rank 1 on plain accelerate as well)."""
    from datasets import load_dataset

    path = os.path.join(out, "pairs.jsonl")
    if int(os.environ.get("RANK", "0")) == 0 and not os.path.exists(path):
        with open(path + ".tmp", "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in _rows())
        os.replace(path + ".tmp", path)
    while not os.path.exists(path):
        time.sleep(0.05)
    return load_dataset("json", data_files=path, split="train", cache_dir=os.path.join(out, "cache"))


def _rows():
    rows = []
    for i in range(16):
        prompt = " ".join(WORDS[(i + k) % 16] for k in range(4))
        rows.append({"prompt": prompt, "chosen": " " + " ".join(WORDS[(i * 3 + k) % 16] for k in range(3)),
                     "rejected": " " + " ".join(WORDS[(i * 5 + 2 * k) % 16] for k in range(2))})
    return rows


def config(out, **overrides):
    from trl import DPOConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    return DPOConfig(**{**dict(
        output_dir=out, per_device_train_batch_size=4 // world, max_steps=3, learning_rate=5e-3, seed=7,
        logging_steps=1, report_to=[], save_strategy="no", max_length=32, disable_tqdm=True,
        beta=0.1, bf16=False, use_cpu=True, dataloader_drop_last=True), **overrides})


def digest(model):
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if p.requires_grad:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            h.update(name.encode())
            h.update(full.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def record(trainer, start, extra=None):
    ref = getattr(trainer, "ref_model", None)
    out = {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
           "rewards_chosen": [e.get("rewards/chosen") for e in trainer.state.log_history if "loss" in e],
           "digest": digest(trainer.model), "seconds": round(time.perf_counter() - start, 2),
           "ref_local_numel": None if ref is None else sum(
               (p.to_local() if hasattr(p, "to_local") else p).numel() for p in ref.parameters()),
           "ref_numel": None if ref is None else sum(p.numel() for p in ref.parameters()),
           "policy_local_numel": sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                                     for p in trainer.model.parameters()),
           "ref_trainable": None if ref is None else sum(p.requires_grad for p in ref.parameters()),
           "global_step": trainer.state.global_step, **(extra or {})}
    return out


def unpaired(out):
    """The pairs as KTO's unpaired rows: (prompt, chosen, True) and (prompt, rejected, False)."""
    from datasets import Dataset

    rows = [{"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"}
            for r in pairs(out) for k in ("chosen", "rejected")]
    return Dataset.from_list(rows)


def joined(out):
    """The pairs as a reward model's rows: prompt + chosen, prompt + rejected (implicit prompt)."""
    return pairs(out).map(lambda r: {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]},
                          remove_columns=["prompt"])


def run_other(name, base, out, tok, start):
    """KTO and reward runs, hyperacc's or plain TRL's (``trl_`` prefix)."""
    import trl

    import hyperacc.integrations.trl as hyperacc_trl

    plain = name.startswith("trl_")
    kind = name[4:] if plain else name
    world = int(os.environ.get("WORLD_SIZE", "1"))
    common = dict(output_dir=os.path.join(out, name), per_device_train_batch_size=4 // world, max_steps=3,
                  learning_rate=5e-3, seed=7, logging_steps=1, report_to=[], save_strategy="no", max_length=32,
                  disable_tqdm=True, bf16=False, use_cpu=True, dataloader_drop_last=True)
    if kind == "kto":
        cls = trl.KTOTrainer if plain else hyperacc_trl.KTOTrainer
        trainer = cls(model=base, args=trl.KTOConfig(**common), train_dataset=unpaired(out), processing_class=tok)
    else:
        cls = trl.RewardTrainer if plain else hyperacc_trl.RewardTrainer
        trainer = cls(model=base, args=trl.RewardConfig(**common), train_dataset=joined(out), processing_class=tok)
    trainer.train()
    return record(trainer, start)


def run(name, base, out, tok):
    from peft import LoraConfig

    start = time.perf_counter()
    if name == "uneven":
        import uneven_generate

        return uneven_generate.run(str(base), os.path.join(out, "uneven"))
    if name.startswith(("grpo", "rloo", "trl_grpo")):
        import grpo_runs

        return grpo_runs.run(name, base, out, tok)
    if name.endswith(("kto", "reward")):
        return run_other(name, base, out, tok, start)
    data = pairs(out)
    sync = dict(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    if name in ("trl", "trl_sync"):
        import trl

        trainer = trl.DPOTrainer(model=base, args=config(os.path.join(out, name), **(sync if name == "trl_sync" else {})),
                                 train_dataset=data, processing_class=tok)
        trainer.train()
        return record(trainer, start)
    from hyperacc.integrations.trl import DPOTrainer

    kwargs = {}
    overrides = {}
    if name == "precompute":
        overrides["precompute_ref_log_probs"] = True
    if name == "lora":
        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    if name == "sync":
        overrides.update(sync)
    if name in ("save", "full4"):
        overrides.update(max_steps=4, save_strategy="steps", save_steps=2)
    trainer = DPOTrainer(model=base, args=config(os.path.join(out, name), **overrides), train_dataset=data,
                         processing_class=tok, **kwargs)
    train_or_die(trainer, killed=name == "save")
    return record(trainer, start)


def train_or_die(trainer, killed: bool) -> None:
    """``trainer.train()``; a ``killed`` run dies right after its first save, or with RESUME=1 in the
    environment resumes from LATEST instead."""
    if killed and not os.environ.get("RESUME"):
        from transformers import TrainerCallback

        class Die(TrainerCallback):
            def on_save(self, args, state, control, **kw):
                dist.barrier()
                os._exit(3)      # a kill right after the save: nothing else of this run survives

        trainer.add_callback(Die())
    trainer.train(resume_from_checkpoint=True if killed and os.environ.get("RESUME") else None)


def main():
    base, out, runs = sys.argv[1], sys.argv[2], sys.argv[3:]
    tok = AutoTokenizer.from_pretrained(base)
    os.makedirs(out, exist_ok=True)
    for name in runs:
        result = run(name, base, out, tok)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0 and result is not None:
            suffix = "_resumed" if name in ("save", "grpo_save") and os.environ.get("RESUME") else ""
            with open(os.path.join(out, f"{name}{suffix}.json"), "w") as handle:
                json.dump(result, handle, indent=1)
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()
