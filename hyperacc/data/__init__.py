"""Data: the stateful micro-batch loader, collators, text pipeline and Megatron format."""
from hyperacc.data.loader import MicroBatchDataLoader

__all__ = ["MicroBatchDataLoader"]
