"""The model of examples/train_qwen.py: its transformers config (preset or pretrained, with the run's
overrides) and the model itself, on the meta device or from pretrained weights, with LoRA when asked.

Apart from the loop because preflight (`preflight_checks.py`: the PEFT targets, the memory plan, a
resume's model shapes) builds the same config and model on the meta device as training does.
"""
from hyperacc.errors import ConfigError
from lora_setup import apply_peft, base_dtype


def model_config(cfg, vocab_size=None):
    """The transformers config: the preset (or the pretrained config) + overrides, no KV cache."""
    from hyperacc.models import qwen3_moe_config

    overrides = dict(cfg.model.overrides)
    if vocab_size is not None and "vocab_size" not in overrides:
        overrides["vocab_size"] = vocab_size
    if cfg.model.name_or_path:
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(cfg.model.name_or_path)
        for key, value in overrides.items():
            setattr(config, key, value)
    elif cfg.model.preset == "tiny":
        config = qwen3_moe_config(**overrides)
    else:
        raise ConfigError(f"model.preset={cfg.model.preset!r} is unknown. Fix: --model.preset=tiny "
                          "(with model.overrides) or set model.name_or_path.")
    config.use_cache = False
    return config


def build_model(cfg, vocab_size=None, accelerator=None):
    """On the meta device (random init after sharding), or, with ``accelerator``, the pretrained
    weights when present (a directory or a hub id in the local cache; each rank later reads only its
    own shards of them in ``prepare``). Without one (planning) the pretrained config, on meta.
    With ``peft.method=lora``: the same base, frozen in ``peft.base_dtype``, under LoRA adapters."""
    from hyperacc.models import build_causal_lm, has_pretrained_weights, load_pretrained, with_router_aux_loss
    from hyperacc.precision import get_recipe

    path, lora = cfg.model.name_or_path, cfg.peft.method == "lora"
    pretrained = bool(path) and has_pretrained_weights(path)
    if pretrained and accelerator is not None:
        # Full fine-tuning: stored as the recipe says. LoRA: the frozen base in peft.base_dtype (None: the files').
        dtype = base_dtype(cfg, None) if lora else get_recipe(cfg.fsdp.precision).param_dtype
        model = load_pretrained(path, accelerator=accelerator, dtype=dtype,
                                attn_implementation=cfg.model.attn_implementation or "eager")
        model.config.use_cache = False
        model.config = with_router_aux_loss(model.config, cfg.model.router_aux_loss != "off")
        return apply_peft(cfg, model) if lora else model
    config = model_config(cfg, vocab_size)
    moe = hasattr(config, "router_aux_loss_coef")
    model = build_causal_lm(config, meta_device=True, attn_implementation=cfg.model.attn_implementation or "eager",
                            router_aux_loss=cfg.model.router_aux_loss != "off",
                            experts_implementation=cfg.model.experts_implementation if moe else None)
    if not lora:
        return model
    from hyperacc.sharding import cast_parameters

    # The base as training will store it: the pretrained files' dtype (planning), else bf16 (random init).
    cast_parameters(model, base_dtype(cfg, config if pretrained else None, random_base=not pretrained))
    return apply_peft(cfg, model)

