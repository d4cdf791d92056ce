"""Small, reusable pieces of a pre-training loop that are not the Accelerator's business.

* :func:`param_groups` - AdamW groups without weight decay on norms, biases (and other 1-D tensors);
* :func:`lr_lambda_scheduler` - warm-up + cosine/linear/constant decay as a ``LambdaLR``;
* :func:`evaluate` - mean token loss and perplexity over a fixed number of held-out batches;
* :class:`StepChecks` (from :mod:`hyperacc.step_checks`) - non-finite loss / gradient norm stops
  the job (both modes) and, in ``training.mode=validate``, cross-rank agreement checks;
* fail-closed checks made before the process group or the model exist (:func:`check_output_path`,
  :func:`check_dataset_path`, :func:`check_optimizer`, :func:`check_model_config`) and after it
  (:func:`raise_if_any_rank_failed`): every rank raises the same
  one-line :class:`~hyperacc.cli_config.ConfigError`.

Nothing here owns a process group: collectives go through the Accelerator that is passed in.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import List, Optional

import torch

from hyperacc.accumulation import count_label_tokens
from hyperacc.launch_env import env_value
from hyperacc.runtime import collective_float_dtype
from hyperacc.step_checks import DisagreementError, NonFiniteError, StepChecks  # noqa: F401 - re-exported

__all__ = ["param_groups", "lr_lambda_scheduler", "evaluate", "eval_batch_indices", "StepChecks",
           "NonFiniteError", "DisagreementError", "check_output_path", "check_dataset_path", "check_optimizer",
           "check_paths_apart", "dataset_files",
           "check_model_config", "raise_if_any_rank_failed", "check_same_config", "TokenIdError"]


# ---------------------------------------------------------------------------------- optimizer
def _no_decay(name: str, param: torch.Tensor) -> bool:
    """Norm weights, biases and every other tensor of fewer than two dimensions."""
    lowered = name.lower()
    return param.ndim < 2 or lowered.endswith(".bias") or "norm" in lowered


def param_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    """Two optimizer parameter groups: decayed matrices, and norms/biases with weight_decay=0.

    Works before ``prepare()`` (``prepare`` rebinds the groups to the sharded parameters).
    Empty groups are left out.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if _no_decay(name, param) else decay).append(param)
    groups = [{"params": decay, "weight_decay": float(weight_decay)},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def lr_lambda_scheduler(optimizer, schedule, max_steps: int):
    """``LambdaLR`` whose factor after ``s`` steps is ``schedule.lr_factor(s, max_steps)``.

    ``schedule``: anything with ``lr_factor(step, max_steps)`` (``cli_config.LRSchedulerConfig``).
    The factor is recomputed from the step count, so a restored scheduler continues exactly.
    """
    def factor(step: int) -> float:
        return schedule.lr_factor(step, max_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------------- evaluation
def eval_batch_indices(num_samples: int, batch_index: int, batch_size: int, dp_rank: int,
                       dp_size: int) -> List[int]:
    """Sample ids of evaluation batch ``batch_index`` on DP rank ``dp_rank``: fixed, disjoint
    across ranks, wrapping around a small held-out set."""
    start = (batch_index * dp_size + dp_rank) * batch_size
    return [(start + i) % num_samples for i in range(batch_size)]


@torch.no_grad()
def evaluate(acc, model, dataset, *, batches: int, batch_size: int, collate_fn=None) -> dict:
    """Token-weighted mean loss (over batches and DP ranks) and perplexity on ``dataset``.

    Every rank runs the same number of forward passes (FSDP all-gathers are collective).
    The model is put in eval mode and returned to train mode afterwards.
    """
    from hyperacc.data.collate import default_collate

    collate = collate_fn or default_collate
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    tokens = 0
    try:
        for b in range(batches):
            ids = eval_batch_indices(len(dataset), b, batch_size, acc.dp_rank, acc.dp_size)
            batch = collate([dataset[i] for i in ids])
            batch = {k: v.to(acc.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            n = count_label_tokens(batch["labels"])
            loss = model(**batch).loss
            loss_sum += loss.detach().double().cpu() * n
            tokens += n
    finally:
        model.train(was_training)
    dtype = collective_float_dtype(acc.runtime.backend)
    local = torch.stack([loss_sum, torch.tensor(float(tokens), dtype=torch.float64)])
    totals = acc.reduce(local.to(acc.device, dtype)).cpu()
    total_loss, total_tokens = float(totals[0]), float(totals[1])
    mean = total_loss / total_tokens if total_tokens else float("nan")
    try:
        ppl = math.exp(mean)
    except OverflowError:
        ppl = float("inf")
    return {"loss": mean, "ppl": ppl, "tokens": int(total_tokens)}


# ---------------------------------------------------------------------------------- fail closed, early
# Checks that need no process group run on every rank before the Accelerator exists, so every rank
# raises the same ConfigError (main() prints it as one line). Checks made after the process group
# exists go through raise_if_any_rank_failed, so that one rank's failure is every rank's message.

def _config_error(message: str):
    from hyperacc.cli_config import ConfigError

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
    from hyperacc.data.text import check_dataset_source

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
    from hyperacc.precision import adapt_optimizer

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


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if isinstance(err, (ValueError, OSError)) else f"{type(err).__name__}: {text}"


def raise_if_any_rank_failed(error: Optional[BaseException], *, group=None, what: str = "") -> None:
    """Collective (every rank calls it): when any rank passes an exception, every rank raises the
    same ConfigError naming the first failing rank, instead of one traceback on that rank and
    "Connection closed by peer" on the others. ``HYPERACC_DEBUG=1`` re-raises the original
    exception (with its traceback) on the rank where it happened."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size(group) > 1:
        messages: List[Optional[str]] = [None] * dist.get_world_size(group)
        dist.all_gather_object(messages, None if error is None else _one_line(error), group=group)
    else:
        messages = [None if error is None else _one_line(error)]
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if not failed:
        return
    if error is not None and env_value("HYPERACC_DEBUG") == "1":
        raise error
    rank, message = failed[0]
    others = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
    prefix = f"{what} failed on rank {rank}{others}: " if what else ""
    raise _config_error(f"{prefix}{message}") from None


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], tree


def check_same_config(config: dict, *, group=None, ignore=("logging.",)) -> None:
    """Collective: every rank runs the same configuration (nodes launched with different flags would
    train with different batches, models or checkpoint directories); else one ConfigError on every
    rank naming the first field that differs. Keys starting with ``ignore`` may differ (per-node
    log files)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    mine = {k: repr(v) for k, v in _flatten(config) if not k.startswith(tuple(ignore))}
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    for rank, other in enumerate(every):
        for key in sorted(set(every[0]) | set(other)):
            if every[0].get(key) != other.get(key):
                raise _config_error(f"the ranks run different configurations: {key} is {every[0].get(key)} on rank 0 "
                                    f"but {other.get(key)} on rank {rank}. Fix: launch every node with the same "
                                    "config file and flags.")


from hyperacc.accumulation import TokenIdError  # noqa: E402,F401 - raised by the accumulator, re-exported
