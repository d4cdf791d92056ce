"""Layer 4: building causal-LM models (presets, meta device, pretrained weights), what prepare() does to a model's weights in order, and the packed_sdpa attention."""
from hyperacc.models.build import (  # noqa: F401 - the package's public names
    TINY_QWEN3_MOE,
    qwen3_moe_config,
    with_router_aux_loss,
    build_causal_lm,
    has_pretrained_weights,
    load_pretrained,
)
