"""Tensor, expert and context parallelism on the job's meshes, applied before FSDP2 (see tensor.py,
expert.py, context.py). The order they are applied in is `hyperacc.sharding.parallelize`'s."""
from __future__ import annotations

import torch.nn as nn

from hyperacc.config import ParallelConfig
from hyperacc.parallel.context import apply_context_parallel, check_context_parallel
from hyperacc.parallel.expert import (apply_expert_parallel, check_expert_parallel, expert_parallel_plan,
                                      set_expert_gradient_reduction)
from hyperacc.parallel.norm import group_by_mesh, total_norm
from hyperacc.parallel.tensor import apply_tensor_parallel, check_tensor_parallel, tensor_parallel_plan

__all__ = ["apply_context_parallel", "apply_expert_parallel", "apply_tensor_parallel", "check_model",
           "expert_parallel_plan", "group_by_mesh", "set_expert_gradient_reduction", "tensor_parallel_plan",
           "total_norm"]


def check_model(model: nn.Module, parallel: ParallelConfig) -> None:
    """Every check of the parallel sizes against the model's architecture (heads, experts, plans);
    raises before any collective. What a model kind refuses on top (PEFT adapters under TP/EP) is the
    kind's `check_layout`; `hyperacc.sharding.parallelize.check_model` runs both, once per prepare."""
    check_tensor_parallel(model, parallel.tp_size)
    check_expert_parallel(model, parallel.ep_size)
    check_context_parallel(model, parallel.cp_size, parallel.tp_size)
