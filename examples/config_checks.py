"""Checks of a training config that need neither a process group nor a model (examples/train_qwen.py),
or only the model on the meta device (`check_peft_targets`).

Each raises one ConfigError naming the problem and the fix; train_qwen.py runs them on every rank
before anything is built (`load_config`, `preflight_checks.preflight`), so every rank raises the same
error (rank 0 prints it: `exit_report.py`). What a resume may change: `resume_checks.py`.
"""
import os

from hyperacc.errors import ConfigError


# What a checkpoint directory holds at its top level (docs/guides/checkpoints.md, "On disk"): no output of
# the run goes there.
CHECKPOINT_DIR_FILES = ("global_step_*", "latest_checkpoint_iteration.txt", "config.yaml", ".hyperacc.lock")


def check_paths(cfg, config_path):
    """What the run writes never overwrites what it reads: the config file, the dataset, the tokenizer,
    the model, the checkpoint it restores (and, in a dry run, which writes only its report, an earlier
    run's metrics file and TensorBoard directory), nor a file in the checkpoint directory. Paths only:
    nothing is opened or created."""
    from hyperacc.tools.preflight import check_output_path, check_paths_apart, dataset_files

    t, log, ck = cfg.training, cfg.logging, cfg.checkpoint
    inputs = [("the config file", config_path), ("model.name_or_path", cfg.model.name_or_path),
              ("data.tokenizer", cfg.data.tokenizer)]
    inputs += [("data.dataset", path) for path in dataset_files(cfg.data.dataset)]
    if ck.restore_from and str(ck.restore_from).upper() != "LATEST":
        inputs.append(("checkpoint.restore_from", ck.restore_from))
    if t.dry_run:
        check_output_path(t.dry_run_report, "--training.dry_run_report", directory=False, example_name="plan.json")
        outputs = [("--training.dry_run_report", t.dry_run_report)]
        inputs += [("logging.metrics_file", log.metrics_file), ("logging.tensorboard_dir", log.tensorboard_dir)]
    else:
        outputs = [("--logging.metrics_file", log.metrics_file), ("--logging.tensorboard_dir", log.tensorboard_dir),
                   ("--peft.export_dir", cfg.peft.export_dir), ("--peft.merged_export_dir", cfg.peft.merged_export_dir)]
    check_paths_apart(outputs, inputs, output_dirs=[("--checkpoint.checkpoint_dir", ck.checkpoint_dir)],
                      reserved=CHECKPOINT_DIR_FILES)
    if ck.save_ckpt and not t.dry_run:
        check_config_not_run_config(config_path, ck.checkpoint_dir)


def check_config_not_run_config(config_path, checkpoint_dir):
    """A run that saves writes its resolved config to ``<checkpoint_dir>/config.yaml``: a config file of
    that name there, in a directory holding no checkpoint yet, is the user's own and would be replaced.
    (Beside checkpoints it is the config an earlier run saved, which a resume's accepted config replaces.)"""
    import glob

    from hyperacc.checkpoint.containment import RUN_CONFIG_FILE

    saved = os.path.join(os.path.expanduser(checkpoint_dir or ""), RUN_CONFIG_FILE)
    if not (config_path and checkpoint_dir and os.path.isfile(saved) and os.path.samefile(config_path, saved)):
        return
    if glob.glob(os.path.join(os.path.expanduser(checkpoint_dir), "global_step_*")):
        return
    raise ConfigError(f"the config file {config_path!r} is --checkpoint.checkpoint_dir={checkpoint_dir}'s "
                      f"{RUN_CONFIG_FILE}, where the run saves its own resolved config: it would be overwritten. Fix: "
                      "keep the config file outside the checkpoint directory, or choose another "
                      "--checkpoint.checkpoint_dir.")


def check_model_dtype(cfg):
    """``model.dtype`` may only repeat what the precision recipe stores (the recipe decides)."""
    from hyperacc.precision import get_recipe

    recipe = get_recipe(cfg.fsdp.precision)
    wanted = str(recipe.param_dtype).replace("torch.", "")
    if cfg.model.dtype is not None and cfg.model.dtype != wanted:
        raise ConfigError(f"model.dtype={cfg.model.dtype} contradicts fsdp.precision={recipe.name} (which stores "
                          f"{wanted} parameters). Fix: drop --model.dtype, or pick the recipe instead, e.g. "
                          f"--fsdp.precision={'bf16' if cfg.model.dtype == 'bfloat16' else 'fp32_master'}.")


# torch.optim.AdamW options hyperacc.precision.adamw.AdamW lacks: kernel choices it has no use for (dropped), and
# variants of the update it does not implement (dropped at their default, refused otherwise).
_TORCH_KERNEL_CHOICES = ("foreach", "fused", "capturable")
_TORCH_ADAMW_VARIANTS = {"amsgrad": "AMSGrad (amsgrad=true)", "maximize": "maximize=true",
                         "differentiable": "differentiable=true"}


