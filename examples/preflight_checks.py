"""Preflight of examples/train_qwen.py: every check made before a process group, the data or the model
exist (on every rank alike, so that each rank raises the same one-line ConfigError), and the dry run.

The individual checks live in `config_checks.py` (paths, optimizer, parallel sizes, compile, PEFT,
switches) and `resume_checks.py` (what a checkpoint's saved config lets us know about a resume); here
they are run in order and their problems collected into one error.
"""
import os

from config_checks import (check_attn_implementation, check_compile, check_parallel, check_peft_exports,
                           check_router_aux, check_transformers_for_tp_ep, optimizer_config)
from config_schema import check_batch
from hyperacc.errors import ConfigError
from hyperacc.tools.cli_config import format_config
from model_setup import build_model, model_config
from resume_checks import check_checkpoint_start, check_resume_model


def check_peft_model(cfg, vocab_size):
    """preflight: the LoRA setup applies to the model (built on the meta device: no memory)."""
    if cfg.peft.method != "none":
        build_model(cfg, vocab_size=vocab_size)


def memory_plan(cfg, world_size, vocab_size=None, device_type="cuda"):
    """The dry-run planner's ShardingPlan for this config on `world_size` ranks (meta model, no process group)."""
    from hyperacc.tools.dry_run import plan_sharding

    model = build_model(cfg, vocab_size=vocab_size)
    fsdp, p = cfg.fsdp, cfg.parallel
    try:
        return plan_sharding(
            model, world_size=world_size, dp_replicate=p.dp_replicate_size, tp=p.tp_size, cp=p.cp_size,
            ep=p.ep_size, wrap_classes=fsdp.wrap_classes, mixed_precision=fsdp.mixed_precision,
            precision=fsdp.precision, cpu_offload=fsdp.cpu_offload,
            activation_checkpointing=fsdp.activation_checkpointing, reshard_after_forward=fsdp.reshard_after_forward,
            micro_batch_size=cfg.training.micro_batch_size, seq_len=cfg.data.seq_len,
            eager_attention=cfg.model.attn_implementation in (None, "eager"), device_type=device_type,
            reduce_every_micro_batch=bool(fsdp.reduce_every_micro_batch),
            micro_batches=check_batch(cfg.training, max(1, world_size // (p.tp_size * p.cp_size))))
    except ValueError as err:
        raise ConfigError(f"dry run for {world_size} ranks: {err}") from None


def check_fits(cfg, plan):
    """One ConfigError when the plan's device peak exceeds training.device_memory_gb."""
    from hyperacc.tools.dry_run import check_fits as plan_fits

    try:
        plan_fits(plan, cfg.training.device_memory_gb)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def dry_run(cfg, world_size):
    """Plan the sharding for `world_size` ranks and estimate memory per rank; no process group."""
    from hyperacc.tools.dry_run import format_plan, write_report
    from hyperacc.runtime import DEVICE_ENV
    from hyperacc.tools.preflight import check_model_config

    vocab = None if "vocab_size" in cfg.model.overrides else _tokenizer(cfg)
    # The model config checks of preflight: a bad override is one line here too, not a traceback.
    config = _model_config_or_error(cfg, vocab)
    check_model_config(config, tokenizer_size=vocab)
    check_attn_implementation(cfg, config)
    device_type = os.environ.get(DEVICE_ENV) or "cuda"     # an accelerator unless told otherwise
    plan = memory_plan(cfg, world_size, vocab, device_type)
    print(format_config(cfg))
    print(format_plan(plan))
    if cfg.training.dry_run_report:
        write_report(plan, cfg.training.dry_run_report, device_type=device_type,
                     device_memory_gb=cfg.training.device_memory_gb)
        print(f"plan written to {cfg.training.dry_run_report}")
    check_fits(cfg, plan)


def preflight(cfg, world_size):
    """Every check that needs neither a process group nor a model, made on every rank before
    either exists: each rank raises the same ConfigError, listing every problem found, which
    main() prints as one line.

    Returns the tokenizer (train() sizes the model with it).
    """
    from hyperacc.precision import get_recipe
    from hyperacc.tools.preflight import check_dataset_path, check_model_config, check_optimizer, check_output_path

    log, ck = cfg.logging, cfg.checkpoint
    problems, tokenizer = [], None

    def collect(check, *args, **kwargs):
        try:
            return check(*args, **kwargs)
        except ConfigError as err:
            problems.append(str(err))

    collect(check_output_path, log.metrics_file, "--logging.metrics_file", directory=False)
    collect(check_output_path, log.tensorboard_dir, "--logging.tensorboard_dir", directory=True)
    collect(check_peft_exports, cfg)
    if ck.save_ckpt:
        collect(check_output_path, ck.checkpoint_dir, "--checkpoint.checkpoint_dir", directory=True)
    collect(check_dataset_path, cfg.data.dataset)
    collect(check_embedded_splits, cfg)
    collect(check_stream_source, cfg)
    resumed = collect(check_checkpoint_start, cfg)      # the checkpoint a resume restores, or None
    collect(lambda: check_optimizer(optimizer_config(cfg), recipe=get_recipe(cfg.fsdp.precision)))
    collect(check_parallel, cfg, world_size)
    collect(check_compile, cfg)
    collect(check_transformers_for_tp_ep, cfg)
    tokenizer, config = collect(load_data_tokenizer, cfg), None
    if tokenizer is not None:
        config = collect(_model_config_or_error, cfg, len(tokenizer))
        if config is not None:
            collect(check_model_config, config, tokenizer_size=len(tokenizer))
            collect(check_router_aux, cfg, config)
            collect(check_pretrained_model, cfg, len(tokenizer))
            if resumed is not None:
                collect(check_resume_model, cfg, resumed, config, len(tokenizer))
    collect(check_attn_implementation, cfg, config)
    if config is not None and not problems:
        collect(check_peft_model, cfg, len(tokenizer))
    if tokenizer is not None and cfg.training.device_memory_gb is not None and not problems:
        from hyperacc.runtime import detect_device_type
        collect(lambda: check_fits(cfg, memory_plan(cfg, world_size, len(tokenizer), detect_device_type())))
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else
                          f"{len(problems)} problems: " + " | ".join(problems))
    return tokenizer


def check_pretrained_model(cfg, vocab_size):
    """A model with pretrained weights is built as its own config.json says (`model_setup.build_model`), so
    ``model.overrides`` would be ignored, and a tokenizer larger than its vocabulary (e.g. with the chat
    template's special tokens added) would stop the run at the first batch: both refused here."""
    from transformers import AutoConfig

    from hyperacc.models import has_pretrained_weights

    path, model = cfg.model.name_or_path, cfg.model
    if not path or not has_pretrained_weights(path):
        return
    config = AutoConfig.from_pretrained(path)
    rope = getattr(config, "rope_parameters", None) or {}
    missing = object()

    def saved(key):
        return getattr(config, key) if hasattr(config, key) else rope.get(key, missing) if isinstance(rope, dict) else missing

    ignored = {key: value for key, value in model.overrides.items() if saved(key) != value}
    if ignored:       # (an override that repeats the saved value changes nothing: allowed)
        key, value = next(iter(ignored.items()))
        now = saved(key)
        raise ConfigError(f"model.overrides.{key}={value!r} with pretrained weights (model.name_or_path={path}, whose "
                          f"config has {key}={'no such field' if now is missing else repr(now)}): the model is built as "
                          "its config.json says, so the override would be ignored. Fix: drop model.overrides."
                          f"{key} (or save a copy of the model with the change: config.json and weights).")
    vocab = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "vocab_size", None)
    if isinstance(vocab, int) and vocab_size > vocab:
        added = " (data.format=chat added the chat template's special tokens)" if cfg.data.format == "chat" else ""
        raise ConfigError(f"the tokenizer has {vocab_size} entries{added} but model.name_or_path={path} has "
                          f"vocab_size={vocab}: token ids from {vocab} on have no embedding row. Fix: the model's own "
                          "tokenizer and chat template (--data.tokenizer unset or its directory, --data.chat_template "
                          "a template whose tokens it holds), or a model whose vocabulary holds this tokenizer.")


def check_embedded_splits(cfg):
    """The embedded corpora (``data.dataset`` null) have a train and a validation split only; another
    ``data.split`` (or ``data.eval_split`` with evaluation on) would fail only once the data is built."""
    if cfg.data.dataset not in (None, "default"):
        return
    for flag, split, used in (("data.split", cfg.data.split, True),
                              ("data.eval_split", cfg.data.eval_split, cfg.eval.eval_steps > 0)):
        if used and split is not None and split not in ("train", "validation"):
            raise ConfigError(f"{flag}={split!r}: the embedded {cfg.data.format} corpus (data.dataset=null) has the "
                              f"splits train and validation only. Fix: --{flag}=" +
                              ("train" if flag == "data.split" else "validation") + ", or --data.dataset=<a dataset "
                              "with that split>.")


def check_stream_source(cfg):
    """``data.streaming`` reads what ``datasets`` streams; a Megatron prefix is memory-mapped already, and a
    stream has no held-out tail to evaluate on unless the source has the split."""
    from hyperacc.data.text import is_megatron_spec

    d = cfg.data
    if not d.streaming:
        return
    if d.dataset not in (None, "default") and is_megatron_spec(d.dataset):
        raise ConfigError(f"data.streaming=true with data.dataset={d.dataset!r}, a Megatron prefix: its tokens are "
                          "memory-mapped, not loaded ahead, so there is nothing to stream. Fix: --data.streaming=false.")
    if cfg.eval.eval_steps > 0 and d.dataset not in (None, "default") and d.eval_split is None:
        raise ConfigError(f"data.streaming=true with evaluation on: a stream of {d.dataset!r} has no held-out tail "
                          "(the map-style pipeline carves one from train). Fix: --data.eval_split=<a split the "
                          "dataset has, e.g. validation>, or --eval.eval_steps=0.")


def _model_config_or_error(cfg, vocab_size):
    try:
        from huggingface_hub.errors import StrictDataclassError   # a config field of the wrong type
    except ImportError:
        StrictDataclassError = TypeError   # noqa: N806 - older huggingface_hub: no strict config fields
    path = cfg.model.name_or_path
    if path and str(path).startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(path)):
        what = "is a file" if os.path.isfile(os.path.expanduser(path)) else "does not exist"
        raise ConfigError(f"model.name_or_path={path!r} {what}: it takes a model directory (config.json, and weights "
                          "to fine-tune) or a hub id. Fix: --model.name_or_path=<such a directory>, or null to build "
                          "model.preset from scratch.")
    try:
        return model_config(cfg, vocab_size=vocab_size)
    except ConfigError:
        raise                                   # already names its flag and fix
    except (OSError, ValueError, TypeError, StrictDataclassError) as err:
        raise ConfigError(f"model: {' '.join(str(err).split()).rstrip('.')}. Fix: correct model.overrides / "
                          "model.name_or_path as named.") from None


