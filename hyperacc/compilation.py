"""`torch.compile` of each transformer block, before FSDP2 shards it.

Why per block, and why in this order: compiling the whole model puts FSDP2's all-gathers, the MoE
router's data-dependent shapes and the loss in one graph that breaks and recompiles (accelerate measured
whole-model compile of Qwen3-30B-A3B 2.4x slower than per-layer). Blocks of one class share one piece
of code, so dynamo compiles it once and every layer reuses it. The block's ``forward`` is replaced in
place -- after the recompute wrapper (so activation checkpointing is compiled into the graph), before
``fully_shard`` (whose hooks then stay outside the graph and run eagerly around it) -- which keeps
parameter names, and so checkpoint keys and HF exports, unchanged: a compiled run's checkpoint
resumes eager and the other way round.

Settings come from `hyperacc.FSDPConfig` (``compile``, ``compile_backend``, ``compile_mode``,
``compile_fullgraph``, ``compile_dynamic``), which accelerate's ``dynamo_backend``/``TorchDynamoPlugin``
and the ``ACCELERATE_DYNAMO_*`` variables of an ``accelerate launch`` config file also fill. A backend
that cannot run on this device is an error before any collective, never a silent eager run.
"""
from __future__ import annotations

import dataclasses
import functools
import shutil
from typing import Iterable, Optional

import torch
import torch.nn as nn

# accelerate's DynamoBackend names that mean "do not compile".
_OFF = ("no", "none", "")


def _flag(value) -> Optional[bool]:
    if value is None or isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in ("", "none", "null"):
        return None
    if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ValueError(f"cannot read {value!r} as a boolean (use true/false)")
    return word in ("1", "true", "yes", "on")


def _backend_name(backend) -> str:
    """A backend as torch names it: accelerate's ``DynamoBackend.INDUCTOR`` / "INDUCTOR" -> "inductor"."""
    return str(getattr(backend, "value", backend)).strip().lower()


def resolve_compile(config, explicit: bool) -> None:
    """Normalise the ``compile*`` fields of a resolved FSDPConfig in place. An unset ``compile`` is on when
    the environment names a dynamo backend (``accelerate launch`` with a config file's
    ``dynamo_config``); ``dynamo_backend: NO`` keeps it off and leaves the default backend."""
    backend = _backend_name(config.compile_backend)
    if not explicit:
        config.compile = backend not in _OFF
    config.compile_backend = "inductor" if backend in _OFF else backend
    config.compile_fullgraph = bool(_flag(config.compile_fullgraph))
    config.compile_dynamic = _flag(config.compile_dynamic)
    config.compile_mode = None if str(config.compile_mode).lower() in ("none", "") else config.compile_mode


def apply_dynamo_arguments(config, dynamo_backend=None, dynamo_plugin=None):
    """``config`` with accelerate's ``Accelerator(dynamo_backend=...)`` / ``dynamo_plugin=`` applied: an
    explicit argument of the constructor, so it wins over the launch environment. transformers'
    ``TrainingArguments(torch_compile=True, ...)`` arrives this way."""
    if dynamo_backend is not None and dynamo_plugin is not None:
        raise ValueError("You cannot pass both dynamo_backend= and dynamo_plugin=; pass one of them.")
    if dynamo_plugin is None and dynamo_backend is None:
        return config
    backend = _backend_name(dynamo_backend if dynamo_plugin is None else dynamo_plugin.backend)
    if getattr(dynamo_plugin, "disable", False) or backend in _OFF:
        return dataclasses.replace(config, compile=False)
    fields = {"compile": True, "compile_backend": backend}
    if dynamo_plugin is not None:
        fields.update(compile_mode=dynamo_plugin.mode, compile_fullgraph=bool(dynamo_plugin.fullgraph),
                      compile_dynamic=dynamo_plugin.dynamic)
    return dataclasses.replace(config, **fields)


def _inductor_problem(device_type: str) -> Optional[str]:
    """Why inductor cannot generate code for ``device_type`` here, or None when it can."""
    from torch._inductor.codegen.common import get_scheduling_for_device, init_backend_registration

    init_backend_registration()
    if get_scheduling_for_device(device_type) is None:
        return (f"inductor has no code generator for device '{device_type}' in this torch build"
                + (" (torch_npu registers none)" if device_type == "npu" else ""))
    if device_type == "cpu":
        from torch._inductor import cpp_builder

        try:
            compiler = cpp_builder.get_cpp_compiler()
        except Exception:       # noqa: BLE001 - torch raises several kinds when no compiler is set up
            compiler = None
        if not compiler or not shutil.which(compiler):
            return "inductor needs a C++ compiler on CPU and none was found (install g++, or set CXX)"
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "inductor needs triton on CUDA and it is not installed (pip install triton)"
    return None


def check_backend(config, device_type: str) -> None:
    """One clear error, before any collective, when the configured backend cannot compile on this device."""
    if not config.compile:
        return
    import torch._dynamo

    backend = config.compile_backend
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"FSDPConfig.compile_backend={backend!r} is not a torch.compile backend here; choose "
                         f"one of {', '.join(sorted(known))} (e.g. 'inductor', or 'aot_eager' for eager "
                         "numerics), or set compile=false.")
    problem = _inductor_problem(device_type) if backend == "inductor" else None
    if problem:
        raise RuntimeError(f"FSDPConfig.compile: {problem}. Fix: set compile_backend='aot_eager' (graph capture "
                           "without code generation) or compile=false to train eager.")


def compile_kwargs(config) -> dict:
    kwargs = {"backend": config.compile_backend, "fullgraph": config.compile_fullgraph,
              "dynamic": config.compile_dynamic}
    if config.compile_mode not in (None, "default"):
        kwargs["mode"] = config.compile_mode
    return kwargs


def compile_blocks(blocks: Iterable[nn.Module], config) -> None:
    """Replace each block's ``forward`` by its compiled version, in place (names unchanged).

    Submodules split by tensor or expert parallelism run eagerly between the compiled pieces:
    AOTAutograd cannot trace the backward of transformers' TP layers (local-tensor matmul + DTensor
    redistribution: a RecursionError in torch 2.13), and expert-parallel dispatch sends token counts
    known only at run time (an all-to-all whose split sizes are data) from inside an FSDP unit of its
    own. Under TP a block compiles its norms, rotary embedding, attention core and router; under EP
    everything but the experts."""
    kwargs = compile_kwargs(config)
    for block in blocks:
        for module in block.modules():
            if _split_over("tp", module) or _split_over("ep", module):
                module.forward = torch._dynamo.disable(module.forward)
        block.forward = torch.compile(block.forward, **kwargs)


def _split_over(dim: str, module: nn.Module) -> bool:
    """Whether ``module`` holds parameters sharded over the mesh dimension ``dim`` ("tp", "ep")."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) and dim in (p.device_mesh.mesh_dim_names or ())
               for p in module.parameters(recurse=False))


def compiled_frames() -> int:
    """How many frames dynamo has compiled in this process so far (each recompilation counts once):
    compare it across steps to see recompiles."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def recompile_limit_hits() -> int:
    """How often dynamo gave up compiling a frame (cache/recompile limit reached) and ran it eagerly."""
    from torch._dynamo.utils import counters

    return int(sum(count for reason, count in counters["frames"].items() if "limit" in str(reason)))


def with_recompute(forward):
    """``forward`` that recomputes its activations in backward (non-reentrant checkpoint); a plain
    function so that dynamo traces it (and the checkpoint as one region) when the block is compiled."""
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(forward)
    def recomputed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return recomputed
