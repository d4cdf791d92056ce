"""PEFT models as a hyperacc model kind (`hyperacc.kinds`): how a `peft.PeftModel` answers the core's
questions. The answers themselves live in `hyperacc.integrations.peft` (names, checks, adapter
initialisation), `peft_export` (PEFT's own export format) and `peft_runtime` (dtypes and adapter
switches under FSDP2); this module only wires them to the seam.

Imported -- and registered -- the first time a PEFT model reaches the core: `hyperacc.integrations`
declares it to `hyperacc.kinds.register_lazy` with a predicate that never imports peft.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Set

from torch import nn

from hyperacc import kinds
from hyperacc.integrations import peft, peft_export, peft_runtime


class PeftKind(kinds.ModelKind):
    """A `peft.PeftModel`: a frozen base (in its own dtype, not saved in checkpoints, read from the base
    model's files under its own names) and adapters (initialised by PEFT, saved, exported in PEFT's format)."""

    name = "peft"
    # PEFT's save_pretrained filters the adapters out of the state dict on every rank it runs on, even
    # where it writes nothing: only the main process calls it (every rank joins the gathers before).
    save_pretrained_on_main_only = True

    def matches(self, model: nn.Module) -> bool:
        return peft.is_peft_model(model)

    # FSDP / HSDP only. The function itself, not a call to it: the refusal's traceback ends in
    # prepare() -> check_model -> here.
    check_layout = staticmethod(peft.check_parallel)

    def keeps_dtype(self, model: nn.Module) -> Set[str]:
        # The frozen base keeps its dtype: no gradient, no optimizer state (`sharding.cast_parameters` says why).
        return {name for name, param in model.named_parameters() if not param.requires_grad}

    def before_sharding(self, model: nn.Module, *, device, seed: int) -> Dict[str, Any]:
        peft.broadcast_adapters(model, device)      # built before the seed was set: rank 0's init everywhere
        return peft.initial_adapter_values(model, seed)     # PEFT's own init, full size, seeded per layer

    def after_sharding(self, model: nn.Module, before: Dict[str, Any], *, initialised: bool) -> None:
        if initialised:
            peft.copy_modules_to_save(model)        # a trainable copy starts as its (just initialised) original
        peft.write_values(model, before)
        peft_runtime.match_copy_dtypes(model)       # fp32 modules_to_save copies between bf16 base layers
        peft_runtime.reshard_around_switches(model)     # PEFT's requires_grad toggles land on the sharded parameters

    def saves_trainable_only(self, model: nn.Module) -> bool:
        return True         # the base comes back from its pretrained files or seed (fingerprinted)

    def always_saved(self, model: nn.Module) -> Set[str]:
        return peft.adapter_tensor_names(model)

    def base_names(self, model: nn.Module) -> Dict[str, Optional[str]]:
        return peft.base_names(model)

    def export(self, model: nn.Module, out_dir: str, *, group=None, into_existing: bool = False,
               tokenizer=None, max_shard_bytes: Optional[int] = None) -> str:
        # What PeftModel.save_pretrained writes: the adapters, in PEFT's format (the base is not the run's to publish).
        return peft_export.export_adapter(model, out_dir, group=group, into_existing=into_existing, tokenizer=tokenizer)

    def pretrained_state_dict(self, model: nn.Module, get_state_dict) -> dict:
        return peft_export.adapter_state_dict(model)        # collective, adapters only, on every rank


PEFT = kinds.register(PeftKind())