def load_data_tokenizer(cfg):
    """The data's tokenizer (the model is sized with its len()); for chat data ready to render
    conversations: its template (data.chat_template; chatml for the embedded tokenizer) probed here.
    A problem names the flag that chose what failed: data.tokenizer, or model.name_or_path when that
    supplies the tokenizer (data.tokenizer unset), or data.chat_template."""
    from hyperacc.data.text import load_tokenizer

    name = cfg.data.tokenizer or cfg.model.name_or_path
    source = "data.tokenizer" if cfg.data.tokenizer or not name else "model.name_or_path (data.tokenizer unset)"
    try:
        tokenizer = load_tokenizer(name)
    except ValueError as err:
        text = " ".join(str(err).split())
        fix = "" if "Fix:" in text else (" Fix: --data.tokenizer=<a tokenizer directory or cached hub id>"
                                          + (" (or a --model.name_or_path that has one)" if cfg.data.tokenizer is None
                                             else "") + ", or --data.tokenizer=default for the embedded one.")
        raise ConfigError(f"{source}: {text}{fix}") from None
    if cfg.data.format == "chat":
        from hyperacc.data.chat import prepare_chat_tokenizer

        template = cfg.data.chat_template or ("chatml" if name in (None, "default") else None)
        try:
            prepare_chat_tokenizer(tokenizer, template)
        except ValueError as err:
            flag = "data.chat_template" if cfg.data.chat_template else source
            raise ConfigError(f"{flag}: {' '.join(str(err).split())}") from None
    return tokenizer


def _tokenizer(cfg):
    return len(load_data_tokenizer(cfg))

