"""What a resume may change, checked from the checkpoint's saved run config (``config.yaml`` in each
checkpoint) before anything is built: examples/train_qwen.py's preflight.

Each check compares the fields that decide something the checkpoint fixed with this run's, and refuses
a change in one line naming the flags and the fix. Without them a changed setting is found only once
the data, the model and the process group exist -- at ``load_state``, as a traceback -- or not at all
(a rescaled LR schedule). The data check stands in for the loader's own (`DataResumeMismatch`): it
compares what the loader's fingerprint is made of (the data source and its rendering) and the global
batch size; what it cannot see from the config -- a file changed in place under the same path -- is
still refused by the loader at ``load_state``, and main() prints that as the same kind of one line.
A parallel layout needs no check: DCP reshards a checkpoint into any layout the run accepts.
"""
import dataclasses
import os

import yaml

from exit_report import as_flags
from hyperacc.errors import ConfigError

FRESH = "start a new run in another --checkpoint.checkpoint_dir"


def check_checkpoint_start(cfg):
    """The checkpoint directory's state against this run (hyperacc.checkpoint.lifecycle): a
    ``restore_from`` that names no checkpoint, or a fresh run into a directory holding another run's
    checkpoints, is refused; a resume must keep the LR schedule, the fine-tuning setup and (unless
    ``data.resume_mismatch=restart``) the data the checkpoint was trained on. Returns the checkpoint
    a resume restores, or None."""
    from hyperacc.checkpoint.lifecycle import check_start

    ck = cfg.checkpoint
    try:
        source = check_start(ck.checkpoint_dir, ck.restore_from, ck.save_ckpt)
    except (OSError, RuntimeError, ValueError) as err:   # no such checkpoint, a file, another tool's, in use
        raise ConfigError(f"checkpoint: {as_flags(str(err))}") from None
    if source is not None:
        check_resume_schedule(cfg, source)
        check_resume_peft(cfg, source)
        check_resume_data(cfg, source)
    return source


def _saved_run_config(checkpoint):
    """The example's config saved in ``checkpoint`` (nested dict), or None (written without it)."""
    from hyperacc.checkpoint.containment import RUN_CONFIG_FILE

    try:
        with open(os.path.join(checkpoint, RUN_CONFIG_FILE), encoding="utf-8") as handle:
            return yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError):
        return None


def check_resume_schedule(cfg, checkpoint):
    """The LR schedule is a function of (lr_scheduler, total steps): changing either on resume would
    rescale the schedule mid-run (e.g. a longer max_steps stretches the cosine: a jump in the LR)."""
    saved = _saved_run_config(checkpoint)
    if saved is None:
        return      # a checkpoint written without the example's config: nothing to compare
    old_sched, new_sched = dict(saved.get("lr_scheduler") or {}), dataclasses.asdict(cfg.lr_scheduler)
    old_total = old_sched.pop("total_steps", None) or (saved.get("training") or {}).get("max_steps")
    new_total = new_sched.pop("total_steps", None) or cfg.training.max_steps
    changed = [f"lr_scheduler.{k}: {old_sched[k]!r} -> {v!r}" for k, v in new_sched.items()
               if k in old_sched and old_sched[k] != v]
    if old_total is not None and int(old_total) != int(new_total):
        changed.insert(0, f"schedule length (lr_scheduler.total_steps or training.max_steps): {old_total} -> {new_total}")
    if changed:
        keep = f" --lr_scheduler.total_steps={old_total}" if old_total is not None else ""
        raise ConfigError(f"resuming {checkpoint} would change its LR schedule mid-run ({'; '.join(changed)}). Fix: "
                          f"keep the checkpoint's schedule{keep and ' with' + keep} (training.max_steps may then differ), "
                          f"or {FRESH}.")


def check_resume_peft(cfg, checkpoint):
    """An adapters-only checkpoint holds what was trained and nothing else: every ``peft`` option but
    the export directories must be the checkpoint's (the LoRA shapes, targets and the base's dtype; a
    switch between LoRA and full fine-tuning). The base itself is checked by hyperacc when the
    checkpoint is loaded (its fingerprint, saved with the adapters)."""
    saved = _saved_run_config(checkpoint)
    if saved is None:
        return
    from config_checks import PEFT_OUTPUTS
    from config_schema import PeftConfig

    defaults = dataclasses.asdict(PeftConfig())
    old = {**defaults, **(saved.get("peft") or {})}      # a checkpoint from before --peft.*: full fine-tuning
    new = dataclasses.asdict(cfg.peft)
    changed = [f"peft.{k}: {old[k]!r} -> {new[k]!r}" for k in defaults if k not in PEFT_OUTPUTS and old[k] != new[k]]
    if changed:
        raise ConfigError(f"resuming {checkpoint} would change its fine-tuning setup ({'; '.join(changed)}): the "
                          "checkpoint holds only what that setup trains. Fix: resume with the checkpoint's peft "
                          "options (its config.yaml lists them; peft.export_dir and peft.merged_export_dir may "
                          f"differ), or {FRESH}.")