def optimizer_config(cfg):
    """The optimizer to build: torch.optim.AdamW becomes hyperacc.precision.adamw.AdamW (same arguments but its
    kernel choices foreach/fused/capturable) under a bf16 recipe, whose fp32 arithmetic and moment
    dtype follow the recipe. A torch.optim.AdamW option hyperacc's lacks (amsgrad=true ...), and
    torch's Adam (which ``prepare`` refuses under a bf16 recipe), are a ConfigError naming the fix."""
    import torch

    from hyperacc.tools.cli_config import Component
    from hyperacc.precision import get_recipe

    opt, recipe = cfg.optimizer, get_recipe(cfg.fsdp.precision)
    if not recipe.low_precision:
        return opt
    try:
        cls = opt.resolve()
    except (ImportError, AttributeError):
        return opt                                  # named by the parser's own check
    precision = f"fsdp.precision={recipe.name}"
    if cls is torch.optim.AdamW:
        kwargs = {k: v for k, v in opt.kwargs.items() if k not in _TORCH_KERNEL_CHOICES}
        for name, what in _TORCH_ADAMW_VARIANTS.items():
            if kwargs.pop(name, False):             # false (the default) is the same update: dropped
                raise ConfigError(
                    f"optimizer.{name}={opt.kwargs[name]!r}: under {precision} torch.optim.AdamW runs as "
                    "hyperacc.precision.adamw.AdamW (torch's would keep bf16 moments and round every update of the bf16 "
                    f"parameters to nearest), which has no {what}. Fix: drop optimizer.{name} (or set it to "
                    "false), or --fsdp.precision=fp32_master to train with torch.optim.AdamW itself.")
        return Component("hyperacc.precision.adamw.AdamW", kwargs)
    if isinstance(cls, type) and issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)):
        from hyperacc.precision.adamw import AdamW
        if not issubclass(cls, AdamW):
            raise ConfigError(
                f"optimizer._target_={opt.target} under {precision}: {cls.__name__} (torch's Adam) would keep bf16 "
                "moments and round every update of the bf16 parameters to nearest (small updates vanish), so "
                "prepare refuses it. Fix: _target_: torch.optim.AdamW in the YAML (run here as hyperacc.precision.adamw.AdamW) "
                f"or hyperacc.precision.adamw.AdamW (decoupled weight decay; {cls.__name__}'s weight_decay is an L2 term), or "
                f"--fsdp.precision=fp32_master to keep {opt.target}.")
    return opt


def check_router_aux(cfg, config):
    """An MoE-only option on a dense model does nothing: refused when set (its default, None, adapts:
    the sequence-wise load-balancing loss for MoE routers, nothing for dense models)."""
    mode = cfg.model.router_aux_loss
    if mode in ("sequence", "micro_batch") and not hasattr(config, "router_aux_loss_coef"):
        raise ConfigError(f"model.router_aux_loss={mode} but {type(config).__name__} is a dense model (no MoE "
                          "router). Fix: drop --model.router_aux_loss (its default adapts to the model), or set it "
                          "to off.")


def check_attn_implementation(cfg, config=None):
    """``model.attn_implementation`` (and, for an MoE ``config``, ``model.experts_implementation``) names a
    kernel that transformers or hyperacc registered (hyperacc's ``packed_sdpa`` included) -- checked here,
    not by transformers once the data is rendered and the model built. A hub kernel ("org/repo") passes:
    only loading it can tell."""
    import hyperacc.models.packed_attention  # noqa: F401 - registers "packed_sdpa", as build_model does
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, ALL_EXPERTS_FUNCTIONS

    from hyperacc.config.components import _hint

    name = cfg.model.attn_implementation
    known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if name is not None and name not in known and "/" not in name:
        raise ConfigError(f"model.attn_implementation={name!r} is not an attention implementation transformers or "
                          f"hyperacc provides.{_hint(known, name)} Fix: --model.attn_implementation= one of "
                          f"{', '.join(sorted(known))} (or null: eager).")
    experts, moe = cfg.model.experts_implementation, hasattr(config, "router_aux_loss_coef")
    known = ["eager", *ALL_EXPERTS_FUNCTIONS.keys()]
    if moe and experts is not None and experts not in known:
        raise ConfigError(f"model.experts_implementation={experts!r} is not an experts kernel transformers "
                          f"provides.{_hint(known, experts)} Fix: --model.experts_implementation= one of "
                          f"{', '.join(sorted(known))} (or null: transformers' default).")


