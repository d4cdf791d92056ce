"""The RNG bucket: torch CPU, the current accelerator's generator, python ``random``, numpy.

States are stored as tensors and plain Python values only, so they load with
``torch.load(weights_only=True)``. When the topology changed since the save, per-rank streams
cannot be mapped onto the new ranks; they are re-derived from (seed, step, rank) instead.
"""
from __future__ import annotations

import hashlib
import random
from typing import Optional

import numpy as np
import torch

from hyperacc.runtime import device_module


def get_rng_state(device_type: str) -> dict:
    np_state = np.random.get_state()
    state = {
        "torch_cpu": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"name": str(np_state[0]), "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                  "cached_gaussian": float(np_state[4])},
        "device_type": device_type,
    }
    module = device_module(device_type)
    if module is not None:
        state["device"] = module.get_rng_state()
    return state


def set_rng_state(state: dict, device_type: str) -> None:
    torch.set_rng_state(state["torch_cpu"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npy = state["numpy"]
    np.random.set_state((npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    module = device_module(device_type)
    if module is not None and "device" in state and state.get("device_type") == device_type:
        module.set_rng_state(state["device"])


def derived_seed(seed: int, step: int, rank: int) -> int:
    digest = hashlib.sha256(f"hyperacc-rng:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63 - 1)


def rederive_rng(seed: int, step: int, rank: int, device_type: str) -> int:
    """Seed every generator from (seed, step, rank): deterministic, distinct per rank."""
    value = derived_seed(seed, step, rank)
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value % 2**32)
    module = device_module(device_type)
    if module is not None:
        module.manual_seed(value)
    return value


def rng_summary(state: Optional[dict]) -> str:
    return "none" if state is None else ", ".join(sorted(k for k in state if k != "device_type"))
