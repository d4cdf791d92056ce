"""The DeviceMeshes of a job and their named dimensions.

Dense mesh, outermost first: ``dp_replicate`` (HSDP replicas), ``dp_shard`` (FSDP shards), ``cp``
(context parallel), ``tp`` (tensor parallel). Data parallelism spans replicate x shard; the ranks of
one ``tp`` (and ``cp``) group see the same tokens.

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
        """How many ranks see each token (the cp x tp peers of a data-parallel rank)."""
        return self.parallel.tp_size * self.parallel.cp_size

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh `fully_shard` gets for dense modules: 1-D for FSDP, 2-D (replicate, shard) for HSDP."""
        if self.parallel.dp_replicate_size > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]

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
    """Raise for dimensions the mesh can describe but hyperacc cannot train with yet."""
    if parallel.cp_size > 1:
        raise NotImplementedError(
            f"ParallelConfig.cp_size={parallel.cp_size}: context parallelism is not supported yet. Set "
            "cp_size=1 and use dp_replicate_size/dp_shard_size/tp_size/ep_size.")


def build_mesh(parallel: ParallelConfig, world_size: int, device_type: str) -> MeshInfo:
    """Validate the sizes against the world, then create the meshes (collectives)."""
    resolved = parallel.resolved(world_size)
    check_supported(resolved)
    shape = (resolved.dp_replicate_size, resolved.dp_shard_size, resolved.cp_size, resolved.tp_size)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    expert_mesh = None
    if resolved.ep_size > 1:
        expert_shape = (resolved.dp_replicate_size, resolved.efsdp_size, resolved.ep_size)
        expert_mesh = init_device_mesh(device_type, expert_shape, mesh_dim_names=EXPERT_MESH_DIMS)
    return MeshInfo(mesh=mesh, parallel=resolved, expert_mesh=expert_mesh)
