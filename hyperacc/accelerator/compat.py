"""accelerate's constructor arguments, translated into hyperacc's configs.

An accelerate script passes `fsdp_plugin=`, `parallelism_config=`, `mixed_precision=`, `cpu=`,
`deepspeed_plugin=` ... to its `Accelerator`. hyperacc honours each with accelerate's meaning where
it can (the FSDP plugin and the parallelism config become `FSDPConfig` / `ParallelConfig`) and
refuses the rest with one error that names the argument, instead of a `TypeError` or a silent
difference. The list of accelerate members hyperacc does not implement lives here too, so that the
generated reference (docs/gen_reference.py), the member test and the `Accelerator` read one list.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from typing import Optional

import torch

from hyperacc import kinds
from hyperacc.config import CheckpointConfig, FSDPConfig, ParallelConfig
from hyperacc.config.compile import apply_dynamo_arguments
from hyperacc.config.launch_env import env_flag, env_hidden


# accelerate.Accelerator members that raise NotImplementedError on hyperacc, each with the reason.
NOT_SUPPORTED = {
    "lomo_backward": "LOMO fuses the optimizer into backward; hyperacc's optimizers step on FSDP2 shards.",
    "deepspeed_ulysses_dl_adapter": "DeepSpeed is not supported: hyperacc shards with FSDP2.",
    "register_save_state_pre_hook": "hyperacc saves models with torch DCP, not as a list of weights a hook "
                                    "could edit; use register_for_checkpointing for extra objects.",
    "register_load_state_pre_hook": "hyperacc loads models with torch DCP, not as a list of weights a hook "
                                    "could edit; use register_for_checkpointing for extra objects.",
}

# Launch-environment switches that would make accelerate's own __init__ build a second FSDP plugin,
# device mesh or DeepSpeed engine. hyperacc reads their settings itself (hyperacc.config.resolve).
_ACCELERATE_SWITCHES = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG", "ACCELERATE_USE_DEEPSPEED",
                        "ACCELERATE_USE_MEGATRON_LM")


def not_supported(name: str):
    """A stand-in member that raises, naming the member and why."""
    def refuse(*_args, **_kwargs):
        raise NotImplementedError(f"Accelerator.{name} is not supported by hyperacc: {NOT_SUPPORTED[name]}")
    refuse.__name__ = name
    refuse.__doc__ = f"Not supported by hyperacc: {NOT_SUPPORTED[name]}"
    return refuse


@contextlib.contextmanager
def accelerate_switches_off():
    """Hide the FSDP/DeepSpeed/parallelism switches from accelerate's __init__ (restored after)."""
    with env_hidden(_ACCELERATE_SWITCHES):
        yield


def refuse_unsupported_plugins(*, deepspeed_plugin=None, deepspeed_plugins=None, megatron_lm_plugin=None,
                               torch_tp_plugin=None) -> None:
    """One clear error per accelerate backend hyperacc replaces, before any process group exists."""
    if deepspeed_plugin is not None or deepspeed_plugins is not None or \
            env_flag("ACCELERATE_USE_DEEPSPEED"):
        raise NotImplementedError(
            "deepspeed_plugin: DeepSpeed is not supported by hyperacc, which shards with FSDP2. Drop the "
            "DeepSpeed plugin/config (ZeRO-3 ~ FSDPConfig(reshard_after_forward=True), offload ~ "
            "FSDPConfig(cpu_offload=True)), or use accelerate.Accelerator for DeepSpeed.")
    if megatron_lm_plugin is not None or env_flag("ACCELERATE_USE_MEGATRON_LM"):
        raise NotImplementedError("megatron_lm_plugin: Megatron-LM training is not supported by hyperacc; "
                                  "use ParallelConfig for its mesh and FSDP2.")
    if torch_tp_plugin is not None:
        raise NotImplementedError("torch_tp_plugin: pass the sizes as parallelism_config=ParallelismConfig("
                                  "tp_size=...) or hyperacc.ParallelConfig(tp_size=...) instead.")