def _same_path(old, new) -> bool:
    """Two spellings of one input: equal, or naming the same existing file (another cwd, a symlink)."""
    if old == new:
        return True
    if not (isinstance(old, str) and isinstance(new, str)):
        return False
    try:
        return os.path.samefile(os.path.expanduser(old), os.path.expanduser(new))
    except OSError:
        return False


def data_identity(data: dict, training: dict, model: dict) -> dict:
    """Flag -> value of what decides the training loader's samples and their order of steps: the
    source, how it is cut into samples (format, seq_len, columns, tokenizer, chat template) -- the
    loader's dataset fingerprint -- and the global batch size. ``data.packing`` is not in it: packing
    never changes which samples a step trains on. Sections as saved (nested dicts)."""
    from config_schema import DataConfig

    d = {**dataclasses.asdict(DataConfig()), **data}       # a field added since the save: its default
    tokenizer = d["tokenizer"] or model.get("name_or_path") or "default"
    identity = {"data.format": d["format"], "data.dataset": d["dataset"], "data.name": d["name"],
                "data.split": d["split"], "data.seq_len": d["seq_len"], "data.tokenizer": tokenizer,
                "training.global_batch_size": training.get("global_batch_size")}
    if d["format"] == "chat":
        identity["data.messages_column"] = d["messages_column"]
        identity["data.chat_template"] = d["chat_template"] or ("chatml" if tokenizer == "default" else None)
    else:
        identity["data.text_column"] = d["text_column"]
    return identity


def check_resume_data(cfg, checkpoint):
    """The data must be the checkpoint's: its saved position (epoch, step) names samples by their place
    in that data. Refused unless ``data.resume_mismatch=restart`` (the loader then restarts the saved
    epoch at step 0; it decides by its own fingerprint, which this mirrors)."""
    saved = _saved_run_config(checkpoint)
    if saved is None or cfg.data.resume_mismatch == "restart":
        return
    old = data_identity(saved.get("data") or {}, saved.get("training") or {}, saved.get("model") or {})
    new = data_identity(dataclasses.asdict(cfg.data), dataclasses.asdict(cfg.training), dataclasses.asdict(cfg.model))
    changed = [f"{key}: {old.get(key)!r} -> {value!r}" for key, value in new.items()
               if not _same_path(old.get(key), value)]
    if changed:
        raise ConfigError(f"resuming {checkpoint} with other data than it was trained on ({'; '.join(changed)}): "
                          "its saved data position would name other samples. Fix: resume with the checkpoint's "
                          "data settings (its config.yaml lists them), or --data.resume_mismatch=restart to keep "
                          f"its model, optimizer and progress and restart the data at the saved epoch's start, or {FRESH}.")


# Config fields that fix the shapes of the model's tensors (what a checkpoint can be loaded into).
SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
                "decoder_sparse_step", "mlp_only_layers", "tie_word_embeddings", "attention_bias")


def check_resume_model(cfg, checkpoint, config, vocab_size):
    """The model must have the checkpoint's tensor shapes (another size would fail in ``load_state``,
    after the model was built and sharded). ``config``: this run's transformers config; the saved one
    is built the same way from the saved model section (skipped when that cannot be built here)."""
    saved = _saved_run_config(checkpoint)
    if not saved or not saved.get("model"):
        return
    from model_setup import model_config

    model = {**dataclasses.asdict(cfg.model), **saved["model"]}
    fields = {name: model[name] for name in ("name_or_path", "preset", "overrides")}
    try:
        old_config = model_config(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **fields)), vocab_size)
    except Exception:  # noqa: BLE001 - e.g. the saved name_or_path no longer exists here: the load checks
        return
    changed = [f"{name}: {getattr(old_config, name, None)!r} -> {getattr(config, name, None)!r}" for name in SHAPE_FIELDS
               if getattr(old_config, name, None) != getattr(config, name, None)]
    if changed:
        raise ConfigError(f"resuming {checkpoint} into another model ({'; '.join(changed)}): its tensors have the "
                          "saved model's shapes. Fix: resume with the checkpoint's model.* settings (its config.yaml "
                          f"lists them; the vocabulary follows data.tokenizer), or {FRESH}.")
