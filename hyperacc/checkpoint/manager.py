"""Checkpointer: the one object the Accelerator talks to. It wires policy, storage, discovery,
buckets, RNG and export together; each of those lives in its own module."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from typing import Optional

import torch

from hyperacc.checkpoint import _comm, buckets, discovery, rng, storage
from hyperacc.checkpoint.export import export_hf
from hyperacc.checkpoint.policy import SavePolicy
from hyperacc.config import CheckpointConfig
from hyperacc.progress import Progress

logger = logging.getLogger("hyperacc.checkpoint")
warn0 = buckets.warn0


class _Clock:
    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps = {}

    def lap(self, name):
        now = time.perf_counter()
        self.laps[name] = now - self.last
        self.last = now

    def done(self):
        self.laps["total"] = time.perf_counter() - self.start
        return self.laps


@dataclasses.dataclass
class TrainState:
    """Everything a checkpoint covers, built fresh by the Accelerator for each call."""

    models: list
    optimizers: list
    schedulers: list
    loader: object = None
    progress: Progress = dataclasses.field(default_factory=Progress)
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0


class Checkpointer:
    """Saves and restores the six buckets with torch.distributed.checkpoint.

    ``save`` / ``load`` / ``on_step_end`` / ``finish`` / ``wait`` are collective: every rank calls
    them at the same point of the loop.
    """

    def __init__(self, config: Optional[CheckpointConfig] = None, *, device_type: str = "cpu", cpu_group=None):
        self.config = config if config is not None else CheckpointConfig()
        self.device_type = device_type
        self.cpu_group = cpu_group
        self.policy = SavePolicy(self.config.save_ckpt, self.config.save_steps, self.config.save_epochs)
        self._pending: Optional[concurrent.futures.Future] = None
        self._pending_path: Optional[str] = None
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._async_group = None
        self._stager = None
        self._last_saved_path: Optional[str] = None
        self.last_save_timings: dict = {}   # seconds the caller was blocked, by phase
        self.last_load_timings: dict = {}

    # ------------------------------------------------------------------ public API
    def on_step_end(self, state: TrainState) -> Optional[str]:
        """After each optimizer step: save when the policy says so. Returns the directory saved."""
        if not self.config.save_ckpt:
            return None
        self._reap_finished_async()
        loader_epoch = getattr(state.loader, "epoch", None)
        epoch = int(loader_epoch) if loader_epoch is not None else int(state.progress.epoch)
        reason = self.policy.step_end(int(state.progress.global_step), epoch)
        if reason is None:
            return None
        logger.info("saving checkpoint at step %d: %s", state.progress.global_step, reason)
        return self.save(state)

    def finish(self, state: TrainState) -> None:
        """End of training: a synchronous final save (unless this step was just saved), wait for
        in-flight saves, export to Hugging Face format when ``save_consolidated == "final"``."""
        try:
            if not self.config.save_ckpt:
                self.wait()
                return
            step = int(state.progress.global_step)
            if step > 0 and self.policy.final_needed(step):
                self.save(state, final=True)
            self.wait()
            last = self._last_saved_path
            if self.config.save_consolidated == "final" and last and discovery.step_of(last) == step:
                hf_dir = os.path.join(last, "hf")
                if not _comm.broadcast_object(os.path.isdir(hf_dir), self.cpu_group):
                    export_hf(buckets.as_list(state.models)[0], hf_dir, group=self.cpu_group)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def wait(self) -> None:
        """Block until the in-flight async save (if any) completed; re-raise its error."""
        pending, self._pending, self._pending_path = self._pending, None, None
        if pending is not None:
            pending.result()

    def save(self, state: TrainState, *, output_dir: Optional[str] = None, final: bool = False) -> Optional[str]:
        """Save all buckets to ``output_dir`` (default ``<checkpoint_dir>/global_step_<N>``).

        Asynchronous when ``config.is_async`` and not ``final``: returns once the state is staged
        in CPU memory. Returns the directory, or None when it already held a complete checkpoint
        (never overwritten).
        """
        self.wait()
        start = time.perf_counter()
        cfg = self.config
        step = int(state.progress.global_step)
        path = os.path.abspath(output_dir or discovery.step_dir(cfg.checkpoint_dir, step))
        status = _comm.decide_on_rank0(lambda: self._prepare_dir(path), self.cpu_group)
        if status == "exists":
            warn0(f"{path} already holds a complete checkpoint: it is kept as it is and this save is "
                  "skipped (hyperacc never overwrites a checkpoint; use another checkpoint_dir or "
                  "remove it to save there).")
            self.policy.note_saved(step)
            return None

        timings = {"prepare_dir": time.perf_counter() - start}
        models = buckets.as_list(state.models)
        optimizers = buckets.as_list(state.optimizers) if cfg.save_optimizer else []
        payload = {}
        for i, model in enumerate(models):
            payload[buckets.model_key(i)] = buckets.model_state(model, trainable_only=cfg.is_peft)
        for i, optimizer in enumerate(optimizers):
            owner = buckets.optimizer_owner(models, i, len(optimizers))
            payload[buckets.optimizer_key(i)] = buckets.optimizer_state(owner, optimizer)

        timings["state_dicts"] = time.perf_counter() - start - sum(timings.values())
        layout = "none"
        if cfg.save_train_state:
            layout = "per_rank" if cfg.save_extra_state_per_rank else "embedded"

        def write_own_files():
            if layout != "none":
                shared = buckets.shared_extra_state(state)
                if layout == "per_rank":
                    per_rank = {**shared, "rng": rng.get_rng_state(self.device_type), "rank": _comm.rank(),
                                "world_size": _comm.world_size(), "dp_rank": int(state.dp_rank),
                                "dp_size": int(state.dp_size)}
                    storage.atomic_save(per_rank, storage.extra_state_path(path, _comm.rank()))
                else:
                    payload[storage.EMBEDDED_EXTRA_KEY] = storage.bytes_to_tensor(storage.dumps(shared))
            if _comm.rank() == 0:
                storage.write_sentinel(path, {
                    "global_step": step, "epoch": int(state.progress.epoch), "train_state": layout,
                    "rng": "per_rank" if layout == "per_rank" else "not_saved",
                    "models": len(models), "optimizers": len(optimizers),
                    "schedulers": len(buckets.as_list(state.schedulers)) if layout != "none" else 0,
                    "world_size": _comm.world_size(), "dp_size": int(state.dp_size),
                    "peft": bool(cfg.is_peft), "seed": int(state.seed)})

        _comm.run_on_every_rank(write_own_files, self.cpu_group)   # one rank failing stops all

        timings["extra_state"] = time.perf_counter() - start - sum(timings.values())
        if cfg.is_async and not final:
            if self._stager is None:
                self._stager = storage.ReusableCpuStager()
            upload = storage.dcp_async_save(payload, path, process_group=self._async_process_group(),
                                            stager=self._stager)
            del payload  # staged: the training step may now change parameters and optimizer state
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hyperacc-ckpt")
            self._pending = self._executor.submit(self._complete_async, upload, path, step)
            self._pending_path = path
        else:
            # dcp.save returns on every rank only after the coordinator wrote .metadata (its last step
            # is a collective): that is the opening barrier. Then rank 0 moves LATEST and prunes;
            # the broadcast of its outcome is the closing barrier (and shares any error).
            storage.dcp_save(payload, path, process_group=self.cpu_group)
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

        Returns the directory restored from, or None when there was nothing to restore.
        """
        self.wait()
        cfg = self.config
        source = source if source is not None else cfg.restore_from
        if source is None:
            return None
        clock = _Clock()
        models = buckets.as_list(state.models)
        optimizers = buckets.as_list(state.optimizers) if cfg.restore_optimizer else []
        templates = [buckets.model_state(m) for m in models]
        model_keys = [[f"{buckets.model_key(i)}.{k}" for k in t] for i, t in enumerate(templates)]
        plan = _comm.decide_on_rank0(
            lambda: self._plan_load(source, model_keys, len(optimizers), state), self.cpu_group)
        if plan is None:
            return None
        path = plan["path"]
        clock.lap("plan")

        payload = {buckets.model_key(i): t for i, t in enumerate(templates)}
        n_opt = min(len(optimizers), plan["saved_optimizers"])
        owners = [buckets.optimizer_owner(models, i, len(optimizers)) for i in range(n_opt)]
        for i in range(n_opt):
            payload[buckets.optimizer_key(i)] = buckets.optimizer_state(owners[i], optimizers[i])
        if plan["layout"] == "embedded" and cfg.restore_train_state:
            payload[storage.EMBEDDED_EXTRA_KEY] = torch.empty(plan["embedded_numel"], dtype=torch.uint8)
        strict = () if cfg.is_peft else tuple(f"{buckets.model_key(i)}." for i in range(len(models)))
        clock.lap("state_dicts")
        storage.dcp_load(payload, path, strict_prefixes=strict, process_group=self.cpu_group)
        clock.lap("dcp")

        for i, model in enumerate(models):
            buckets.restore_model(model, payload[buckets.model_key(i)], strict=not cfg.is_peft)
        for i in range(n_opt):
            buckets.restore_optimizer(owners[i], optimizers[i], payload[buckets.optimizer_key(i)])

        clock.lap("apply")
        if cfg.restore_train_state:
            _comm.run_on_every_rank(
                lambda: self._restore_train_state(state, plan, payload, optimizer_restored=n_opt > 0),
                self.cpu_group)
        clock.lap("train_state")
        self.policy.note_restored(int(state.progress.global_step), int(state.progress.epoch))
        self._last_saved_path = path if discovery.step_of(path) == int(state.progress.global_step) else None
        _comm.barrier(self.cpu_group)
        clock.lap("barrier")
        self.last_load_timings = clock.done()
        return path

    # ------------------------------------------------------------------ internals
    def _prepare_dir(self, path: str) -> str:
        if discovery.is_complete(path):
            return "exists"
        if os.path.isdir(path) and os.listdir(path):
            warn0(f"{path} holds an incomplete checkpoint (no .metadata; an interrupted save): writing "
                  "over it.")
        os.makedirs(path, exist_ok=True)
        return "ok"

    def _async_process_group(self):
        """A dedicated gloo group: the background thread's collectives must not interleave with
        the training loop's on the same group."""
        if not _comm.distributed():
            return None
        if self._async_group is None:
            import torch.distributed as dist
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def _complete_async(self, upload: concurrent.futures.Future, path: str, step: int) -> str:
        upload.result()  # on rank 0 this returns after every rank's files and .metadata are written
        if _comm.rank() == 0:
            self._after_complete(path, step)
        return path

    def _reap_finished_async(self) -> None:
        if self._pending is not None and self._pending.done():
            self.wait()

    def _after_complete(self, path: str, step: int) -> None:
        """Rank 0, once the save is complete: move the LATEST pointer, then apply retention."""
        root = os.path.abspath(self.config.checkpoint_dir)
        if os.path.dirname(path) != root or discovery.step_of(path) != step:
            return  # an explicit output_dir outside the managed layout: no pointer, no retention
        discovery.write_pointer(root, step)
        keep = self.config.keep_last_n
        if keep > 0:
            protected = {os.path.abspath(p) for p in (path, self._pending_path) if p}
            pointed = discovery.read_pointer(root)
            if pointed is not None:
                protected.add(discovery.step_dir(root, pointed))
            complete = discovery.scan(root)
            for _, old in complete[:-keep]:
                if os.path.abspath(old) not in protected:
                    discovery.remove_checkpoint(old)
                    logger.info("keep_last_n=%d: removed %s", keep, old)

    def _plan_load(self, source, model_keys, n_optimizers, state) -> Optional[dict]:
        """Rank 0: find the checkpoint and check everything that could fail, before any collective."""
        cfg = self.config
        path = discovery.resolve_source(source, cfg.checkpoint_dir)
        if path is None:
            return None
        path = os.path.abspath(path)
        sentinel = storage.read_sentinel(path) or {}
        available = storage.read_dcp_metadata(path).state_dict_metadata
        if not cfg.is_peft:
            missing = [k for keys in model_keys for k in keys if k not in available]
            if missing:
                raise RuntimeError(f"missing model key(s) in checkpoint {path}: {missing[:8]}"
                                   f"{' ...' if len(missing) > 8 else ''} (the model does not match the "
                                   "checkpoint; set is_peft=True only for adapter checkpoints).")
        saved_optimizers = sentinel.get("optimizers")
        if saved_optimizers is None:
            saved_optimizers = len({k.split(".")[0] for k in available if k.startswith("optimizer")})
        if n_optimizers and saved_optimizers == 0:
            raise FileNotFoundError(f"{path} holds no optimizer state (saved with save_optimizer=False); "
                                    "set restore_optimizer=False to load it.")
        if n_optimizers and saved_optimizers != n_optimizers:
            warn0(f"The checkpoint holds {saved_optimizers} optimizer(s) but training has {n_optimizers}: "
                  f"restoring the first {min(saved_optimizers, n_optimizers)} pair(s) in order, the rest "
                  "keep their fresh state.")

        layout = sentinel.get("train_state")
        if layout is None:  # not written by hyperacc: detect from the files
            if os.path.isdir(os.path.join(path, storage.EXTRA_STATE_DIR)):
                layout = "per_rank"
            elif storage.EMBEDDED_EXTRA_KEY in available:
                layout = "embedded"
            else:
                layout = "none"
        plan = {"path": path, "layout": layout, "saved_optimizers": saved_optimizers,
                "saved_world_size": sentinel.get("world_size"), "saved_dp_size": sentinel.get("dp_size"),
                "embedded_numel": None, "same_topology": False}
        if not cfg.restore_train_state:
            return plan
        if layout == "none":
            raise FileNotFoundError(f"{path} holds no training state (saved with save_train_state=False: "
                                    "weights only). Set restore_train_state=False to load just the weights.")
        world = _comm.world_size()
        plan["same_topology"] = (sentinel.get("world_size") == world
                                 and sentinel.get("dp_size") == int(state.dp_size))
        if layout == "per_rank":
            needed = range(world) if plan["same_topology"] else [0]
            absent = [storage.extra_state_path(path, r) for r in needed
                      if not os.path.isfile(storage.extra_state_path(path, r))]
            if absent:
                raise FileNotFoundError(f"extra_state file(s) missing from {path}: {absent[:4]} (the "
                                        "training-state bucket of this checkpoint is incomplete).")
        elif layout == "embedded":
            if storage.EMBEDDED_EXTRA_KEY not in available:
                raise FileNotFoundError(f"{path} says its training state is embedded in the DCP payload "
                                        f"but the '{storage.EMBEDDED_EXTRA_KEY}' item (extra_state) is "
                                        "missing.")
            plan["embedded_numel"] = int(available[storage.EMBEDDED_EXTRA_KEY].size.numel())
        else:
            raise RuntimeError(f"{path}: unknown training-state layout {layout!r}")
        if cfg.save_ckpt and discovery.step_of(path) is not None:
            newer = [s for s, _ in discovery.scan(cfg.checkpoint_dir) if s > discovery.step_of(path)]
            if newer:
                warn0(f"Resuming from {path} while {cfg.checkpoint_dir} holds newer complete checkpoints "
                      f"(steps {newer[:6]}): saves that reach those steps will be skipped, not overwritten.")
        return plan

    def _restore_train_state(self, state, plan, payload, *, optimizer_restored: bool) -> None:
        path = plan["path"]
        if plan["layout"] == "embedded":
            extra = storage.tensor_to_obj(payload[storage.EMBEDDED_EXTRA_KEY], f"extra_state in {path}")
        else:
            own = _comm.rank() if plan["same_topology"] else 0
            extra = storage.load_weights_only(storage.extra_state_path(path, own),
                                              f"extra_state file of rank {own} in {path}")
        buckets.restore_shared_extra_state(state, extra, optimizer_restored=optimizer_restored)
        step = int(state.progress.global_step)
        if plan["layout"] == "per_rank" and plan["same_topology"] and "rng" in extra:
            rng.set_rng_state(extra["rng"], self.device_type)
        else:
            why = ("the checkpoint keeps no per-rank RNG (embedded extra-state layout)"
                   if plan["layout"] == "embedded" else
                   f"the topology changed (saved world size {plan['saved_world_size']}, dp size "
                   f"{plan['saved_dp_size']}; now {_comm.world_size()}, {state.dp_size})")
            if plan["layout"] == "embedded":
                logger.info("RNG re-derived from (seed, step, rank): %s", why)
            else:
                warn0(f"RNG states not restored because {why}: re-deriving them from (seed={state.seed}, "
                      f"step={step}, rank).")
            rng.rederive_rng(int(state.seed), step, _comm.rank(), self.device_type)
