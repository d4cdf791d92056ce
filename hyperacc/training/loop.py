"""Small, reusable pieces of a pre-training loop that are not the Accelerator's business.

* :func:`param_groups` - AdamW groups without weight decay on norms, biases (and other 1-D tensors);
* :func:`lr_lambda_scheduler` - warm-up + cosine/linear/constant decay as a ``LambdaLR``;
* :func:`evaluate` - mean token loss and perplexity over a fixed number of held-out batches;
* fail-closed checks made after the process group exists (:func:`raise_if_any_rank_failed`,
  :func:`check_same_config`): every rank raises the same one-line :class:`~hyperacc.errors.ConfigError`.
  (The checks made before it, of paths, datasets and optimizers, are `hyperacc.tools.preflight`'s.)

Nothing here owns a process group: collectives go through the Accelerator that is passed in.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from hyperacc.batch import count_label_tokens
from hyperacc.config.launch_env import env_value
from hyperacc.data.collate import default_collate
from hyperacc.runtime import collective_float_dtype
from hyperacc.errors import ConfigError

__all__ = ["param_groups", "lr_lambda_scheduler", "evaluate", "eval_batch_indices", "raise_if_any_rank_failed",
           "check_same_config"]


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

    ``schedule``: anything with ``lr_factor(step, max_steps)`` (the example's
    ``examples/config_schema.LRSchedulerConfig``: warm-up ``(s + 1) / w``, then cosine / linear /
    constant decay to ``min_lr_ratio``). The factor is recomputed from the step count, so a restored
    scheduler continues exactly.

    Why not transformers' schedules (issue 39, ``benchmarks/libraries_data.py``; lr 3e-4, 2,000 steps
    + 10 past the end): none computes that factor at every step once there is a warm-up. Without
    one, ``get_wsd_schedule(num_stable_steps=0, min_lr_ratio=...)`` (cosine, linear) and
    ``get_constant_schedule_with_warmup`` match exactly (max |lr diff| 0). With 100 warm-up steps
    the closest differ by 2.2e-7 (``get_cosine_with_min_lr_schedule_with_warmup_lr_rate``: our
    warm-up, its decay one step early, not held at the minimum after the end), 3.0e-6
    (``get_cosine_with_min_lr_schedule_with_warmup``, ``get_constant_schedule_with_warmup``: warm-up
    from 0, ``s / w``, so the first step trains at lr 0) and 2.7e-5 (``get_wsd_schedule``, linear:
    warm-up from ``min_lr_ratio``). Switching would move a resumed run off the schedule its checkpoint
    was trained on. The ``LambdaLR`` over a closure also keeps the checkpoint's ``lr_scheduler``
    bucket as it is (``lr_lambdas: [None]``; transformers' ``functools.partial`` lambdas store
    ``[{}]``, loadable either way but not the same bytes). Time per step: 0.8-1.0x, no difference.
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
    raise ConfigError(f"{prefix}{message}") from None


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
                raise ConfigError(f"the ranks run different configurations: {key} is {every[0].get(key)} on rank 0 "
                                    f"but {other.get(key)} on rank {rank}. Fix: launch every node with the same "
                                    "config file and flags.")
