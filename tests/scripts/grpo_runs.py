"""TRL's online trainers (GRPO, RLOO) on hyperacc, or plain TRL's GRPO on accelerate: the runs of
tests/scripts/dpo_runs.py whose names start with ``grpo``, ``rloo`` or ``trl_grpo``.

The policy is the tiny causal LM of BASE_DIR, loaded by path (as `trl/scripts/grpo.py` does; the reference of
``beta > 0`` is loaded from the same path by TRL). 8 prompts; each step takes 2 of them, 4 completions each
(global generation batch 8 = per device 8 / processes), up to 12 new tokens, temperature 1, fp32, AdamW,
seed 7. The toy reward: the share of even token ids in a completion. Runs:

  grpo        hyperacc.integrations.trl.GRPOTrainer, full fine-tune, beta 0.04 (a reference sharded frozen)
  grpo_lora   the same with LoRA (the reference: the base with adapters disabled)
  rloo        hyperacc.integrations.trl.RLOOTrainer, full fine-tune
  trl_grpo    plain `trl.GRPOTrainer` on accelerate (1 process: the baseline of benchmarks/preference.py)
  grpo4       grpo, 4 steps, checkpoints at steps 2 and 4: the uninterrupted run
  grpo_save   the same, but the process dies right after the step-2 save; with RESUME=1 it resumes instead
  grpo_ga2    grpo with gradient_accumulation_steps=2 (per device 4 / processes; TRL splits each generation in 2)
  grpo_tp     GRPO with tp_size=2 (2 processes; the last run of its launch): the refusal recorded
  grpo_midblock  num_iterations=2; saved at step 1 (inside a generation block), then resumed under another
              seed, and under its own: the refusals

Rank 0's record (dpo_runs.py writes it to OUT/<run>.json) adds to the log history every completion in the
order of the global batch (rank 0's rows, then rank 1's), per generation, and the trained weights
(OUT/<run>.pt, full tensors).
"""
import os
import time

import torch
import torch.distributed as dist

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def prompts():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": " ".join(WORDS[(i * 3 + k) % 16] for k in range(3))} for i in range(8)])


class EvenShare:
    """The toy reward; remembers every completion it scored, in this rank's order."""

    __name__ = "even_share"

    def __init__(self):
        self.seen = []

    def __call__(self, prompts, completions, completion_ids, trainer_state=None, **kwargs):
        self.seen.append({"step": trainer_state.global_step if trainer_state else None,
                          "ids": [list(map(int, ids)) for ids in completion_ids]})
        return [sum(1 for t in ids if t % 2 == 0) / max(1, len(ids)) for ids in completion_ids]


def _config(cls, out, world, **overrides):
    return cls(**{**dict(output_dir=out, per_device_train_batch_size=8 // world, num_generations=4,
                         max_completion_length=12, temperature=1.0, max_steps=3, learning_rate=1e-2, seed=7,
                         logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, bf16=False,
                         use_cpu=True, beta=0.04), **overrides})


def run(name, base, out, tok):
    import trl

    import hyperacc.integrations.trl as hyperacc_trl

    start = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    reward = EvenShare()
    overrides, kwargs = {}, {}
    if name in ("grpo4", "grpo_save"):
        overrides.update(max_steps=4, save_strategy="steps", save_steps=2)
    if name == "grpo_ga2":       # 2 micro-batches per step: TRL splits each generation (steps_per_generation=2)
        overrides.update(per_device_train_batch_size=4 // world, gradient_accumulation_steps=2)
    if name == "grpo_midblock":
        overrides.update(max_steps=2, num_iterations=2)
    if name == "grpo_lora":
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    if name == "grpo_tp":        # tensor parallelism: refused once the Accelerator knows the layout
        from accelerate.parallelism_config import ParallelismConfig

        config = _config(trl.GRPOConfig, os.path.join(out, name), world, per_device_train_batch_size=8,
                         parallelism_config=ParallelismConfig(tp_size=2))
        try:
            hyperacc_trl.GRPOTrainer(model=str(base), reward_funcs=reward, args=config, train_dataset=prompts(),
                                     processing_class=tok)
        except NotImplementedError as error:
            return {"error": str(error)}
        return {"error": None}
    if name == "rloo":
        cls, config = hyperacc_trl.RLOOTrainer, _config(trl.RLOOConfig, os.path.join(out, name), world)
    else:
        cls = trl.GRPOTrainer if name == "trl_grpo" else hyperacc_trl.GRPOTrainer
        config = _config(trl.GRPOConfig, os.path.join(out, name), world, **overrides)
    trainer = cls(model=str(base), reward_funcs=reward, args=config, train_dataset=prompts(), processing_class=tok,
                  **kwargs)
    if name == "grpo_ga2":       # 2 micro-batches per step: TRL splits each generation (steps_per_generation=2)
        overrides.update(per_device_train_batch_size=4 // world, gradient_accumulation_steps=2)
    if name == "grpo_midblock":
        return midblock(trainer, reward, base, tok)
    from dpo_runs import train_or_die

    train_or_die(trainer, killed=name == "grpo_save")
    return record(trainer, reward, name, out, start)


def midblock(trainer, reward, base, tok):
    """num_iterations=2 (a generation every 2 steps); a callback of the user's asks for a save at step 1, inside
    the block, and stops; the resume from it is refused, the message recorded; before that, a resume under
    another seed (refused too)."""
    import trl
    from transformers import TrainerCallback

    import hyperacc.integrations.trl as hyperacc_trl

    class SaveAndStop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_save = control.should_training_stop = True

    trainer.add_callback(SaveAndStop())
    trainer.train()
    out = {"global_step": trainer.state.global_step}
    for key, seed in (("seed_error", trainer.args.seed + 1), ("error", trainer.args.seed)):
        args = _config(trl.GRPOConfig, trainer.args.output_dir, int(os.environ.get("WORLD_SIZE", "1")),
                       max_steps=2, num_iterations=2, seed=seed)
        again = hyperacc_trl.GRPOTrainer(model=str(base), reward_funcs=reward, args=args, train_dataset=prompts(),
                                         processing_class=tok)
        try:
            again.train(resume_from_checkpoint=True)
            out[key] = None
        except (RuntimeError, ValueError) as error:
            out[key] = f"{type(error).__name__}: {error}"
    return out


def record(trainer, reward, name, out, start):
    from dpo_runs import digest

    seen = [reward.seen]
    if dist.is_initialized():
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, reward.seen)
    completions = []
    for calls in zip(*seen):
        completions.append({"step": calls[0]["step"], "ids": [ids for call in calls for ids in call["ids"]]})
    history = [e for e in trainer.state.log_history if "loss" in e]
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
               for n, p in trainer.model.named_parameters() if p.requires_grad}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(weights, os.path.join(out, f"{name}{'_resumed' if os.environ.get('RESUME') else ''}.pt"))
    ref = getattr(trainer, "ref_model", None)
    return {"losses": [e["loss"] for e in history], "grad_norms": [e.get("grad_norm") for e in history],
            "rewards": [e.get("reward") for e in history], "kl": [e.get("kl") for e in history],
            "aux_loss": [e.get("aux_loss") for e in history],
            "completions": completions, "digest": digest(trainer.model),
            "ref_local_numel": None if ref is None else sum(
                (p.to_local() if hasattr(p, "to_local") else p).numel() for p in ref.parameters()),
            "ref_numel": None if ref is None else sum(p.numel() for p in ref.parameters()),
            "ref_trainable": None if ref is None else sum(p.requires_grad for p in ref.parameters()),
            "global_step": trainer.state.global_step, "seconds": round(time.perf_counter() - start, 2)}
