"""What a PEFT adapter is made of: exactly the tensors PEFT's own ``get_peft_model_state_dict`` keeps.

Why PEFT's function and not the model's structure: PEFT decides, per config, what an adapter file
holds -- each tuner's own tensors, the biases it trains (``bias="all"`` / ``"lora_only"``), the
``modules_to_save`` copies, DoRA magnitudes, trainable-token deltas, and embedding layers when they are
targeted or were resized. A list of hyperacc's own, read off the model's structure, left the trained
biases out: the export loaded, and gave other logits than the trained model. Here PEFT itself
chooses, so the choice is PEFT's by construction: its function runs over placeholders (a meta tensor of
the right shape and dtype per state-dict key: nothing is gathered, nothing allocated), and each
placeholder it returns names the model tensor it stands for. Only then are those tensors gathered, one
at a time (`hyperacc.integrations.peft_export`).

A value PEFT computes while saving instead of picking it (VB-LoRA's top-k weights, prompt learning's
prompt embeddings) is no placeholder: hyperacc cannot reproduce it from sharded tensors exactly, and
refuses it in one line before anything is gathered or written. So is a tensor that trains but that
PEFT's format does not hold (the reloaded adapter would lack it).

Checkpoints use the same choice (`trained_names`): an adapters-only checkpoint holds every tensor
PEFT keeps (and everything that trains), so a resume loses nothing an export would keep.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn


def placeholders(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every state-dict key of ``model`` -> a distinct meta tensor of that tensor's (full) shape and dtype."""
    out = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor):
            out[key] = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
    return out


def saved_keys(model: nn.Module, adapter: str, *, save_embedding_layers="auto",
               stand_ins: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, str]:
    """{key in PEFT's adapter file: the model's state-dict key it comes from} for ``adapter``, as
    ``PeftModel.save_pretrained(save_embedding_layers=...)`` chooses them (PEFT's own function).
    Raises NotImplementedError when PEFT computes a saved value instead of taking a model tensor."""
    from peft.utils import get_peft_model_state_dict

    config = model.peft_config[adapter]
    kind = getattr(config.peft_type, "value", config.peft_type)
    if getattr(config, "is_prompt_learning", False):
        # PEFT saves prompt embeddings it computes by running the prompt encoder (on sharded weights:
        # a collective on the one rank that saves): refused before PEFT's function runs at all.
        raise NotImplementedError(
            f"adapter {adapter!r} ({kind}): PEFT saves prompt-learning adapters as prompt embeddings it computes "
            "while saving, not as stored model tensors, and hyperacc's sharded export writes stored tensors only. "
            "Fix: a LoRA-family adapter (LoraConfig, LoHa, LoKr), or train the prompt adapter without hyperacc's "
            "sharding.")
    stand_ins = placeholders(model) if stand_ins is None else stand_ins
    source = {id(t): key for key, t in stand_ins.items()}
    chosen = get_peft_model_state_dict(model, state_dict=stand_ins, adapter_name=adapter,
                                       save_embedding_layers=save_embedding_layers)
    out = {}
    for file_key, value in chosen.items():
        if id(value) not in source:
            raise NotImplementedError(
                f"adapter {adapter!r} ({kind}): PEFT computes the saved tensor {file_key!r} while saving instead of "
                "storing a model tensor, and hyperacc's sharded export writes stored tensors only (it cannot "
                "reproduce the value exactly). Fix: a configuration whose tensors PEFT saves as they are (VB-LoRA: "
                "save_only_topk_weights=False), or a LoRA-family adapter (LoraConfig, LoHa, LoKr).")
        out[file_key] = source[id(value)]
    return out


def adapter_files(model: nn.Module, *, save_embedding_layers="auto") -> Dict[str, Dict[str, str]]:
    """`saved_keys` of every adapter of the PEFT model (what ``save_pretrained`` writes: all of them)."""
    stand_ins = placeholders(model)
    return {adapter: saved_keys(model, adapter, save_embedding_layers=save_embedding_layers, stand_ins=stand_ins)
            for adapter in model.peft_config}


def check_exportable(model: nn.Module, files: Dict[str, Dict[str, str]]) -> None:
    """Refuse, in one line, a trainable tensor that no adapter file holds: the reloaded adapter would
    silently lack what was trained."""
    kept = {key for keys in files.values() for key in keys.values()}
    for name, param in model.named_parameters():
        if param.requires_grad and name not in kept:
            raise ValueError(
                f"{name} trains, but PEFT's adapter format does not hold it (get_peft_model_state_dict leaves it "
                "out): the exported adapter would silently lack it. Fix: name its module in the PEFT config's "
                "modules_to_save before training, freeze it (requires_grad=False), or export the merged model "
                "(export_merged), which holds every trained tensor.")


def trained_names(model: nn.Module) -> set:
    """What an adapters-only checkpoint must hold beyond the trainable parameters: every tensor PEFT
    keeps for any adapter (embedding layers aside: a frozen base layer comes back from the base's
    source, and the frozen-base fingerprint checks it). Local, no collective, no file or hub access."""
    try:
        files = adapter_files(model, save_embedding_layers=False)
    except NotImplementedError:
        files = {}          # a computed value: the checkpoint still holds what trains (the export refuses)
    return {key for keys in files.values() for key in keys.values()}
