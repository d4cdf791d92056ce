"""The few collectives the checkpoint layer needs, each a no-op in a single process.

Every decision that could make ranks take different branches (does the directory exist, is the
checkpoint complete, which layout does it use) is taken on rank 0 and broadcast, so an error is
raised on every rank at the same point, before any collective that could otherwise hang.
"""
from __future__ import annotations

import builtins
from typing import Callable, Optional

import torch.distributed as dist

from hyperacc.errors import _FORWARDED, forwarded  # noqa: F401 - forwarded: re-exported for old callers


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def barrier(group=None) -> None:
    if distributed():
        dist.barrier(group=group)


def broadcast_object(obj, group=None):
    """Rank 0's ``obj`` on every rank."""
    if not distributed():
        return obj
    box = [obj if rank() == 0 else None]
    if group is None:
        dist.broadcast_object_list(box, src=0)
    else:
        dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def all_gather(obj, group=None) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not distributed():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def all_true(flag: bool, group=None) -> bool:
    """True on every rank when ``flag`` is true on every rank."""
    if not distributed():
        return flag
    flags = [None] * world_size()
    dist.all_gather_object(flags, bool(flag), group=group)
    return all(flags)


_RAISABLE = (FileNotFoundError, FileExistsError, RuntimeError, ValueError, KeyError, TypeError)


def decide_on_rank0(fn: Callable[[], object], group=None):
    """Run ``fn`` on rank 0 only and return its result on every rank.

    An exception raised by ``fn`` is re-raised on every rank (same type for the common built-in
    errors, RuntimeError otherwise) instead of leaving the other ranks waiting in a collective.
    """
    outcome: Optional[tuple] = None
    if rank() == 0:
        try:
            outcome = ("ok", fn())
        except Exception as err:  # noqa: BLE001 - forwarded to every rank below
            outcome = ("error", type(err).__name__, str(err))
            if not distributed():
                raise
    outcome = broadcast_object(outcome, group)
    if outcome[0] == "ok":
        return outcome[1]
    _, type_name, message = outcome
    err_type = _FORWARDED.get(type_name) or getattr(builtins, type_name, None)
    if not (isinstance(err_type, type) and issubclass(err_type, _RAISABLE)):
        err_type = RuntimeError
        message = f"{type_name}: {message}"
    raise err_type(message)


def run_on_every_rank(fn: Callable[[], object], group=None):
    """Run ``fn`` on every rank; if it fails on any rank, raise on every rank.

    For per-rank work (writing or reading this rank's own file) followed by collectives: a rank
    that failed alone would otherwise leave the others waiting. The failing rank re-raises its
    own exception; the others raise one of the same built-in type naming the failed rank.
    """
    error: Optional[BaseException] = None
    result = None
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001 - shared with every rank below
        error = err
    if not distributed():
        if error is not None:
            raise error
        return result
    summary = None if error is None else (type(error).__name__, str(error))
    summaries = [None] * world_size()
    dist.all_gather_object(summaries, summary, group=group)
    if error is not None:
        raise error
    for failed_rank, item in enumerate(summaries):
        if item is not None:
            type_name, message = item
            err_type = _FORWARDED.get(type_name) or getattr(builtins, type_name, None)
            if not (isinstance(err_type, type) and issubclass(err_type, _RAISABLE)):
                err_type = RuntimeError
            raise err_type(f"rank {failed_rank} failed: {type_name}: {message}")
    return result
