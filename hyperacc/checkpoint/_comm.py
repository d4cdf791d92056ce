"""The few collectives the checkpoint layer needs, each a no-op in a single process.

Every decision that could make ranks take different branches (does the directory exist, is the
checkpoint complete, which layout does it use) is taken on rank 0 and broadcast, so an error is
raised on every rank at the same point, before any collective that could otherwise hang.
"""
from __future__ import annotations

import builtins
from typing import Callable, Optional

import torch.distributed as dist


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
    err_type = getattr(builtins, type_name, None)
    if not (isinstance(err_type, type) and issubclass(err_type, _RAISABLE)):
        err_type = RuntimeError
        message = f"{type_name}: {message}"
    raise err_type(message)
