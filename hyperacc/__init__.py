"""hyperacc: FSDP2 training for LLMs on NPU, CUDA and CPU with an accelerate-shaped API."""
from hyperacc import _moved
from hyperacc import integrations  # noqa: F401 - declares the integrations' model kinds (lazily: hyperacc.kinds)
from hyperacc.config import CheckpointConfig, FSDPConfig, ParallelConfig

_moved.install()      # old module paths (hyperacc.optim, hyperacc.metrics, ...) still import

__version__ = "0.1.0"
__all__ = ["Accelerator", "ParallelConfig", "FSDPConfig", "CheckpointConfig", "MicroBatchDataLoader",
           "StreamingDataLoader", "prepare", "ReplicaGuard", "ReplicaMismatchError"]


def __getattr__(name):
    # Imported lazily so that light modules (config, data.megatron, the convert CLI) do not pull in
    # torch.distributed and transformers.
    if name in ("Accelerator", "prepare"):
        from hyperacc import accelerator
        return getattr(accelerator, name)
    if name == "MicroBatchDataLoader":
        from hyperacc.data.loader import MicroBatchDataLoader
        return MicroBatchDataLoader
    if name == "StreamingDataLoader":
        from hyperacc.data.streaming import StreamingDataLoader
        return StreamingDataLoader
    if name in ("ReplicaGuard", "ReplicaMismatchError"):
        from hyperacc.training import replica_guard
        return getattr(replica_guard, name)
    raise AttributeError(f"module 'hyperacc' has no attribute {name!r}")
