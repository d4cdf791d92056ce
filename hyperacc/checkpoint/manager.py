"""Checkpointer: the storage layer around the checkpoint's state, and the one object the Accelerator talks to.

What a checkpoint holds is a dict of `Stateful` buckets (`hyperacc.checkpoint.state`: model(s),
optimizer(s), progress, lr_scheduler(s), train loader, RNG, and the user's registered objects), each
saying where its state lives. The Checkpointer puts that dict on disk and back without knowing any
bucket's insides: when to save (policy), where (discovery, lifecycle, containment), the single-writer
lock, the integrity manifest written with the files and verified before a byte is trusted, the load plan
checked on rank 0 and shared with every rank before any collective (restore), async saves, the sentinel
and the Hugging Face export; each lives in its own module.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

import torch

from hyperacc.checkpoint import (_comm, buckets, containment, custom_objects, discovery, frozen_base, integrity,
                                 lifecycle, restore, storage)
from hyperacc.checkpoint.async_save import AsyncSaves
from hyperacc.checkpoint.export import export_hf
from hyperacc.checkpoint.lock import DirLock, lock_shared
from hyperacc.checkpoint.policy import SavePolicy
from hyperacc.checkpoint.state import (DCP, FILE, PER_RANK, SHARED, ModelBucket, OptimizerBucket, TrainState, select,
                                       state_dicts)
from hyperacc.checkpoint.timing import PhaseClock
from hyperacc.config import CheckpointConfig
from hyperacc.sharding import reshard

logger = logging.getLogger("hyperacc.checkpoint")


class Checkpointer:
    """Saves and restores a `TrainState`'s buckets (`TrainState.states`) with torch.distributed.checkpoint.

    ``save`` / ``load`` / ``on_step_end`` / ``finish`` / ``wait`` are collective: every rank calls
    them at the same point of the loop.
    """

    def __init__(self, config: Optional[CheckpointConfig] = None, *, device_type: str = "cpu", cpu_group=None,
                 integrity: bool = True, run_config: Optional[str] = None):
        """``integrity``: record a digest of every file at save and verify them at load (off only to
        measure its cost). ``run_config``: YAML text of the run's config, written atomically to
        ``<checkpoint_dir>/config.yaml`` once a resume was accepted (or at the first save of a fresh
        run) and into every ``global_step_<N>/`` saved."""
        self.config = config if config is not None else CheckpointConfig()
        self.device_type = device_type
        self.cpu_group = cpu_group
        self.integrity = bool(integrity)
        self.run_config = run_config
        self._root_config_written = False
        self._lock = DirLock(self.config.checkpoint_dir)
        self._foreign_warned: set = set()
        self.policy = SavePolicy(self.config.save_ckpt, self.config.save_steps, self.config.save_epochs)
        self._async = AsyncSaves()
        self._last_saved_path: Optional[str] = None
        self.last_save_timings: dict = {}   # seconds the caller was blocked, by phase
        self.last_load_timings: dict = {}
        self.save_guards: list = []         # called on every rank before each save; raising stops it
        self._restored_from: Optional[str] = None   # the checkpoint this run resumed from
        self._base_fingerprints = {}        # trainable-only kinds: the frozen base's fingerprint, once per model
        self._history_checked = False       # whether checkpoint_dir's history was checked (lifecycle.py)
        self._damaged: list = []            # checkpoints LATEST skipped as damaged in the last load
        self.saves_into_checkpoint_dir = True   # False: the caller's ``save`` writes elsewhere (automatic naming)

    # ------------------------------------------------------------------ public API
    def lock(self) -> None:
        """Collective: take the single-writer lock on ``checkpoint_dir`` now (when this job may save), so
        that a second job fails before it trains, and check every rank sees it (a shared directory)."""
        if self.config.save_ckpt:
            lock_shared(self._lock, self.config.checkpoint_dir, self.cpu_group)

    def set_run_config(self, text: Optional[str]) -> None:
        """The run's config as YAML text (see ``__init__``); call before ``load``/``save``."""
        self.run_config = text

    def on_step_end(self, state: TrainState, save=None) -> Optional[str]:
        """After each optimizer step: save when the policy says so. Returns the directory saved.
        ``save(final)`` writes it (default: `save` into checkpoint_dir); the Accelerator passes its own,
        which adds accelerate's registered objects and automatic naming."""
        if not self.config.save_ckpt:
            return None
        if not self._history_checked and self.saves_into_checkpoint_dir:   # a fresh run learns at its first
            self._check_history()       # step, not its first save, that checkpoint_dir holds another run's checkpoints
        self._async.reap()
        loader_epoch = getattr(state.loader, "epoch", None)
        epoch = int(loader_epoch) if loader_epoch is not None else int(state.progress.epoch)
        reason = self.policy.step_end(int(state.progress.global_step), epoch)
        if reason is None:
            return None
        logger.info("saving checkpoint at step %d: %s", state.progress.global_step, reason)
        return save(False) if save is not None else self.save(state)

    def finish(self, state: TrainState, *, final_save: bool = True, save=None) -> None:
        """End of training: a synchronous final save (unless this step was just saved, or
        ``final_save`` is False: no policy asked for one), wait for in-flight saves, export to
        Hugging Face format when ``save_consolidated == "final"``. ``save(final)``: as for `on_step_end`."""
        try:
            if not self.config.save_ckpt or not final_save:
                self.wait()
                return
            step = int(state.progress.global_step)
            if step > 0 and self.policy.final_needed(step):
                save(True) if save is not None else self.save(state, final=True)
            self.wait()
            last = self._last_saved_path
            if self.config.save_consolidated == "final" and last and self.policy.last_saved_step == step:
                hf_dir = os.path.join(last, "hf")
                if not _comm.broadcast_object(os.path.isdir(hf_dir), self.cpu_group):
                    export_hf(buckets.as_list(state.models)[0], hf_dir, group=self.cpu_group)
        finally:
            self._async.close()
            self._lock.release()

    def wait(self) -> None:
        """Block until the in-flight async save (if any) completed; re-raise its error."""
        self._async.wait()

    @property
    def _pending(self):
        """The async save in flight (a Future), or None."""
        return self._async.pending

    def save(self, state: TrainState, *, output_dir: Optional[str] = None, final: bool = False,
             write_extra=None) -> Optional[str]:
        """Save all buckets to ``output_dir`` (default ``<checkpoint_dir>/global_step_<N>``).

        Asynchronous when ``config.is_async`` and not ``final``: returns once the state is staged
        in CPU memory. Returns the directory, or None when it already held a complete checkpoint
        (never overwritten). ``write_extra(path)`` writes more files there before the checkpoint is
        complete, on every rank, and returns their digests (e.g. transformers' ``trainer_state.json``;
        registered objects are buckets of ``state``)."""
        for guard in self.save_guards:      # e.g. StepChecks.verify: a non-finite step is never saved
            guard()
        self.wait()
        start = time.perf_counter()
        cfg = self.config
        step = int(state.progress.global_step)
        path = os.path.abspath(output_dir or discovery.step_dir(cfg.checkpoint_dir, step))
        if path == self._last_saved_path and discovery.is_complete(path):
            return None     # this run saved this step already (e.g. save_state() after a policy save)
        status = _comm.decide_on_rank0(lambda: self._prepare_dir(path), self.cpu_group)
        if status in ("exists", "foreign"):
            what = ("already holds a complete checkpoint" if status == "exists" else
                    "is a symlink (a checkpoint hyperacc did not write: it is never written into)")
            buckets.warn0(f"{path} {what}: it is kept as it is and this save is skipped (hyperacc never overwrites a "
                  "checkpoint; use another CheckpointConfig.checkpoint_dir or remove it to save there).")
            self.policy.note_saved(step)
            return None

        timings = {"prepare_dir": time.perf_counter() - start}
        models = buckets.as_list(state.models)
        trainable_only = buckets.adapters_only(cfg, models)
        base = frozen_base.for_models(models, self.cpu_group, self._base_fingerprints) if trainable_only else None
        states = state.states(adapters_only=trainable_only, optimizers=cfg.save_optimizer, device_type=self.device_type)
        payload = state_dicts(states, DCP)       # model(s), optimizer(s): sharded
        tied = [{alias: kept for alias, kept in bucket.tied().items() if kept in payload[key]}   # stored once,
                for key, bucket in select(states, DCP, ModelBucket).items()]      # under the kept key (for readers)
        timings["state_dicts"] = time.perf_counter() - start - sum(timings.values())
        layout = "none"
        if cfg.save_train_state:
            layout = "per_rank" if cfg.save_extra_state_per_rank else "embedded"
        sentinel = {"integrity": integrity.ALGORITHM if self.integrity else None,
                    "global_step": step, "epoch": int(state.progress.epoch), "train_state": layout,
                    "rng": "per_rank" if layout == "per_rank" else "not_saved", "models": len(models),
                    "optimizers": len(select(states, DCP, OptimizerBucket)),
                    "schedulers": len(states["schedulers"].schedulers) if layout != "none" else 0,
                    "world_size": _comm.world_size(), "dp_size": int(state.dp_size),
                    storage.TRAINABLE_ONLY_KEY: trainable_only, "frozen_base": base, "seed": int(state.seed),
                    "precision": state.precision, "tied": tied}

        def write_own_files():
            """This rank's files beside DCP's; returns their digests for the manifest."""
            digests = {}
            if layout != "none":
                shared = state_dicts(states, SHARED)    # progress, schedulers, loader
                if layout == "per_rank":
                    per_rank = {**shared, **state_dicts(states, PER_RANK), "rank": _comm.rank(),   # + rng
                                "world_size": _comm.world_size(), "dp_rank": int(state.dp_rank),
                                "dp_size": int(state.dp_size)}
                    file = storage.extra_state_path(path, _comm.rank())
                    digests[os.path.relpath(file, path)] = storage.atomic_save(per_rank, file)
                else:
                    payload[storage.EMBEDDED_EXTRA_KEY] = storage.bytes_to_tensor(storage.dumps(shared))
            digests.update(custom_objects.save(select(states, FILE), path,
                                               is_main=_comm.rank() == 0))
            if write_extra is not None:
                digests.update(write_extra(path))
            if _comm.rank() == 0 and self.run_config is not None:
                containment.atomic_write(os.path.join(path, containment.RUN_CONFIG_FILE), self.run_config)
                digests[containment.RUN_CONFIG_FILE] = integrity.digest_bytes(self.run_config.encode("utf-8"))
            if _comm.rank() == 0:
                digests[storage.SENTINEL_FILE] = storage.write_sentinel(path, sentinel)
            return digests

        digests = _comm.run_on_every_rank(write_own_files, self.cpu_group)   # one rank failing stops all
        writer = integrity.IntegrityWriter(path, extra_files=digests, manifest=self.integrity)

        timings["extra_state"] = time.perf_counter() - start - sum(timings.values())
        if cfg.is_async and not final:
            self._async.start(payload, path, writer, lambda: self._after_complete(path, step))
            del payload  # staged: the training step may now change parameters and optimizer state
        else:
            # dcp.save returns on every rank only after the coordinator wrote .metadata (its last step
            # is a collective): that is the opening barrier. Then rank 0 moves LATEST and prunes;
            # the broadcast of its outcome is the closing barrier (and shares any error).
            storage.dcp_save(payload, path, process_group=self.cpu_group, storage_writer=writer)
            del payload
            _comm.decide_on_rank0(lambda: self._after_complete(path, step), self.cpu_group)

        timings["dcp"] = time.perf_counter() - start - sum(timings.values())
        if cfg.save_consolidated == "every":
            export_hf(models[0], os.path.join(path, "hf"), group=self.cpu_group)
        self.policy.note_saved(step)
        self._last_saved_path = path
        timings["total"] = time.perf_counter() - start
        self.last_save_timings = timings
        return path

    def load(self, state: TrainState, source: Optional[str] = None) -> Optional[str]:
        """Restore in place from ``source`` ("LATEST" or a path; None: ``config.restore_from``).

        Every file is verified against the checkpoint's manifest first; with "LATEST" a damaged
        checkpoint is skipped (with a warning) for the newest older one that verifies. Returns the
        directory restored from, or None when there was nothing to restore.
        """
        self.wait()
        cfg = self.config
        source = source if source is not None else cfg.restore_from
        if source is None:
            return None
        clock = PhaseClock()
        models = buckets.as_list(state.models)
        trainable_only = buckets.adapters_only(cfg, models)
        states = state.states(adapters_only=trainable_only, optimizers=cfg.restore_optimizer,
                              device_type=self.device_type)
        model_buckets, optimizers = select(states, DCP, ModelBucket), select(states, DCP, OptimizerBucket)
        for model in models:      # an evaluation forward leaves units unsharded: read the sharded parameters
            reshard(model)
        live_groups = [bucket.group_names() for bucket in optimizers.values()]
        templates = {key: bucket.state_dict() for key, bucket in model_buckets.items()}   # DCP loads into them
        model_keys = [{f"{key}.{k}": tuple(v.shape) for k, v in t.items()} for key, t in templates.items()]
        path, self._damaged = restore.trusted_checkpoint(source, cfg.checkpoint_dir, self.integrity, self.cpu_group,
                                                         lock=self._lock if cfg.save_ckpt else None)
        clock.lap("verify")
        if path is None:
            return None
        base = frozen_base.for_models(models, self.cpu_group) if trainable_only else None   # fresh: as it is now
        tied = [bucket.tied() for bucket in model_buckets.values()]
        plan = _comm.decide_on_rank0(
            lambda: restore.plan_load(cfg, path, model_keys, live_groups, state, adapters_only=trainable_only,
                                      frozen=base, tied=tied, registered_objects=len(select(states, FILE))),
            self.cpu_group)
        clock.lap("plan")

        for (key, template), aliases, live in zip(templates.items(), plan.get("tied_copies") or [], tied):
            if aliases:         # an older checkpoint's second copy of a tie
                buckets.check_tied_copies(path, key, template, {a: live[a] for a in aliases}, self.cpu_group)
        payload = dict(templates)
        restored = list(optimizers.items())[:len(plan["optim"])]      # the checkpoint may hold fewer
        for (key, bucket), saved in zip(restored, plan["optim"]):
            payload[key] = bucket.load_template(saved["structure"])
        if plan["layout"] == "embedded" and cfg.restore_train_state:
            payload[storage.EMBEDDED_EXTRA_KEY] = torch.empty(plan["embedded_numel"], dtype=torch.uint8)
        strict = tuple(f"{key}." for key in model_buckets)    # (PEFT: the trainable keys)
        clock.lap("state_dicts")
        storage.dcp_load(payload, path, strict_prefixes=strict, process_group=self.cpu_group)
        clock.lap("dcp")

        for key, bucket in model_buckets.items():
            bucket.load_state_dict(payload[key])
        for (key, bucket), saved in zip(restored, plan["optim"]):
            bucket.load_state_dict({**payload[key], "param_groups": saved["groups"]})
        clock.lap("apply")
        states["schedulers"].optimizer_restored = bool(restored)   # else the schedule sets the groups' LR
        _comm.run_on_every_rank(lambda: restore.restore_train_state(states, state, plan, payload, cfg), self.cpu_group)
        clock.lap("train_state")
        self.policy.note_restored(int(state.progress.global_step), int(state.progress.epoch))
        self._last_saved_path = path if discovery.step_of(path) == int(state.progress.global_step) else None
        self._restored_from = path
        if cfg.save_ckpt:   # the resume was accepted: its history is this run's; its config replaces the old one
            self._settle_history(path)
            if self._history_checked:   # restored from elsewhere: the first save checks the directory first
                _comm.decide_on_rank0(self._write_root_config, self.cpu_group)
        _comm.barrier(self.cpu_group)
        clock.lap("barrier")
        self.last_load_timings = clock.done()
        return path

    # ------------------------------------------------------------------ internals
    def _settle_history(self, path: str) -> None:
        """Collective, after a resume by a run that saves: steps newer than the one restored (damaged or
        of an abandoned branch) are set aside and LATEST names it (`lifecycle.settle_after_resume`)."""
        if not self._manages(path):
            return      # restored from elsewhere: checkpoint_dir must hold no other run (checked at the first save)
        root, step = self.config.checkpoint_dir, discovery.step_of(path)
        moved = _comm.decide_on_rank0(lambda: lifecycle.settle_after_resume(root, step, self._damaged), self.cpu_group)
        if moved:
            buckets.warn0(f"resumed from step {step}: set aside (renamed, not deleted) in {root}: {'; '.join(moved)}.")
        self._history_checked = True

    def _check_history(self) -> None:
        """Collective: `lifecycle.refuse_foreign_history` for a run that did not resume from checkpoint_dir."""
        root = self.config.checkpoint_dir
        _comm.decide_on_rank0(lambda: lifecycle.refuse_foreign_history(root, self._restored_from), self.cpu_group)
        self._history_checked = True

    def _manages(self, path: str) -> bool:
        """Whether ``path`` is a step directory of ``checkpoint_dir`` (the layout hyperacc owns: lock,
        LATEST, retention, config.yaml, lifecycle). An explicit directory elsewhere (accelerate's
        ``save_state("my_dir")``) is written and read as it is, touching nothing else."""
        return lifecycle.manages(self.config.checkpoint_dir, path)

    def _write_root_config(self) -> None:
        if self.run_config is not None and not self._root_config_written:
            containment.write_run_config(self.config.checkpoint_dir, self.run_config)
            self._root_config_written = True

    def _prepare_dir(self, path: str) -> str:
        """Rank 0, before a save: whether ``path`` may be written (another tool's checkpoint never: refused
        before anything is written), the lock, the run's config."""
        foreign = discovery.foreign_format(path)
        if foreign is not None:
            raise discovery.ForeignCheckpointError(f"{discovery.foreign_text(path, foreign)}: hyperacc never writes "
                                                   "into it (its files stay as they are). Fix: save_state(<a new "
                                                   "directory>), or another CheckpointConfig.checkpoint_dir.")
        managed = self._manages(path)
        if managed:
            self._lock.acquire()
            if not self._history_checked:       # a fresh run: the directory must hold no other run's steps
                lifecycle.refuse_foreign_history(self.config.checkpoint_dir, self._restored_from)
                self._history_checked = True
            self._write_root_config()
        if containment.is_foreign(path):
            return "foreign"
        if discovery.is_complete(path):
            if managed:     # the lifecycle set every newer step aside: this would be another history's
                raise lifecycle.CheckpointDirInUse(f"{path} already holds a complete checkpoint this run did not "
                                                   "write; it is never overwritten. Use another "
                                                   "CheckpointConfig.checkpoint_dir.")
            return "exists"
        if os.path.isdir(path) and os.listdir(path):
            buckets.warn0(f"{path} holds an incomplete checkpoint (no .metadata; an interrupted save): writing "
                  "over it.")
        os.makedirs(path, exist_ok=True)
        return "ok"

    def _after_complete(self, path: str, step: int) -> None:
        """Rank 0, once the save is complete: move the LATEST pointer, then apply retention."""
        lifecycle.after_save(self.config.checkpoint_dir, path, step, self.config.keep_last_n,
                             protect=(path, self._async.pending_path), warned=self._foreign_warned)