# An option only its switch gives a meaning to: (switch, is it on, its options, how to turn it on).
SWITCHES = (
    ("fsdp.compile", lambda c: c.fsdp.compile, ("fsdp.compile_backend", "fsdp.compile_mode", "fsdp.compile_fullgraph",
                                                "fsdp.compile_dynamic"), "--fsdp.compile=true"),
    ("checkpoint.save_ckpt", lambda c: c.checkpoint.save_ckpt,
     ("checkpoint.save_steps", "checkpoint.save_epochs", "checkpoint.keep_last_n", "checkpoint.is_async",
      "checkpoint.save_consolidated", "checkpoint.save_optimizer", "checkpoint.save_train_state",
      "checkpoint.save_extra_state_per_rank"), "--checkpoint.save_ckpt=true"),
    ("checkpoint.restore_from", lambda c: c.checkpoint.restore_from is not None,
     ("checkpoint.restore_optimizer", "checkpoint.restore_train_state"), "--checkpoint.restore_from=LATEST"),
    ("eval.eval_steps", lambda c: c.eval.eval_steps > 0, ("eval.eval_batches", "eval.eval_batch_size",
                                                           "data.eval_split"), "--eval.eval_steps=N"),
    ("lr_scheduler.decay", lambda c: c.lr_scheduler.decay != "constant", ("lr_scheduler.min_lr_ratio",),
     "--lr_scheduler.decay=cosine"),
    ("data.format", lambda c: c.data.format == "chat", ("data.messages_column",), "--data.format=chat"),
    # The embedded corpora (data.dataset null) have no config name nor columns to choose.
    ("data.dataset", lambda c: c.data.dataset not in (None, "default"), ("data.name", "data.text_column",
                                                                         "data.messages_column"),
     "--data.dataset=<a hub id or local path>"),
    # (training.dry_run_world_size is not refused: a config file may preset what a dry run plans for.)
    ("training.dry_run", lambda c: c.training.dry_run, ("training.dry_run_report",), "--training.dry_run=true"),
    ("data.format", lambda c: c.data.format == "text", ("data.text_column",), "--data.format=text"),
    ("data.streaming", lambda c: c.data.streaming, ("data.bad_rows", "data.stream_window"), "--data.streaming=true"),
)


def check_switches(cfg, given):
    """An option given (YAML or flag; ``given`` from `hyperacc.tools.cli_config.given_keys`) while the switch
    that gives it a meaning is off would be ignored silently: refused, as ``--peft.*`` with
    ``peft.method=none`` is. Not when the switch was turned off after the option was given (a flag
    disabling what the YAML file configures), nor when the option holds its default value (it asks for
    nothing: e.g. a run's saved ``config.yaml``, which lists every field, used as the config file)."""
    from config_schema import TrainConfig

    defaults = TrainConfig()
    for switch, on, options, fix in SWITCHES:
        if on(cfg):
            continue
        for option in options:
            if option in given and given[option] >= given.get(switch, 0):
                section, name = option.split(".")
                value = getattr(getattr(cfg, section), name)
                if value == getattr(getattr(defaults, section), name):
                    continue
                state = getattr(getattr(cfg, switch.split(".")[0]), switch.split(".")[1])
                raise ConfigError(f"{option}={_shown(value)} is set but {switch}={_shown(state)} does not use it (it "
                                  f"would be ignored). Fix: {fix} to use it, or drop {option}.")


def _shown(value) -> str:
    """A value as it is written on the command line (true, null, 3, text)."""
    if value is None or isinstance(value, bool):
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


MIN_TRANSFORMERS_TP_EP = (5, 23)   # transformers.distributed.expert_parallel with ep_implementation=


def check_transformers_for_tp_ep(cfg):
    """TP and EP run on transformers' own styles (transformers.distributed.tensor_parallel /
    expert_parallel, as of 5.23): an older transformers is one ConfigError naming the version."""
    from importlib.metadata import PackageNotFoundError, version

    p = cfg.parallel
    if max(p.tp_size or 1, p.ep_size or 1) <= 1:
        return
    try:
        installed = version("transformers")
    except PackageNotFoundError:
        return                                   # reported where the model is built
    numbers = tuple(int(part) for part in installed.split(".")[:2] if part.isdigit())
    if numbers < MIN_TRANSFORMERS_TP_EP:
        need = ".".join(map(str, MIN_TRANSFORMERS_TP_EP))
        raise ConfigError(f"parallel.tp_size={p.tp_size} / ep_size={p.ep_size} need transformers>={need} "
                          f"(transformers.distributed.tensor_parallel and expert_parallel), but {installed} is "
                          f"installed. Fix: pip install 'transformers>={need}', or tp_size=1 and ep_size=1.")


