"""What a Hugging Face export says besides its weights: ``config.json``, ``generation_config.json`` and
the tokenizer, so that a user can generate from it (``AutoTokenizer`` + ``AutoModelForCausalLM`` +
``generate()``) as from any model on the hub.

Why not the training model's config as it stands: training changes it. ``use_cache`` is switched off
for training (a KV cache filled by a forward would be filled again by recomputation; packed rows need
it off) by hyperacc, the example and most scripts; an export that keeps ``use_cache: false`` makes
every ``generate()`` recompute the whole prefix per token. The export carries the model's own value:
the pretrained ``config.json``'s (its ``_name_or_path``, when that is a local directory or a model in
the local Hugging Face cache: nothing is downloaded), else transformers' default for the config class.
A model built from a bare config (the example's presets) has no ``eos_token_id`` / ``pad_token_id``:
``generate()`` would then never stop at the end of a text. When the tokenizer is known, its ids fill
those that the config lacks (a config's own ids are kept).
"""
from __future__ import annotations

import copy
import json
import os
from typing import Optional

TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def own_use_cache(config) -> Optional[bool]:
    """The model's own ``use_cache`` (see the module docstring); None when its config has none."""
    if not hasattr(config, "use_cache"):
        return None
    saved = _pretrained_config(getattr(config, "_name_or_path", "") or "")
    if isinstance(saved, dict) and isinstance(saved.get("use_cache"), bool):
        return saved["use_cache"]
    try:
        default = getattr(type(config)(), "use_cache", None)
    except Exception:  # noqa: BLE001 - a config class that needs arguments: keep the value as it is
        default = None
    return default if isinstance(default, bool) else bool(config.use_cache)


def _pretrained_config(name: str) -> Optional[dict]:
    """The config.json of ``name`` (a local directory, or a hub id already in the local cache), or None."""
    if not name:
        return None
    path = os.path.join(name, "config.json")
    if not os.path.isfile(path):
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(name, "config.json")
        except Exception:  # noqa: BLE001 - not a hub id (e.g. a path that no longer exists)
            found = None
        if not isinstance(found, str):
            return None
        path = found
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def tokenizer_ids(tokenizer) -> dict:
    """{bos/eos/pad_token_id: id} the tokenizer (or a processor's tokenizer) defines."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    out = {}
    for key in TOKEN_IDS:
        value = getattr(tok, key, None)
        if isinstance(value, int):
            out[key] = value
    return out


def export_config(config, *, architecture: Optional[str] = None, dtype=None, tokenizer=None):
    """A copy of ``config`` as the export writes it: its class as architecture, the weights' dtype,
    the model's own ``use_cache`` and the tokenizer's ids where the config has none."""
    if config is None:
        return None
    config = copy.deepcopy(config)
    if architecture is not None:
        config.architectures = [architecture]
    if dtype is not None:
        config.dtype = dtype
    use_cache = own_use_cache(config)
    if use_cache is not None:
        config.use_cache = use_cache
    for key, value in tokenizer_ids(tokenizer).items():
        if getattr(config, key, None) is None:
            setattr(config, key, value)
    return config


def export_generation_config(model, config):
    """The model's generation config as the export writes it (None for a model that does not
    generate), `aligned` with the exported ``config``."""
    if not getattr(model, "can_generate", lambda: False)():
        return None
    from transformers import GenerationConfig

    current = getattr(model, "generation_config", None)
    return aligned(current if current is not None else GenerationConfig.from_model_config(config), config)


def aligned(generation, config):
    """A copy of ``generation`` with the token ids it lacks from ``config`` and ``config``'s
    ``use_cache`` (a generation config made from the training config says ``use_cache: false``)."""
    if generation is None or config is None:
        return generation
    generation = copy.deepcopy(generation)
    for key in TOKEN_IDS:
        if getattr(generation, key, None) is None and getattr(config, key, None) is not None:
            setattr(generation, key, getattr(config, key))
    use_cache = getattr(config, "use_cache", None)
    if isinstance(use_cache, bool):
        generation.use_cache = use_cache
    return generation


def save_tokenizer(tokenizer, directory: str) -> None:
    """``tokenizer.save_pretrained(directory)`` (a tokenizer or a processor; nothing when None), as
    transformers' ``Trainer`` saves it beside a model: its files only, the weights untouched."""
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
