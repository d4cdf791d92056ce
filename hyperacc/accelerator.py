"""`Accelerator`: the facade that wires runtime, mesh, sharding, accumulation and checkpointing.

It holds references and forwards calls; the logic lives in the modules it composes.
"""
from __future__ import annotations

import contextlib
import copy
import os
import random
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from hyperacc import runtime as runtime_lib
from hyperacc.accumulation import GradientAccumulator
from hyperacc.config import CheckpointConfig, FSDPConfig, ParallelConfig, from_environment
from hyperacc.mesh import build_mesh
from hyperacc.progress import Progress
from hyperacc.sharding import shard_model
from hyperacc.wrappers import (ParameterMap, PreparedOptimizer, PreparedScheduler, ShardedDataLoader,
                               rebind_optimizer)

DEFAULT_SEED = 42


def _is_scheduler(obj) -> bool:
    return hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "get_last_lr")


def _configured(config, cls):
    """An explicit config (copied, so the caller's object is untouched) filled from the environment."""
    if config is None:
        config = cls()
    elif not isinstance(config, cls):
        raise TypeError(f"expected a {cls.__name__}, got {type(config).__name__}")
    filled = copy.copy(config)
    return from_environment(filled)


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Accelerator:
    """Shard with FSDP2 over one DeviceMesh, accumulate exactly, checkpoint everything.

    Every argument is optional. Unset ones come from the `accelerate launch` environment
    (FSDP_*, PARALLELISM_CONFIG_*, ACCELERATE_MIXED_PRECISION, ACCELERATE_GRADIENT_ACCUMULATION_STEPS,
    HYPERACC_CHECKPOINT_*), else from the defaults; explicit arguments win field by field.
    """

    def __init__(self, parallel: Optional[ParallelConfig] = None, fsdp: Optional[FSDPConfig] = None,
                 checkpoint: Optional[CheckpointConfig] = None, seed: Optional[int] = None,
                 gradient_accumulation_steps: Optional[int] = None, device_type: Optional[str] = None):
        self.parallel_config = _configured(parallel, ParallelConfig)
        self.fsdp_config = _configured(fsdp, FSDPConfig)
        self.checkpoint_config = _configured(checkpoint, CheckpointConfig)
        if gradient_accumulation_steps is None:
            gradient_accumulation_steps = int(os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", 1))
        self.seed = DEFAULT_SEED if seed is None else int(seed)
        # Validate the parallel sizes against the world before any collective runs.
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
        self.parallel_config.resolved(world)
        self.runtime = runtime_lib.init_runtime(device_type)
        self._mesh = build_mesh(self.parallel_config, self.runtime.world_size, self.runtime.device_type)
        set_seed(self.seed)
        self.accumulator = GradientAccumulator(
            device=self.device, dp_size=self.dp_size, group=self._cpu_group_or_none(),
            fsdp=self.fsdp_config, gradient_accumulation_steps=gradient_accumulation_steps)
        self.progress = Progress()
        self._params = ParameterMap()
        self._models: list = []
        self._optimizers: list = []
        self._schedulers: list = []
        self._train_loader = None
        self._checkpointer = None

    # ------------------------------------------------------------------ identity
    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def process_index(self) -> int:
        return self.runtime.rank

    @property
    def local_process_index(self) -> int:
        return self.runtime.local_rank

    @property
    def num_processes(self) -> int:
        return self.runtime.world_size

    @property
    def is_main_process(self) -> bool:
        return self.runtime.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.runtime.local_rank == 0

    @property
    def mesh(self):
        return self._mesh.mesh

    @property
    def dp_rank(self) -> int:
        return self._mesh.dp_rank

    @property
    def dp_size(self) -> int:
        return self._mesh.dp_size

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.accumulator.gradient_accumulation_steps

    @property
    def sync_gradients(self) -> bool:
        return self.accumulator.sync_gradients

    @property
    def step_loss(self) -> Optional[float]:
        """Global token-mean loss of the last `accumulate(model, batch)` step (same on every rank)."""
        return self.accumulator.step_loss

    def _cpu_group_or_none(self):
        """The gloo group for CPU-side collectives; None (= the default group) on CPU runs.

        None rather than a handle on the default group: a held handle would keep the group and its
        worker threads alive past `end_training()`, into interpreter shutdown.
        """
        return self.runtime.cpu_group

    # ------------------------------------------------------------------ prepare
    def prepare(self, *objects):
        """Shard models, rebind optimizers, wrap schedulers and loaders; returns them in order."""
        models = [obj for obj in objects if isinstance(obj, torch.nn.Module)]
        for model in models:
            self._prepare_model(model)
        prepared = []
        for obj in objects:
            if isinstance(obj, torch.nn.Module):
                prepared.append(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                prepared.append(self._prepare_optimizer(obj))
            elif _is_scheduler(obj):
                prepared.append(None)   # after all optimizers of this call are wrapped
            else:
                prepared.append(self._prepare_loader(obj))
        for index, obj in enumerate(objects):
            if prepared[index] is None and _is_scheduler(obj):
                prepared[index] = self._prepare_scheduler(obj)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _prepare_model(self, model: torch.nn.Module) -> None:
        if any(model is seen for seen in self._models):
            raise ValueError("prepare() was called twice on the same model. Prepare each model once "
                             "and keep using the object it returned.")
        originals = dict(model.named_parameters())
        shard_model(model, self._mesh.fsdp_mesh, self.fsdp_config, self.device, self.seed)
        self._params.record(model, originals)
        self._models.append(model)

    def _prepare_optimizer(self, optimizer):
        if isinstance(optimizer, PreparedOptimizer):
            raise ValueError("This optimizer was already prepared.")
        rebind_optimizer(optimizer, self._params)
        is_first = not self._optimizers
        prepared = PreparedOptimizer(optimizer, should_step=lambda: self.accumulator.sync_gradients,
                                     on_step=self._count_step if is_first else None)
        self._optimizers.append(prepared)
        return prepared

    def _prepare_scheduler(self, scheduler):
        prepared = PreparedScheduler(scheduler, self._optimizers)
        self._schedulers.append(prepared)
        return prepared

    def _prepare_loader(self, loader):
        from hyperacc.data.loader import MicroBatchDataLoader

        if isinstance(loader, MicroBatchDataLoader):
            prepared = loader.bind(self.dp_rank, self.dp_size)
        elif isinstance(loader, DataLoader):
            prepared = ShardedDataLoader(loader, dp_rank=self.dp_rank, dp_size=self.dp_size, seed=self.seed,
                                         on_last_batch=self._set_end_of_dataloader)
        else:
            raise TypeError(f"prepare() does not know how to prepare a {type(loader).__name__}: pass "
                            "nn.Module, torch.optim.Optimizer, LR scheduler, DataLoader or MicroBatchDataLoader.")
        if self._train_loader is None:
            self._train_loader = prepared
        return prepared

    def _set_end_of_dataloader(self, value: bool) -> None:
        self.accumulator.end_of_dataloader = value

    def _count_step(self) -> None:
        self.progress.global_step += 1
        self.progress.consumed_samples += self.accumulator.step_samples
        self.progress.consumed_tokens += self.accumulator.step_tokens

    # ------------------------------------------------------------------ training
    def accumulate(self, model, batch=None):
        """Step mode with ``batch`` (a list of micro-batches), accelerate-compatible mode without."""
        models = [model] if isinstance(model, torch.nn.Module) else list(model)
        if batch is not None:
            return self.accumulator.step(models, batch)
        return self.accumulator.micro_step(models)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        if self.accumulator.in_step:
            loss = self.accumulator.scale_step_loss(loss)
        elif self._needs_step_mode():
            raise RuntimeError("backward() was called outside `with acc.accumulate(model, batch)` while the "
                               "loader yields several micro-batches per step: gradients would be "
                               "reduced after every micro-batch and weighted wrongly. Wrap the "
                               "micro-batch loop in acc.accumulate(model, batch).")
        elif self.gradient_accumulation_steps > 1:
            loss = self.accumulator.scale_micro_step_loss(loss)
        loss.backward(**kwargs)

    def _needs_step_mode(self) -> bool:
        return getattr(self._train_loader, "micro_batches_per_step", 1) > 1

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm of (DTensor) gradients; returns that norm, identical on every rank."""
        from torch.distributed.tensor import DTensor

        params = [p for p in parameters if p.grad is not None]
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=True)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total

    def step_end(self):
        """Call once per optimizer step, after optimizer.step()/scheduler.step(): runs the save policy."""
        self._sync_epoch()
        if not self.checkpoint_config.save_ckpt:
            return None
        return self._get_checkpointer().on_step_end(self._train_state())

    # ------------------------------------------------------------------ collectives
    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate ``tensor`` from every process along dim 0 (scalars become a 1-D tensor)."""
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
        if self.num_processes == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.num_processes)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=0)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        result = tensor.clone()
        if self.num_processes > 1:
            dist.all_reduce(result)
        return result / self.num_processes if reduction == "mean" else result

    def wait_for_everyone(self) -> None:
        if self.num_processes > 1:
            dist.barrier()

    def print(self, *args, **kwargs) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self):
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    def unwrap_model(self, model):
        """FSDP2 shards in place, so the prepared model is the user's own module."""
        return model

    # ------------------------------------------------------------------ checkpoints
    def _get_checkpointer(self):
        if self._checkpointer is None:
            from hyperacc.checkpoint import Checkpointer

            self._checkpointer = Checkpointer(self.checkpoint_config, device_type=self.runtime.device_type,
                                              cpu_group=self._cpu_group_or_none())
        return self._checkpointer

    def _sync_epoch(self) -> None:
        if self._train_loader is not None and hasattr(self._train_loader, "epoch"):
            self.progress.epoch = int(self._train_loader.epoch)

    def _train_state(self):
        from hyperacc.checkpoint import TrainState

        self._sync_epoch()
        return TrainState(
            models=list(self._models), optimizers=[o.optimizer for o in self._optimizers],
            schedulers=[s.scheduler for s in self._schedulers], loader=self._train_loader,
            progress=self.progress, dp_rank=self.dp_rank, dp_size=self.dp_size, seed=self.seed)

    def save_state(self, output_dir: Optional[str] = None) -> Optional[str]:
        """Save all six buckets to ``<checkpoint_dir>/global_step_<N>`` (or ``output_dir``)."""
        return self._get_checkpointer().save(self._train_state(), output_dir=output_dir)

    def load_state(self, input_dir: Optional[str] = None) -> Optional[str]:
        """Restore in place from a path or "LATEST" (default: CheckpointConfig.restore_from).

        Returns the directory loaded, or None for a fresh start.
        """
        if input_dir is None and self.checkpoint_config.restore_from is None:
            return None
        loaded = self._get_checkpointer().load(self._train_state(), input_dir)
        self._sync_epoch()
        return loaded

    def end_training(self) -> None:
        """Final checkpoint per the policy, wait for async saves, release the process group."""
        if self.checkpoint_config.save_ckpt or self._checkpointer is not None:
            self._get_checkpointer().finish(self._train_state())
        runtime_lib.shutdown(self.runtime)


def prepare(*objects):
    """Prepare with a default `Accelerator` (configured from the environment).

    Pass everything that belongs together in one call: each call builds a new Accelerator.
    """
    return Accelerator().prepare(*objects)
