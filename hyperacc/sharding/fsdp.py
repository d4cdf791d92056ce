"""FSDP2 wrapping of a model: per-block `fully_shard`, meta-device materialisation, activation
recompute, CPU offload, mixed precision and the precision recipe's parameter dtype. 0-d parameters,
which `fully_shard` refuses, stay whole on every rank (`hyperacc.sharding.replicated`). The steps
are composed, in order, by `hyperacc.sharding.parallelize`.

Why per block: each transformer block becomes one all-gather/reduce-scatter unit, so only one
block's full parameters exist at a time; the root call covers what is left (embeddings, head).
"""
from __future__ import annotations

import contextlib

import dataclasses
import functools
import warnings
import zlib
from typing import Collection, Iterable, List, Optional

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from hyperacc.config import FSDPConfig
from hyperacc.parallel import set_expert_gradient_reduction
from hyperacc.precision import get_recipe
from hyperacc.runtime.mesh import MeshInfo
from hyperacc.sharding.replicated import replicate_scalars, scalar_parameters

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def block_classes(model: nn.Module, wrap_classes: Optional[Iterable[str]]) -> List[str]:
    """Names of the module classes that become FSDP units (explicit list, else `_no_split_modules`)."""
    if wrap_classes:
        return list(wrap_classes)
    return sorted(getattr(model, "_no_split_modules", None) or [])


def find_blocks(model: nn.Module, class_names: Iterable[str]) -> List[nn.Module]:
    names = set(class_names)
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def enable_recompute(blocks: Iterable[nn.Module]) -> None:
    """Recompute each block's activations in backward instead of storing them.

    The block's ``forward`` is wrapped in place (non-reentrant checkpoint), which keeps parameter
    names, and therefore checkpoint keys and HF exports, unchanged.
    """
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def cast_parameters(model: nn.Module, dtype: torch.dtype, *, keep_frozen: bool = False,
                    keep: Collection[str] = ()) -> None:
    """Store every floating-point parameter in ``dtype``, in place (ties and identities kept; buffers
    such as RoPE frequencies keep their own dtype). Works on the meta device.

    ``keep`` (parameter names: a model kind's `keeps_dtype`, e.g. an adapter model's frozen base) and
    ``keep_frozen`` (every frozen parameter) keep their stored dtype. Frozen parameters get no
    gradient and no optimizer state, so a bf16 base under adapters stays bf16 under the fp32_master recipe
    instead of doubling in size; FSDP2 needs only a unit's trainable parameters to share a dtype, and
    adapter layers cast between adapter and base dtypes. (A plain model is cast whole: its layers
    expect one dtype.)"""
    keep = set(keep)
    for name, param in model.named_parameters():
        if name in keep or (keep_frozen and not param.requires_grad):
            continue
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def _policies(config: FSDPConfig, device_type: str) -> dict:
    kwargs = {"reshard_after_forward": config.reshard_after_forward}
    if config.mixed_precision or get_recipe(config.precision).low_precision:
        # Gradients are always reduced in fp32 (bf16 ones are cast back to the parameters' dtype).
        compute = _DTYPES.get(config.mixed_precision)
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    if config.cpu_offload:
        if device_type == "cpu":
            warnings.warn("FSDPConfig.cpu_offload=True is ignored on a CPU-only run: parameters, "
                          "gradients and optimizer states already live in host memory (FSDP2's "
                          "offload policy needs an accelerator). Training continues without offload.",
                          stacklevel=3)
        else:
            kwargs["offload_policy"] = CPUOffloadPolicy()
    return kwargs


def _root_policies(kwargs: dict, config: FSDPConfig) -> dict:
    """The root unit's policies: never resharded after forward (backward needs it at once) and,
    under ``mixed_precision``, fp32 outputs. accelerate wraps the forward of a mixed-precision model
    in ``convert_outputs_to_fp32``, so its users get fp32 logits and loss; FSDP2's ``output_dtype``
    does the same cast on the root alone, so the blocks in between still hand bf16 activations to
    each other. A bf16 *recipe* without ``mixed_precision`` is a storage choice (like a model loaded
    in bf16 under accelerate): its outputs stay in the parameters' dtype."""
    root = {**kwargs, "reshard_after_forward": False}
    if config.mixed_precision and "mp_policy" in kwargs:
        root["mp_policy"] = dataclasses.replace(kwargs["mp_policy"], output_dtype=torch.float32)
    return root


