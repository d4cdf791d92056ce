"""hyperacc: FSDP2 training for LLMs on NPU, CUDA and CPU with an accelerate-shaped API."""
from hyperacc.config import CheckpointConfig, FSDPConfig, ParallelConfig
from hyperacc.data.loader import MicroBatchDataLoader
from hyperacc.accelerator import Accelerator, prepare

__version__ = "0.1.0"
__all__ = ["Accelerator", "ParallelConfig", "FSDPConfig", "CheckpointConfig", "MicroBatchDataLoader",
           "prepare"]
