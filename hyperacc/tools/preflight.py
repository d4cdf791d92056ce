"""Fail-closed checks of a run's inputs made before the process group or the model exist.

Output paths that can be written and never overlap an input (:func:`check_output_path`,
:func:`check_paths_apart`), datasets that exist (:func:`check_dataset_path`), an optimizer that
builds and that the precision recipe accepts (:func:`check_optimizer`) and a consistent, finite
model config (:func:`check_model_config`). Every rank runs them alike and raises the same one-line
:class:`~hyperacc.tools.cli_config.ConfigError`. (Re-exported by :mod:`hyperacc.training`.)
"""
from __future__ import annotations

import math
import os
import warnings
from typing import List, Optional

import torch
from hyperacc.data.text import check_dataset_source
from hyperacc.errors import ConfigError
from hyperacc.precision import adapt_optimizer


def _config_error(message: str) -> ConfigError:
    return ConfigError(message)


def check_output_path(path: Optional[str], flag: str, *, directory: bool, example_name: str = "metrics.jsonl") -> None:
    """``path`` (a file, or a directory when ``directory``) can be created or written.

    Walks up to the nearest existing ancestor: a regular file there (``checkpoint_dir`` under a
    file) or a missing write permission is a ConfigError naming the flag.
    """
    if not path:
        return
    full = os.path.abspath(os.path.expanduser(os.fspath(path)))
    kind = "directory" if directory else "file"
    if os.path.lexists(full):
        if directory and not os.path.isdir(full):
            raise _config_error(f"{flag}={path!r} exists and is not a directory. Fix: choose a directory path, "
                                f"e.g. {flag}={path}.d")
        if not directory and os.path.isdir(full):
            raise _config_error(f"{flag}={path!r} is a directory, a file path is expected. Fix: e.g. "
                                f"{flag}={os.path.join(path, example_name)}")
        if not os.access(full, os.W_OK | (os.X_OK if directory else 0)):
            raise _config_error(f"{flag}={path!r}: the {kind} is not writable. Fix: change its permissions or "
                                f"choose another path.")
        return
    parent = os.path.dirname(full)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise _config_error(f"{flag}={path!r} cannot be created: {parent!r} is a regular file, not a directory. "
                            f"Fix: choose a {kind} path whose parents are directories.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _config_error(f"{flag}={path!r} cannot be created: no write permission in {parent!r}. Fix: choose "
                            f"a writable location.")


def dataset_files(dataset) -> List[str]:
    """The local paths a dataset spec reads (its files, directories, glob matches, and the .idx/.bin of
    Megatron prefixes and blends); hub names and the embedded corpus (None) give none."""
    import glob

    if dataset is None or dataset == "default":
        return []
    specs = [dataset] if isinstance(dataset, (str, os.PathLike)) else list(dataset)
    if len(specs) == 1 and isinstance(specs[0], str) and len(specs[0].split()) > 1:
        specs = specs[0].split()                       # "w1 prefix1 w2 prefix2": the numbers match nothing
    found = []
    for spec in specs:
        if not isinstance(spec, (str, os.PathLike)):
            continue
        path = os.path.expanduser(os.fspath(spec))
        candidates = glob.glob(path) if any(c in path for c in "*?[") else [path]
        stem = path[:-4] if path.endswith((".idx", ".bin")) else path
        candidates += [stem + ".idx", stem + ".bin"]
        found += [c for c in candidates if os.path.exists(c)]
    return found


def _same_or_inside(path: str, other: str) -> Optional[str]:
    """"is" when ``path`` names ``other`` (through symlinks and hard links), "is inside" when it lies
    under the directory ``other``, else None."""
    real, base = os.path.realpath(path), os.path.realpath(other)
    if real == base or (os.path.exists(path) and os.path.exists(other) and os.path.samefile(path, other)):
        return "is"
    if os.path.isdir(base) and os.path.commonpath([real, base]) == base:
        return "is inside"
    return None


