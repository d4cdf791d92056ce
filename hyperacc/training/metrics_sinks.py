"""Where finished metric records go: one small interface, three built-in sinks, accelerate's trackers.

A sink receives the records ``MetricsLogger`` has already reduced over the ranks (plain host
numbers, identical on every rank), on the main process only:

- ``write(records, kind)``: ``kind="step"``: one record per optimizer step of a flushed window
  (the last one is the logging step, it alone carries the memory fields); ``kind="eval"``: a
  one-record list from ``log_eval``. The records are shared with the caller and the other sinks:
  read them, do not modify them.
- ``progress(step)``: called on every optimizer step that does not flush (no values: nothing has
  been read yet). Optional.
- ``close()``: called once, by ``MetricsLogger.close``. Optional.

Any object with a ``write`` method is a sink; ``MetricsSink`` gives the no-op defaults.
Built in: ``JsonlSink`` (one JSON object per record appended to a file, flushed per line),
``TensorBoardSink`` (scalars under ``train/`` and ``eval/``), ``ConsoleSink`` (a line per logging
step and per evaluation, and an optional tqdm bar).

One logging system: ``JsonlSink`` and ``TensorBoardSink`` are accelerate trackers too
(``accelerate.tracking.GeneralTracker``; ``TensorBoardSink`` *is* accelerate's ``TensorBoardTracker``),
so ``Accelerator(log_with=[...])`` takes them and ``Accelerator.log`` writes to the same file / run;
``MetricsLogger(accelerator=acc)`` registers its own sinks with ``acc.trackers`` and writes its
records to every other tracker there (``write_to_tracker``: ``log(tracker_values(record), step)``).
``ConsoleSink`` stays ours: accelerate has no console / progress-bar tracker.
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings
from typing import Callable, List, Literal, Optional

import torch.distributed as dist
from accelerate import PartialState
from accelerate.tracking import GeneralTracker, TensorBoardTracker

__all__ = ["MetricsSink", "JsonlSink", "TensorBoardSink", "ConsoleSink", "tracker_values", "write_to_tracker",
           "require_accelerate_state"]

Kind = Literal["step", "eval"]

# The step-record keys TensorBoardSink plots (when present).
_TB_STEP_KEYS = ("loss", "grad_norm", "lr", "step_time", "tokens_per_second",
                 "memory_allocated_gib", "memory_reserved_gib", "memory_rss_gib")


def _format_number(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


class MetricsSink:
    """The sink interface, with no-op defaults for the optional methods."""

    def write(self, records: List[dict], kind: Kind) -> None:
        raise NotImplementedError

    def progress(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink(MetricsSink, GeneralTracker):
    """Appends ``json.dumps(record)`` lines to ``path`` (flushed per line); also an accelerate tracker.

    The file describes one history: records of steps after ``start_step`` (the step training
    resumes from, 0 for a fresh start) belong to a branch this run replays or abandons, so they are
    moved, with any partial last line a killed process left, to ``<path>.superseded-<time>`` (kept,
    never deleted) before new records are appended. Each step then appears once, in order.

    As an accelerate ``GeneralTracker`` (name ``"jsonl"``) it can be passed to
    ``Accelerator(log_with=[JsonlSink(path)])``: ``accelerator.log(values, step=s)`` appends
    ``{"step": s, **values}`` to the same file (a line without ``step`` when ``step`` is None; such a
    line is set aside on a resume). The file is opened (and set aside) by ``start()``, which
    accelerate's ``init_trackers`` calls on every rank: with ``main_process_only`` (the default)
    only global rank 0 opens it; ``MetricsLogger``, which already runs it on its main process only,
    passes ``main_process_only=False``."""

    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path: str, start_step: Optional[int] = None, *, main_process_only: bool = True):
        super().__init__()
        self.path = path
        self.start_step = None if start_step is None else int(start_step)
        self.main_process_only = bool(main_process_only)
        self.superseded: Optional[str] = None
        self._file = None
        self._closed = False

    @property
    def tracker(self):
        """The open file (None before ``start`` and after ``close``)."""
        return self._file

    def start(self) -> None:
        if self._file is not None or self._closed or (self.main_process_only and not _is_main_process()):
            return
        if self.start_step is not None:
            self.superseded = _set_aside_after(self.path, self.start_step)
        self._file = _open_append(self.path)

    def write(self, records: List[dict], kind: Kind) -> None:
        self._append(records)

    def log(self, values: dict, step: Optional[int] = None, **kwargs) -> None:
        self._append([dict(values) if step is None else {"step": int(step), **values}])

    def _append(self, records: List[dict]) -> None:
        self.start()
        if self._file is None:
            return
        for record in records:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self) -> None:
        self.close()


_TB_WARNED = False


class TensorBoardSink(MetricsSink, TensorBoardTracker):
    """accelerate's ``TensorBoardTracker`` (its ``SummaryWriter``, one ``add_scalar`` per value, a
    flush per ``log``) writing ``train/<key>`` per step record and ``eval/loss``, ``eval/ppl`` per
    evaluation into ``log_dir`` itself (run name ""). Without the ``tensorboard`` package it warns
    once and writes nothing.

    Why accelerate's tracker and not our own ``SummaryWriter`` calls: one TensorBoard code path for
    ``MetricsLogger(tensorboard_dir=...)`` and ``Accelerator(log_with="tensorboard")`` (same tags,
    same values; 0.6-1.1x the time per record of the former hand-written ``add_scalar`` loop, ~0.3 ms
    either way on a shared 2-core CPU: ``benchmarks/libraries_data.py``). Its cost: accelerate's trackers log through
    accelerate's logger, which needs accelerate's process state (``PartialState``): the Accelerator
    makes it; a lone process without one gets a ``PartialState()`` (see ``require_accelerate_state``)."""

    def __init__(self, log_dir: str, *, main_process_only: bool = True):
        TensorBoardTracker.__init__(self, "", log_dir)
        self.log_dir = log_dir
        self.main_process_only = bool(main_process_only)
        self.writer = None
        self._closed = False

    def start(self) -> None:
        if self.writer is not None or self._closed or not _tensorboard_installed(self.log_dir):
            return
        require_accelerate_state("TensorBoardSink")
        TensorBoardTracker.start(self)

    def write(self, records: List[dict], kind: Kind) -> None:
        self.start()
        if self.writer is None:
            return
        for record in records:
            self.log(tracker_values(record, kind), step=record["step"])

    def close(self) -> None:
        self._closed = True
        if self.writer is not None:
            TensorBoardTracker.finish(self)
            self.writer = None

    def finish(self) -> None:
        self.close()


def _tensorboard_installed(log_dir: str) -> bool:
    global _TB_WARNED
    try:
        import tensorboard  # noqa: F401  (torch's SummaryWriter needs it)
    except ImportError:
        if not _TB_WARNED:
            warnings.warn(f"tensorboard_dir={log_dir!r} is set but tensorboard is not installed; "
                          "TensorBoard logging is off (pip install tensorboard).", stacklevel=4)
            _TB_WARNED = True
        return False
    return True


def tracker_values(record: dict, kind: Kind) -> dict:
    """The scalars a record gives an accelerate tracker: ``train/<key>`` for the plotted step keys
    present, or ``eval/loss`` and ``eval/ppl``."""
    if kind == "eval":
        return {"eval/loss": record["eval_loss"], "eval/ppl": record["eval_ppl"]}
    return {f"train/{key}": record[key] for key in _TB_STEP_KEYS if record.get(key) is not None}


def write_to_tracker(tracker, records: List[dict], kind: Kind) -> None:
    """Hand ``records`` to one accelerate tracker: ``write`` if it is a sink too, else ``log`` per record."""
    if hasattr(tracker, "write"):
        tracker.write(records, kind)
        return
    for record in records:
        tracker.log(tracker_values(record, kind), step=record["step"])


def require_accelerate_state(what: str) -> None:
    """accelerate's trackers log through accelerate's logger, which raises without a ``PartialState``.
    A lone process (no process group, WORLD_SIZE unset or 1) gets one here (what ``Accelerator()``
    would build from the same environment); in a process group the Accelerator must exist first
    (building a state would touch the group): one ValueError, on every rank alike."""
    if PartialState._shared_state:   # private: PartialState exposes no "already initialised" query
        return
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed and int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        PartialState()
        return
    raise ValueError(f"{what} writes through accelerate's trackers, which need accelerate's process state: create "
                     "the Accelerator (hyperacc.Accelerator() or accelerate.PartialState()) before it.")


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):     # no isatty, or a closed stream
        return False


def _is_main_process() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class ConsoleSink(MetricsSink):
    """The logging step's line ``step=N loss=... lr=... grad_norm=... tokens/s=... step_time=...s``
    and ``eval step=N eval_loss=... eval_ppl=...``, through ``log_fn`` if given, else printed
    (above the bar when there is one). ``progress_bar``: a tqdm bar on ``file``,
    ``initial=initial_step``, ``total=max_steps``, postfix loss / lr / tokens per second. Without
    ``file`` the bar goes to stderr only when that is a terminal: in a log file or a pipe each redraw
    would land between the step lines (which carry the same numbers), so there the lines stand alone."""

    def __init__(self, *, progress_bar: bool = True, max_steps: Optional[int] = None, initial_step: int = 0,
                 file=None, log_fn: Optional[Callable[[str], None]] = None):
        self._log_fn = log_fn
        self._bar = None
        if progress_bar and (file is not None or _is_terminal(sys.stderr)):
            from tqdm import tqdm
            self._bar = tqdm(total=max_steps, initial=initial_step, desc="train", unit="step",
                             dynamic_ncols=True, file=file if file is not None else sys.stderr)

    def progress(self, step: int) -> None:
        if self._bar is not None and step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def write(self, records: List[dict], kind: Kind) -> None:
        if not records:
            return
        record = records[-1]
        step = record["step"]
        if kind == "eval":
            self._print(f"eval step={step} eval_loss={_format_number(record['eval_loss'])} "
                        f"eval_ppl={_format_number(record['eval_ppl'])}")
            return
        if self._bar is not None:
            self._bar.set_postfix(loss=_format_number(record["loss"]), lr=_format_number(record["lr"]),
                                  tok_s=f"{record['tokens_per_second']:.0f}", refresh=False)
            if step > self._bar.n:
                self._bar.update(step - self._bar.n)
            else:
                self._bar.refresh()
        self._print(f"step={step} loss={_format_number(record['loss'])} lr={_format_number(record['lr'])} "
                    f"grad_norm={_format_number(record['grad_norm'])} tokens/s={record['tokens_per_second']:.1f} "
                    f"step_time={record['step_time']:.3f}s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _print(self, line: str) -> None:
        if self._log_fn is not None:
            self._log_fn(line)
        elif self._bar is not None:
            self._bar.write(line, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(line, flush=True)


def _set_aside_after(path: str, step: int) -> Optional[str]:
    """Move the lines of ``path`` whose record's step is after ``step`` (or that do not parse) to a
    sibling file; rewrite ``path`` atomically with the rest. Returns the sibling's path, or None."""
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as handle:
        lines = [line for line in handle.read().splitlines() if line.strip()]
    kept, moved = [], []
    for line in lines:
        try:
            record_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            moved.append(line)
            continue
        (kept if record_step <= step else moved).append(line)
    if not moved:
        return None
    aside = f"{path}.superseded-{time.strftime('%Y%m%d-%H%M%S')}"
    with open(aside, "a", encoding="utf-8") as handle:
        handle.write("\n".join(moved) + "\n")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in kept))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    warnings.warn(f"{path}: {len(moved)} record(s) after step {step} (the step this run starts from) moved to "
                  f"{aside}; the file now holds each step once, in order.", stacklevel=4)
    return aside


def _open_append(path: str):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    needs_newline = False
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, "rb") as existing:
            existing.seek(-1, os.SEEK_END)
            needs_newline = existing.read(1) != b"\n"
    handle = open(path, "a", encoding="utf-8")
    if needs_newline:
        handle.write("\n")
        handle.flush()
    return handle
