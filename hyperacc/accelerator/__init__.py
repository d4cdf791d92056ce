"""Layer 6, the face: `Accelerator` (accelerate-compatible), its checkpoint half and the translation of accelerate's constructor arguments."""
from hyperacc.accelerator.facade import (  # noqa: F401 - the package's public names
    DEFAULT_SEED,
    Accelerator,
    NOT_SUPPORTED,
    prepare,
)
