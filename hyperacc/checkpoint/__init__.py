"""Six-bucket checkpointing on torch.distributed.checkpoint (see docs/guides/checkpoints.md).

state (what: a dict of Stateful buckets), manager (the storage layer around it: policy, storage, discovery,
lifecycle, integrity, lock), rng, export (HF).
"""
from hyperacc.checkpoint.manager import Checkpointer
from hyperacc.checkpoint.state import TrainState

__all__ = ["Checkpointer", "TrainState"]
