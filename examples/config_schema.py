"""The configuration schema of examples/train_qwen.py: one dataclass per section, and the LR schedule.

It lives with the example, not in the library: a training script owns its schema. hyperacc's own
sections (``parallel``, ``fsdp``, ``checkpoint``) are its configuration dataclasses, whose unset
fields come from the ``accelerate launch`` environment (see ``hyperacc.config``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Literal, Optional

from hyperacc.errors import ConfigError
from hyperacc.tools.cli_config import Component
from hyperacc.config import CheckpointConfig, FSDPConfig, ParallelConfig
from hyperacc.data.loader import micro_batches_per_step

@dataclasses.dataclass
class ModelConfig:
    """Which model to train. ``name_or_path``: a pretrained directory or hub id (its weights are
    loaded); None builds ``preset`` from scratch. ``overrides``: transformers config fields
    (e.g. ``{hidden_size: 256, num_hidden_layers: 4}``) applied to the preset or pretrained config.
    ``dtype``: None = the parameter dtype of the precision recipe (``fsdp.precision``); a value that
    contradicts the recipe is an error (the recipe decides what is stored)."""

    name_or_path: Optional[str] = None
    preset: str = "tiny"
    overrides: Dict[str, Any] = dataclasses.field(default_factory=dict)
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    attn_implementation: Optional[str] = None
    # MoE models only: the experts kernel ("grouped_mm", "eager" = per-expert loop, "batched_mm";
    # None = transformers' default) and the router's load-balancing loss (coefficient from the config):
    # "sequence" (per sequence, the same in every layout), "micro_batch" (transformers' own: over each
    # forward's tokens, so it changes with the micro-batch size and the cp split) or "off";
    # None (the default) = "sequence" for MoE models, none for dense ones (an explicit mode on a dense
    # model is an error: it would do nothing).
    experts_implementation: Optional[str] = "grouped_mm"
    router_aux_loss: Optional[Literal["sequence", "micro_batch", "off"]] = None


@dataclasses.dataclass
class DataConfig:
    """Training data. ``dataset`` None = the embedded offline corpus; otherwise a hub id, a local
    dataset/file path or a Megatron prefix (the training script decides how to read it). ``tokenizer``
    None = the model's tokenizer when ``model.name_or_path`` is set, else the embedded offline tokenizer.
    ``format``: ``text`` (pre-training: packed ``seq_len`` windows of the ``text_column``) or ``chat``
    (conversations in ``messages_column``, or prompt/completion, rendered with the chat template, loss
    on the assistant's tokens only, each cut to ``seq_len``; None dataset = the embedded chat corpus).
    ``chat_template``: ``chatml`` (hyperacc's ChatML training template; the default with the embedded
    tokenizer) or the path of a Jinja template with ``{% generation %}`` blocks; None = the tokenizer's.
    ``packing`` (chat): each micro-batch's conversations in one row without padding, kept apart --
    the same samples per step and the same losses as padded rows, without the padding's cost.
    ``resume_mismatch``: a resume whose data differs from the checkpoint's (another dataset, seq_len,
    tokenizer, template, global batch size: the saved position would name other samples) is refused
    (``error``, before anything is built where the saved config tells) or restarts the data at the start
    of the saved epoch with the model, optimizer and progress restored (``restart``).
    ``streaming``: read the dataset as a stream (``datasets`` streaming: hub id or local files; null = the
    embedded corpus as a stream), tokenized or rendered as it is trained on, resumed from the stream's own
    position without reading the trained records again (hyperacc.data.StreamingDataLoader); records are
    shuffled within windows of ``stream_window`` records (the most a resume reads again). ``bad_rows``
    (streaming): a record that cannot be made into samples stops the run naming its place in the stream
    (``error``) or is skipped and counted (``skip``)."""

    dataset: Optional[str] = None
    format: Literal["text", "chat"] = "text"
    packing: bool = False
    messages_column: str = "messages"
    chat_template: Optional[str] = None
    name: Optional[str] = None
    split: str = "train"
    text_column: str = "text"
    tokenizer: Optional[str] = None
    seq_len: int = 128
    num_proc: int = 1
    shuffle: bool = True
    eval_split: Optional[str] = None
    resume_mismatch: Literal["error", "restart"] = "error"
    streaming: bool = False
    bad_rows: Literal["error", "skip"] = "error"
    stream_window: int = 1024

    def validate(self):
        if self.stream_window < 1:
            raise ConfigError(f"data.stream_window={self.stream_window} must be >= 1. Fix: --data.stream_window=1024")
        if self.seq_len < 1:
            raise ConfigError(f"data.seq_len={self.seq_len} must be >= 1. Fix: --data.seq_len=128")
        if self.num_proc < 1:
            raise ConfigError(f"data.num_proc={self.num_proc} must be >= 1. Fix: --data.num_proc=1")
        if self.format == "text" and (self.packing or self.chat_template):
            what = "data.packing=true" if self.packing else "data.chat_template"
            raise ConfigError(f"{what} applies to chat data, but data.format=text (pre-training windows are full "
                              f"seq_len rows already). Fix: --data.format=chat, or drop {what.split('=')[0]}.")
        if self.format == "chat" and self.seq_len < 2:
            raise ConfigError(f"data.seq_len={self.seq_len} cannot hold a conversation. Fix: --data.seq_len=512")


@dataclasses.dataclass
class TrainingConfig:
    """The loop. Batch sizes are in samples (sequences of ``data.seq_len`` tokens; chat: conversations);
    ``global_batch_size`` is per optimizer step over all data-parallel ranks and must be a
    multiple of ``micro_batch_size`` (and, at prepare time, of ``micro_batch_size * dp_size``).
    ``epochs``: at most this many passes over the data (training stops at ``max_steps`` or at
    the end of the last epoch, whichever comes first). ``gc_steps``/``empty_cache_steps``: run
    ``gc.collect()`` / empty the device cache every N steps (0 = never).
    ``mode``: ``validate`` = deterministic checks for correctness runs, ``production`` = speed.
    ``dry_run``: parse, build on the meta device and check the plan, then exit without training;
    ``dry_run_world_size`` plans for that many processes instead of the launched ones;
    ``dry_run_report``: also write the plan as JSON to this path. ``device_memory_gb``: the memory
    of one device (GB = 10^9 bytes); a plan that does not fit it stops the dry run and the training
    run before anything is built (None: not checked). ``collective_timeout_s``: a collective that
    waits longer (a rank died or hangs) stops the job with one line naming the silent rank(s), so an
    elastic launcher can restart it (see docs/guides/resume.md).
    ``replica_check_steps``: every that many steps (and before each save) the copies that must agree
    across ranks -- HSDP replicas, parameters kept whole, the step and the loss -- are compared by
    checksum; a mismatch stops the job naming the parameter and ranks (0 = only before saves;
    validate mode checks every step). See docs/guides/resume.md, "Silent divergence: the replica guard".
    ``verbose``: also print the resolved config at the start (rank 0; ``--verbose`` for short). The file
    holding it is written either way where the run keeps something: ``config.resolved.yaml`` in
    ``checkpoint.checkpoint_dir`` when the run saves checkpoints, else beside ``logging.metrics_file``
    (``metrics.jsonl`` -> ``metrics.config.resolved.yaml``); a run that keeps nothing writes nothing."""

    max_steps: int = 20
    global_batch_size: int = 8
    micro_batch_size: int = 2
    seed: int = 42
    mode: Literal["validate", "production"] = "production"
    dry_run: bool = False
    dry_run_world_size: Optional[int] = None
    dry_run_report: Optional[str] = None
    device_memory_gb: Optional[float] = None
    collective_timeout_s: float = 1800.0
    replica_check_steps: int = 100
    gradient_clipping: Optional[float] = 1.0
    epochs: int = 1
    gc_steps: int = 0
    empty_cache_steps: int = 0
    verbose: bool = False

    def validate(self):
        for name in ("max_steps", "global_batch_size", "micro_batch_size", "epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"training.{name}={getattr(self, name)} must be >= 1. "
                                  f"Fix: --training.{name}=<positive integer>")
        for name in ("gc_steps", "empty_cache_steps", "replica_check_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"training.{name}={getattr(self, name)} must be >= 0 (0 = never).")
        check_batch(self)
        if self.dry_run_world_size is not None and self.dry_run_world_size < 1:
            raise ConfigError(f"training.dry_run_world_size={self.dry_run_world_size} must be >= 1.")
        # Each range is written `not (in range)`: NaN fails every comparison, so it is refused as well.
        if not 0 < self.collective_timeout_s <= MAX_TIMEOUT_S:
            raise ConfigError(f"training.collective_timeout_s={self.collective_timeout_s} must be a number of seconds "
                              f"> 0 and <= {MAX_TIMEOUT_S:.0f} (how long a collective may wait before the job stops). "
                              "Fix: --training.collective_timeout_s=1800")
        memory = self.device_memory_gb
        if memory is not None and not (memory > 0 and math.isfinite(memory)):
            raise ConfigError(f"training.device_memory_gb={self.device_memory_gb} must be a finite number > 0 (the "
                              "memory of one device in GB). Fix: e.g. --training.device_memory_gb=64 for a 64 GB "
                              "device, or --training.device_memory_gb=null to skip the check.")
        if self.gradient_clipping is not None and not (self.gradient_clipping >= 0
                                                       and math.isfinite(self.gradient_clipping)):
            raise ConfigError(f"training.gradient_clipping={self.gradient_clipping} must be a finite number >= 0. "
                              "Fix: e.g. --training.gradient_clipping=1.0, or 0 / null to disable clipping.")


MAX_TIMEOUT_S = 1e9    # ~31 years: finite, and within what timedelta and the process group's timeout hold


def check_batch(training: "TrainingConfig", dp_size: int = 1) -> int:
    """Micro-batches per rank per step, or the ConfigError naming the flags (rule: micro_batches_per_step)."""
    try:
        return micro_batches_per_step(training.global_batch_size, training.micro_batch_size, dp_size)
    except ValueError as err:
        raise ConfigError(f"training.{err} (training.* flags; {dp_size} data-parallel rank(s)).") from None


def default_optimizer() -> Component:
    """AdamW with LLM pre-training defaults."""
    return Component("torch.optim.AdamW", {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8,
                                           "weight_decay": 0.1})


@dataclasses.dataclass
class LRSchedulerConfig:
    """Linear warm-up for ``warmup_steps``, then ``decay`` from the optimizer's lr down to
    ``min_lr_ratio * lr`` at ``total_steps`` (None: ``training.max_steps``).

    A separate ``total_steps`` lets a job stop early (``training.max_steps`` smaller) and resume
    later on the very same schedule.
    """

    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    total_steps: Optional[int] = None

    def validate(self):
        if self.warmup_steps < 0:
            raise ConfigError(f"lr_scheduler.warmup_steps={self.warmup_steps} must be >= 0.")
        if self.total_steps is not None and self.total_steps < 1:
            raise ConfigError(f"lr_scheduler.total_steps={self.total_steps} must be >= 1 (or null: "
                              "training.max_steps).")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"lr_scheduler.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]. "
                              "Fix: --lr_scheduler.min_lr_ratio=0.1")

    def lr_factor(self, step: int, max_steps: int) -> float:
        """Multiplier of the base lr after ``step`` scheduler steps (usable with LambdaLR)."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        span = max(1, max_steps - self.warmup_steps)
        progress = min(1.0, max(0.0, (step - self.warmup_steps) / span))
        if self.decay == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