def check_paths_apart(outputs, inputs, *, output_dirs=(), reserved=()) -> None:
    """The paths a run writes never touch what it reads, nor each other.

    ``outputs``: ``(flag, path)`` of the files and directories the run writes; ``inputs``: ``(what,
    path)`` of what it reads (config file, dataset files, tokenizer, model, a checkpoint to restore).
    ``output_dirs``: ``(flag, path)`` of directories the run fills with files of its own (checkpoints),
    ``reserved``: the names (fnmatch patterns) of its own entries at their top level
    (``latest_checkpoint_iteration.txt``, ``global_step_*`` ...).
    A ConfigError names the first output that is an input (the same file or directory, or a link to
    it) or lies inside an input directory, that is the same path as another output or output
    directory, or that is or lies under a reserved entry of an output directory (it would overwrite or
    mix with the run's own files there). Unset paths (None, "") are skipped; inputs that do not exist
    too."""
    import fnmatch

    def full(p):
        return os.path.abspath(os.path.expanduser(os.fspath(p)))

    outputs = [(flag, full(p)) for flag, p in outputs if p]
    output_dirs = [(flag, full(p)) for flag, p in output_dirs if p]
    inputs = [(what, full(p)) for what, p in inputs if p and os.path.exists(full(p))]
    for i, (flag, path) in enumerate(outputs):
        for what, source in inputs:
            relation = _same_or_inside(path, source)
            if relation:
                raise _config_error(f"{flag}={path!r} {relation} {what} ({source!r}): writing there would "
                                    f"overwrite or change it. Fix: choose a {flag} path outside every input (the "
                                    "config file, data, tokenizer, model and checkpoint read).")
        for other_flag, other in outputs[:i] + [(f, d) for f, d in output_dirs if f != flag]:
            if os.path.realpath(path) == os.path.realpath(other):
                raise _config_error(f"{flag} and {other_flag} are the same path ({path!r}): each would overwrite "
                                    f"the other. Fix: give {flag} a path of its own.")
        for dir_flag, directory in output_dirs:
            if dir_flag == flag:
                continue
            inside = os.path.relpath(os.path.realpath(path), os.path.realpath(directory))
            if inside in (os.curdir, os.pardir) or inside.startswith(os.pardir + os.sep):
                continue                                # outside (or the directory itself: see above)
            if any(fnmatch.fnmatch(inside.split(os.sep)[0], pattern) for pattern in reserved):
                raise _config_error(f"{flag}={path!r} lies among the files {dir_flag}={directory!r} holds of its own "
                                    f"({inside}): writing it could overwrite one of them. Fix: choose a {flag} "
                                    f"path outside {directory!r}, or in it under a name of its own.")


def check_dataset_path(dataset) -> None:
    """A dataset that names local files must exist (hub names are checked when loaded)."""

    try:
        check_dataset_source(dataset)
    except ValueError as err:
        raise _config_error(f"data.dataset: {err}") from None


def _non_finite(value) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_non_finite(v) for v in value)
    return isinstance(value, float) and not math.isfinite(value)


def check_optimizer(optimizer_cfg, *, recipe=None, section: str = "optimizer") -> None:
    """Build the configured optimizer (a ``cli_config.Component``) on one scalar parameter, as the
    training script will on the model's parameter groups: a call its signature cannot take, a
    non-finite number (``lr=inf``), its own argument checks (``lr=-1``, ``betas`` outside [0, 1) ...)
    and, with ``recipe``, what ``prepare`` would refuse under that precision recipe (torch's Adam with
    bf16 parameters) become a ConfigError now, not a traceback per rank after the model is built."""
    if optimizer_cfg is None:
        return

    target = getattr(optimizer_cfg, "target", "optimizer")
    kwargs = dict(getattr(optimizer_cfg, "kwargs", {}))
    for name, value in kwargs.items():
        if _non_finite(value):
            raise _config_error(f"{section}.{name}={value!r} is not a finite number. Fix: a finite value, e.g. "
                                f"--{section}.{name}=<number> (see {target}).")
    probe = torch.nn.Parameter(torch.zeros(1))
    groups = [{"params": [probe]}]
    optimizer_cfg.check_call((groups,), section=section)    # the runtime argument: the parameter groups
    try:
        optimizer = optimizer_cfg.build(groups)
    except (ValueError, TypeError, RuntimeError) as err:
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise _config_error(f"{section} {target}({given}) rejects its arguments: {' '.join(str(err).split())}. "
                            f"Fix: correct the {section}.* value it names (YAML or --{section}.<name>=...).") from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise _config_error(f"{section} {target} returned a {type(optimizer).__name__}, not a torch.optim.Optimizer "
                            f"built on the parameter groups it is passed. Fix: a {section}._target_ that builds an "
                            f"optimizer from its first argument, e.g. torch.optim.AdamW.")
    if recipe is not None:
        try:
            with warnings.catch_warnings():     # a mere warning is prepare's to give, once
                warnings.simplefilter("ignore")
                adapt_optimizer(optimizer, recipe)
        except ValueError as err:
            raise _config_error(f"{section} {target} under fsdp.precision={recipe.name}: {err}") from None


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _first_non_finite(tree, prefix=""):
    """(dotted key, value) of the first NaN/inf float in nested dicts/lists, else None."""
    if isinstance(tree, float) and not math.isfinite(tree):
        return prefix, tree
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for key, value in items:
        found = _first_non_finite(value, f"{prefix}.{key}" if prefix else str(key))
        if found:
            return found
    return None


