"""The names of the precision recipes, checked when a config is built.

Why here, torch-free: ``FSDPConfig.precision`` names a recipe and a name that is not one must fail when
the config is built, before anything runs, while the config layer stays importable without torch (the
convert CLI reads configs). What each recipe holds (dtypes, rounding) is `hyperacc.precision.recipes`.
"""
from __future__ import annotations

from typing import Optional

RECIPE_NAMES = ("fp32_master", "bf16", "bf16_sr")
DEFAULT_RECIPE = "fp32_master"


def check_recipe_name(name: Optional[str]) -> str:
    """``name`` (None: the default) if it names a recipe, else one ValueError listing the choices."""
    name = DEFAULT_RECIPE if name is None else str(name)
    if name not in RECIPE_NAMES:
        raise ValueError(f"precision={name!r} is not a recipe; choose one of {', '.join(RECIPE_NAMES)} "
                         f"(see docs/guides/precision.md). Fix: FSDPConfig.precision='{DEFAULT_RECIPE}' (the "
                         "default), or another recipe named above.")
    return name
