"""What examples/train_qwen.py says besides its step lines: where the resolved config went, and a
closing summary (rank 0).

A first run should fit on one screen and end by saying what it produced. The resolved config (about
110 lines) is therefore written to a file instead of the console -- printed too with
``--training.verbose`` (``--verbose``) -- and the run ends with a few lines: the steps it ran, the loss
from its first step to its last, where the metrics, checkpoints and config went, the wall time, and
the flags to try next.

Where the config file goes: ``<checkpoint_dir>/config.resolved.yaml`` when the run saves checkpoints
(the directory is this run's: it holds the lock), else beside the metrics file
(``metrics.jsonl`` -> ``metrics.config.resolved.yaml``, so runs sharing a folder keep theirs apart),
else nowhere: a run that keeps nothing writes nothing (``checkpoint.save_ckpt=false`` promises that
``checkpoint_dir`` is not touched). It is this launch's config, written once the start is accepted
(after ``load_state``: a refused resume leaves the directory as it was); the checkpoints' own
``config.yaml`` (what a resume is checked against) is the library's and stays as it is.
"""
import os
import time

import yaml

from hyperacc.checkpoint.containment import atomic_write
from hyperacc.checkpoint.discovery import read_pointer
from hyperacc.tools.cli_config import dump_config
from hyperacc.training.metrics_sinks import MetricsSink

RESOLVED_CONFIG = "config.resolved.yaml"


def resolved_config_path(cfg, checkpoint_dir):
    """Where this run's resolved config is written (see the module docstring), or None."""
    if cfg.checkpoint.save_ckpt and checkpoint_dir:
        return os.path.join(checkpoint_dir, RESOLVED_CONFIG)
    if cfg.logging.metrics_file:
        return f"{os.path.splitext(cfg.logging.metrics_file)[0]}.{RESOLVED_CONFIG}"
    return None


def write_resolved_config(cfg, path):
    """The config as YAML at ``path`` (atomically: a planted symlink is replaced, never followed)."""
    atomic_write(path, yaml.safe_dump(dump_config(cfg), sort_keys=False, width=100), fsync=False)


def announce(cfg, checkpoint_dir, processes):
    """Rank 0, once the start is accepted (after ``load_state``: a refused resume leaves ``checkpoint_dir``
    as it was): write the resolved config and say in one line what runs and where the config went.
    Returns the file's path, or None. A file that cannot be written is a note, not a stop: rank 0 alone
    must not leave the other ranks waiting in a collective."""
    t, path = cfg.training, resolved_config_path(cfg, checkpoint_dir)
    try:
        if path:
            write_resolved_config(cfg, path)
    except OSError as err:
        print(f"note: the resolved config could not be written to {path}: {err}", flush=True)
        path = None
    where = path or ("above" if t.verbose else "not written (--verbose prints it)")
    print(f"training to step {t.max_steps}, {t.global_batch_size} sequences of {cfg.data.seq_len} tokens a step, "
          f"{processes} process(es); resolved config: {where}", flush=True)
    return path


class SummarySink(MetricsSink):
    """Keeps the first and the last step record and the last evaluation, for the summary (a metrics sink:
    written on the main process only, with exactly the records the JSONL file gets)."""

    def __init__(self):
        self.first = self.last = self.eval = None

    def write(self, records, kind):
        if not records:
            return
        if kind == "eval":
            self.eval = records[-1]
            return
        self.first = self.first or records[0]
        self.last = records[-1]


def _loss(value):
    return f"{value:.4f}" if value is not None else "n/a"


def summary(cfg, sink, *, checkpoint_dir, config_path, started):
    """The closing lines (rank 0): what ran, what it produced, where, and what to try next."""
    first, last = sink.first, sink.last
    if first is None:
        ran = "done: no step trained"
    else:
        ran = (f"done: {last['step'] - first['step'] + 1} steps ({first['step']} -> {last['step']}) in "
               f"{time.monotonic() - started:.1f} s; loss {_loss(first['loss'])} -> {_loss(last['loss'])}")
        if sink.eval is not None:
            ran += f", eval_loss {_loss(sink.eval['eval_loss'])} (step {sink.eval['step']})"
    log = cfg.logging
    kept = [p for p in (log.metrics_file, log.tensorboard_dir) if p]
    lines = [ran, "metrics:     " + (", ".join(kept) if kept else
                                     "not kept (--logging.metrics_file=runs/tiny/metrics.jsonl keeps them)")]
    saved = read_pointer(checkpoint_dir) if cfg.checkpoint.save_ckpt and os.path.isdir(checkpoint_dir) else None
    if saved is not None:
        lines.append(f"checkpoints: {checkpoint_dir} (LATEST = step {saved})")
    else:
        lines.append("checkpoints: none saved (--checkpoint.save_ckpt=true --checkpoint.save_steps=10 saves them)")
    lines.append(f"config:      {config_path}" if config_path else
                 "config:      not written (nothing of this run is kept; --verbose prints it)")
    lines.append("next:")
    if cfg.peft.method == "none":
        lines.append("  --model.name_or_path=DIR --peft.method=lora --peft.export_dir=adapter  "
                     "LoRA on a pretrained model")
    if saved is not None:
        lines.append("  --checkpoint.restore_from=LATEST  relaunch with it after an interruption: resumes exactly")
    else:
        lines.append("  --checkpoint.save_ckpt=true, then --checkpoint.restore_from=LATEST  save, then resume")
    lines.append("  --help  every flag;  --verbose  print the resolved config at the start")
    return lines
