"""The checkpoint half of `Accelerator`: save_state / load_state, what they save, and when the loop saves.

Split from the facade by concern: the Accelerator composes the mesh, sharding and accumulation;
this mixin turns its live objects -- accelerate's registered ones (``register_for_checkpointing``)
included -- into a `TrainState` for `hyperacc.checkpoint.Checkpointer` (its dict of Stateful buckets,
integrity, LATEST) and back. Frameworks that step their own scheduler (transformers'
`Trainer`) hand it over with `checkpoint_scheduler` so that it lands in the lr_scheduler bucket.

When the loop saves by itself (`step_end`, `end_training`): only when asked, as accelerate, which never
saves unless asked. Asked means a `CheckpointConfig` that requests saves (``save_ckpt``, ``checkpoint_dir``
or a save cadence given: `CheckpointConfig.save_requested`) or accelerate's
``ProjectConfiguration(automatic_checkpoint_naming=True)``, whose saves go where accelerate puts them,
``<project_dir>/checkpoints/checkpoint_<i>``. accelerate's ``project_dir`` is also where an unset
``checkpoint_dir`` lies (``<project_dir>/checkpoints``), not the working directory.
"""
from __future__ import annotations

import copy
import os
import re
from typing import Dict, Optional

from hyperacc.sharding.rebind import PreparedScheduler


class CheckpointingMixin:
    """save_state / load_state for `hyperacc.Accelerator` (which provides the attributes used here)."""

    def _init_checkpointing(self) -> None:
        """After accelerate's ``__init__`` (its project configuration is known): where an unset
        checkpoint_dir lies, whether the loop saves by itself, and the directory lock when it does (a
        second job on this checkpoint_dir fails now, not at its first save)."""
        cfg, project = self.checkpoint_config, self.project_configuration
        if project.automatic_checkpoint_naming and self.project_dir is None:
            raise ValueError("ProjectConfiguration(automatic_checkpoint_naming=True) needs a project_dir (its "
                             "checkpoints go to <project_dir>/checkpoints/checkpoint_<i>). Fix: "
                             "ProjectConfiguration(project_dir=DIR, automatic_checkpoint_naming=True).")
        if self.project_dir is not None and not cfg.given("checkpoint_dir"):
            cfg = self.checkpoint_config = copy.copy(cfg)      # the caller's config object stays as it was
            cfg.checkpoint_dir = os.path.join(self.project_dir, "checkpoints")
        self._saves_requested = bool(cfg.save_ckpt) and (cfg.save_requested or project.automatic_checkpoint_naming)
        if self._saves_requested and not project.automatic_checkpoint_naming:
            self._get_checkpointer().lock()

    def _get_checkpointer(self):
        if self._checkpointer is None:
            from hyperacc.checkpoint import Checkpointer

            self._checkpointer = Checkpointer(self.checkpoint_config, device_type=self.runtime.device_type,
                                              cpu_group=self.runtime.cpu_group)
            # automatic naming: the loop's saves go to accelerate's checkpoint_<i>, not into checkpoint_dir
            self._checkpointer.saves_into_checkpoint_dir = not self.project_configuration.automatic_checkpoint_naming
        return self._checkpointer

    def _policy_step_end(self) -> Optional[str]:
        """`step_end`'s save: when asked (see the module docstring) and the cadence says so."""
        if not self._saves_requested:
            return None
        return self._get_checkpointer().on_step_end(self._train_state(), save=self._policy_save)

    def _finish_checkpointing(self) -> None:
        """`end_training`'s part: the final checkpoint when the loop saves by itself (``save_on_end``
        overrides: a framework that decides when to save sets it False), then wait for in-flight saves."""
        final = self._saves_requested if self.save_on_end is None else bool(self.save_on_end)
        if self._checkpointer is not None or (final and self.checkpoint_config.save_ckpt):
            self._get_checkpointer().finish(self._train_state(), final_save=final, save=self._policy_save)

    def _policy_save(self, final: bool) -> Optional[str]:
        return self._save(None, final=final)

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
            precision=self.recipe.name, custom_objects=list(self._custom_objects))

    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, *,
                   extra_files: Optional[Dict[str, bytes]] = None, **save_model_func_kwargs) -> Optional[str]:
        """Save all six buckets (and registered objects) to ``output_dir``; default
        ``<checkpoint_dir>/global_step_<N>``, or accelerate's ``<project_dir>/checkpoints/checkpoint_<i>``
        with `ProjectConfiguration(automatic_checkpoint_naming=True)`. ``extra_files`` (name -> bytes,
        e.g. transformers' ``trainer_state.json``) are written by the main process before the
        checkpoint is complete and covered by its integrity manifest."""
        return self._save(output_dir, extra_files=extra_files)

    def _save(self, output_dir: Optional[str], *, final: bool = False,
              extra_files: Optional[Dict[str, bytes]] = None) -> Optional[str]:
        from hyperacc.checkpoint import custom_objects

        if self.project_configuration.automatic_checkpoint_naming:
            output_dir = custom_objects.next_automatic_dir(self.project_dir, self.save_iteration,
                                                           self.project_configuration.total_limit,
                                                           is_main=self.is_main_process)
        def write_extra(path):
            return custom_objects.save_files(extra_files or {}, path, is_main=self.is_main_process)

        saved = self._get_checkpointer().save(self._train_state(), output_dir=output_dir, final=final,
                                              write_extra=write_extra)
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
        loaded = self._get_checkpointer().load(self._train_state(), input_dir)   # registered objects too
        if loaded is not None:
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
