"""transformers' `TrainingArguments` as hyperacc's Accelerator arguments, and what cannot be honoured.

`Trainer` builds its accelerator from its arguments (mixed precision, the FSDP plugin of
``fsdp_config``, accelerate's ``parallelism_config``, the dynamo plugin of ``torch_compile``, the
data-loader options of ``accelerator_config``). hyperacc's Accelerator takes every one of those with
accelerate's meaning, so they are passed on as `Trainer` builds them; what hyperacc adds is the
checkpoint policy: ``output_dir`` is the checkpoint directory, ``save_total_limit`` the number of
checkpoints kept, ``save_only_model`` a weights-only checkpoint. `Trainer` still decides *when* to save
(``save_strategy`` / ``save_steps``).

Options hyperacc cannot honour are refused here, each in one line naming the option and the fix,
before the Accelerator (and any collective) exists.
"""
from __future__ import annotations

from typing import List

from hyperacc.config import CheckpointConfig

# TrainingArguments fields that have no meaning on hyperacc's engine, with the reason and the fix.
_REFUSED = {
    "deepspeed": "DeepSpeed is not used by hyperacc, which shards with FSDP2 (ZeRO-3 ~ FSDP2's default "
                 "resharding). Remove `deepspeed=`, or use transformers.Trainer for DeepSpeed.",
    "load_best_model_at_end": "hyperacc's checkpoints are DCP shards restored as a whole (model, optimizer, "
                              "progress, data position, RNG), not per-checkpoint model files the Trainer could "
                              "swap in. Set load_best_model_at_end=False and convert the best checkpoint with "
                              "`python -m hyperacc.checkpoint.convert to-hf`.",
    "auto_find_batch_size": "it re-runs the training loop with a smaller batch after an out-of-memory error, "
                            "preparing the model a second time; hyperacc shards a model once. Set the batch size "
                            "(hyperacc's plan report / `make rehearse` tells what fits).",
    "ignore_data_skip": "hyperacc restores the data position from the checkpoint itself (by index; a stream, which "
                        "has none, is replayed to it), so there is nothing to ignore. Drop ignore_data_skip (or start a new run without "
                        "resume_from_checkpoint to restart the data order).",
}


def nan_options(args) -> List[str]:
    """The arguments set to NaN (``beta=float("nan")`` trains DPO with a loss of exactly 0.0 every step on plain
    accelerate too: nothing moves and nothing says so). Infinity stays allowed (``max_grad_norm=inf``: no clip)."""
    import dataclasses
    import math

    return [f"{type(args).__name__}.{field.name}=nan" for field in dataclasses.fields(args)
            if isinstance(getattr(args, field.name, None), float) and math.isnan(getattr(args, field.name))]


def refused_options(args) -> List[str]:
    """One message per TrainingArguments option hyperacc cannot honour (empty when all are fine)."""
    problems = [f"TrainingArguments.{name}={getattr(args, name)!r}: {why}"
                for name, why in _REFUSED.items() if getattr(args, name, None)]
    plugin_args = getattr(args, "fsdp_plugin_args", None) or {}
    if int(plugin_args.get("fsdp_version", 2)) == 1:
        problems.append("TrainingArguments.fsdp_config['version']=1: accelerate's FSDP1 wrapping has no meaning on "
                        "hyperacc, which always shards with FSDP2 (fully_shard). Set fsdp_config={'version': 2} "
                        "or drop the fsdp options (hyperacc shards every decoder block by default).")
    strategy = getattr(getattr(args, "hub_strategy", None), "value", getattr(args, "hub_strategy", None))
    if getattr(args, "push_to_hub", False) and strategy in ("checkpoint", "all_checkpoints"):
        problems.append(f"TrainingArguments.hub_strategy={strategy!r}: hyperacc's checkpoints are DCP "
                        "shards, not the model folders the Hub expects. Use hub_strategy='end' (or 'every_save' for "
                        "the exported model) and keep checkpoints on shared storage.")
    pc = getattr(args, "parallelism_config", None)
    if pc is not None and (getattr(pc, "cp_size", 1) or 1) > 1:
        problems.append(_CP_UNDER_TRAINER)
    if pc is not None and (getattr(pc, "sp_size", 1) or 1) > 1:
        problems.append("TrainingArguments.parallelism_config.sp_size > 1: sequence parallelism (Ulysses) is "
                        "DeepSpeed's; hyperacc does not provide it. Set sp_size=1.")
    return problems


_CP_UNDER_TRAINER = ("context parallelism (cp_size > 1) under Trainer: the Trainer splits sequences with "
                     "accelerate's own context-parallel path, which is not hyperacc's. Use cp_size=1 with "
                     "Trainer, or hyperacc's own loop (examples/train_qwen.py) for context parallelism.")


def check_parallel(parallel_config) -> None:
    """The mesh hyperacc resolved (also from the PARALLELISM_CONFIG_* variables) against Trainer."""
    if parallel_config.cp_size > 1:
        raise NotImplementedError(_CP_UNDER_TRAINER)


def checkpoint_config(args) -> CheckpointConfig:
    """hyperacc's checkpoint policy for a Trainer run: saved where `Trainer` saves, when it saves."""
    weights_only = bool(getattr(args, "save_only_model", False))
    return CheckpointConfig(
        checkpoint_dir=args.output_dir, save_ckpt=True,
        save_steps=0, save_epochs=0,            # Trainer's save_strategy decides; hyperacc's own policy is off
        keep_last_n=int(args.save_total_limit or 0),
        save_optimizer=not weights_only, save_train_state=not weights_only)


def router_aux_mode(model):
    """The MoE load-balancing loss as `Trainer` / TRL compute it on accelerate: transformers' own
    per-forward term when the model's config asks for it ("micro_batch"), else none. hyperacc's
    sequence-wise term would add to ``outputs.loss`` and detach ``outputs.aux_loss``, but TRL builds its
    loss from ``outputs.aux_loss`` itself: that term must keep its gradient."""
    config = getattr(model, "config", None)
    return "micro_batch" if getattr(config, "output_router_logits", False) else None


def inexact_loss(trainer) -> List[str]:
    """Why this Trainer's step loss would not be the token mean over micro-batches and ranks (empty if it is)."""
    problems = []
    if not trainer.model_accepts_loss_kwargs and trainer.compute_loss_func is None:
        problems.append("the model's forward takes no `num_items_in_batch`: Trainer averages each micro-batch's mean "
                        "loss, so short and long micro-batches weigh the same (not the token mean of the step). Give "
                        "forward `**kwargs` passed to the loss, or set compute_loss_func.")
    if not trainer.args.average_tokens_across_devices and trainer.accelerator.dp_size > 1:
        problems.append("average_tokens_across_devices=False: each rank's loss is divided by its own token count, so "
                        "the step loss is the mean of per-rank means, not the token mean over all ranks. Leave it "
                        "True (the default).")
    return problems

