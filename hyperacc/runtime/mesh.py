"""The DeviceMeshes of a job and their named dimensions.

Dense mesh, outermost first: ``dp_replicate`` (HSDP replicas), ``dp_shard`` (FSDP shards), ``cp``
(context parallel), ``tp`` (tensor parallel). Data parallelism spans replicate x shard; the ranks of
one ``tp`` group see the same tokens, the ranks of one ``cp`` group the same samples but each its own
piece of every sequence. FSDP shards dense parameters over dp_shard x cp (flattened into one mesh
dimension, ``dp_shard_cp``): cp ranks hold different tokens, so their gradients are reduced like
data-parallel ones.

Expert mesh (only when ``ep_size > 1``): ``dp_replicate`` x ``efsdp`` x ``ep`` over the same ranks in
the same row-major order, efsdp = dp_shard*cp*tp / ep. Each MoE layer's experts are split whole over
``ep`` and FSDP-sharded over ``efsdp`` (x ``dp_replicate`` for HSDP); everything else lives on the
dense mesh. Both are built once, here.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hyperacc.config import ParallelConfig

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")
EXPERT_MESH_DIMS = ("dp_replicate", "efsdp", "ep")


@dataclasses.dataclass(frozen=True)
class MeshInfo:
    """The meshes plus this rank's data-parallel coordinates."""

    mesh: DeviceMesh
    parallel: ParallelConfig          # resolved: no -1 left
    expert_mesh: Optional[DeviceMesh] = None
    shard_cp_mesh: Optional[DeviceMesh] = None   # dp_shard x cp flattened (cp_size > 1)

    @property
    def dp_size(self) -> int:
        return self.parallel.dp_replicate_size * self.parallel.dp_shard_size

    @property
    def dp_rank(self) -> int:
        replica = self.mesh.get_local_rank("dp_replicate")
        shard = self.mesh.get_local_rank("dp_shard")
        return replica * self.parallel.dp_shard_size + shard

    @property
    def same_tokens(self) -> int:
        """How many ranks hold each token (the tp peers; cp peers hold different pieces)."""
        return self.parallel.tp_size

    @property
    def same_samples(self) -> int:
        """How many ranks hold (a piece of) each sample: the cp x tp peers of a data-parallel rank."""
        return self.parallel.tp_size * self.parallel.cp_size

    @property
    def grad_ranks(self) -> int:
        """The ranks FSDP reduces dense gradients over (dp x cp): what each loss is scaled by."""
        return self.dp_size * self.parallel.cp_size

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh `fully_shard` gets for dense modules: 1-D for FSDP (dp_shard, or dp_shard x cp
        flattened), 2-D (replicate, shard) for HSDP."""
        shard = "dp_shard_cp" if self.shard_cp_mesh is not None else "dp_shard"
        if self.parallel.dp_replicate_size > 1:
            return self.mesh["dp_replicate", shard]
        return self.mesh[shard]

    @property
    def cp_mesh(self) -> DeviceMesh:
        return self.mesh["cp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def ep_mesh(self) -> DeviceMesh:
        if self.expert_mesh is None:
            raise RuntimeError("This job has no expert mesh (ep_size=1).")
        return self.expert_mesh["ep"]

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh:
        """The mesh `fully_shard` gets for expert modules: efsdp, or (replicate, efsdp) for HSDP."""
        if self.expert_mesh is None:
            raise RuntimeError("This job has no expert mesh (ep_size=1).")
        if self.parallel.dp_replicate_size > 1:
            return self.expert_mesh["dp_replicate", "efsdp"]
        return self.expert_mesh["efsdp"]


def check_supported(parallel: ParallelConfig) -> None:
    """Raise for dimensions the mesh can describe but hyperacc cannot train with yet (none today:
    every size that `ParallelConfig.resolved` accepts is supported)."""


def build_mesh(parallel: ParallelConfig, world_size: int, device_type: str) -> MeshInfo:
    """Validate the sizes against the world, then create the meshes (collectives)."""
    resolved = parallel.resolved(world_size)
    check_supported(resolved)
    shape = (resolved.dp_replicate_size, resolved.dp_shard_size, resolved.cp_size, resolved.tp_size)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    shard_cp = None
    if resolved.cp_size > 1:
        # No public API flattens mesh dimensions yet (torch 2.13); `_flatten` keeps the result a
        # dimension of the root mesh, which FSDP2 + TP need (2-D DTensors on one mesh).
        shard_cp = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    expert_mesh = None
    if resolved.ep_size > 1:
        expert_shape = (resolved.dp_replicate_size, resolved.efsdp_size, resolved.ep_size)
        expert_mesh = init_device_mesh(device_type, expert_shape, mesh_dim_names=EXPERT_MESH_DIMS)
    return MeshInfo(mesh=mesh, parallel=resolved, expert_mesh=expert_mesh, shard_cp_mesh=shard_cp)