def _first_text_for_number(tree, defaults, prefix=""):
    """(dotted key, value, default) of the first str in ``tree`` where ``defaults`` holds a number."""
    if isinstance(tree, str) and isinstance(defaults, (int, float)) and not isinstance(defaults, bool):
        return prefix, tree, defaults
    if isinstance(tree, dict) and isinstance(defaults, dict):
        for key, value in tree.items():
            found = _first_text_for_number(value, defaults.get(key), f"{prefix}.{key}" if prefix else str(key))
            if found:
                return found
    return None


def check_model_config(config, *, tokenizer_size: Optional[int] = None, flag: str = "model.overrides") -> None:
    """Consistency of a transformers config (sizes positive, heads divide, experts fit the
    routing, vocabulary holds the tokenizer) before any model is built."""
    get = lambda name: getattr(config, name, None)  # noqa: E731
    values = config.to_dict() if hasattr(config, "to_dict") else {}
    bad = _first_non_finite(values)
    if bad:
        raise _config_error(f"{flag}: the model config's {bad[0]}={bad[1]} is not a finite number (from "
                            f"{flag} or the pretrained config). Fix: a finite value, e.g. --{flag}.<name>=<number>.")
    try:
        defaults = type(config)().to_dict()
    except Exception:  # noqa: BLE001 - a config class that needs arguments: nothing to compare with
        defaults = {}
    bad = _first_text_for_number(values, defaults)
    if bad:
        raise _config_error(f"{flag}: the model config's {bad[0]}={bad[1]!r} is text where {type(config).__name__} "
                            f"has a number. Fix: a finite number, e.g. --{flag}.{bad[0].rsplit('.', 1)[-1]}={bad[2]}")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "moe_intermediate_size", "head_dim", "num_experts", "num_experts_per_tok"):
        value = get(name)
        if value is not None and not _positive_int(value):
            raise _config_error(f"{flag}.{name}={value!r} must be a positive integer. Fix: --{flag}.{name}=<n>")
    heads, kv, hidden = get("num_attention_heads"), get("num_key_value_heads"), get("hidden_size")
    if heads and kv and heads % kv:
        raise _config_error(f"{flag}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv} "
                            f"(grouped-query attention shares each KV head among a whole number of query heads). "
                            f"Fix: e.g. --{flag}.num_key_value_heads={math.gcd(heads, kv)}")
    if heads and hidden and get("head_dim") is None and hidden % heads:
        raise _config_error(f"{flag}: num_attention_heads={heads} does not divide hidden_size={hidden} (and no "
                            f"head_dim is set). Fix: set --{flag}.head_dim or a head count that divides {hidden}.")
    experts, active = get("num_experts"), get("num_experts_per_tok")
    if experts and active and active > experts:
        raise _config_error(f"{flag}: num_experts_per_tok={active} > num_experts={experts}. Fix: "
                            f"--{flag}.num_experts_per_tok={experts} or more experts.")
    vocab = get("vocab_size")
    if tokenizer_size is not None and vocab is not None and vocab < tokenizer_size:
        raise _config_error(f"{flag}.vocab_size={vocab} is smaller than the tokenizer ({tokenizer_size} entries). "
                            f"Fix: --{flag}.vocab_size={tokenizer_size} (or leave it unset).")
