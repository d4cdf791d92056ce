"""Stochastic rounding keyed by what each element is, not by where it happens to live.

Rounding fp32 updates into bf16 stochastically needs random bits. Drawing them from a generator
seeded per shard makes them depend on the layout: two HSDP replicas of one shard would round the
same update differently (the replicas silently diverge), and a run resumed at another world size
would round differently from the uninterrupted one. Here an element's bits are a hash of
(seed, step, parameter name) and its index in the full, unsharded tensor, so

* every copy of an element (HSDP replicas, parameters kept whole on every rank) rounds identically,
* the rounding is independent of the sharding: 1 process and 8 round every element the same way,
* there is no RNG state to checkpoint: a resumed run rounds as the uninterrupted one did.

The hash is an integer mixer (two multiply-xorshift rounds) computed with int64 tensor arithmetic
whose products stay below 2**63 (32-bit values times 31-bit constants): no overflow, so every
device computes the same bits. The global indices of a DTensor's local elements come from
``distribute_tensor`` of a 1-D index vector per tensor dimension with the same placements and
``src_data_rank=None`` (no communication): torch's own sharding rules, uneven and strided shards
included.
"""
from __future__ import annotations

import hashlib
from typing import List, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

__all__ = ["rounding_key", "element_indices", "rounding_noise", "stochastic_round_"]

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


def rounding_noise(key: tuple, indices: torch.Tensor) -> torch.Tensor:
    """16 random bits (int32 in [0, 65536)) for each global element index in ``indices`` (int64)."""
    low, high = indices & _MASK32, indices >> 32
    mixed = _mix32(low ^ key[0])
    mixed = _mix32(mixed ^ high ^ key[1])
    return (mixed & 0xFFFF).to(torch.int32)


def stochastic_round_(target: torch.Tensor, value: torch.Tensor, noise: torch.Tensor) -> None:
    """Write fp32 ``value`` into bf16 ``target``, rounding each element up or down with probability
    proportional to its distance: add 16 random bits (``noise``) below bf16's mantissa, truncate."""
    bits = value.contiguous().view(torch.int32)
    rounded = (bits + noise.view(bits.shape)).bitwise_and_(-65536)   # 0xFFFF0000: sign, exponent, 7 bits
    target.copy_(rounded.view(torch.float32))                         # exact: the low 16 bits are zero


def _dim_positions(tensor: torch.Tensor) -> List[torch.Tensor]:
    """For each dimension, the global positions of this rank's local slices along it."""
    shape = tuple(tensor.shape)
    if not isinstance(tensor, DTensor):
        return [torch.arange(n, device=tensor.device) for n in shape]
    mesh, placements = tensor.device_mesh, tensor.placements
    positions = []
    for dim, size in enumerate(shape):
        along = [_as_1d(p) if isinstance(p, Shard) and p.dim == dim else Replicate() for p in placements]
        vector = distribute_tensor(torch.arange(size, device=mesh.device_type), mesh, along, src_data_rank=None)
        positions.append(vector.to_local())
    local_shape = tuple(tensor.to_local().shape)
    if tuple(len(p) for p in positions) != local_shape:     # torch changed its sharding rules
        raise RuntimeError(f"stochastic rounding: derived a local shape {tuple(len(p) for p in positions)} for "
                           f"placements {placements} of shape {shape}, but the shard is {local_shape}.")
    return positions


def _as_1d(placement: Shard) -> Shard:
    """The same placement (plain or strided) acting on dimension 0 of a 1-D vector."""
    if type(placement) is Shard:
        return Shard(0)
    return type(placement)(0, split_factor=placement.split_factor)    # torch's _StridedShard


def element_indices(tensor: torch.Tensor, start: int = 0, length: int = -1) -> torch.Tensor:
    """Global flat (row-major) indices in the full tensor of the local elements ``start`` ..
    ``start + length`` (flat, row-major positions in this rank's contiguous local tensor)."""
    positions = _dim_positions(tensor)
    global_strides = _row_major_strides(tuple(tensor.shape))
    local_shape = [len(p) for p in positions]
    total = 1
    for n in local_shape:
        total *= n
    length = total - start if length < 0 else length
    device = positions[0].device if positions else tensor.device
    flat = torch.arange(start, start + length, dtype=torch.int64, device=device)
    out = torch.zeros(length, dtype=torch.int64, device=device)
    for dim in reversed(range(len(local_shape))):
        flat, coordinate = flat.div(local_shape[dim], rounding_mode="floor"), flat.remainder(local_shape[dim])
        out += positions[dim][coordinate] * global_strides[dim]
    return out


def _row_major_strides(shape: Sequence[int]) -> List[int]:
    strides, running = [], 1
    for n in reversed(shape):
        strides.append(running)
        running *= n
    return list(reversed(strides))