def check_parallel(cfg, world_size):
    """The parallel sizes (YAML/CLI, else the launch environment) against the world size."""
    from hyperacc.runtime.mesh import check_supported
    from exit_report import as_flags
    from hyperacc.parallel.context import PACKED_ROWS
    try:
        resolved = cfg.parallel.resolved(world_size)
        check_supported(resolved)
    except (ValueError, NotImplementedError) as err:
        raise ConfigError(f"parallel sizes for {world_size} process(es): {err}") from None
    if cfg.data.packing and resolved.cp_size > 1:
        raise ConfigError(f"data.packing=true with parallel.cp_size={resolved.cp_size}: {as_flags(PACKED_ROWS)}")


def check_compile(cfg):
    """--fsdp.compile*: a backend that exists and can generate code on this device, a mode that FSDP2
    allows (`hyperacc.sharding.compile.check_backend`), before any process group exists."""
    from hyperacc.sharding.compile import check_backend
    from hyperacc.runtime import detect_device_type
    try:
        check_backend(cfg.fsdp, detect_device_type(), cfg.parallel)
    except (ValueError, RuntimeError) as err:
        raise ConfigError(f"fsdp.compile: {err}") from None


# --------------------------------------------------------------------------- PEFT (--peft.*)
PEFT_OUTPUTS = ("export_dir", "merged_export_dir")      # where the run writes: free to change on resume


def check_peft_installed(cfg):
    """``peft`` is an optional extra: imported only for ``peft.method=lora``, and named when missing."""
    if cfg.peft.method == "none":
        return
    try:
        import peft  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"peft.method={cfg.peft.method} needs the peft package, which cannot be imported ({err}). "
                          "Fix: pip install 'hyperacc[peft]' (or pip install peft), or --peft.method=none for full "
                          "fine-tuning.") from None


def check_peft_layout(cfg):
    """Adapters under tensor or expert parallelism are refused by hyperacc (``prepare`` raises
    NotImplementedError): said here, before anything is built."""
    p = cfg.parallel
    if cfg.peft.method == "none":
        return
    for size, flag in ((p.tp_size or 1, "tp_size"), (p.ep_size or 1, "ep_size")):
        if size > 1:
            raise ConfigError(f"peft.method={cfg.peft.method} with parallel.{flag}={size}: hyperacc does not support "
                              f"PEFT adapters under {'tensor' if flag == 'tp_size' else 'expert'} parallelism. Fix: "
                              f"--parallel.{flag}=1 (FSDP/HSDP shard the adapters and the base alike), or "
                              "--peft.method=none for full fine-tuning.")


def check_peft_exports(cfg):
    """The export directories can be created, and hold nothing yet: hyperacc never writes over an
    export, and finding one only after training would lose the export (checked again when writing)."""
    from hyperacc.tools.preflight import check_output_path

    for name in PEFT_OUTPUTS:
        path = getattr(cfg.peft, name)
        if not path:
            continue
        flag = f"--peft.{name}"
        check_output_path(path, flag, directory=True)
        full = os.path.abspath(os.path.expanduser(path))
        if os.path.isdir(full) and os.listdir(full):
            raise ConfigError(f"{flag}={path!r} already holds files ({sorted(os.listdir(full))[0]}, ...): the export "
                              f"is written into a new or empty directory, never over another one. Fix: choose a new "
                              f"{flag}, or empty that directory.")


def _matches(name, target) -> bool:
    """PEFT's rule for a module name in a list of ``target_modules``: the whole name or its last parts."""
    return name == target or name.endswith("." + target)


def check_peft_targets(cfg, model):
    """Every ``peft.target_modules`` / ``modules_to_save`` name matches a module of ``model`` (the base
    model, on the meta device): PEFT itself only refuses a list that matches nothing at all, so a typo
    beside a valid name would silently train fewer adapters. (Whether PEFT can adapt a module's type is
    PEFT's to say: `apply_peft` in train_qwen.py turns its error into a ConfigError.)"""
    import torch

    modules = {name: module for name, module in model.named_modules() if name}
    linear = ",".join(sorted({name.rsplit(".", 1)[-1] for name, module in modules.items()
                              if isinstance(module, torch.nn.Linear)}))
    targets = [t.strip() for t in cfg.peft.target_modules]
    for flag, wanted in (("target_modules", [] if targets == ["all-linear"] else targets),
                         ("modules_to_save", [t.strip() for t in cfg.peft.modules_to_save or []])):
        for target in wanted:
            if not any(_matches(name, target) for name in modules):
                raise ConfigError(f"peft.{flag}: {target!r} matches no module of {type(model).__name__} (a module "
                                  f"matches by its name or its last dotted parts). Fix: name modules it has, e.g. its "
                                  f"linear layers {linear}" + (", or all-linear." if flag == "target_modules" else "."))
