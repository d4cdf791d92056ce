"""The checkpoint directory's lifecycle: what a run may do with the checkpoints it finds there.

One run owns a ``checkpoint_dir`` at a time (``lock.py``), and every ``global_step_<N>`` in it must
belong to that run's one history, so that LATEST always names a complete, verified checkpoint of
this run. The states, and what each kind of run does in each:

================  =========================  =======================================================
directory holds   fresh run (no restore)     resume (``restore_from`` = LATEST or a step in it)
================  =========================  =======================================================
nothing           saves                      LATEST: starts fresh (warning); a path: refused
checkpoints       refused at its first step  restores step S (LATEST falls back past damaged
                  (the example: before       steps to the newest that verifies); then, if it may
                  anything is built): resume save, every complete step directory newer than S
                  it, or use another         is set aside (renamed, never deleted) and LATEST
                  checkpoint_dir             names S
================  =========================  =======================================================

Setting aside renames ``global_step_<N>`` to ``global_step_<N>.damaged-<time>`` (a damaged step
LATEST skipped: kept for inspection, and step N is saved anew when training reaches it) or
``global_step_<N>.superseded-<time>`` (a complete step of the branch a resume from an older step
abandons). Such names are not step directories: LATEST, resume and ``keep_last_n`` ignore them.
An interrupted save (a step directory without ``.metadata``) is not a checkpoint: it stays, and is
written over when training reaches its step. A resume from a checkpoint outside ``checkpoint_dir``
into a directory that holds checkpoints is a fresh run there, and refused the same way. A save
then always finds its directory absent or incomplete; finding a complete one is a broken invariant
and an error, never a silent skip.
"""
from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Iterable, List, Optional

from hyperacc.checkpoint import containment, discovery
from hyperacc.errors import CheckpointDirInUse  # noqa: F401 - defined with every error class

logger = logging.getLogger("hyperacc.checkpoint")


def manages(root: str, path: str) -> bool:
    """Whether ``path`` is a step directory of ``root`` (the layout the lifecycle governs): a
    ``global_step_<N>`` directly in it. Other names there (accelerate's ``checkpoint_<i>`` when
    ``root`` is ``<project_dir>/checkpoints``, an explicit ``save_state`` name) are written as they are."""
    return os.path.dirname(os.path.abspath(path)) == os.path.abspath(root) and discovery.step_of(path) is not None


def refuse_foreign_history(root: str, source: Optional[str] = None) -> None:
    """Before a run saves into ``root`` without having resumed from it: refuse when ``root`` already
    holds complete checkpoints (another run's). ``source``: the checkpoint restored, if any."""
    steps = [step for step, _ in discovery.scan(root)]
    if not steps:
        return
    where = (f"this run restored {source}, which is not in it" if source else "this run did not resume from them")
    raise CheckpointDirInUse(
        f"checkpoint_dir {os.path.abspath(root)} already holds checkpoints of another run (steps "
        f"{_steps_text(steps)}) and {where}: its saves would mix with them. Fix: resume that run "
        "(CheckpointConfig.restore_from='LATEST', or load_state('LATEST')), or use another "
        "CheckpointConfig.checkpoint_dir.")


def settle_after_resume(root: str, step: int, damaged: Iterable[str] = ()) -> List[str]:
    """Rank 0, after a verified resume from ``global_step_<step>`` of ``root`` by a run that saves:
    set aside the damaged checkpoints LATEST skipped and every step directory newer than ``step``,
    then point LATEST at ``step``. Returns one line per directory set aside (for a warning)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    damaged = {os.path.abspath(p) for p in damaged}
    lines = []
    for newer_step, path in discovery.scan(root):       # complete ones: an interrupted save is written over
        if newer_step <= step:
            continue
        reason = "damaged" if os.path.abspath(path) in damaged else "superseded"
        if containment.is_foreign(path):
            raise CheckpointDirInUse(
                f"{path} is a symlink (a checkpoint hyperacc did not write) newer than the step {step} this run "
                "resumes from: it would mix into this run's history, and hyperacc never moves what it does not "
                "own. Fix: remove the link, or resume from it (CheckpointConfig.restore_from='LATEST', or "
                "load_state('LATEST')).")
        target = _free_name(f"{path}.{reason}-{stamp}")
        os.rename(path, target)
        lines.append(f"{os.path.basename(path)} -> {os.path.basename(target)}"
                     + (" (failed verification)" if reason == "damaged" else " (newer than the step resumed from)"))
    if discovery.read_pointer(root) != step:
        discovery.write_pointer(root, step)
    return lines


def _free_name(path: str) -> str:
    candidate, n = path, 1
    while os.path.lexists(candidate):
        n += 1
        candidate = f"{path}.{n}"
    return candidate


def _steps_text(steps: List[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}, {steps[1]}, ..., {steps[-1]}"


def after_save(root: str, path: str, step: int, keep: int, *, protect=(), warned: Optional[set] = None) -> None:
    """Rank 0, once the save of ``path`` (step ``step``) is complete: move LATEST to it, then keep the
    newest ``keep`` complete checkpoints (0: all). ``protect``: never removed (an in-flight save).
    Symlinked (foreign) checkpoints are left alone, with one warning each (``warned`` remembers)."""
    root = os.path.abspath(root)
    if os.path.dirname(os.path.abspath(path)) != root or discovery.step_of(path) != step:
        return  # an explicit output_dir outside the managed layout: no pointer, no retention
    discovery.write_pointer(root, step)
    if keep <= 0:
        return
    protected = {os.path.abspath(p) for p in (path, *protect) if p}
    protected.add(discovery.step_dir(root, step))
    warned = set() if warned is None else warned
    for _, old in discovery.scan(root)[:-keep]:
        if os.path.abspath(old) in protected:
            continue
        if containment.is_foreign(old):
            if old not in warned:
                warned.add(old)
                warnings.warn(f"keep_last_n={keep}: {old} is a symlink (a checkpoint hyperacc did not write): it is "
                              "left alone, not deleted.", stacklevel=2)
            continue
        discovery.remove_checkpoint(old)
        logger.info("keep_last_n=%d: removed %s", keep, old)


def check_start(root: str, restore_from: Optional[str], save_ckpt: bool) -> Optional[str]:
    """Before anything is built (on every rank, no collective): the checkpoint a resume would restore
    (not yet verified), or None for a fresh start. Raises FileNotFoundError for a ``restore_from`` that
    names no checkpoint, and :class:`CheckpointDirInUse` when a run that saves would mix its steps
    with another run's in ``root``. Reads only; writes nothing."""
    source = None
    if restore_from is not None:
        with warnings.catch_warnings():     # "LATEST" in an empty directory: the load warns once, later
            warnings.simplefilter("ignore")
            source = discovery.resolve_source(restore_from, root)
    if save_ckpt and (source is None or not manages(root, source)):
        refuse_foreign_history(root, source)
    return source
