"""hyperacc's configuration dataclasses, and the one rule that says where each value comes from.

Precedence, lowest first: dataclass default <- ``accelerate launch`` environment (FSDP_*,
PARALLELISM_CONFIG_*, ACCELERATE_MIXED_PRECISION, HYPERACC_PARALLEL_EP_SIZE, HYPERACC_CHECKPOINT_*)
<- explicit value (a constructor argument, or YAML/CLI through ``hyperacc.tools.cli_config``). Every field is
declared ``None`` = *unset* (as accelerate's FSDP plugin does) and ``__post_init__`` resolves the unset
ones once, so explicit beats the environment field by field even where it equals the default, with no
record of constructor calls, and resolving again changes nothing. A field whose value may be None
(``mixed_precision``, ``wrap_classes``, ``restore_from``) takes the environment when given None;
``mixed_precision="no"`` is an explicit "off".
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

from hyperacc.config.compile import resolve_compile
from hyperacc.config.recipes import check_recipe_name
from hyperacc.config.launch_env import launch_env
from hyperacc.config.launch_env import parse_env_text as _from_env


def unset(default, env: Optional[str] = None):
    """A field that is None until resolved: from the environment variable ``env``, else ``default``."""
    return dataclasses.field(default=None, metadata={"default": default, "env": env})


def default_of(field: dataclasses.Field):
    """The value a field resolves to when neither an argument nor the environment sets it."""
    if "default" in field.metadata:
        return field.metadata["default"]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def _class_list(text) -> Optional[list]:
    names = [name.strip() for name in text.split(",") if name.strip()] if isinstance(text, str) else text
    return list(names) if names else None


def resolve(config, env=None, prefix: Optional[str] = None) -> None:
    """Fill, in place, every unset (None) field of ``config`` from ``env`` (default: the process environment;
    a field without a variable of its own reads ``prefix + NAME`` if given), else from its default."""
    env = launch_env(env)
    for field in dataclasses.fields(config):
        if getattr(config, field.name) is not None:
            continue
        value, var = default_of(field), field.metadata.get("env") or prefix and prefix + field.name.upper()
        if var and var in env:
            try:
                value = _from_env(env[var], value)
            except ValueError as err:
                raise ValueError(f"environment variable {var}={env[var]!r} is invalid: {err}") from None
        setattr(config, field.name, value)


@dataclasses.dataclass
class ParallelConfig:
    """Sizes of the mesh dimensions. ``dp_shard_size=-1`` means "the rest of the world".

    Dense mesh: dp_replicate x dp_shard x cp x tp. Expert mesh (MoE experts, when ``ep_size > 1``):
    dp_replicate x efsdp x ep over the same ranks, with efsdp = dp_shard*cp*tp / ep.
    """

    dp_replicate_size: Optional[int] = unset(1, "PARALLELISM_CONFIG_DP_REPLICATE_SIZE")
    dp_shard_size: Optional[int] = unset(-1, "PARALLELISM_CONFIG_DP_SHARD_SIZE")
    cp_size: Optional[int] = unset(1, "PARALLELISM_CONFIG_CP_SIZE")
    tp_size: Optional[int] = unset(1, "PARALLELISM_CONFIG_TP_SIZE")
    ep_size: Optional[int] = unset(1, "HYPERACC_PARALLEL_EP_SIZE")

    def __post_init__(self):
        resolve(self)

    @property
    def efsdp_size(self) -> int:
        """Expert-FSDP size of a resolved config: the ranks of a dp_replicate group over ep."""
        return self.dp_shard_size * self.cp_size * self.tp_size // self.ep_size

    def resolved(self, world_size: int) -> "ParallelConfig":
        """Return a copy with ``-1`` filled in, validated against ``world_size``."""
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "ep_size"):
            size = getattr(self, name)
            if size == 0 or size < -1:
                raise ValueError(f"ParallelConfig.{name}={size} is invalid: use a positive size "
                                 "(or -1 for dp_shard_size to take the rest of the world).")
            if size == -1 and name != "dp_shard_size":
                raise ValueError(f"ParallelConfig.{name}=-1 is not allowed: only dp_shard_size may be -1.")
        fixed = self.dp_replicate_size * self.tp_size * self.cp_size
        shard = world_size // fixed if self.dp_shard_size == -1 else self.dp_shard_size
        if self.dp_shard_size == -1 and world_size % fixed:
            raise ValueError(
                f"World size {world_size} is not divisible by dp_replicate_size*tp_size*cp_size = "
                f"{self.dp_replicate_size}*{self.tp_size}*{self.cp_size} = {fixed}. Change the "
                "parallel sizes or the number of processes.")
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
        return dataclasses.replace(self, dp_shard_size=shard)


@dataclasses.dataclass
class FSDPConfig:
    """How FSDP2 shards the model.

    ``mixed_precision``: "bf16"/"fp16" parameters in compute, or "no"/None (full precision).
    ``reduce_every_micro_batch``: reduce-scatter gradients after every micro-batch of an
    accumulation step (lower memory: no unsharded gradient kept between micro-batches) instead
    of only after the last one (fewer collectives).
    ``precision``: the recipe for stored parameters, gradients and optimizer states
    ("fp32_master", "bf16", "bf16_sr"; see `hyperacc.precision`).
    ``compile``: `torch.compile` each transformer block before sharding (`hyperacc.sharding.compile`), with
    ``compile_backend`` ("inductor", "aot_eager", ...), ``compile_mode``, ``compile_fullgraph`` and
    ``compile_dynamic`` (None: torch's automatic dynamic shapes). Unset, they come from accelerate's
    ``ACCELERATE_DYNAMO_*`` variables (an accelerate config file's ``dynamo_config``).
    """

    reshard_after_forward: Optional[bool] = unset(True, "FSDP_RESHARD_AFTER_FORWARD")
    mixed_precision: Optional[str] = unset(None, "ACCELERATE_MIXED_PRECISION")
    cpu_offload: Optional[bool] = unset(False, "FSDP_OFFLOAD_PARAMS")
    activation_checkpointing: Optional[bool] = unset(False, "FSDP_ACTIVATION_CHECKPOINTING")
    wrap_classes: Optional[List[str]] = unset(None, "FSDP_TRANSFORMER_CLS_TO_WRAP")
    reduce_every_micro_batch: Optional[bool] = unset(False, "HYPERACC_FSDP_REDUCE_EVERY_MICRO_BATCH")
    precision: Optional[str] = unset("fp32_master", "HYPERACC_FSDP_PRECISION")
    compile: Optional[bool] = unset(False, "HYPERACC_FSDP_COMPILE")
    compile_backend: Optional[str] = unset("inductor", "ACCELERATE_DYNAMO_BACKEND")
    compile_mode: Optional[str] = unset("default", "ACCELERATE_DYNAMO_MODE")
    compile_fullgraph: Optional[bool] = unset(False, "ACCELERATE_DYNAMO_USE_FULLGRAPH")
    compile_dynamic: Optional[bool] = unset(None, "ACCELERATE_DYNAMO_USE_DYNAMIC")

    def __post_init__(self):

        explicit_compile = self.compile is not None or "HYPERACC_FSDP_COMPILE" in launch_env()
        resolve(self)
        resolve_compile(self, explicit_compile)
        check_recipe_name(self.precision)      # an unknown recipe fails here, naming the choices
        if str(self.mixed_precision).lower() == "no":
            self.mixed_precision = None
        if self.mixed_precision not in (None, "bf16", "fp16"):
            raise ValueError(f"FSDPConfig.mixed_precision={self.mixed_precision!r} is not one of "
                             "None, 'no', 'bf16', 'fp16'. Fix: FSDPConfig.mixed_precision='bf16' (bf16 compute), "
                             "or None for full precision.")
        self.wrap_classes = _class_list(self.wrap_classes)


SAVE_CONSOLIDATED_CHOICES = ("none", "final", "every")


CHECKPOINT_ENV_PREFIX = "HYPERACC_CHECKPOINT_"


@dataclasses.dataclass
class CheckpointConfig:
    """What is saved and restored, where and when. See docs/guides/checkpoints.md.
    Every field ``<name>`` can come from ``HYPERACC_CHECKPOINT_<NAME>`` in the environment.

    The defaults alone never make a training loop save (accelerate never saves unless asked): see
    `save_requested`. Which fields were *given* (an argument, or their environment variable) is recorded
    when the config is built, before the unset ones are resolved; ``dataclasses.replace`` passes every
    field, so its copy counts them all as given."""

    save_ckpt: Optional[bool] = unset(True)
    checkpoint_dir: Optional[str] = unset("./checkpoints")
    save_steps: Optional[int] = unset(0)
    save_epochs: Optional[int] = unset(1)
    is_async: Optional[bool] = unset(False)
    is_peft: Optional[bool] = unset(None)       # None: detected (a peft.PeftModel saves its trainable tensors only)
    save_optimizer: Optional[bool] = unset(True)
    save_train_state: Optional[bool] = unset(True)
    save_extra_state_per_rank: Optional[bool] = unset(True)
    restore_from: Optional[str] = unset(None)
    restore_optimizer: Optional[bool] = unset(True)
    restore_train_state: Optional[bool] = unset(True)
    keep_last_n: Optional[int] = unset(0)
    save_consolidated: Optional[str] = unset("none")

    def __post_init__(self):
        env = launch_env()
        self._given = frozenset(f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None
                                or CHECKPOINT_ENV_PREFIX + f.name.upper() in env)
        resolve(self, prefix=CHECKPOINT_ENV_PREFIX)
        if isinstance(self.is_peft, str):       # from the environment: a word, or empty for "detect"
            self.is_peft = _from_env(self.is_peft, False) if self.is_peft.strip() else None
        if self.save_consolidated not in SAVE_CONSOLIDATED_CHOICES:
            raise ValueError(f"CheckpointConfig.save_consolidated={self.save_consolidated!r} must be "
                             f"one of {SAVE_CONSOLIDATED_CHOICES}. Fix: CheckpointConfig.save_consolidated='none' "
                             "(DCP shards only), 'final' or 'every'.")
        for name in ("save_steps", "save_epochs", "keep_last_n"):
            if getattr(self, name) < 0:
                raise ValueError(f"CheckpointConfig.{name} must be >= 0 (0 disables it).")

    def given(self, name: str) -> bool:
        """Whether field ``name`` was set by an argument or its environment variable (not a default)."""
        return name in getattr(self, "_given", frozenset())

    @property
    def save_requested(self) -> bool:
        """Whether this config asks the training loop to save (`Accelerator.step_end`'s policy and
        `end_training`'s final checkpoint): ``save_ckpt``, ``checkpoint_dir``, or a non-zero ``save_steps``
        / ``save_epochs`` given, and ``save_ckpt`` not False. Explicit `save_state` calls save either way."""
        if not self.save_ckpt:
            return False
        return (self.given("save_ckpt") or self.given("checkpoint_dir")
                or any(self.given(name) and getattr(self, name) > 0 for name in ("save_steps", "save_epochs")))

