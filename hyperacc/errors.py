"""Every error class hyperacc raises, in one place, lowest layer first.

Why one module: scripts catch these by type (the example turns each into one ``config error:`` line),
and a catch should not have to know which of a dozen modules a class lives in. Why at the lowest layer:
any layer may raise them and every layer may import this one.

Errors marked ``@forwarded`` keep their class when a decision taken on rank 0 is re-raised on every
rank (`hyperacc.checkpoint._comm.decide_on_rank0`): callers catch them by type on every rank alike.
"""
from __future__ import annotations

_FORWARDED: dict = {}      # hyperacc's own error classes, re-raised as themselves on every rank


def forwarded(cls):
    """Class decorator: an error of this class raised on rank 0 by `decide_on_rank0` is raised as the
    same class on every rank (callers catch it by type, e.g. the example's one-line config errors)."""
    _FORWARDED[cls.__name__] = cls
    return cls


# ------------------------------------------------------------ raised by hyperacc.config.components
class ConfigError(ValueError):
    """A configuration problem found while parsing (before any training work starts)."""


# ------------------------------------------------------------ raised by hyperacc.runtime.watchdog
class CollectiveTimeout(RuntimeError):
    """A collective timed out; the message names the step and the silent rank(s)."""


# ------------------------------------------------------------ raised by hyperacc.weights.files
class WeightsError(ValueError):
    """The weights do not fit the model (or cannot be read): one line naming the key or file."""


# ------------------------------------------------------------ raised by hyperacc.data.megatron
class IndexedDatasetError(ValueError):
    """A ``.bin``/``.idx`` pair is missing, truncated, foreign or inconsistent."""


# ------------------------------------------------------------ raised by hyperacc.data.loader
class DataResumeMismatch(ValueError):
    """The data or global batch size differs from the checkpoint's (``resume_mismatch='error'``): its
    own class, so that a script reports it as the configuration problem it is, not as a crash."""


# ------------------------------------------------------------ raised by hyperacc.data.streaming
class StreamRowError(ValueError):
    """A streamed record could not be made into samples (``bad_rows='error'``): the message names its
    position in the stream, so that it can be found and fixed, or skipped with ``bad_rows='skip'``."""


# ------------------------------------------------------------ raised by hyperacc.training.accumulation
class TokenIdError(ValueError):
    """A batch holds token ids outside the model's vocabulary (raised on every rank, before the forward)."""


# ------------------------------------------------------------ raised by hyperacc.training.step_checks
class NonFiniteError(FloatingPointError):
    """A loss or gradient norm became NaN/Inf at ``step``: nothing from it on is saved."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class DisagreementError(RuntimeError):
    """Values that must be identical on every rank differ (validate mode)."""


# ------------------------------------------------------------ raised by hyperacc.training.replica_guard
class ReplicaMismatchError(RuntimeError):
    """Copies of state that must be identical on several ranks differ."""


# ------------------------------------------------------------ raised by hyperacc.checkpoint.lock
@forwarded
class CheckpointDirLocked(RuntimeError):
    """Another job holds the checkpoint directory."""


@forwarded
class CheckpointDirNotShared(RuntimeError):
    """A rank does not see the checkpoint directory rank 0 writes (another node's local disk), or
    uses another one; raised on every rank alike."""


# ------------------------------------------------------------ raised by hyperacc.checkpoint.lifecycle
@forwarded
class CheckpointDirInUse(RuntimeError):
    """The run would mix its checkpoints with those of another run in one checkpoint_dir."""


# ------------------------------------------------------------ raised by hyperacc.checkpoint.discovery
@forwarded
class ForeignCheckpointError(ValueError):
    """A directory holds another tool's checkpoint (accelerate's, transformers' Trainer's, a Hugging Face
    model): `load_state` cannot restore it exactly and `save_state` never writes into it."""


# ------------------------------------------------------------ raised by hyperacc.checkpoint.integrity
@forwarded
class IntegrityError(RuntimeError):
    """A checkpoint's files do not match its manifest (or the manifest is missing/unreadable)."""


# ------------------------------------------------------------ raised by hyperacc.checkpoint.storage
@forwarded
class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file holds something other than tensors and plain values."""


# ------------------------------------------------------------ raised by hyperacc.checkpoint.containment
@forwarded
class ForeignPathError(RuntimeError):
    """hyperacc was about to write into or delete something it does not own (a symlink)."""


# ------------------------------------------------------------ raised by hyperacc.checkpoint.convert
class ConvertError(ValueError):
    """Bad input for the converter: one line naming the problem and the fix."""
