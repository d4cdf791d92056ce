"""`torch.compile` of each transformer block, before FSDP2 shards it.

Why per block, and why in this order: compiling the whole model puts FSDP2's all-gathers, the MoE
router's data-dependent shapes and the loss in one graph that breaks and recompiles (accelerate measured
whole-model compile of Qwen3-30B-A3B 2.4x slower than per-layer). Blocks of one class share one piece
of code, so dynamo compiles it once and every layer reuses it. The block's ``forward`` is replaced in
place -- after TP/EP/CP have hooked the block, before ``fully_shard`` (whose hooks then stay outside the
graph and run eagerly around it) -- which keeps parameter names, and so checkpoint keys and HF exports,
unchanged: a compiled run's checkpoint resumes eager and the other way round. Activation recompute
wraps the compiled forward, not the other way round: dynamo traces a checkpointed region as one
higher-order op that refuses side effects, and the MoE router's logit recording (`hyperacc.training.router_aux`)
is one, so the whole region would fall back to eager.

Settings come from `hyperacc.FSDPConfig` (``compile``, ``compile_backend``, ``compile_mode``,
``compile_fullgraph``, ``compile_dynamic``), which accelerate's ``dynamo_backend``/``TorchDynamoPlugin``
and the ``ACCELERATE_DYNAMO_*`` variables of an ``accelerate launch`` config file also fill. A backend
that cannot run on this device is an error before any collective, never a silent eager run.
"""
from __future__ import annotations

import warnings
from typing import Iterable

import torch
import torch.nn as nn

from hyperacc.config.compile import (  # noqa: F401 - resolution lives with the config; re-exported
    CUDA_GRAPH_MODES, MODES, apply_dynamo_arguments, check_backend, resolve_compile)


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
