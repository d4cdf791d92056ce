"""LoRA in examples/train_qwen.py (``--peft.*``): the frozen base's dtype, the `peft.LoraConfig` of the
``peft`` section, wrapping the meta-device base, and the exports at the end of training."""
import re

from config_checks import check_peft_targets
from hyperacc.errors import ConfigError


def base_dtype(cfg, config, *, random_base=False):
    """The frozen base's dtype under LoRA: ``peft.base_dtype``, else the pretrained checkpoint's own
    (None with ``config`` None: `load_pretrained` reads it from the files; else ``config.dtype``), or
    bf16 for a randomly initialised base."""
    import torch

    if cfg.peft.base_dtype is not None:
        return {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.peft.base_dtype]
    if random_base:
        return torch.bfloat16
    if config is None:
        return None
    dtype = getattr(config, "dtype", None) or torch.float32     # as load_pretrained reads it
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def lora_config(cfg):
    """``peft.LoraConfig`` of the ``peft`` section (a causal LM; ``all-linear`` as PEFT means it)."""
    from peft import LoraConfig, TaskType

    p = cfg.peft
    targets = [t.strip() for t in p.target_modules]
    return LoraConfig(task_type=TaskType.CAUSAL_LM, r=p.r, lora_alpha=p.alpha, lora_dropout=p.dropout,
                      target_modules="all-linear" if targets == ["all-linear"] else targets,
                      modules_to_save=[m.strip() for m in p.modules_to_save] if p.modules_to_save else None)


def apply_peft(cfg, model):
    """``model`` (the base, on the meta device) under LoRA adapters: a ``peft.PeftModel`` whose base is
    frozen; ``prepare`` shards it like any model. A target that matches no module, or one PEFT cannot
    adapt, is one ConfigError."""
    from peft import get_peft_model

    from hyperacc.integrations.peft import check_layout

    check_peft_targets(cfg, model)
    try:
        model = get_peft_model(model, lora_config(cfg))
    except (ValueError, TypeError) as err:
        # PEFT names a module it cannot adapt by its whole repr: its class name says enough.
        text = re.sub(r"Target module (\w+)\(.*?\) is not supported", r"Target module \1 is not supported",
                      str(err), flags=re.S)
        raise ConfigError(f"peft: PEFT refuses this LoRA setup on {type(model).__name__}: {' '.join(text.split())} "
                          "Fix: change --peft.target_modules / --peft.modules_to_save as named.") from None
    try:
        check_layout(model, cfg.parallel.tp_size or 1, cfg.parallel.ep_size or 1)     # what prepare() refuses
    except NotImplementedError as err:
        raise ConfigError(f"peft: {' '.join(str(err).split())}") from None
    return model


def export_peft(cfg, acc, model, tokenizer=None):
    """Collective: the adapters in PEFT's format (``peft.export_dir``) and/or the base with the adapters
    merged, a plain Hugging Face checkpoint (``peft.merged_export_dir``); every rank writes its share.
    The training tokenizer goes with each: ``AutoTokenizer`` loads it from the same directory, and the
    merged model's config gets its eos/pad ids (the example's preset configs have none)."""
    from hyperacc.integrations.peft import export_adapter, export_merged

    group = acc.runtime.cpu_group
    if cfg.peft.export_dir:
        export_adapter(model, cfg.peft.export_dir, group=group, tokenizer=tokenizer)
        acc.print(f"adapter exported to {cfg.peft.export_dir} (peft.PeftModel.from_pretrained(base, dir) loads it)")
    if cfg.peft.merged_export_dir:
        export_merged(model, cfg.peft.merged_export_dir, group=group, tokenizer=tokenizer)
        acc.print(f"merged model exported to {cfg.peft.merged_export_dir} (transformers' from_pretrained loads it, "
                  "AutoTokenizer its tokenizer)")