def check_not_sharded(model: nn.Module) -> None:
    """Refuse a model FSDP2 already wraps (before any collective)."""
    if isinstance(model, FSDPModule):
        raise ValueError("This model is already sharded: prepare() was called twice on the same model. "
                         "Prepare each model once and keep the returned object.")


def transformer_blocks(model: nn.Module, config: FSDPConfig) -> List[nn.Module]:
    """The modules that become FSDP units (and are compiled / recomputed): ``FSDPConfig.wrap_classes``,
    else the model's ``_no_split_modules``; a warning when none is found (one unit: more memory)."""
    names = block_classes(model, config.wrap_classes)
    blocks = find_blocks(model, names)
    if not blocks and config.wrap_classes and block_classes(model, None):
        # e.g. a launch config naming another model's block: the model's own blocks are the safe unit.
        warnings.warn(f"No module of class {names} found in {type(model).__name__}: wrapping its own "
                      f"blocks {block_classes(model, None)} (from _no_split_modules) instead.", stacklevel=3)
        names = block_classes(model, None)
        blocks = find_blocks(model, names)
    if not blocks:
        warnings.warn(f"No module of class {names or '(none given)'} found in {type(model).__name__}: "
                      "sharding the whole model as one unit (more memory). Set FSDPConfig.wrap_classes "
                      "to the transformer block class name.", stacklevel=3)
    return blocks


def _dense_mesh(mesh):
    """The mesh dense modules are sharded over: a `MeshInfo`'s FSDP mesh, or a plain DeviceMesh."""
    return mesh.fsdp_mesh if isinstance(mesh, MeshInfo) else mesh


def offloads(config: FSDPConfig, device_type: str) -> bool:
    """Whether FSDP2 keeps the shards in host memory (CPU offload on an accelerator)."""
    return bool(config.cpu_offload) and device_type != "cpu"


def apply_fsdp(model: nn.Module, blocks: List[nn.Module], mesh, config: FSDPConfig,
               experts: Iterable[nn.Module] = ()) -> None:
    """`fully_shard` the experts (on the expert mesh), each block, then the root, in place. ``mesh``:
    a `hyperacc.runtime.mesh.MeshInfo` or a plain DeviceMesh. 0-d parameters, which `fully_shard`
    refuses, are left out (``ignored_params``) and replicated by `allocate_shards`."""
    dense = _dense_mesh(mesh)
    kwargs = _policies(config, dense.device_type)
    experts = list(experts)
    for module in experts:
        fully_shard(module, mesh=mesh.expert_fsdp_mesh, **kwargs)
    if experts:
        set_expert_gradient_reduction(experts, mesh.grad_ranks, mesh.parallel.efsdp_size)
    scalars = scalar_parameters(model)
    ignored = {"ignored_params": set(scalars)} if scalars else {}
    for block in blocks:
        fully_shard(block, mesh=dense, **kwargs, **ignored)
    # The root (embeddings, final norm, head) is needed again as soon as backward starts: resharding
    # it after forward would only buy one more all-gather per micro-batch (FSDP2's own default).
    fully_shard(model, mesh=dense, **_root_policies(kwargs, config), **ignored)


def allocate_shards(model: nn.Module, mesh, config: FSDPConfig, device: torch.device, seed: int, *,
                    on_meta: bool, initialize: bool = True) -> None:
    """After sharding: a model that was on the meta device (``on_meta``) gets its shards allocated,
    and initialised from ``seed`` (`materialize`) unless ``initialize=False`` (the caller fills them
    next: pretrained weights); its 0-d parameters become data-parallel replicas."""
    if on_meta:
        target = torch.device("cpu") if offloads(config, device.type) else device
        if initialize:
            materialize(model, target, seed)
        else:
            model.to_empty(device=target)
        for param in scalar_parameters(model):      # not offloaded: FSDP2 manages no state of theirs
            param.data = param.data.to(device)
    replicate_scalars(model, scalar_parameters(model), _dense_mesh(mesh))


def _module_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode()) & 0x7FFFFFFF


