"""Stochastic rounding keyed by what each element is, not by where it happens to live.

Rounding fp32 updates into bf16 stochastically needs random bits. Drawing them from a generator
seeded per shard makes them depend on the layout: two HSDP replicas of one shard would round the
same update differently (the replicas silently diverge), and a run resumed at another world size
would round differently from the uninterrupted one. Here an element's bits are a hash of
(seed, step, parameter name) and its index in the full, unsharded tensor, so

* every copy of an element (HSDP replicas, parameters kept whole on every rank) rounds identically,
* the rounding is independent of the sharding: 1 process and 8 round every element the same way,
* there is no RNG state to checkpoint: a resumed run rounds as the uninterrupted one did.

The hash is an integer mixer (multiply-xorshift rounds) computed with int64 tensor arithmetic
whose products stay below 2**63 (32-bit values times 31-bit constants): no overflow, so every
device computes the same bits. The global indices of a DTensor's local elements follow torch's
sharding rules per tensor dimension (torch.chunk per mesh dimension; later mesh dimensions first
for a strided shard, as FSDP2 lays out a TP-sharded dimension), checked against the local shape
and, in the tests, against ``distribute_tensor`` itself. An FSDP shard (whole rows of dim 0) is
one contiguous run of the full tensor: its indices are an offset plus ``arange``.
"""
from __future__ import annotations

import hashlib
from typing import List, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor, Shard

__all__ = ["rounding_key", "dim_positions", "element_indices", "rounding_noise", "stochastic_round_"]

_MASK32 = 0xFFFFFFFF
_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)     # odd, < 2**31: a 32-bit value times one fits in int64


def rounding_key(seed: int, step: int, name: str) -> tuple:
    """Two 32-bit words from (seed, step, parameter name): the per-update part of the hash."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(step)}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xorshift-multiply) on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * _MULTIPLIERS[0]) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MULTIPLIERS[1]) & _MASK32
    return x ^ (x >> 15)


def rounding_noise(key: tuple, indices: torch.Tensor, *, wide: bool = False) -> torch.Tensor:
    """16 random bits (int32 in [0, 65536)) for each global element index in ``indices`` (int64).
    ``wide``: the full tensor has more than 2**32 elements (the high index bits are folded in too;
    decided from the tensor's size, not read from the device)."""
    mixed = indices & _MASK32
    if wide:
        mixed = mixed ^ _mix32((indices >> 32) ^ key[1])
    mixed = _mix32(mixed ^ key[0])
    return (mixed & 0xFFFF).to(torch.int32)


def stochastic_round_(target: torch.Tensor, value: torch.Tensor, noise: torch.Tensor) -> None:
    """Write fp32 ``value`` into bf16 ``target``, rounding each element up or down with probability
    proportional to its distance: add 16 random bits (``noise``) below bf16's mantissa, truncate."""
    bits = value.contiguous().view(torch.int32)
    rounded = (bits + noise.view(bits.shape)).bitwise_and_(-65536)   # 0xFFFF0000: sign, exponent, 7 bits
    target.copy_(rounded.view(torch.float32))                         # exact: the low 16 bits are zero


def dim_positions(tensor: torch.Tensor) -> List[torch.Tensor]:
    """For each dimension, the global positions of this rank's local slices along it (small 1-D
    tensors, on the CPU: reading them never waits for a device)."""
    shape = tuple(tensor.shape)
    if not isinstance(tensor, DTensor):
        return [torch.arange(n) for n in shape]
    mesh, placements = tensor.device_mesh, tensor.placements
    coordinate = mesh.get_coordinate()
    positions = []
    for dim, size in enumerate(shape):
        splits = [(m, p) for m, p in enumerate(placements) if _shards(p, dim)]
        if any(type(p) is not Shard for _, p in splits):
            splits.reverse()        # a strided shard: the later mesh dimensions split the tensor first
        along = torch.arange(size)
        for mesh_dim, _ in splits:  # torch.chunk, as Shard and FSDP2 split (uneven: the last pieces shorter)
            pieces = along.chunk(mesh.size(mesh_dim))
            index = coordinate[mesh_dim]
            along = pieces[index] if index < len(pieces) else along[:0]
        positions.append(along)
    local_shape = tuple(tensor.to_local().shape)
    if tuple(len(p) for p in positions) != local_shape:     # torch changed its sharding rules
        raise RuntimeError(f"stochastic rounding: derived a local shape {tuple(len(p) for p in positions)} for "
                           f"placements {placements} of shape {shape}, but the shard is {local_shape}.")
    return positions


def _shards(placement, dim: int) -> bool:
    """Whether ``placement`` splits tensor dimension ``dim``: Shard, or torch's _StridedShard (which,
    in torch 2.13, is neither a Shard subclass nor says is_shard())."""
    return not placement.is_replicate() and not placement.is_partial() and getattr(placement, "dim", None) == dim


def element_indices(tensor: torch.Tensor, start: int = 0, length: int = -1,
                    positions: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
    """Global flat (row-major) indices in the full tensor of the local elements ``start`` ..
    ``start + length`` (flat, row-major positions in this rank's contiguous local tensor).
    ``positions``: `dim_positions(tensor)`, when the caller asks for several pieces of one tensor."""
    positions = dim_positions(tensor) if positions is None else positions
    global_shape = tuple(tensor.shape)
    global_strides = _row_major_strides(global_shape)
    local_shape = [len(p) for p in positions]
    total = 1
    for n in local_shape:
        total *= n
    length = total - start if length < 0 else length
    device = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).device
    flat = torch.arange(start, start + length, dtype=torch.int64, device=device)
    if all(len(p) == n for p, n in zip(positions[1:], global_shape[1:])):
        # only dim 0 split (FSDP; chunks of chunks are runs of rows): one contiguous run, an offset
        return flat.add_(int(positions[0][0]) * global_strides[0] if positions and total else 0)
    out = torch.zeros(length, dtype=torch.int64, device=device)
    for dim in reversed(range(len(local_shape))):
        flat, coordinate = flat.div(local_shape[dim], rounding_mode="floor"), flat.remainder(local_shape[dim])
        out += positions[dim].to(device)[coordinate] * global_strides[dim]
    return out


def _row_major_strides(shape: Sequence[int]) -> List[int]:
    strides, running = [], 1
    for n in reversed(shape):
        strides.append(running)
        running *= n
    return list(reversed(strides))
