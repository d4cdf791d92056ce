"""Configuration dataclasses and where their values come from.

Precedence for every field: an explicit argument (or YAML/CLI value) wins, else the
`accelerate launch` environment (FSDP_*, PARALLELISM_CONFIG_*, ACCELERATE_MIXED_PRECISION,
HYPERACC_CHECKPOINT_*), else the dataclass default. To know which fields were given
explicitly, each config records the names passed to its constructor.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Mapping, Optional


def _records_explicit_fields(cls):
    """Wrap a dataclass ``__init__`` so instances remember which fields were passed."""
    original_init = cls.__init__
    names = [f.name for f in dataclasses.fields(cls)]

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        object.__setattr__(self, "_explicit", set(names[: len(args)]) | set(kwargs))

    cls.__init__ = __init__
    return cls


def explicit_fields(config) -> set:
    """Names of the fields the user set explicitly on ``config``."""
    return set(getattr(config, "_explicit", ()))


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"cannot read {text!r} as a boolean (use true/false)")


def _parse_optional_str(text: str) -> Optional[str]:
    text = text.strip()
    return None if text.lower() in ("", "none", "null") else text


def _fill_from_env(config, env_map: Mapping[str, tuple], env: Mapping[str, str]):
    """Set every field that was not explicit and has an env variable present."""
    explicit = explicit_fields(config)
    for field_name, (var, parse) in env_map.items():
        if field_name in explicit or var not in env:
            continue
        try:
            value = parse(env[var])
        except ValueError as err:
            raise ValueError(f"environment variable {var}={env[var]!r} is invalid: {err}") from None
        setattr(config, field_name, value)
    return config


@_records_explicit_fields
@dataclasses.dataclass
class ParallelConfig:
    """Sizes of the mesh dimensions. ``dp_shard_size=-1`` means "the rest of the world".

    Dense mesh: dp_replicate x dp_shard x cp x tp. Expert mesh (MoE experts, when ``ep_size > 1``):
    dp_replicate x efsdp x ep over the same ranks, with efsdp = dp_shard*cp*tp / ep.
    """

    dp_replicate_size: int = 1
    dp_shard_size: int = -1
    cp_size: int = 1
    tp_size: int = 1
    ep_size: int = 1

    @property
    def efsdp_size(self) -> int:
        """Expert-FSDP size of a resolved config: the ranks of a dp_replicate group over ep."""
        return self.dp_shard_size * self.cp_size * self.tp_size // self.ep_size

    def resolved(self, world_size: int) -> "ParallelConfig":
        """Return a copy with ``-1`` filled in, validated against ``world_size``."""
        sizes = {"dp_replicate_size": self.dp_replicate_size, "dp_shard_size": self.dp_shard_size,
                 "tp_size": self.tp_size, "cp_size": self.cp_size, "ep_size": self.ep_size}
        for name, size in sizes.items():
            if size == 0 or size < -1:
                raise ValueError(f"ParallelConfig.{name}={size} is invalid: use a positive size "
                                 "(or -1 for dp_shard_size to take the rest of the world).")
            if size == -1 and name != "dp_shard_size":
                raise ValueError(f"ParallelConfig.{name}=-1 is not allowed: only dp_shard_size may be -1.")
        fixed = self.dp_replicate_size * self.tp_size * self.cp_size
        if self.dp_shard_size == -1:
            if world_size % fixed:
                raise ValueError(
                    f"World size {world_size} is not divisible by dp_replicate_size*tp_size*cp_size = "
                    f"{self.dp_replicate_size}*{self.tp_size}*{self.cp_size} = {fixed}. Change the "
                    "parallel sizes or the number of processes.")
            shard = world_size // fixed
        else:
            shard = self.dp_shard_size
            if fixed * shard != world_size:
                raise ValueError(
                    f"Parallel sizes dp_replicate={self.dp_replicate_size} x dp_shard={shard} x "
                    f"cp={self.cp_size} x tp={self.tp_size} = {fixed * shard} but the world has "
                    f"{world_size} processes. Make the product equal the world size, or set "
                    "dp_shard_size=-1 to take the rest.")
        inner = shard * self.cp_size * self.tp_size
        if inner % self.ep_size:
            raise ValueError(
                f"ParallelConfig.ep_size={self.ep_size} does not divide dp_shard*cp*tp = {shard}*{self.cp_size}*"
                f"{self.tp_size} = {inner} (the ranks of one replica the experts are spread over). "
                f"Pick an ep_size that divides {inner}.")
        resolved = dataclasses.replace(self, dp_shard_size=shard)
        object.__setattr__(resolved, "_explicit", explicit_fields(self))
        return resolved


PARALLEL_ENV = {
    "dp_replicate_size": ("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", int),
    "dp_shard_size": ("PARALLELISM_CONFIG_DP_SHARD_SIZE", int),
    "tp_size": ("PARALLELISM_CONFIG_TP_SIZE", int),
    "cp_size": ("PARALLELISM_CONFIG_CP_SIZE", int),
    "ep_size": ("HYPERACC_PARALLEL_EP_SIZE", int),
}

MIXED_PRECISION_CHOICES = (None, "bf16", "fp16")


def _parse_mixed_precision(text: str) -> Optional[str]:
    value = _parse_optional_str(text)
    if value is not None and value.lower() == "no":
        return None
    return value


def _parse_class_list(text: str) -> Optional[list]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    return names or None


@_records_explicit_fields
@dataclasses.dataclass
class FSDPConfig:
    """How FSDP2 shards the model.

    ``reduce_every_micro_batch``: reduce-scatter gradients after every micro-batch of an
    accumulation step (lower memory: no unsharded gradient kept between micro-batches) instead
    of only after the last one (fewer collectives).
    """

    reshard_after_forward: bool = True
    mixed_precision: Optional[str] = None
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    wrap_classes: Optional[list] = None
    reduce_every_micro_batch: bool = False

    def __post_init__(self):
        if self.mixed_precision not in MIXED_PRECISION_CHOICES:
            raise ValueError(f"FSDPConfig.mixed_precision={self.mixed_precision!r} is not one of "
                             "None, 'bf16', 'fp16'.")
        if isinstance(self.wrap_classes, str):
            self.wrap_classes = _parse_class_list(self.wrap_classes)


FSDP_ENV = {
    "reshard_after_forward": ("FSDP_RESHARD_AFTER_FORWARD", _parse_bool),
    "cpu_offload": ("FSDP_OFFLOAD_PARAMS", _parse_bool),
    "activation_checkpointing": ("FSDP_ACTIVATION_CHECKPOINTING", _parse_bool),
    "wrap_classes": ("FSDP_TRANSFORMER_CLS_TO_WRAP", _parse_class_list),
    "mixed_precision": ("ACCELERATE_MIXED_PRECISION", _parse_mixed_precision),
}

SAVE_CONSOLIDATED_CHOICES = ("none", "final", "every")


@_records_explicit_fields
@dataclasses.dataclass
class CheckpointConfig:
    """What is saved and restored, where and when. See README "Checkpoints"."""

    save_ckpt: bool = True
    checkpoint_dir: str = "./checkpoints"
    save_steps: int = 0
    save_epochs: int = 1
    is_async: bool = False
    is_peft: bool = False
    save_optimizer: bool = True
    save_train_state: bool = True
    save_extra_state_per_rank: bool = True
    restore_from: Optional[str] = None
    restore_optimizer: bool = True
    restore_train_state: bool = True
    keep_last_n: int = 0
    save_consolidated: str = "none"

    def __post_init__(self):
        if self.save_consolidated not in SAVE_CONSOLIDATED_CHOICES:
            raise ValueError(f"CheckpointConfig.save_consolidated={self.save_consolidated!r} must be "
                             f"one of {SAVE_CONSOLIDATED_CHOICES}.")
        for name in ("save_steps", "save_epochs", "keep_last_n"):
            if getattr(self, name) < 0:
                raise ValueError(f"CheckpointConfig.{name} must be >= 0 (0 disables it).")


def _checkpoint_env() -> dict:
    parsers = {bool: _parse_bool, int: int, str: str}
    env_map = {}
    for field in dataclasses.fields(CheckpointConfig):
        default_type = type(field.default) if field.default is not None else str
        parse = _parse_optional_str if field.default is None else parsers[default_type]
        env_map[field.name] = (f"HYPERACC_CHECKPOINT_{field.name.upper()}", parse)
    return env_map


CHECKPOINT_ENV = _checkpoint_env()


def from_environment(config, env: Optional[Mapping[str, str]] = None):
    """Fill the non-explicit fields of a config from the launcher environment (returns it)."""
    env = os.environ if env is None else env
    env_map = {ParallelConfig: PARALLEL_ENV, FSDPConfig: FSDP_ENV,
               CheckpointConfig: CHECKPOINT_ENV}[type(config)]
    _fill_from_env(config, env_map, env)
    if isinstance(config, FSDPConfig):
        config.__post_init__()
    return config


_CLI_NAMES = ("ConfigError", "Component", "TrainConfig", "parse_config", "build_config", "load_config",
              "dump_config", "save_config", "format_config")


def __getattr__(name):
    # The YAML + typed CLI layer lives in hyperacc.cli_config (it builds these dataclasses, so it
    # imports this module); its public names are reachable from here too.
    if name in _CLI_NAMES:
        from hyperacc import cli_config
        return getattr(cli_config, name)
    raise AttributeError(f"module 'hyperacc.config' has no attribute {name!r}")
