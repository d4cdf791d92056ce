"""The one DeviceMesh of a job and its named dimensions.

Dimension order, outermost first: ``dp_replicate`` (HSDP replicas), ``dp_shard`` (FSDP shards),
``cp`` (context parallel), ``tp`` (tensor parallel). Data parallelism spans replicate x shard.
"""
from __future__ import annotations

import dataclasses

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hyperacc.config import ParallelConfig

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclasses.dataclass(frozen=True)
class MeshInfo:
    """The mesh plus this rank's data-parallel coordinates."""

    mesh: DeviceMesh
    parallel: ParallelConfig          # resolved: no -1 left

    @property
    def dp_size(self) -> int:
        return self.parallel.dp_replicate_size * self.parallel.dp_shard_size

    @property
    def dp_rank(self) -> int:
        replica = self.mesh.get_local_rank("dp_replicate")
        shard = self.mesh.get_local_rank("dp_shard")
        return replica * self.parallel.dp_shard_size + shard

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh `fully_shard` gets: 1-D for FSDP, 2-D (replicate, shard) for HSDP."""
        if self.parallel.dp_replicate_size > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]


def check_supported(parallel: ParallelConfig) -> None:
    """Raise for dimensions the mesh can describe but hyperacc cannot train with yet."""
    for name in ("tp_size", "cp_size"):
        if getattr(parallel, name) > 1:
            raise NotImplementedError(
                f"ParallelConfig.{name}={getattr(parallel, name)}: tensor and context parallelism are "
                f"not supported yet. Set {name}=1 and use dp_replicate_size/dp_shard_size.")


def build_mesh(parallel: ParallelConfig, world_size: int, device_type: str) -> MeshInfo:
    """Validate the sizes against the world, then create the mesh (a collective)."""
    resolved = parallel.resolved(world_size)
    check_supported(resolved)
    shape = (resolved.dp_replicate_size, resolved.dp_shard_size, resolved.cp_size, resolved.tp_size)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
    return MeshInfo(mesh=mesh, parallel=resolved)
