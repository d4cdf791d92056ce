"""Where checkpoints live and which one "LATEST" means.

Layout: ``<checkpoint_dir>/global_step_<N>/`` per save, ``.metadata`` inside it (written last by
DCP) marks it complete, and ``<checkpoint_dir>/latest_checkpoint_iteration.txt`` holds one integer,
the newest complete step, replaced atomically after the save finished.
"""
from __future__ import annotations

import os
import re
import warnings
from typing import List, Optional, Tuple

from hyperacc.checkpoint import containment
from hyperacc.errors import ForeignCheckpointError  # noqa: F401 - defined with every error class

POINTER_FILE = "latest_checkpoint_iteration.txt"
METADATA_FILE = ".metadata"
STEP_DIR_RE = re.compile(r"^global_step_(\d+)$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{int(step)}")


def is_complete(path: str) -> bool:
    """A checkpoint directory is complete once DCP wrote its ``.metadata`` (its last file)."""
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def step_of(path: str) -> Optional[int]:
    match = STEP_DIR_RE.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def read_pointer(root: str) -> Optional[int]:
    path = os.path.join(root, POINTER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        text = handle.read().strip()
    try:
        return int(text)
    except ValueError:
        warnings.warn(f"{path} does not hold one integer ({text[:40]!r}); ignoring it and scanning "
                      f"{root} for complete checkpoints instead.", stacklevel=2)
        return None


def write_pointer(root: str, step: int) -> None:
    """Atomically replace the LATEST pointer: temp file, fsync, rename, fsync the directory."""
    containment.atomic_write(os.path.join(root, POINTER_FILE), f"{int(step)}\n")


def scan(root: str, *, warn_incomplete: bool = False) -> List[Tuple[int, str]]:
    """Complete ``global_step_<N>`` directories under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = STEP_DIR_RE.match(name)
        path = os.path.join(root, name)
        if not match or not os.path.isdir(path):
            continue
        if is_complete(path):
            found.append((int(match.group(1)), path))
        elif warn_incomplete:
            warnings.warn(f"Skipping incomplete checkpoint {path} (no {METADATA_FILE}: its save did not "
                          "finish).", stacklevel=3)
    return sorted(found)


def find_latest(root: str) -> Optional[str]:
    """The checkpoint "LATEST" names: the pointer's, else the newest complete directory, else None."""
    if not os.path.isdir(root):
        return None
    step = read_pointer(root)
    if step is not None:
        path = step_dir(root, step)
        if is_complete(path):
            return path
        warnings.warn(f"{os.path.join(root, POINTER_FILE)} names step {step} but {path} is missing or "
                      "incomplete; using the newest complete checkpoint instead.", stacklevel=2)
    complete = scan(root, warn_incomplete=True)
    return complete[-1][1] if complete else None


def resolve_source(source: str, checkpoint_dir: str) -> Optional[str]:
    """Turn ``"LATEST"`` or a path into a complete checkpoint directory.

    "LATEST" with nothing to resume from warns and returns None (fresh start). A path that does not
    exist, or a step directory whose save did not finish, raises FileNotFoundError. A path that is
    a checkpoint root (holds the pointer or step directories) means the LATEST one inside it.
    """
    if source == "LATEST":
        if os.path.lexists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
            raise NotADirectoryError(f"LATEST (CheckpointConfig.restore_from / load_state) looks in "
                                     f"CheckpointConfig.checkpoint_dir={checkpoint_dir!r}, which is a file, not a "
                                     "checkpoint directory. Fix: CheckpointConfig.checkpoint_dir=<the directory the "
                                     "run saved into>.")
        found = find_latest(checkpoint_dir)
        if found is None:
            warnings.warn(f"LATEST (CheckpointConfig.restore_from / load_state) but {checkpoint_dir!r} holds no complete checkpoint: "
                          "starting from scratch.", stacklevel=2)
        return found
    path = os.fspath(source)
    if os.path.isfile(path):
        raise NotADirectoryError(f"{path!r} is a file, not a checkpoint: pass the global_step_<N> directory that "
                                 f"holds it ({os.path.dirname(os.path.abspath(path))!r}), a checkpoint root, or 'LATEST'. "
                                 "Fix: CheckpointConfig.restore_from=<that directory> (load_state's source).")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Checkpoint directory {path!r} does not exist (CheckpointConfig.restore_from "
                                "/ load_state source). Fix: pass an existing global_step_<N> directory, a "
                                "checkpoint root, or 'LATEST'.")
    if is_complete(path):
        return path
    if os.path.isfile(os.path.join(path, POINTER_FILE)) or scan(path):
        found = find_latest(path)
        if found is not None:
            return found
    foreign = foreign_format(path)
    if foreign is not None:
        raise ForeignCheckpointError(
            f"{foreign_text(path, foreign)} (no {METADATA_FILE}, no global_step_<N> directory): hyperacc cannot "
            f"restore its optimizer, data position and RNG exactly and will not guess. Fix: resume it with the tool "
            f"that wrote it, or {weights_fix(path)}.")
    raise FileNotFoundError(f"{path!r} is not a complete checkpoint: it has no {METADATA_FILE} (the save "
                            "that wrote it did not finish) and holds no complete global_step_<N> "
                            "directory. Fix: CheckpointConfig.restore_from=<a complete global_step_<N> directory or "
                            "a checkpoint root> (load_state's source), or 'LATEST'.")


# Names that say who wrote a directory that is not a hyperacc checkpoint (accelerate's `save_state`:
# accelerate.utils.constants and its FSDP helpers; transformers' `Trainer`: trainer_state.json).
_TRAINER_FILES = ("trainer_state.json",)
_ACCELERATE_NAMES = re.compile(r"^(random_states_\d+\.pkl|(optimizer|scheduler|sampler)(_\d+)?\.bin|scaler\.pt"
                               r"|pytorch_model_fsdp(_\d+)?(\.bin)?|optimizer_\d+|dl_state_dict(_\d+)?\.bin)$")
_WEIGHT_NAMES = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
_OWN_NAMES = ("hyperacc_checkpoint.json", "extra_state")     # written before DCP's files (an unfinished save)


def foreign_format(path: str) -> Optional[str]:
    """What wrote ``path`` when it is another tool's checkpoint or model (None: hyperacc's, or none)."""
    names = set(os.listdir(path)) if os.path.isdir(path) else set()
    if names & set(_OWN_NAMES) or any(name.endswith(".distcp") for name in names):
        return None         # hyperacc's own (an unfinished save of the Trainer integration holds trainer_state.json too)
    if names & set(_TRAINER_FILES):
        return "a checkpoint written by transformers' Trainer on plain accelerate (trainer_state.json)"
    if any(_ACCELERATE_NAMES.match(name) for name in names):
        return "a checkpoint written by accelerate's save_state"
    if any(_WEIGHT_NAMES.match(name) for name in names):
        if "config.json" in names:
            return "a Hugging Face model directory (config.json and weights, as save_pretrained writes)"
        return "a checkpoint written by accelerate's save_state (model weights without config.json)"
    return None


def foreign_text(path: str, foreign: str) -> str:
    """The words `load_state` and `save_state` both use for another tool's checkpoint."""
    return f"{path!r} is {foreign}, not a hyperacc checkpoint"


def weights_fix(path: str) -> str:
    """How to start a hyperacc run from the weights in ``path`` (another tool's checkpoint), in a way that
    works there: directly when it is a Hugging Face model directory, else through accelerate's own loader."""
    names = set(os.listdir(path)) if os.path.isdir(path) else set()
    if "config.json" in names and any(_WEIGHT_NAMES.match(name) for name in names):
        return f"start a new hyperacc run from its weights: hyperacc.models.load_pretrained({path!r})"
    return ("export its weights with accelerate's own loader (prepare the same model and optimizer with "
            f"accelerate.Accelerator, accelerator.load_state({path!r}), then "
            "accelerator.unwrap_model(model).save_pretrained(DIR, state_dict=accelerator.get_state_dict(model))) "
            "and start a new hyperacc run from them: hyperacc.models.load_pretrained(DIR)")


def latest_candidates(root: str) -> List[str]:
    """What "LATEST" may fall back to, best first: the pointer's checkpoint, then every complete
    checkpoint older than it, newest first (the newest complete one leads when there is no pointer)."""
    pointed = read_pointer(root) if os.path.isdir(root) else None
    if pointed is not None and is_complete(step_dir(root, pointed)):
        return [step_dir(root, pointed)] + [p for s, p in reversed(scan(root)) if s < pointed]
    if pointed is not None:
        warnings.warn(f"{os.path.join(root, POINTER_FILE)} names step {pointed} but {step_dir(root, pointed)} is "
                      "missing or incomplete; using the newest complete checkpoint instead.", stacklevel=2)
    return [p for _, p in reversed(scan(root, warn_incomplete=True))]


def remove_checkpoint(path: str) -> bool:
    """Delete one checkpoint directory hyperacc wrote; a symlinked one is foreign and left alone
    (returns False). The completeness marker goes first (a crash leaves it incomplete)."""
    return containment.remove_tree(path)
