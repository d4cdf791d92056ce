"""hyperacc as the engine under transformers' `Trainer`: same constructor, same script, one import.

    from hyperacc.integrations.transformers import Trainer        # instead of: from transformers import Trainer

`Trainer` builds its own `accelerate.Accelerator`, saves `checkpoint-<N>/` through accelerate's FSDP
helpers and resumes data by skipping batches. `HyperaccTrainerMixin` changes exactly those seams and
nothing else of the training loop:

- **Accelerator**: hyperacc's, built from the same arguments `Trainer` builds for accelerate's
  (`trainer_args`): FSDP2 over one DeviceMesh, `ParallelConfig` from accelerate's parallelism config or
  hyperacc's variables, the precision recipe, `torch_compile` as per-block compile.
- **Checkpoints**: `save_steps` / `save_strategy` still decide when; what is written is hyperacc's
  six-bucket checkpoint in ``<output_dir>/global_step_<N>/`` (with `Trainer`'s ``trainer_state.json``
  inside, under the integrity manifest), LATEST, ``save_total_limit`` as retention.
  ``resume_from_checkpoint=True`` means LATEST; a path may be a checkpoint or the checkpoint root.
  Model, optimizer, scheduler, RNG, progress and the data position come back from the buckets; the
  loader continues where it stood (no batch is skipped by re-reading; a stream — an iterable dataset,
  `datasets` with ``streaming=True`` — continues from its own saved position, or is replayed where it
  keeps none: `hyperacc.data.stream_position`).
- **Loss**: `Trainer`'s ``num_items_in_batch`` arithmetic is already the token mean over micro-batches
  and ranks when every data-parallel rank reads different data; under tensor parallelism its peers read
  the same batch, so the Trainer's "tp size" is hyperacc's (`get_tp_size`).
- **save_model**: hyperacc's sharded export (every rank writes its share), a PEFT model as its adapter.

Put the mixin first: ``class MyTrainer(HyperaccTrainerMixin, SomeTrainer)``. Nothing in transformers is
patched: a plain `transformers.Trainer` in the same process is untouched.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import warnings
from typing import Optional

import transformers

from hyperacc.accelerator import Accelerator
from hyperacc.accelerator.compat import accelerate_switches_off
from hyperacc.checkpoint import discovery, storage
from hyperacc.config import FSDPConfig
from hyperacc.integrations import trainer_args

TRAINER_STATE_NAME = transformers.trainer.TRAINER_STATE_NAME     # transformers' own name for the file


class HyperaccTrainerMixin:
    """Runs a `transformers.Trainer` (or subclass) on hyperacc's Accelerator and checkpoints."""

    # A trainer that generates while training (TRL's GRPO, RLOO: ``args.num_generations``) needs the online
    # mixin, which seeds each sample and keeps generation in step across ranks (`trl_online`).
    _hyperacc_generation_seeded = False

    # ------------------------------------------------------------------ accelerator
    def create_accelerator_and_postprocess(self) -> None:
        """hyperacc's Accelerator from the arguments `Trainer` would give accelerate's."""
        from accelerate.utils import DataLoaderConfiguration, FullyShardedDataParallelPlugin, GradientAccumulationPlugin

        nans = trainer_args.nan_options(self.args)
        if nans:
            raise ValueError(f"{', '.join(nans)}: not a number. Set a finite value.")
        problems = trainer_args.refused_options(self.args)
        if getattr(self.args, "num_generations", None) is not None and not self._hyperacc_generation_seeded:
            problems.append(f"{type(self).__name__}: a trainer that generates its own completions during training "
                            f"({type(self.args).__name__}.num_generations) through HyperaccTrainerMixin: its sampling "
                            "would depend on the rank and its generation could leave ranks waiting. Use "
                            "hyperacc.integrations.trl.GRPOTrainer / RLOOTrainer, or put "
                            "hyperacc.integrations.trl.HyperaccOnlineMixin first in your class.")
        if problems:
            raise NotImplementedError("; ".join(problems))
        options = self.args.accelerator_config.to_dict()
        accumulation = dict(options.pop("gradient_accumulation_kwargs") or {})
        if "num_steps" in accumulation:
            if self.args.gradient_accumulation_steps > 1:
                raise ValueError("accelerator_config's gradient_accumulation_kwargs['num_steps'] and "
                                 "gradient_accumulation_steps > 1 are both set: keep one of them.")
            self.args.gradient_accumulation_steps = accumulation["num_steps"]
        accumulation["num_steps"] = 1           # the Trainer accumulates itself (as with accelerate)
        accumulation.setdefault("sync_each_batch", FSDPConfig().reduce_every_micro_batch)   # sharded gradients
        loader_config = DataLoaderConfiguration(
            **{name: options.pop(name) for name in ("split_batches", "dispatch_batches", "even_batches",
                                                    "use_seedable_sampler")},
            data_seed=self.args.data_seed, non_blocking=options.pop("non_blocking"))
        fsdp_plugin = None
        if self.args.fsdp_plugin_args is not None:
            with accelerate_switches_off():
                fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        arguments = self._build_accelerator_args(dataloader_config=loader_config, fsdp_plugin=fsdp_plugin,
                                                 gradient_accumulation_plugin=GradientAccumulationPlugin(**accumulation))
        self.accelerator = Accelerator(**arguments, checkpoint=trainer_args.checkpoint_config(self.args),
                                       seed=self.args.seed, router_aux_loss=trainer_args.router_aux_mode(self.model))
        trainer_args.check_parallel(self.accelerator.parallel_config)
        self.accelerator.save_on_end = False    # the Trainer decides when to save; `end()` adds no checkpoint
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(self.gather_function,
                                                     use_gather_object=self.args.eval_use_gather_object)
        self.is_deepspeed_enabled = False
        self.is_fsdp_enabled = True             # FSDP2: Trainer prepares model and optimizer together

    def end(self) -> None:
        """As `Trainer.end` on accelerate: finish the trackers, wait for an asynchronous save, destroy the
        process group (also one accelerate created first). No final checkpoint: saving is the Trainer's."""
        import torch.distributed as dist

        self.accelerator.end_training()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def get_tp_size(self) -> int:
        """Ranks that read the same batch (tensor-parallel peers): the Trainer divides its token count
        by it and scales the loss by ``processes / it``, the number of data-parallel ranks."""
        return self.accelerator.num_processes // self.accelerator.dp_size

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer steps its scheduler itself; hyperacc saves and restores it (lr_scheduler bucket)."""
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        self.accelerator.checkpoint_scheduler(scheduler)
        return scheduler

    # ------------------------------------------------------------------ saving
    def _save_checkpoint(self, model, trial) -> None:
        """hyperacc's checkpoint in ``<output_dir>/global_step_<N>/``, with trainer_state.json inside."""
        if trial is not None:
            raise NotImplementedError("hyperparameter search trials are not supported by hyperacc's Trainer "
                                      "integration: run each trial as its own training run.")
        if self.state.global_step != self.accelerator.progress.global_step:
            raise RuntimeError(f"Trainer is at step {self.state.global_step} but hyperacc counted "
                               f"{self.accelerator.progress.global_step} optimizer steps: the optimizer was not "
                               "stepped through the prepared optimizer. The checkpoint would be misnamed; not saved.")
        if self.hp_search_backend is None:
            self.store_flos()
        self._record_callback_states()
        self.accelerator.save_state(extra_files={TRAINER_STATE_NAME: self._state_json()})

    def _record_callback_states(self) -> None:
        """As `Trainer` does before writing its state: the exportable callbacks' current state."""
        for callback in self.callback_handler.callbacks + [self.control]:
            if isinstance(callback, transformers.trainer_callback.ExportableState):
                name = type(callback).__name__
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(callback.state())
                else:
                    self.state.stateful_callbacks[name] = callback.state()

    def _state_json(self) -> bytes:
        """`TrainerState.save_to_json`'s text, as bytes for the checkpoint's manifest."""
        return (json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n").encode("utf-8")

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Collective (every rank calls it, as `Trainer` does): hyperacc's sharded HF export, or the PEFT
        adapter of a PEFT model, plus the tokenizer and training arguments `Trainer` saves beside it."""
        import torch

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        processor = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        # The export saves the processor (rank 0) and fills the config's missing token ids from it.
        self.accelerator.save_model(self.model, output_dir, tokenizer=processor)
        if self.args.should_save:
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    # ------------------------------------------------------------------ resuming
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`; ``resume_from_checkpoint`` is a hyperacc checkpoint (True: LATEST in
        ``output_dir``; a path: a ``global_step_<N>`` directory or a checkpoint root)."""
        for problem in trainer_args.inexact_loss(self):
            warnings.warn(problem, stacklevel=2)
        self._stream_epoch_shift = 0
        return super().train(self._checkpoint_to_resume(resume_from_checkpoint), *args, **kwargs)

    def _checkpoint_to_resume(self, source) -> Optional[str]:
        path = self._resolved_checkpoint(source)
        if path is not None:
            sentinel = storage.read_sentinel(path) or {}
            if sentinel.get("train_state") == "none":
                raise ValueError(f"{path} is a weights-only checkpoint (saved with save_only_model=True): it holds no "
                                 "optimizer, scheduler, RNG or data position to resume. Start a new run from its "
                                 "weights (`python -m hyperacc.checkpoint.convert to-hf`), or save full checkpoints.")
            self._check_resumable(path, sentinel)
        return path

    def _check_resumable(self, path: str, sentinel: dict) -> None:
        """A subclass's own refusals of checkpoint ``path`` (``sentinel``: its descriptor, read once), before
        anything is loaded. None here."""

    def _resolved_checkpoint(self, source) -> Optional[str]:
        if source is None or source is False:
            steps = [step for step, _ in discovery.scan(self.args.output_dir)]
            if steps and self.args.save_strategy != "no":
                raise ValueError(f"output_dir {self.args.output_dir!r} already holds checkpoints of another run (steps "
                                 f"{', '.join(map(str, steps))}) and this run does not resume from them: its saves "
                                 "would mix with them. Resume with trainer.train(resume_from_checkpoint=True), or use "
                                 "another output_dir.")
            return None
        if source is True:
            found = discovery.find_latest(self.args.output_dir)
            if found is None:
                root = self.args.output_dir
                foreign = sorted(n for n in (os.listdir(root) if os.path.isdir(root) else ()) if n.startswith("checkpoint-"))
                why = (f" It holds {', '.join(foreign)}: checkpoints of transformers' Trainer on plain accelerate, "
                       "which hyperacc does not resume (start a new run from their weights)." if foreign else "")
                raise ValueError(f"resume_from_checkpoint=True but {root!r} holds no complete hyperacc checkpoint "
                                 f"(global_step_<N>/ with .metadata).{why} Start without resume_from_checkpoint, or "
                                 "pass the checkpoint's path.")
            return found
        return discovery.resolve_source(os.fspath(source), self.args.output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        """All six buckets at once (Trainer calls this after `prepare`, as for FSDP)."""
        self.accelerator.load_state(resume_from_checkpoint)
        if self.accelerator.progress.global_step != self.state.global_step:
            raise RuntimeError(f"{resume_from_checkpoint}: its trainer_state.json says step {self.state.global_step} "
                               f"but its buckets say step {self.accelerator.progress.global_step}; the directory "
                               "was edited. Resume another checkpoint.")

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        """Restored with the model by `load_state` (hyperacc's buckets)."""

    def _load_scaler(self, checkpoint) -> None:
        """Restored with the model by `load_state` (hyperacc's buckets)."""

    def _load_rng_state(self, checkpoint) -> None:
        """Restored with the model by `load_state`; the loader replays its epoch's order itself."""

    def _run_epoch(self, **kwargs):
        """The resumed epoch: hyperacc's loader already stands after the batches trained, so the Trainer
        runs the rest of that epoch as it would have, without skipping (re-reading) any batch.

        A stream has no length: `Trainer` then calls all of ``max_steps`` one epoch and cannot tell in which
        pass over the stream a step lies, but each pass it runs is one epoch of the loader. The loader's
        restored position says which: the resumed epoch is that pass, and every later one is numbered
        as in an uninterrupted run (``set_epoch`` reshuffles a `datasets` stream by it)."""
        kwargs["epoch"] += getattr(self, "_stream_epoch_shift", 0)
        if kwargs["resume_from_checkpoint"] is None or kwargs["epoch"] != kwargs["epochs_trained"]:
            return super()._run_epoch(**kwargs)
        if 0 < self.state.max_steps <= self.state.global_step:
            # The checkpoint is the run's last step. `Trainer` checks max_steps only after a step, so it
            # would train one more (learning rate 0, the schedule over) and save it as global_step_<N+1>.
            self.control.should_training_stop = True
            return None
        epoch, done = self._data_position(kwargs["train_dataloader"], kwargs["epoch"],
                                          kwargs["steps_trained_in_current_epoch"])
        self._stream_epoch_shift = epoch - kwargs["epoch"]
        kwargs["epoch"] = epoch
        full = kwargs["steps_in_epoch"]
        kwargs.update(resume_from_checkpoint=None, steps_trained_in_current_epoch=0, steps_in_epoch=full - done,
                      num_update_steps_per_epoch=kwargs["num_update_steps_per_epoch"]
                      - done // self.args.gradient_accumulation_steps)
        fix = _EpochFraction(kwargs["epoch"], done, full)
        self.callback_handler.callbacks.insert(0, fix)
        try:
            return super()._run_epoch(**kwargs)
        finally:
            self.callback_handler.callbacks.remove(fix)

    def _data_position(self, loader, epoch: int, batches: int) -> tuple:
        """(epoch, batches done in it) the resumed run continues from: the Trainer's own count, checked
        against the loader's restored position; for a stream in a later pass, the loader's."""
        position = loader.restored_position() if hasattr(loader, "restored_position") else None
        if position is None and getattr(loader, "use_stateful_dataloader", False):
            return epoch, batches   # map-style data: torchdata's StatefulDataLoader restored its own position
        if position is None:
            raise RuntimeError("the checkpoint restored no data position for the train DataLoader (saved with "
                               "save_only_model=True?): hyperacc does not resume by skipping batches. Resume a "
                               "full checkpoint, or start a new run from its weights.")
        accumulation = self.args.gradient_accumulation_steps
        if (not transformers.trainer_utils.has_length(loader) and position[0] > epoch
                and position[1] % accumulation == 0):
            return position         # a stream: the Trainer counted every step since the start as one epoch
        if position != (epoch, batches):
            raise RuntimeError(f"the checkpoint's data position is epoch {position[0]}, batch {position[1]}, but the "
                               f"Trainer's step count puts this run at epoch {epoch}, batch {batches}: the dataset or the "
                               "global batch (per-device batch x gradient_accumulation_steps x processes) changed "
                               "since the save. Keep them (how the global batch is split may change), or start a "
                               "new run.")
        return epoch, batches


class _EpochFraction(transformers.TrainerCallback):
    """Keeps ``state.epoch`` what an uninterrupted run reports while the resumed epoch runs as a
    shorter one (first among the callbacks, so every other one and the logs see the right value)."""

    def __init__(self, epoch: int, done: int, full: int):
        self.epoch, self.done, self.full = epoch, done, full

    def on_step_end(self, args, state, control, **kwargs):
        steps = round((state.epoch - self.epoch) * (self.full - self.done))
        state.epoch = self.epoch + (self.done + steps) / self.full


class Trainer(HyperaccTrainerMixin, transformers.Trainer):
    """`transformers.Trainer` on hyperacc: same constructor and arguments."""
