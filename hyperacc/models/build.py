"""Building causal-LM models from configs: presets, the meta device, and pretrained weights.

Models are built on the meta device so that a 30B model costs no host memory before it is
sharded; `hyperacc.sharding` materialises and initialises them after `fully_shard`.

transformers (and `hyperacc.models.packed_attention`, which registers ``packed_sdpa`` with it) is
imported inside the builders: ``import hyperacc.models`` stays light for the convert CLI and configs.
"""
from __future__ import annotations

import contextlib
import copy
import os
from typing import Optional

import torch
from torch import nn

from hyperacc.config.launch_env import env_hidden
from hyperacc.errors import WeightsError
from hyperacc.weights.files import has_safetensors, resolve_model_dir
from hyperacc.weights.load import SOURCE_ATTR, WeightsSource

TINY_QWEN3_MOE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=4, num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False,
)


def qwen3_moe_config(**overrides):
    """A `Qwen3MoeConfig` of the tiny preset, with ``overrides`` applied."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides})


def with_router_aux_loss(config, enabled: Optional[bool] = None):
    """``config`` with the MoE router's load-balancing loss switched on (``enabled=None``: on for
    every model that has one, i.e. a config with ``router_aux_loss_coef``); a dense config is
    returned unchanged. transformers then adds ``router_aux_loss_coef * aux_loss`` to ``loss`` and
    returns ``aux_loss`` separately."""
    if not hasattr(config, "router_aux_loss_coef"):
        return config
    want = True if enabled is None else bool(enabled)
    if getattr(config, "output_router_logits", None) != want:
        config = copy.deepcopy(config)
        config.output_router_logits = want
    return config


def build_causal_lm(config, *, meta_device: bool = False, seed: Optional[int] = None,
                    attn_implementation: str = "eager", router_aux_loss: Optional[bool] = None,
                    experts_implementation: Optional[str] = None):
    """Instantiate a causal LM from a transformers config with random weights.

    ``meta_device=True`` allocates nothing: the model is initialised later, after sharding.
    ``attn_implementation``: "eager" (default: bitwise reproducible everywhere), "sdpa", "packed_sdpa"
    (sdpa within each sample of packed rows: `hyperacc.models.packed_attention`), ...
    ``router_aux_loss``: the MoE load-balancing loss (None: on for models that have one; False:
    off), see `with_router_aux_loss`.
    ``experts_implementation``: MoE experts kernel ("grouped_mm", "eager" loop, ...; None: the
    transformers default, grouped_mm where supported).
    """
    from transformers import AutoModelForCausalLM

    import hyperacc.models.packed_attention  # noqa: F401  (registers "packed_sdpa" with transformers)

    if seed is not None:
        torch.manual_seed(seed)
    config = with_router_aux_loss(config, router_aux_loss)
    kwargs = {"attn_implementation": attn_implementation}
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    context = torch.device("meta") if meta_device else contextlib.nullcontext()
    with context:
        return AutoModelForCausalLM.from_config(config, **kwargs)


def has_pretrained_weights(path: str) -> bool:
    """True when ``path`` is a local directory holding Hugging Face weights, or a hub id whose
    weights are already in the local Hugging Face cache (nothing is downloaded)."""
    if not os.path.isdir(path):
        try:
            path = resolve_model_dir(path)
        except WeightsError:
            return False
    names = os.listdir(path)
    return any(n.endswith((".safetensors", ".bin")) and "model" in n for n in names)


def load_pretrained(path_or_id: str, *, accelerator=None, dtype=None, attn_implementation: str = "eager"):
    """Pretrained weights from a local directory or a hub id already in the local cache.

    With an ``accelerator`` the model comes back on the meta device, remembering its safetensors
    files, and ``accelerator.prepare(model)`` reads each rank's shards straight from them (no rank
    ever holds the whole model; see `hyperacc.weights.load`). Without one it is a plain
    `from_pretrained` on this process; loading on every rank, rather than rank 0 only, keeps the
    weights defined everywhere (accelerate's FSDP_CPU_RAM_EFFICIENT_LOADING would leave other
    ranks empty). ``attn_implementation`` as in `build_causal_lm`.
    """
    from transformers import AutoModelForCausalLM

    if accelerator is not None:
        return build_for_sharded_load(path_or_id, dtype=dtype, attn_implementation=attn_implementation)
    with _without_ram_efficient_loading():
        return AutoModelForCausalLM.from_pretrained(resolve_model_dir(path_or_id), dtype=dtype,
                                                    attn_implementation=attn_implementation)


def _without_ram_efficient_loading():
    return env_hidden(["FSDP_CPU_RAM_EFFICIENT_LOADING"])


def build_for_sharded_load(path_or_id: str, *, dtype=None, attn_implementation: str = "eager") -> nn.Module:
    """The model of ``path_or_id`` on the meta device (no memory), remembering its weight files;
    `fill_shards` loads them after sharding. ``dtype``: None keeps the checkpoint's (config's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import hyperacc.models.packed_attention  # noqa: F401  (registers "packed_sdpa" with transformers)

    directory = resolve_model_dir(path_or_id)
    if not has_safetensors(directory):
        raise WeightsError(f"{directory} holds no model.safetensors or model.safetensors.index.json: hyperacc "
                           "loads safetensors weights only (re-save *.bin weights with save_pretrained).")
    config = AutoConfig.from_pretrained(directory)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.name_or_path = path_or_id
    setattr(model, SOURCE_ATTR, WeightsSource(directory, dtype))
    return model