@dataclasses.dataclass
class LoggingConfig:
    """Where step metrics go (see ``hyperacc.training.metrics.MetricsLogger``)."""

    metrics_file: Optional[str] = None
    logging_steps: int = 1
    tensorboard_dir: Optional[str] = None
    progress_bar: bool = True

    def validate(self):
        if self.logging_steps < 1:
            raise ConfigError(f"logging.logging_steps={self.logging_steps} must be >= 1. "
                              "Fix: --logging.logging_steps=1")


@dataclasses.dataclass
class EvalConfig:
    """Evaluation every ``eval_steps`` optimizer steps (0 = never) on ``eval_batches`` batches of
    ``eval_batch_size`` samples per rank (None = ``training.micro_batch_size``)."""

    eval_steps: int = 0
    eval_batches: int = 4
    eval_batch_size: Optional[int] = None

    def validate(self):
        if self.eval_steps < 0:
            raise ConfigError(f"eval.eval_steps={self.eval_steps} must be >= 0 (0 = never).")
        if self.eval_batches < 1:
            raise ConfigError(f"eval.eval_batches={self.eval_batches} must be >= 1.")
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            raise ConfigError(f"eval.eval_batch_size={self.eval_batch_size} must be >= 1.")


# LoRA's default targets: the attention projections, which every Qwen3 (dense and MoE) has as nn.Linear.
# PEFT's "all-linear" adds a dense model's MLP; on Qwen3-MoE it also adapts the router (LoRA on the routing
# itself) and the fused experts, as parameters (peft 0.21), which hyperacc refuses: not a default for either.
ATTENTION_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclasses.dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning. ``method``: ``none`` = full fine-tuning (every other field
    unused), ``lora`` = LoRA adapters (the ``peft`` package: ``pip install hyperacc[peft]``) on
    ``target_modules`` (module names, or ``all-linear`` = PEFT's every linear layer but the output
    head), rank ``r``, scaling ``alpha / r``, ``dropout`` on the adapters' input; ``modules_to_save``:
    modules trained whole beside the adapters (e.g. ``lm_head``). The base model is frozen and stored in
    ``base_dtype`` (None: the pretrained checkpoint's own dtype, bf16 for a randomly initialised
    preset); the adapters (and ``modules_to_save``) in the precision recipe's dtype (``fsdp.precision``).
    ``export_dir``: the adapters in PEFT's own format at the end of training (``PeftModel.from_pretrained``
    loads it); ``merged_export_dir``: the base with the adapters folded in, a plain Hugging Face checkpoint.
    Both must be new or empty directories. A resume must keep every option but the export directories."""

    method: Literal["none", "lora"] = "none"
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: List[str] = dataclasses.field(default_factory=lambda: list(ATTENTION_PROJECTIONS))
    modules_to_save: Optional[List[str]] = None
    base_dtype: Optional[Literal["bf16", "fp32"]] = None
    export_dir: Optional[str] = None
    merged_export_dir: Optional[str] = None

    def validate(self):
        # `not (in range)`: NaN fails every comparison, so it is refused as well (inf too, by isfinite).
        if self.r < 1:
            raise ConfigError(f"peft.r={self.r} must be >= 1 (the LoRA rank). Fix: --peft.r=8")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ConfigError(f"peft.alpha={self.alpha} must be a finite number > 0 (LoRA scales its update by "
                              "alpha / r). Fix: --peft.alpha=16")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"peft.dropout={self.dropout} must be in [0, 1) (the dropout probability on the "
                              "adapters' input). Fix: --peft.dropout=0.0 (or e.g. 0.05)")
        names = [name.strip() for name in self.target_modules]
        if not names or not all(names):
            raise ConfigError(f"peft.target_modules={self.target_modules!r} must name at least one module (no empty "
                              f"names). Fix: --peft.target_modules={','.join(ATTENTION_PROJECTIONS)} (or all-linear)")
        if "all-linear" in names and len(names) > 1:
            raise ConfigError(f"peft.target_modules={','.join(names)}: all-linear already targets every linear layer "
                              "and cannot be combined with names. Fix: --peft.target_modules=all-linear, or a list "
                              "of module names only.")
        if self.modules_to_save is not None and not all(name.strip() for name in self.modules_to_save):
            raise ConfigError(f"peft.modules_to_save={self.modules_to_save!r} holds an empty name. Fix: e.g. "
                              "--peft.modules_to_save=lm_head, or null.")
        if self.method == "none":
            unused = [f"peft.{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                      if f.name != "method" and getattr(self, f.name) != getattr(PeftConfig(), f.name)]
            if unused:
                raise ConfigError(f"{unused[0]} is set but peft.method=none (full fine-tuning) does not use it. "
                                  "Fix: --peft.method=lora to train LoRA adapters, or drop the peft options.")


@dataclasses.dataclass
class TrainConfig:
    """The configuration of the training example: one section per concern."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    optimizer: Component = dataclasses.field(default_factory=default_optimizer)
    lr_scheduler: LRSchedulerConfig = dataclasses.field(default_factory=LRSchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    fsdp: FSDPConfig = dataclasses.field(default_factory=FSDPConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    peft: PeftConfig = dataclasses.field(default_factory=PeftConfig)
