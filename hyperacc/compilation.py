"""`torch.compile` of each transformer block, before FSDP2 shards it.

Why per block, and why in this order: compiling the whole model puts FSDP2's all-gathers, the MoE
router's data-dependent shapes and the loss in one graph that breaks and recompiles (accelerate measured
whole-model compile of Qwen3-30B-A3B 2.4x slower than per-layer). Blocks of one class share one piece
of code, so dynamo compiles it once and every layer reuses it. The block's ``forward`` is replaced in
place -- after TP/EP/CP have hooked the block, before ``fully_shard`` (whose hooks then stay outside the
graph and run eagerly around it) -- which keeps parameter names, and so checkpoint keys and HF exports,
unchanged: a compiled run's checkpoint resumes eager and the other way round. Activation recompute
wraps the compiled forward, not the other way round: dynamo traces a checkpointed region as one
higher-order op that refuses side effects, and the MoE router's logit recording (`hyperacc.router_aux`)
is one, so the whole region would fall back to eager.

Settings come from `hyperacc.FSDPConfig` (``compile``, ``compile_backend``, ``compile_mode``,
``compile_fullgraph``, ``compile_dynamic``), which accelerate's ``dynamo_backend``/``TorchDynamoPlugin``
and the ``ACCELERATE_DYNAMO_*`` variables of an ``accelerate launch`` config file also fill. A backend
that cannot run on this device is an error before any collective, never a silent eager run.
"""
from __future__ import annotations

import dataclasses
import shutil
import warnings
from typing import Iterable, Optional

import torch
import torch.nn as nn

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
    from hyperacc.config import _from_env
    from hyperacc.launch_env import launch_env

    if not explicit:
        named = _backend_name(launch_env().get("ACCELERATE_DYNAMO_BACKEND", "no"))
        config.compile = named not in _OFF
    backend = _backend_name(config.compile_backend)
    config.compile_backend = "inductor" if backend in _OFF else backend
    dynamic = config.compile_dynamic
    if isinstance(dynamic, str):        # from ACCELERATE_DYNAMO_USE_DYNAMIC (None-default fields stay text)
        try:
            dynamic = None if dynamic.strip().lower() in ("", "none", "null") else _from_env(dynamic, False)
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


def check_model(model: nn.Module, config) -> None:
    """A model the user already compiled whole would be compiled twice, FSDP2's hooks and all."""
    from accelerate.utils import is_compiled_module

    if config.compile and is_compiled_module(model):
        raise ValueError("FSDPConfig.compile=True but the model is already torch.compile'd as a whole. Fix: pass "
                         "the uncompiled model (hyperacc compiles each block itself), or compile=false.")


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
    if not blocks:
        raise ValueError("FSDPConfig.compile=True but the model has no transformer block to compile (none of "
                         "FSDPConfig.wrap_classes / _no_split_modules matched). Fix: set wrap_classes to the "
                         "block class name, or compile=false.")
    kwargs = compile_kwargs(config)
    for block in blocks:
        for module in block.modules():
            if _split_over("tp", module) or _split_over("ep", module):
                module.forward = torch.compiler.disable(module.forward)
        block.forward = torch.compile(block.forward, **kwargs)


def _split_over(dim: str, module: nn.Module) -> bool:
    """Whether ``module`` holds parameters sharded over the mesh dimension ``dim`` ("tp", "ep")."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) and dim in (p.device_mesh.mesh_dim_names or ())
               for p in module.parameters(recurse=False))


def compiled_frames() -> int:
    """How many frames dynamo has compiled in this process so far (each recompilation counts once):
    compare it across steps to see recompiles."""
    from torch._dynamo.utils import counters    # private: dynamo's own frame counters (no public API)

    return int(counters["frames"]["ok"])


def recompile_limit_hits() -> int:
    """How many frames dynamo gave up recompiling (its recompile limit reached): they now run eagerly."""
    from torch._dynamo.utils import counters    # private: as in compiled_frames (no public API)

    return int(sum(count for reason, count in counters["unimplemented"].items()
                   if "recompile limit" in str(reason).lower() or "cache_size_limit" in str(reason).lower()))


class CompileWatch:
    """Frames compiled during training, for the step log, and one warning when compiling goes on
    after warm-up: a recompile storm (shapes or Python state that change every step) costs a compile
    per step, and past torch's recompile limit dynamo silently runs the frame eagerly."""

    def __init__(self, enabled: bool, warmup_steps: int = 2, storm_steps: int = 3):
        self.enabled, self.warmup_steps, self.storm_steps = enabled, warmup_steps, storm_steps
        self._start = self._last = compiled_frames() if enabled else 0
        self.after_warmup, self._steps_compiling, self._warned = 0, 0, False

    @property
    def total(self) -> int:
        """Frames compiled since the watch started (training, evaluation, anything else compiled)."""
        return (compiled_frames() if self.enabled else 0) - self._start

    def step(self, step: int) -> dict:
        """Call once per optimizer step; returns ``{"compiles": frames so far}`` (empty when off)."""
        if not self.enabled:
            return {}
        now = compiled_frames()
        new, self._last = now - self._last, now
        if step > self.warmup_steps and new:
            self.after_warmup += new
            self._steps_compiling += 1
            if self._steps_compiling >= self.storm_steps and not self._warned:
                self._warned = True
                warnings.warn(f"torch.compile is still compiling at step {step} ({self.after_warmup} frames since "
                              f"step {self.warmup_steps}, {recompile_limit_hits()} frames gone eager at the "
                              "recompile limit): sequence lengths that change every step recompile unless "
                              "dynamic. Fix: FSDPConfig(compile_dynamic=True), or pad batches to a few lengths "
                              "(pad_collate(..., pad_to_multiple_of=N)).", stacklevel=2)
        return {"compiles": self.total}

    def summary(self) -> str:
        return (f"torch.compile: {self.total} frames compiled, {self.after_warmup} after step {self.warmup_steps}, "
                f"{recompile_limit_hits()} run eagerly at the recompile limit")
