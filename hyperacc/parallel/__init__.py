"""Tensor, expert and context parallelism on the job's meshes, applied before FSDP2 (see tensor.py,
expert.py, context.py)."""
from __future__ import annotations

from typing import List

import torch.nn as nn

from hyperacc.config import ParallelConfig
from hyperacc.parallel.context import apply_context_parallel, check_context_parallel
from hyperacc.parallel.expert import (apply_expert_parallel, check_expert_parallel, expert_parallel_plan,
                                      set_expert_gradient_reduction)
from hyperacc.parallel.norm import group_by_mesh, total_norm
from hyperacc.parallel.tensor import apply_tensor_parallel, check_tensor_parallel, tensor_parallel_plan

__all__ = ["check_model", "group_by_mesh", "parallelize", "set_expert_gradient_reduction", "total_norm"]


def check_model(model: nn.Module, parallel: ParallelConfig) -> None:
    """Every model-dependent check of the parallel sizes; raises before any collective."""
    from hyperacc.integrations.peft import check_layout

    check_layout(model, parallel.tp_size, parallel.ep_size)     # PEFT adapters: FSDP/HSDP only
    check_tensor_parallel(model, parallel.tp_size)
    check_expert_parallel(model, parallel.ep_size)
    check_context_parallel(model, parallel.cp_size, parallel.tp_size)


def parallelize(model: nn.Module, mesh_info) -> List[nn.Module]:
    """Apply TP and EP to a (meta-device or real) model in place; returns the experts modules that
    must become FSDP units on the expert mesh (none without EP)."""
    parallel = mesh_info.parallel
    check_model(model, parallel)
    ep_plan = expert_parallel_plan(model, parallel.ep_size)
    if parallel.tp_size > 1:
        apply_tensor_parallel(model, mesh_info.tp_mesh, tensor_parallel_plan(model, ep_plan))
    if parallel.cp_size > 1:
        apply_context_parallel(model, mesh_info.cp_mesh)
    if not ep_plan:
        return []
    return apply_expert_parallel(model, mesh_info.ep_mesh, mesh_info.tp_mesh, ep_plan)