def _mixed_precision_name(policy) -> Optional[str]:
    """accelerate's FSDP plugin mixed-precision policy (object, dict or string) -> 'bf16'/'fp16'/None."""
    if policy is None:
        return None
    if isinstance(policy, str):
        return None if policy == "no" else policy
    dtype = policy.get("param_dtype") if isinstance(policy, dict) else getattr(policy, "param_dtype", None)
    return {torch.bfloat16: "bf16", torch.float16: "fp16", "bf16": "bf16", "fp16": "fp16"}.get(dtype)


def fsdp_config_from_plugin(plugin, mixed_precision=None) -> FSDPConfig:
    """Map an accelerate `FullyShardedDataParallelPlugin` (or None) and accelerate's `mixed_precision=`
    argument onto hyperacc's FSDPConfig.

    Only the fields FSDP2 has a meaning for are read; each one the plugin sets is an explicit value
    (it beats the launch environment, as the plugin does in accelerate). The plugin's own precision
    policy beats the argument; the argument beats ACCELERATE_MIXED_PRECISION.
    """
    if getattr(plugin, "fsdp_version", 2) == 1:
        warnings.warn("fsdp_plugin has fsdp_version=1: hyperacc always shards with FSDP2 (fully_shard); "
                      "its FSDP1-only fields (sharding_strategy, backward_prefetch, ...) are ignored.")
    fields = {}
    reshard = getattr(plugin, "reshard_after_forward", None)
    if isinstance(reshard, bool):
        fields["reshard_after_forward"] = reshard
    offload = getattr(plugin, "cpu_offload", None)
    if offload is not None:
        fields["cpu_offload"] = type(offload).__name__ == "CPUOffloadPolicy" or getattr(offload, "offload_params", False)
    if getattr(plugin, "activation_checkpointing", None) is not None:
        fields["activation_checkpointing"] = bool(plugin.activation_checkpointing)
    names = getattr(plugin, "transformer_cls_names_to_wrap", None)
    if names:
        fields["wrap_classes"] = list(names) if not isinstance(names, str) else [names]
    precision = _mixed_precision_name(getattr(plugin, "mixed_precision_policy", None)) or \
        _precision_argument(mixed_precision)
    if precision is not None:
        fields["mixed_precision"] = precision
    return FSDPConfig(**fields)


def _precision_argument(mixed_precision) -> Optional[str]:
    """accelerate's `mixed_precision=` ("no"/"bf16"/"fp16", a string or its enum) as an FSDPConfig value."""
    if mixed_precision is None:
        return None
    name = str(getattr(mixed_precision, "value", mixed_precision)).lower()
    if name == "fp8":
        raise NotImplementedError("mixed_precision='fp8' is not supported by hyperacc; use 'bf16'.")
    return name


def parallel_config_from_accelerate(config) -> ParallelConfig:
    """Map an accelerate `ParallelismConfig` onto hyperacc's ParallelConfig."""
    if getattr(config, "sp_size", 1) not in (None, 1):
        raise NotImplementedError("parallelism_config.sp_size > 1: sequence parallelism is not supported by "
                                  "hyperacc yet; set sp_size=1.")
    fields = {name: getattr(config, name) for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")
              if getattr(config, name, None) is not None}
    return ParallelConfig(**fields)


def warn_split_batches(split_batches) -> None:
    if split_batches is not None:
        warnings.warn("split_batches= is ignored (as by accelerate 1.15, which moved it): pass "
                      "dataloader_config=DataLoaderConfiguration(split_batches=...) instead.")


def _checked(config, cls):
    """The caller's config (copied, so it stays untouched), or a fresh one from the environment."""
    if config is None:
        return cls()
    if not isinstance(config, cls):
        raise TypeError(f"expected a {cls.__name__}, got {type(config).__name__}")
    return copy.copy(config)


