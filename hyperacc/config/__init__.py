"""Layer 1: the configuration dataclasses, the one reader of the launch environment, `_target_` components and the resolution of compile settings."""
from hyperacc.config.settings import (  # noqa: F401 - the package's public names
    unset,
    default_of,
    resolve,
    ParallelConfig,
    FSDPConfig,
    SAVE_CONSOLIDATED_CHOICES,
    CHECKPOINT_ENV_PREFIX,
    CheckpointConfig,
)