def _full_size_copy(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` owning fresh, full-size CPU tensors (no children). Floating
    parameters are fp32 whatever the recipe stores, so every recipe starts from the same weights."""
    # Not copy.copy: an FSDP unit's class re-runs __init__ without arguments in __new__.
    clone = object.__new__(type(module))
    clone.__dict__.update(module.__dict__)
    clone._modules = {}
    # A DTensor reports its global shape; None entries (e.g. a Linear without bias) stay None.
    clone._parameters = {
        name: None if p is None else nn.Parameter(
            torch.empty(p.shape, dtype=torch.float32 if p.is_floating_point() else p.dtype),
            requires_grad=p.requires_grad)
        for name, p in module._parameters.items()}
    # nn.Module's own dicts (private, no public way to give a shallow clone new parameters/buffers)
    clone._buffers = {name: None if b is None else torch.empty(b.shape, dtype=b.dtype)
                      for name, b in module._buffers.items()}
    return clone


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    with torch.no_grad():
        if isinstance(target, DTensor):
            local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(local.to_local())
        else:
            target.copy_(full)


def _initialiser(model: nn.Module):
    init = getattr(model, "_init_weights", None)
    if init is not None:
        return init

    def reset(module):
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return reset


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a meta-device model's shards and initialise them reproducibly.

    Each module is initialised at full size on the host from a generator seeded by (seed, module
    name), and every rank keeps only its own shard. The weights therefore depend on the seed alone:
    identical across ranks, across runs, and across world sizes.
    """
    model.to_empty(device=device)
    init = _initialiser(model)
    for name, module in model.named_modules():
        own = [t for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None]
        if not own:
            continue
        full = _full_size_copy(module)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_module_seed(seed, name))
            init(full)
        for key, tensor in module._parameters.items():
            if tensor is not None:
                _copy_into(tensor, full._parameters[key])
        for key, tensor in module._buffers.items():
            if tensor is not None:
                _copy_into(tensor, full._buffers[key])


def rank0_only_weights_expected() -> bool:
    """transformers' `from_pretrained` under an `accelerate launch` FSDP config with
    `fsdp_cpu_ram_efficient_loading` (the launcher's default) loads the weights on rank 0 only and
    leaves the model on the meta device elsewhere."""
    from hyperacc.config.launch_env import env_flag

    return env_flag("ACCELERATE_USE_FSDP") and env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING")


def broadcast_from_rank0(model: nn.Module, device: torch.device, group=None) -> None:
    """Give every rank rank 0's weights (as accelerate's `sync_module_states` does) when rank 0 has
    real weights and some rank does not; a model on the meta device everywhere is left to be
    initialised after sharding."""
    import torch.distributed as dist

    on_meta = torch.tensor([float(any(t.is_meta for t in [*model.parameters(), *model.buffers()]))])
    flags = [torch.zeros(1) for _ in range(dist.get_world_size(group))]
    dist.all_gather(flags, on_meta, group=group)
    if flags[0].item() or not any(f.item() for f in flags):
        return
    if on_meta.item():
        model.to_empty(device=device)
    else:
        model.to(device)
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0, group=group)


def reshard(model: nn.Module) -> None:
    """Free every unsharded FSDP2 parameter of ``model``. A forward without backward (evaluation)
    leaves FSDP2 units unsharded; a state dict read then would alias storage FSDP frees at the next
    reshard. Every reader of a prepared model's weights (checkpoint, export, get_state_dict) calls it."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextlib.contextmanager
def gathered_for_decoding(model: nn.Module, whole: bool = False):
    """``model``'s weights gathered for a run of forwards without backward (decoding), resharded after.

    Always the root unit (embeddings, final norm, head: the weights outside the blocks): a wrapper whose
    `generate` calls the model it wraps (an adapter wrapper does) bypasses the sharded root's forward hook,
    which gathers them ("got mixed torch.Tensor and DTensor"); and decoding gathers them once per call
    instead of once per token. ``whole=True``: every block too, kept gathered across the decoding steps (the
    whole model on each rank while inside, as DDP holds it): a 4-layer 38 M model generating 32 tokens on 2
    CPU processes spent 2.1x an unsharded run's step time gathering each block at each token. The root is initialised first (FSDP2 takes the
    first unit to run forward as the root, which here would be a block). Uses FSDP2 internals (the lazy
    init, each unit's post-forward resharding setting, saved and restored as they were): torch 2.6-2.13."""
    if not isinstance(model, FSDPModule):
        yield model
        return
    model._get_fsdp_state()._lazy_init()    # no public equivalent; a no-op once initialised
    units = [m for m in model.modules() if isinstance(m, FSDPModule)] if whole else [model]
    saved = []
    for unit in units:
        state = unit._get_fsdp_state()
        saved.append((unit, state._auto_reshard_after_forward,
                      [group.post_forward_mesh_info for group in state._fsdp_param_groups]))
        if whole:
            unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield model
    finally:
        for unit, auto, infos in saved:
            state = unit._get_fsdp_state()
            state._auto_reshard_after_forward = auto
            for group, info in zip(state._fsdp_param_groups, infos):
                group.post_forward_mesh_info = info
            unit.reshard()