def resolve_configs(*, parallel, fsdp, checkpoint, parallelism_config, fsdp_plugin, mixed_precision,
                    dynamo_backend=None, dynamo_plugin=None):
    """hyperacc's three configs: its own arguments win, else accelerate's; every field they leave
    unset comes from the launch environment, else the default (`hyperacc.config.resolve`).
    A given FSDPConfig is complete, so `mixed_precision=` applies only without one; accelerate's
    ``dynamo_backend``/``dynamo_plugin`` set its compile fields (`hyperacc.sharding.compile`)."""
    if parallel is None and parallelism_config is not None:
        parallel = parallel_config_from_accelerate(parallelism_config)
    if fsdp is None:
        fsdp = fsdp_config_from_plugin(fsdp_plugin, mixed_precision)
    else:
        _precision_argument(mixed_precision)      # fp8 is refused either way

    fsdp = apply_dynamo_arguments(_checked(fsdp, FSDPConfig), dynamo_backend, dynamo_plugin)
    return _checked(parallel, ParallelConfig), fsdp, _checked(checkpoint, CheckpointConfig)


def process_group_timeout_s(kwargs_handlers) -> Optional[float]:
    """accelerate's `InitProcessGroupKwargs(timeout=...)` among ``kwargs_handlers``, in seconds."""
    from accelerate.utils import InitProcessGroupKwargs

    for handler in kwargs_handlers or ():
        if isinstance(handler, InitProcessGroupKwargs) and handler.timeout is not None:
            return handler.timeout.total_seconds()
    return None


def mark_state_fsdp2(state, fsdp_plugin=None) -> None:
    """Make accelerate's state say what hyperacc does, FSDP2 sharding (its members branch on it).

    Set on the process state too: every new AcceleratorState() copies the process state's type
    over its own.
    """
    import accelerate
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    accelerate.PartialState().distributed_type = DistributedType.FSDP
    state.distributed_type = DistributedType.FSDP
    if fsdp_plugin is None:
        with accelerate_switches_off():
            fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    state.fsdp_plugin = fsdp_plugin


def check_no_stale_state(world_size: int) -> None:
    """accelerate's process state may exist already (a `PartialState()` made before the Accelerator).
    If it was built without this job's processes, every accelerate collective would be a no-op."""
    import accelerate

    state = accelerate.PartialState._shared_state  # private: PartialState exposes no "already initialised" query
    if state and state.get("num_processes", world_size) != world_size:
        raise RuntimeError(
            f"accelerate's PartialState was created before hyperacc.Accelerator and sees "
            f"{state.get('num_processes')} process(es) in a job of {world_size}. Create the Accelerator "
            "first (or pass cpu=True to PartialState on a CPU-only machine).")


def add_script_conveniences(model: torch.nn.Module, accelerator) -> None:
    """What scripts written for accelerate call on the prepared model itself: DDP's
    `model.no_sync()`, and `save_pretrained` (transformers would write the DTensor shards as they
    are; it gets the full weights, gathered on the main process, instead)."""
    model.no_sync = functools.partial(accelerator.no_sync, model)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained = functools.partial(_save_pretrained_full, model, accelerator)


def _save_pretrained_full(model, accelerator, *args, state_dict=None, **kwargs):
    kind = kinds.for_model(model)
    if state_dict is None:      # collective: every rank (a PEFT model's: its adapters only)
        state_dict = kind.pretrained_state_dict(model, accelerator.get_state_dict)
    if kind.save_pretrained_on_main_only and not kwargs.get("is_main_process", accelerator.is_main_process):
        # e.g. PEFT filters the adapters out of the state dict on every rank, even where it writes nothing
        # (accelerate's get_state_dict is empty there: KeyError).
        return None
    return type(model).save_pretrained(model, *args, state_dict=state_dict, **kwargs)
