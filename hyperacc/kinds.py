"""Model kinds: the one seam through which the core asks what a model that is not a plain `nn.Module`
needs -- an adapter-wrapped model today, the next kind (a quantized base, ...) tomorrow.

Why a seam: every capability that special-cased itself inside the core (sharding asked "is this an adapter
model?", so did the weight loader, the checkpoint buckets, the exports, ...) tied the lowest layers to
the highest and made an import cycle of them. Here the core asks a `ModelKind` instead -- a handful of
questions with the plain model's answers as defaults -- and an integration answers them for its own
models. The next kind is one new file that subclasses `ModelKind` and calls `register`.

Which kind serves a model: `for_model(model)` asks the registered kinds, the most recently registered
first, whether they `matches` the model; the first that does serves it; else `PLAIN` (the plain
model's answers). A kind whose implementation imports an optional library is registered *lazily* with
`register_lazy(predicate, module)`: a cheap predicate on the model (e.g. is the library imported at all, and
is the model an instance of its wrapper class; such a model cannot exist without its library imported) and
the name of the module that implements the kind. That module is
imported -- and registers its kind -- the first time a model passes the predicate. So ``import
hyperacc`` imports no optional library and a plain model never loads an integration: each integration
declares its own lazy entry when it is imported, and this module knows none of them.

The protocol, in the order `prepare()` and the later calls use it:

- `matches(model)`: does this kind serve ``model``.
- `check_layout(model, parallel)`: refuse, before any collective, a layout (`hyperacc.ParallelConfig`)
  the kind cannot train under.
- `keeps_dtype(model)`: the parameters stored in their own dtype rather than the precision recipe's.
- `before_sharding(model, device=, seed=)`: on the full-shape model (maybe on the meta device), before
  any cast or sharding; may be collective. Its result is handed to `after_sharding`.
- `after_sharding(model, before, initialised=)`: once the shards hold their values.
- `saves_trainable_only(model)` / `always_saved(model)`: what a checkpoint holds.
- `base_names(model)`: which tensors are the frozen base, under their pretrained-checkpoint names
  (weight loading, the frozen-base fingerprint of a trainable-only checkpoint).
- `export(model, out_dir, ...)`: the kind's own export format (None: hyperacc's Hugging Face export).
- `pretrained_state_dict(model, get_state_dict)` and `save_pretrained_on_main_only`: what the prepared
  model's own ``save_pretrained`` gets.

This module imports nothing heavy (no torch): the package root imports it.
"""
from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

if TYPE_CHECKING:       # annotations only: importing torch here would make `import hyperacc` heavy
    import torch
    from torch import nn

__all__ = ["ModelKind", "PLAIN", "for_model", "register", "register_lazy", "unregister", "registered"]


