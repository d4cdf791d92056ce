"""Six-bucket checkpointing on torch.distributed.checkpoint (see README "Checkpoints").

policy (when), storage (DCP and files), discovery (LATEST), buckets (what), rng, export (HF).
"""
from hyperacc.checkpoint.manager import Checkpointer, TrainState

__all__ = ["Checkpointer", "TrainState"]
