"""The checkpoint half of `Accelerator`: save_state / load_state and what they save.

Split from the facade by concern: the Accelerator composes the mesh, sharding and accumulation;
this mixin turns its live objects into a `TrainState` for `hyperacc.checkpoint.Checkpointer` (six
buckets, integrity, LATEST) and back. Frameworks that step their own scheduler (transformers'
`Trainer`) hand it over with `checkpoint_scheduler` so that it lands in the lr_scheduler bucket.
"""
from __future__ import annotations

import re
from typing import Dict, Optional

from hyperacc.wrappers import PreparedScheduler


class CheckpointingMixin:
    """save_state / load_state for `hyperacc.Accelerator` (which provides the attributes used here)."""

    def _get_checkpointer(self):
        if self._checkpointer is None:
            from hyperacc.checkpoint import Checkpointer

            self._checkpointer = Checkpointer(self.checkpoint_config, device_type=self.runtime.device_type,
                                              cpu_group=self.runtime.cpu_group)
        return self._checkpointer

    def add_save_guard(self, guard) -> None:
        """``guard()`` runs on every rank before each checkpoint save; raising stops the save."""
        self._get_checkpointer().save_guards.append(guard)

    def set_run_config(self, text: Optional[str]) -> None:
        """The run's config (YAML text): saved in every checkpoint, and as ``<checkpoint_dir>/config.yaml``
        once a resume was accepted. Call before `load_state`/`save_state`."""
        self._get_checkpointer().set_run_config(text)

    def _sync_epoch(self) -> None:
        if self._train_loader is not None and hasattr(self._train_loader, "epoch"):
            self.progress.epoch = int(self._train_loader.epoch)

    def _train_state(self):
        from hyperacc.checkpoint import TrainState

        self._sync_epoch()
        return TrainState(
            models=list(self._models), optimizers=[o.optimizer for o in self._optimizers],
            schedulers=[s.scheduler for s in self._schedulers], loader=self._train_loader,
            progress=self.progress, dp_rank=self.dp_rank, dp_size=self.dp_size, seed=self.seed,
            precision=self.recipe.name)

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, *,
                   extra_files: Optional[Dict[str, bytes]] = None, **save_model_func_kwargs) -> Optional[str]:
        """Save all six buckets (and registered objects) to ``output_dir``; default
        ``<checkpoint_dir>/global_step_<N>``, or accelerate's ``<project_dir>/checkpoints/checkpoint_<i>``
        with `ProjectConfiguration(automatic_checkpoint_naming=True)`. ``extra_files`` (name -> bytes,
        e.g. transformers' ``trainer_state.json``) are written by the main process before the
        checkpoint is complete and covered by its integrity manifest."""
        from hyperacc.checkpoint import custom_objects

        if self.project_configuration.automatic_checkpoint_naming:
            output_dir = custom_objects.next_automatic_dir(self.project_dir, self.save_iteration,
                                                           self.project_configuration.total_limit,
                                                           is_main=self.is_main_process)
        def write_extra(path):
            digests = custom_objects.save(self._custom_objects, path, is_main=self.is_main_process)
            return {**digests, **custom_objects.save_files(extra_files or {}, path, is_main=self.is_main_process)}

        saved = self._get_checkpointer().save(self._train_state(), output_dir=output_dir, write_extra=write_extra)
        if self.project_configuration.automatic_checkpoint_naming:
            self.project_configuration.iteration += 1
        return saved

    def load_state(self, input_dir: Optional[str] = None, **load_model_func_kwargs) -> Optional[str]:
        """Restore in place from a path or "LATEST" (default: CheckpointConfig.restore_from, or the
        newest automatic checkpoint). Returns the directory loaded, or None for a fresh start."""
        from hyperacc.checkpoint import custom_objects

        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            input_dir = custom_objects.newest_automatic_dir(self.project_dir)
        if input_dir is None and self.checkpoint_config.restore_from is None:
            return None
        loaded = self._get_checkpointer().load(self._train_state(), input_dir)
        if loaded is not None:
            custom_objects.load(self._custom_objects, loaded)
            match = re.search(r"checkpoint_(\d+)$", loaded.rstrip("/"))
            if self.project_configuration.automatic_checkpoint_naming and match:
                self.project_configuration.iteration = int(match.group(1)) + 1
        self._sync_epoch()
        return loaded

    def checkpoint_scheduler(self, scheduler) -> None:
        """Save and restore ``scheduler`` in the lr_scheduler bucket although its owner steps it (not
        prepared: e.g. transformers' `Trainer` steps its scheduler itself, once per optimizer step)."""
        if not any(getattr(s, "scheduler", s) is scheduler for s in self._schedulers):
            self._schedulers.append(PreparedScheduler(scheduler, self._optimizers))
