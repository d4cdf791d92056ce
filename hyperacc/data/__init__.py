"""Data: the stateful micro-batch loader, collators, text pipeline and Megatron format."""
__all__ = ["MicroBatchDataLoader"]


def __getattr__(name):
    if name == "MicroBatchDataLoader":
        from hyperacc.data.loader import MicroBatchDataLoader
        return MicroBatchDataLoader
    raise AttributeError(f"module 'hyperacc.data' has no attribute {name!r}")
