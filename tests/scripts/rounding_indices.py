"""TEST ONLY: hyperacc.precision.rounding.element_indices against torch's own sharding, on real ranks.

    torchrun --nproc_per_node=2|4 rounding_indices.py OUT.json
For shapes (even, uneven, 1-D, 3-D) and placements (Shard on each dim, Replicate, 2-D meshes with
Shard/_StridedShard on one dim), the indices hyperacc derives for each local element must equal the
values torch's distribute_tensor puts there from ``arange(numel).view(shape)`` (the oracle), for the
whole shard and for flat pieces of it. Rank 0 writes the failures (an empty list passes).
"""
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard  # private: the placement FSDP2 + TP create

from hyperacc.precision.rounding import dim_positions, element_indices


def cases(world):
    shapes = [(8, 6), (7, 5), (5,), (3, 7, 4), (1, 9)]
    meshes = [init_device_mesh("cpu", (world,), mesh_dim_names=("a",))]      # built once: few process groups
    if world == 4:
        meshes.append(init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b")))
    for shape in shapes:
        options = [Replicate()] + [Shard(d) for d in range(len(shape))]
        for mesh in meshes:
            if mesh.ndim == 1:
                for placement in options:
                    yield shape, mesh, (placement,)
            else:
                for first in options:
                    for second in options:
                        yield shape, mesh, (first, second)
                if shape[0] % 4 == 0:    # distribute_tensor (the oracle) strides even shards only
                    # what fully_shard makes of a TP-sharded dim: FSDP's shards strided over TP's
                    yield shape, mesh, (_StridedShard(0, split_factor=2), Shard(0))


def main():
    dist.init_process_group("gloo")
    failures = []
    for shape, mesh, placements in cases(dist.get_world_size()):
        numel = 1
        for n in shape:
            numel *= n
        oracle = distribute_tensor(torch.arange(numel).view(shape), mesh, list(placements))
        probe = distribute_tensor(torch.zeros(shape), mesh, list(placements))
        expected = oracle.to_local().reshape(-1)
        got = element_indices(probe)
        positions = dim_positions(probe)
        pieces = [element_indices(probe, s, min(3, expected.numel() - s), positions) for s in range(0, expected.numel(), 3)]
        pieced = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
        if not (torch.equal(got, expected) and torch.equal(pieced, expected)):
            failures.append(f"{shape} {placements} rank {dist.get_rank()}: {got.tolist()[:8]} vs {expected.tolist()[:8]}")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, failures)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as handle:
            json.dump(sum(gathered, []), handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
