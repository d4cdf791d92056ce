"""A model's own tensor/expert-parallel plans, read and expanded to concrete names.

transformers publishes each architecture's plans: `config.base_model_tp_plan` / `base_model_ep_plan`
for the base model and `_tp_plan` on the head class (e.g. ``{"lm_head": "colwise_gather_output"}``).
A model instance (transformers >= 5) merges them, with the base model's prefix and vocab-parallel
input embeddings, into its ``tp_plan``/``ep_plan`` properties. Rules are keyed by module or
parameter name with ``*`` standing for a layer number; here they are expanded against the model's
own ``named_modules``/``named_parameters`` into one entry per concrete parameter (to shard) and per
module (to hook), parameters first.
"""
from __future__ import annotations

import re
from typing import Dict

import torch.nn as nn


def model_plan(model: nn.Module, kind: str) -> Dict[str, str]:
    """The model's ``kind`` ("tp" or "ep") plan with wildcards; {} when it has none."""
    plan = getattr(model, f"{kind}_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    # Older transformers: build it from the config and the head class, as the model itself would.
    config = getattr(model, "config", None)
    base = dict(getattr(config, f"base_model_{kind}_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        base = {f"{prefix}.{key}": style for key, style in base.items()}
    return {**dict(getattr(type(model), f"_{kind}_plan", None) or {}), **base}


def _matcher(plan: Dict[str, str]):
    patterns = [(re.compile(re.escape(key).replace(r"\*", r"\d+")), style) for key, style in plan.items()]

    def style_of(name: str):
        for pattern, style in patterns:
            if pattern.fullmatch(name):
                return style
        return None
    return style_of


def expand_plan(model: nn.Module, plan: Dict[str, str]) -> Dict[str, str]:
    """One entry per concrete parameter and module name. A parameter without a rule of its own
    takes its module's rule (``q_proj: colwise`` shards ``q_proj.weight`` and ``q_proj.bias``)."""
    style_of = _matcher(plan)
    expanded: Dict[str, str] = {}
    for module_name, module in model.named_modules():
        module_style = style_of(module_name) if module_name else None
        for param_name, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            style = style_of(name) or module_style
            if style is not None:
                expanded[name] = style
        if module_style is not None:
            expanded[module_name] = module_style
    return expanded


def drop_covered(plan: Dict[str, str], covered: Dict[str, str]) -> Dict[str, str]:
    """``plan`` without the entries on the modules of ``covered`` and their children/parameters."""
    roots = [name for name in covered if name]
    return {name: style for name, style in plan.items()
            if not any(name == root or name.startswith(root + ".") for root in roots)}
