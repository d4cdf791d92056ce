"""Building causal-LM models from configs: presets, the meta device, and pretrained weights.

Models are built on the meta device so that a 30B model costs no host memory before it is
sharded; `hyperacc.sharding` materialises and initialises them after `fully_shard`.
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch

TINY_QWEN3_MOE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=4, num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False,
)


def qwen3_moe_config(**overrides):
    """A `Qwen3MoeConfig` of the tiny preset, with ``overrides`` applied."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides})


def build_causal_lm(config, *, meta_device: bool = False, seed: Optional[int] = None,
                    attn_implementation: str = "eager"):
    """Instantiate a causal LM from a transformers config with random weights.

    ``meta_device=True`` allocates nothing: the model is initialised later, after sharding.
    ``attn_implementation``: "eager" (default: bitwise reproducible everywhere), "sdpa", ...
    """
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    context = torch.device("meta") if meta_device else contextlib.nullcontext()
    with context:
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def has_pretrained_weights(path: str) -> bool:
    """True when ``path`` is a local directory holding Hugging Face weights."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return any(n.endswith((".safetensors", ".bin")) and "model" in n for n in names)


def load_pretrained(path_or_id: str, *, dtype=None):
    """Load weights with `from_pretrained` (hub id or local directory) on every rank.

    Loading on every rank, rather than rank 0 only, keeps the weights defined everywhere before
    sharding (accelerate's FSDP_CPU_RAM_EFFICIENT_LOADING would leave other ranks empty).
    """
    from transformers import AutoModelForCausalLM

    with _without_ram_efficient_loading():
        return AutoModelForCausalLM.from_pretrained(path_or_id, dtype=dtype, attn_implementation="eager")


@contextlib.contextmanager
def _without_ram_efficient_loading():
    saved = os.environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = saved