class ModelKind:
    """What the core asks of a model, answered for a plain `nn.Module`. Subclass it and override what
    differs; every method receives the model itself (kinds hold no per-model state)."""

    name = "plain"

    #: the model's own ``save_pretrained`` runs on the main process only (every rank still joins
    #: `pretrained_state_dict`, which may be collective).
    save_pretrained_on_main_only = False

    def matches(self, model: "nn.Module") -> bool:
        """Whether this kind serves ``model``. Cheap and local: it runs on every checkpoint and export."""
        return False

    # ------------------------------------------------------------------ prepare
    def check_layout(self, model: "nn.Module", parallel) -> None:
        """Raise, before any collective and alike on every rank, for a layout (``parallel``: a
        `hyperacc.ParallelConfig`, read for its sizes) the kind cannot train ``model`` under; one line
        naming the problem and a fix."""

    def keeps_dtype(self, model: "nn.Module") -> Set[str]:
        """Names (as ``named_parameters`` gives them) of the parameters prepare stores in their own
        dtype instead of the precision recipe's parameter dtype."""
        return set()

    def before_sharding(self, model: "nn.Module", *, device: "torch.device", seed: int) -> Any:
        """Runs on the full-shape model (real or on the meta device), before the recipe's cast and
        sharding, on every rank in the same order (collectives allowed). Returns what
        `after_sharding` needs (values computed at full size, ...)."""
        return None

    def after_sharding(self, model: "nn.Module", before: Any, *, initialised: bool) -> None:
        """Runs once the shards hold their values (the model's own, rank 0's, the pretrained files',
        or ``initialised`` from the seed: the model came on the meta device without weight files).
        ``before``: what `before_sharding` returned."""

    # ------------------------------------------------------------------ checkpoints and weights
    def saves_trainable_only(self, model: "nn.Module") -> bool:
        """Whether a checkpoint holds only the trainable tensors (plus `always_saved`): the rest comes
        back from the model's own source (pretrained files or the seed), checked by a fingerprint of
        the frozen base (`hyperacc.checkpoint.frozen_base`)."""
        return False

    def always_saved(self, model: "nn.Module") -> Set[str]:
        """In a trainable-only checkpoint: tensors held whatever their ``requires_grad`` (e.g. an
        inactive adapter), so that what a checkpoint holds does not depend on a switchable flag."""
        return set()

    def base_names(self, model: "nn.Module") -> Dict[str, Optional[str]]:
        """Every parameter and buffer name -> its key in the base model's checkpoint files, or None for
        a tensor of the kind's own that no base file holds (not read: `before_sharding` /
        `after_sharding` give it its values)."""
        names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
        return {n: n for n in names}

    # ------------------------------------------------------------------ exports
    def export(self, model: "nn.Module", out_dir: str, *, group=None, into_existing: bool = False,
               tokenizer=None, max_shard_bytes: Optional[int] = None) -> Optional[str]:
        """Collective: write the kind's own export of ``model`` into ``out_dir`` and return it; None
        (the default) when the kind has no format of its own and hyperacc's Hugging Face export of the
        whole model is what it wants (`hyperacc.weights.export.export_sharded`)."""
        return None

    def pretrained_state_dict(self, model: "nn.Module", get_state_dict: Callable[["nn.Module"], dict]) -> dict:
        """Collective (every rank): the state dict the prepared model's own ``save_pretrained`` is
        given. ``get_state_dict``: accelerate's (full weights on the main process), the default."""
        return get_state_dict(model)

    def __repr__(self) -> str:
        return f"<model kind {self.name!r}>"


PLAIN = ModelKind()

_lock = threading.Lock()
_kinds: List[ModelKind] = []
_lazy: List[Tuple[Callable[[Any], bool], str]] = []


def register(kind: ModelKind) -> ModelKind:
    """Make ``kind`` serve the models it `matches`, before every kind registered earlier. Returns it."""
    if not isinstance(kind, ModelKind):
        raise TypeError(f"register() takes a hyperacc.kinds.ModelKind, got {type(kind).__name__}")
    with _lock:
        if kind not in _kinds:
            _kinds.insert(0, kind)
    return kind


def unregister(kind: ModelKind) -> None:
    """Forget ``kind`` (a test's own kind, when the test ends)."""
    with _lock:
        if kind in _kinds:
            _kinds.remove(kind)


def register_lazy(predicate: Callable[[Any], bool], module: str) -> None:
    """When a model passes ``predicate`` (cheap; it must not import the optional library), import
    ``module``, which registers its kind. Each module is imported at most once."""
    with _lock:
        if all(name != module for _, name in _lazy):
            _lazy.append((predicate, module))


def registered() -> List[ModelKind]:
    """The registered kinds, in the order `for_model` asks them."""
    return list(_kinds)


def for_model(model) -> ModelKind:
    """The kind that serves ``model``: the first registered kind that `matches` it, else `PLAIN`."""
    for kind in registered():
        if kind.matches(model):
            return kind
    for predicate, module in list(_lazy):
        if predicate(model):
            importlib.import_module(module)         # registers its kind
            with _lock:
                if (predicate, module) in _lazy:
                    _lazy.remove((predicate, module))
            return for_model(model)
    return PLAIN
