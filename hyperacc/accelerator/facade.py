"""`Accelerator`: accelerate's, with hyperacc's mesh, FSDP2, exact accumulation and checkpoints instead.

Why a subclass: a script written for accelerate uses ~110 members (trackers, `gather_for_metrics`,
`split_between_processes`, `set_trigger`, `autocast`, `save_model`, `accelerate.logging` ...) whose
meaning is accelerate's. Inheriting them keeps that meaning exact and costs no re-implementation;
hyperacc overrides only what touches models, optimizers, loaders and checkpoints. Two things a naive
subclass gets wrong are fixed here: accelerate's state is built on hyperacc's process group (on a
CPU-only machine accelerate alone would pick "no distribution" and train every rank alone), and
optimizers are rebound to the sharded parameters that `fully_shard` creates.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import accelerate
from accelerate.utils import set_seed
import torch

from hyperacc import parallel, precision, weights
from hyperacc.accelerator import compat
from hyperacc.training import router_aux
from hyperacc import runtime as runtime_lib
from hyperacc.training.accumulation import GradientAccumulator
from hyperacc.training.hooks import SavePolicyHook, StepHooks
from hyperacc.accelerator.checkpointing import CheckpointingMixin
from hyperacc.config.launch_env import env_value
from hyperacc.config import CheckpointConfig, FSDPConfig, ParallelConfig
from hyperacc.runtime.mesh import build_mesh
from hyperacc.runtime.progress import Progress
from hyperacc.models import setup as model_setup
from hyperacc.sharding import reshard
from hyperacc.sharding.rebind import ParameterMap, PreparedScheduler, rebind_optimizer

DEFAULT_SEED = 42


def _is_scheduler(obj) -> bool:
    return hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "get_last_lr")


class Accelerator(CheckpointingMixin, accelerate.Accelerator):
    """Shard with FSDP2 over one DeviceMesh, accumulate exactly, checkpoint everything.

    Takes every argument of `accelerate.Accelerator` with its meaning (`fsdp_plugin` and
    `parallelism_config` become hyperacc's FSDPConfig/ParallelConfig), plus hyperacc's own
    keyword-only `parallel`, `fsdp`, `checkpoint`, `seed`, `device_type` and `router_aux_loss` (MoE
    load balancing: "sequence", the default, or "micro_batch"; `hyperacc.training.router_aux`), which win,
    and `parallelize_fn`: your own ``fn(model, mesh, fsdp_config)`` in place of
    `hyperacc.sharding.parallelize` (TP -> EP -> CP -> compile -> recompute -> FSDP2; it says what stays hyperacc's).
    Unset values come from the `accelerate launch` environment, else from the defaults.
    """

    def __init__(self, device_placement: bool = True, split_batches=None, mixed_precision=None,
                 gradient_accumulation_steps: int = 1, cpu: bool = False, dataloader_config=None,
                 deepspeed_plugin=None, fsdp_plugin=None, torch_tp_plugin=None, megatron_lm_plugin=None,
                 rng_types=None, log_with=None, project_dir=None, project_config=None,
                 gradient_accumulation_plugin=None, step_scheduler_with_optimizer: bool = True,
                 kwargs_handlers=None, dynamo_backend=None, dynamo_plugin=None, deepspeed_plugins=None,
                 parallelism_config=None, *, parallel: Optional[ParallelConfig] = None,
                 fsdp: Optional[FSDPConfig] = None, checkpoint: Optional[CheckpointConfig] = None,
                 seed: Optional[int] = None, device_type: Optional[str] = None,
                 router_aux_loss: Optional[str] = None, parallelize_fn: Optional[Callable] = None):
        compat.refuse_unsupported_plugins(deepspeed_plugin=deepspeed_plugin, deepspeed_plugins=deepspeed_plugins,
                                          megatron_lm_plugin=megatron_lm_plugin, torch_tp_plugin=torch_tp_plugin)
        compat.warn_split_batches(split_batches)
        self.parallel_config, self.fsdp_config, self.checkpoint_config = compat.resolve_configs(
            parallel=parallel, fsdp=fsdp, checkpoint=checkpoint, parallelism_config=parallelism_config,
            fsdp_plugin=fsdp_plugin, mixed_precision=mixed_precision, dynamo_backend=dynamo_backend,
            dynamo_plugin=dynamo_plugin)
        self.save_on_end: Optional[bool] = None     # end_training's final save; None: when saves were asked for
        self.seed = DEFAULT_SEED if seed is None else int(seed)
        self._router_aux_mode = router_aux_loss
        if parallelize_fn is not None and not callable(parallelize_fn):
            raise TypeError(f"Accelerator(parallelize_fn={parallelize_fn!r}): not a function. Fix: pass a function "
                            "fn(model, mesh, fsdp_config) that lays the model out in place (see "
                            "hyperacc.sharding.parallelize, the default), or leave parallelize_fn unset.")
        self._parallelize_fn = parallelize_fn

        # Validate the parallel sizes against the world, then start the process group: both before
        # accelerate builds its state, so that the state describes this job.
        dist = torch.distributed
        self.parallel_config.resolved(dist.get_world_size() if dist.is_initialized() else int(env_value("WORLD_SIZE", "1")))
        self.runtime = runtime_lib.init_runtime("cpu" if cpu and device_type is None else device_type,
                                                compat.process_group_timeout_s(kwargs_handlers))
        compat.check_no_stale_state(self.runtime.world_size)
        with compat.accelerate_switches_off():
            super().__init__(
                device_placement=device_placement, split_batches=split_batches,
                mixed_precision=self.fsdp_config.mixed_precision or "no",   # FSDPConfig is what runs
                gradient_accumulation_steps=gradient_accumulation_steps, cpu=self.runtime.device_type == "cpu",
                dataloader_config=dataloader_config, rng_types=rng_types, log_with=log_with,
                project_dir=project_dir, project_config=project_config,
                gradient_accumulation_plugin=gradient_accumulation_plugin,
                step_scheduler_with_optimizer=step_scheduler_with_optimizer, kwargs_handlers=kwargs_handlers)
        compat.mark_state_fsdp2(self.state, fsdp_plugin)
        self.recipe = precision.recipe_for(self.fsdp_config, self.runtime.device_type, self.scaler is not None)
        self._mesh = build_mesh(self.parallel_config, self.runtime.world_size, self.runtime.device_type)
        if seed is not None:
            set_seed(self.seed)         # accelerate's: python, numpy, torch and every accelerator
        self.accumulator = GradientAccumulator(
            device=self.device, dp_size=self._mesh.grad_ranks, group=self.runtime.cpu_group, fsdp=self.fsdp_config,
            gradient_state=self.gradient_state, same_tokens=self._mesh.same_tokens,
            same_samples=self._mesh.same_samples)
        self.progress = Progress()
        self._params = ParameterMap()
        self._train_loader = None
        self._checkpointer = None
        self._init_checkpointing()      # saves only when asked; project_dir honoured (hyperacc.accelerator.checkpointing)
        self.step_hooks = StepHooks(self)   # run by optimizer.step() and step_end() (hyperacc.training.hooks)
        self.step_hooks.add(SavePolicyHook(self._policy_step_end))

    # ------------------------------------------------------------------ identity
    @property
    def device(self) -> torch.device:
        """This process's device (NPU, CUDA or CPU, detected once; ``HYPERACC_DEVICE`` forces one)."""
        return self.runtime.device

    @property
    def mesh(self):
        """The dense DeviceMesh (``dp_replicate`` x ``dp_shard`` x ``cp`` x ``tp``), built once."""
        return self._mesh.mesh

    @property
    def torch_device_mesh(self):
        """accelerate's name for the mesh: the same object as `mesh`."""
        return self._mesh.mesh

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index (ranks that share it -- tp and cp peers -- read the same samples)."""
        return self._mesh.dp_rank

    @property
    def dp_size(self) -> int:
        """The number of data-parallel ranks: dp_replicate x dp_shard (the loader splits each step over them)."""
        return self._mesh.dp_size

    @property
    def step_loss(self) -> Optional[float]:
        """Global token-mean loss of the last `accumulate(model, batch)` step (same on every rank)."""
        return self.accumulator.step_loss

    @property
    def step_aux_loss(self) -> Optional[float]:
        """Token-weighted MoE router aux loss of the last step (None unless passed to `backward`)."""
        return self.accumulator.step_aux_loss

    # ------------------------------------------------------------------ prepare
    def prepare(self, *objects, device_placement=None):
        """Shard models, rebind optimizers, prepare loaders, then schedulers; returns them in order."""
        prepared = [self.prepare_model(obj) if isinstance(obj, torch.nn.Module) else None for obj in objects]
        for index, obj in enumerate(objects):
            if isinstance(obj, torch.optim.Optimizer):
                prepared[index] = self.prepare_optimizer(obj)
            elif prepared[index] is None and not _is_scheduler(obj):
                prepared[index] = self.prepare_data_loader(obj)
        for index, obj in enumerate(objects):
            if prepared[index] is None:
                prepared[index] = self.prepare_scheduler(obj)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def prepare_model(self, model: torch.nn.Module, device_placement=None, evaluation_mode: bool = False):
        """Shard ``model`` on the mesh (in place; returns it). ``evaluation_mode=True`` (accelerate's name): a model
        that is only run, never trained -- a preference trainer's reference, a teacher: sharded by the same plan, frozen,
        in its own dtype, in eval mode; it is not in the checkpoints and no optimizer can hold it."""
        if evaluation_mode:
            return self._prepare_frozen(model)
        if any(model is seen for seen in self._models):
            raise ValueError("prepare() was called twice on the same model. Prepare each model once "
                             "and keep using the object it returned.")
        # Every model check (its kind's, the layout's, compile's), once, before any collective.
        kind = model_setup.check_model(model, self._mesh, self.fsdp_config, self.device.type)
        aux_mode = router_aux.check_mode(model, self._router_aux_mode)
        layout = (tuple(self._mesh.mesh.mesh_dim_names), tuple(self._mesh.mesh.shape), repr(self.fsdp_config), aux_mode)
        if getattr(model, "_hyperacc_layout", None) == "frozen":
            raise ValueError("This model was prepared with evaluation_mode=True (frozen, in its own dtype) and cannot "
                             "be trained: prepare a fresh copy of it for training.")
        if getattr(model, "_hyperacc_layout", None) is not None:
            # Sharded by an earlier Accelerator of this job (transformers' Trainer prepares the model it
            # evaluated again for training, or a second Trainer gets the same model): adopted as it is.
            if model._hyperacc_layout != layout:
                raise ValueError("This model was sharded by another Accelerator with a different mesh, FSDP or "
                                 "router-aux setting; it cannot be re-sharded. Build a fresh model for this one.")
            originals = dict(model.named_parameters())
        else:
            originals = model_setup.shard_and_fill(model, kind=kind, mesh=self._mesh, fsdp_config=self.fsdp_config,
                                                   parallelize_fn=self._parallelize_fn, device=self.device,
                                                   seed=self.seed, num_processes=self.num_processes)
            router_aux.install(model, aux_mode, self.accumulator.aux_weights)
            model._hyperacc_layout = layout
        self._params.record(model, originals)
        self._models.append(model)
        compat.add_script_conveniences(model, self)
        return model

    def _prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        if any(model is seen for seen in self._models) or getattr(model, "_hyperacc_layout", None) is not None:
            raise ValueError("evaluation_mode=True: this model was already prepared (for training, or as another "
                             "frozen model). A frozen reference must be its own copy: pass a separate model object.")
        kind = model_setup.check_model(model, self._mesh, self.fsdp_config, self.device.type)
        model_setup.shard_and_fill(model, kind=kind, mesh=self._mesh, fsdp_config=self.fsdp_config,
                                   parallelize_fn=self._parallelize_fn, device=self.device, seed=self.seed,
                                   num_processes=self.num_processes, frozen=True)
        # No backward follows its forward: the root unit (embeddings, head) is resharded too, as every block is,
        # or it would stay gathered on every rank after the first forward (the whole head per rank).
        if hasattr(model, "set_reshard_after_forward"):
            model.set_reshard_after_forward(True)
        model._hyperacc_layout = "frozen"
        return model.eval()

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        if getattr(optimizer, "_is_accelerate_prepared", False) or isinstance(optimizer, accelerate.optimizer.AcceleratedOptimizer):
            raise ValueError("This optimizer was already prepared.")
        rebind_optimizer(optimizer, self._params)
        precision.adapt_optimizer(optimizer, self.recipe, seed=self.seed, names=self._params.names())
        if not self._optimizers:      # progress counts the steps of the first optimizer
            optimizer.register_step_post_hook(lambda *_: self._count_step())
            optimizer.register_step_pre_hook(lambda opt, *_: self.step_hooks.before_optimizer_step(opt))
        return super().prepare_optimizer(optimizer, device_placement=device_placement)

    def prepare_scheduler(self, scheduler):
        """Step mode (a MicroBatchDataLoader was prepared): once per optimizer step. Otherwise
        accelerate's AcceleratedScheduler, which steps as accelerate scripts size their schedules."""
        if not _is_scheduler(scheduler):
            raise TypeError(f"prepare() does not know how to prepare a {type(scheduler).__name__}: pass "
                            "nn.Module, torch.optim.Optimizer, LR scheduler, DataLoader or MicroBatchDataLoader.")
        if self._needs_once_per_step_scheduler():
            prepared = PreparedScheduler(scheduler, self._optimizers, self.accumulator)   # reads its sync flag
            self._schedulers.append(prepared)
            return prepared
        return super().prepare_scheduler(scheduler)      # accelerate's AcceleratedScheduler

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        from hyperacc.data.loader import MicroBatchDataLoader
        from hyperacc.data.resumable import prepare_plain_loader
        from hyperacc.data.streaming import StreamingDataLoader

        if isinstance(data_loader, (MicroBatchDataLoader, StreamingDataLoader)):
            prepared = data_loader.bind(self.dp_rank, self.dp_size)
        elif isinstance(data_loader, torch.utils.data.DataLoader):
            prepared = prepare_plain_loader(self, data_loader, device_placement, slice_fn_for_dispatch)
        else:
            raise TypeError(f"prepare() does not know how to prepare a {type(data_loader).__name__}: pass "
                            "nn.Module, torch.optim.Optimizer, LR scheduler, DataLoader, MicroBatchDataLoader or "
                            "StreamingDataLoader.")
        self._dataloaders.append(prepared)
        if self._train_loader is None:
            self._train_loader = prepared
        return prepared

    def _needs_once_per_step_scheduler(self) -> bool:
        return getattr(self._train_loader, "micro_batches_per_step", None) is not None

    def _count_step(self) -> None:
        self.progress.global_step += 1
        self.progress.consumed_samples += self.accumulator.step_samples
        self.progress.consumed_tokens += self.accumulator.step_tokens

    # ------------------------------------------------------------------ training
    def accumulate(self, *args):
        """`accumulate(model, batch)`: step mode (a list of micro-batches, token-weighted);
        `accumulate(*models)`: accelerate's gradient accumulation over `gradient_accumulation_steps`."""
        models, batch = [], None
        for arg in args:
            if isinstance(arg, torch.nn.Module):
                models.append(arg)
            elif isinstance(arg, (list, tuple)) and arg and all(isinstance(m, torch.nn.Module) for m in arg):
                models.extend(arg)
            elif batch is None:
                batch = arg
            else:
                raise TypeError("accumulate() takes models and at most one batch (a list of micro-batches).")
        if batch is not None:
            self.runtime.heartbeat.step = self.progress.global_step + 1
            return self.accumulator.step(models, batch, step=self.progress.global_step + 1)
        return super().accumulate(*models)

    def backward(self, loss: torch.Tensor, aux_loss=None, **kwargs) -> None:
        """``aux_loss``: the micro-batch's MoE router aux loss (``outputs.aux_loss``), already part of
        ``loss``; passed only to be logged, token-weighted, as `step_aux_loss`."""
        if self.accumulator.in_step:
            self.accumulator.record_aux_loss(aux_loss)
            loss = self.accumulator.scale_step_loss(loss)
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward(**kwargs)
            return
        if self._needs_once_per_step_scheduler() and self._train_loader.micro_batches_per_step > 1:
            raise RuntimeError("backward() was called outside `with acc.accumulate(model, batch)` while the "
                               "loader yields several micro-batches per step: gradients would be "
                               "reduced after every micro-batch and weighted wrongly. Wrap the "
                               "micro-batch loop in acc.accumulate(model, batch).")
        super().backward(loss, **kwargs)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm of (DTensor) gradients; returns that norm, identical on every rank."""
        self.unscale_gradients()
        groups = parallel.group_by_mesh([p for p in parameters if p.grad is not None])
        total = parallel.total_norm(groups, norm_type)
        self.step_hooks.grad_norm = total       # the step hooks' (step checks, metrics)
        for params in groups:     # foreach kernels take DTensors of one mesh at a time
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        """Element-wise, so each rank clips its own gradient shards."""
        self.unscale_gradients()
        for param in parameters:
            if param.grad is not None:
                param.grad.clamp_(min=-clip_value, max=clip_value)

    @staticmethod
    @contextlib.contextmanager
    def trigger_sync_in_backward(model):
        """Reduce gradients in the next backward even inside `no_sync` (FSDP2's sync flag)."""
        if not hasattr(model, "set_requires_gradient_sync"):
            yield
            return
        model.set_requires_gradient_sync(True)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(False)

    def step_end(self):
        """Call once per optimizer step, after optimizer.step()/scheduler.step(): runs the step hooks in
        order, the save policy last (it saves only when asked: `CheckpointConfig.save_requested` or
        automatic checkpoint naming). Returns the directory saved, or None."""
        self._sync_epoch()
        return self.step_hooks.step_end(self._train_loader)

    def add_step_hook(self, hook, order: Optional[int] = None):
        """Run ``hook`` at every optimizer step, by ``order`` (`hyperacc.training.hooks`: StepChecks,
        ReplicaGuard, CompileWatch, MetricsLogger and PeriodicCleanup register as they are). Returns a
        handle whose ``remove()`` unregisters it."""
        return self.step_hooks.add(hook, order)

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        if hasattr(dataloader, "skip_first_batches"):       # a ResumableLoader
            return dataloader.skip_first_batches(num_batches)
        return super().skip_first_batches(dataloader, num_batches)

    def free_memory(self, *objects):
        self._train_loader = None
        self._params = ParameterMap()
        return super().free_memory(*objects)

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization: bool = True, *,
                   tokenizer=None):
        """accelerate's signature; every rank writes its share of the files (`hyperacc.weights.export`).
        ``tokenizer`` (hyperacc's, optional): saved beside the model, its token ids in the config."""
        weights.save_model_sharded(model, save_directory, max_shard_size, safe_serialization,
                                   group=self.runtime.cpu_group, tokenizer=tokenizer)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The user's own module (FSDP2 shards in place), resharded (see `sharding.reshard`)."""
        reshard(model)
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper,
                                    keep_torch_compile=keep_torch_compile)

    def get_state_dict(self, model, unwrap: bool = True):
        """accelerate's (full weights on the main process's host), after `sharding.reshard`."""
        reshard(model)
        return super().get_state_dict(model, unwrap=unwrap)

    def end_training(self) -> None:
        """Finish trackers; a final checkpoint only when saves were asked for (as for `step_end`); wait
        for async saves; release the process group if hyperacc created it."""
        self._finish_checkpointing()
        for tracker in self.trackers:
            tracker.finish()
        runtime_lib.shutdown(self.runtime)


for _name in compat.NOT_SUPPORTED:
    setattr(Accelerator, _name, compat.not_supported(_name))

NOT_SUPPORTED = tuple(compat.NOT_SUPPORTED)


def prepare(*objects):
    """Prepare with a default `Accelerator` (configured from the environment).

    Pass everything that belongs together in one call: each call builds a new Accelerator.
    """
    return Accelerator().prepare(*objects)
