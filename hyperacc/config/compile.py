"""What the ``compile*`` fields of `FSDPConfig` mean here, resolved and checked before any work.

Why in the config layer: resolving a field (the launch environment's dynamo backend, accelerate's
``dynamo_backend``/``dynamo_plugin`` arguments) and refusing settings that cannot run on this device
are decisions about configuration, taken before a process group or a model exists. Applying the
settings to a model's blocks is `hyperacc.sharding.compile`'s business.
"""
from __future__ import annotations

import dataclasses
import shutil
from typing import Optional

from hyperacc.config.launch_env import launch_env, parse_env_text

# accelerate's DynamoBackend names that mean "do not compile".
_OFF = ("no", "none", "")
# torch.compile's modes (None: "default"); the ones that capture CUDA graphs.
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _backend_name(backend) -> str:
    """A backend as torch names it: accelerate's ``DynamoBackend.INDUCTOR`` / "INDUCTOR" -> "inductor"."""
    return str(getattr(backend, "value", backend)).strip().lower()


def resolve_compile(config, explicit: bool) -> None:
    """Normalise the ``compile*`` fields of a resolved FSDPConfig in place. ``compile`` not given (argument
    or HYPERACC_FSDP_COMPILE) is on when the launch environment names a dynamo backend (``accelerate
    launch`` with a config file's ``dynamo_config``; ``dynamo_backend: NO`` keeps it off)."""
    if not explicit:
        named = _backend_name(launch_env().get("ACCELERATE_DYNAMO_BACKEND", "no"))
        config.compile = named not in _OFF
    backend = _backend_name(config.compile_backend)
    config.compile_backend = "inductor" if backend in _OFF else backend
    dynamic = config.compile_dynamic
    if isinstance(dynamic, str):        # from ACCELERATE_DYNAMO_USE_DYNAMIC (None-default fields stay text)
        try:
            dynamic = None if dynamic.strip().lower() in ("", "none", "null") else parse_env_text(dynamic, False)
        except ValueError as err:
            raise ValueError(f"environment variable ACCELERATE_DYNAMO_USE_DYNAMIC={dynamic!r} is invalid: "
                             f"{err}") from None
    config.compile_dynamic = dynamic
    config.compile_fullgraph = bool(config.compile_fullgraph)
    config.compile_mode = None if str(config.compile_mode).lower() in ("none", "", "default") else config.compile_mode


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
    from torch._inductor.codegen.common import (  # private: inductor's device registry (no public API)
        get_scheduling_for_device, init_backend_registration)

    init_backend_registration()
    if get_scheduling_for_device(device_type) is None:
        return (f"inductor has no code generator for device '{device_type}' in this torch build"
                + (" (torch_npu registers none)" if device_type == "npu" else ""))
    if device_type == "cpu":
        from torch._inductor import cpp_builder     # private: the compiler inductor will call (no public API)

        try:
            compiler = cpp_builder.get_cpp_compiler()
        except Exception:       # noqa: BLE001 - torch raises several kinds when no compiler is set up
            compiler = None
        if not compiler or not shutil.which(compiler):
            return "inductor needs a C++ compiler on CPU and none was found (install g++, or set CXX)"
    if device_type == "cuda":
        from torch.utils._triton import has_triton  # private: torch's own triton probe (no public API)

        if not has_triton():
            return "inductor needs triton on CUDA and it is not installed (pip install triton)"
    return None


def check_backend(config, device_type: str, parallel=None) -> None:
    """One clear error, before any collective, when the compile settings cannot work here: a backend
    unknown to torch or unable to generate code for this device, CUDA graphs (FSDP2 frees and re-gathers
    the parameters a graph would capture), or ``fullgraph`` where tensor/expert parallelism must break
    the graph (`compile_blocks`)."""
    if not config.compile:
        return
    import torch        # here, not at the top: the config layer stays importable without torch

    backend = config.compile_backend
    if backend not in torch.compiler.list_backends(exclude_tags=()):
        usual = sorted({*torch.compiler.list_backends(), "aot_eager", "eager"})
        raise ValueError(f"FSDPConfig.compile_backend={backend!r} is not a torch.compile backend here. Fix: "
                         f"use one of {', '.join(usual)} ('aot_eager' keeps eager numerics), or compile=false.")
    problem = _inductor_problem(device_type) if backend == "inductor" else None
    if problem:
        raise RuntimeError(f"FSDPConfig.compile: {problem}. Fix: set compile_backend='aot_eager' (graph capture "
                           "without code generation) or compile=false to train eager.")
    if config.compile_mode not in MODES:
        raise ValueError(f"FSDPConfig.compile_mode={config.compile_mode!r} is not a torch.compile mode; choose "
                         f"one of {', '.join(MODES[1:])}. Fix: FSDPConfig.compile_mode='default'.")
    if config.compile_mode in CUDA_GRAPH_MODES or backend == "cudagraphs":
        raise ValueError(f"FSDPConfig.compile: CUDA graphs ({backend}, mode {config.compile_mode!r}) cannot "
                         "capture a block whose parameters FSDP2 frees and re-gathers every step. Fix: "
                         "compile_mode='max-autotune-no-cudagraphs' or 'default'.")
    split = [name for name in ("tp_size", "ep_size") if getattr(parallel, name, 1) > 1]
    if config.compile_fullgraph and split:
        raise ValueError(f"FSDPConfig.compile_fullgraph=True with {' and '.join(split)} > 1: the tensor/expert-"
                         "parallel layers run eagerly between compiled pieces, so a block is not one graph. "
                         "Fix: compile_fullgraph=false.")
