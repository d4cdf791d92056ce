"""Layer 3: precision recipes (which dtype parameters, gradients and optimizer states live in), hyperacc's AdamW and its layout-independent stochastic rounding."""
from hyperacc.precision.recipes import (  # noqa: F401 - the package's public names
    Recipe,
    RECIPES,
    DEFAULT_RECIPE,
    get_recipe,
    check_recipe,
    recipe_for,
    adapt_optimizer,
)
