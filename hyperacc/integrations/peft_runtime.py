"""A prepared PEFT model at run time under FSDP2: dtypes between fp32 trainable copies and a bf16
frozen base, and PEFT's adapter switches (which toggle ``requires_grad``) on resharded units.
Installed after sharding by the PEFT model kind (`hyperacc.integrations.peft_kind`)."""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
from torch import nn

from hyperacc.integrations.peft import copy_wrappers, is_peft_model
from hyperacc.sharding import reshard


def _first_float(module: nn.Module) -> Optional[torch.dtype]:
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)


def _cast(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and dtype is not None:
        return value.to(dtype)
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    return value


def _inputs_to_own_dtype(module, args, kwargs):
    """Before a trainable copy runs: its inputs in the dtype it computes in (read at call time, so
    FSDP's mixed-precision parameters count)."""
    dtype = _first_float(module)
    return _cast(args, dtype), {k: _cast(v, dtype) for k, v in kwargs.items()}


def match_copy_dtypes(model: nn.Module) -> None:
    """A ``modules_to_save`` copy stored in the recipe's dtype (fp32 master weights) beside a frozen
    bf16 base: its inputs are cast to its own dtype and its output back to the original module's,
    as PEFT's adapters do, so the layers around it see the dtype they expect."""
    for module in copy_wrappers(model):
        base_dtype = _first_float(module.original_module)
        for copy_module in module.modules_to_save.values():
            if _first_float(copy_module) in (None, base_dtype):
                continue
            copy_module.register_forward_pre_hook(_inputs_to_own_dtype, with_kwargs=True)
            copy_module.register_forward_hook(
                lambda mod, args, output, original=module.original_module: _cast(output, _first_float(original)))


def reshard_around_switches(model: nn.Module) -> None:
    """PEFT switches adapters on and off (``disable_adapter()``, ``set_adapter``, ...) by toggling
    ``requires_grad``. Under FSDP2 the flag that counts is the sharded parameter's (copied to the
    unsharded one at every all-gather); toggled while a unit is unsharded (after any forward, the
    root unit always) it lands on the unsharded copy only and is lost, and restoring it later lands
    on the sharded one: measured, a ``modules_to_save`` copy ended frozen after one
    ``with model.disable_adapter():`` -- still updated, but no longer in adapters-only checkpoints.
    Each of these calls is made on resharded units here, so the flags land where FSDP2 reads them."""
    if not is_peft_model(model):
        return
    switch_off = model.disable_adapter

    @contextlib.contextmanager
    def disable_adapter():
        reshard(model)
        with switch_off():
            try:
                yield
            finally:
                reshard(model)       # before PEFT restores the flags on exit

    model.disable_adapter = disable_adapter
    for owner, name in ((model, "set_adapter"), (model.base_model, "enable_adapter_layers"),
                        (model.base_model, "disable_adapter_layers")):
        method = getattr(owner, name, None)
        if method is not None:
            setattr(owner, name, _after_reshard(model, method))


def _after_reshard(model: nn.Module, method):
    @functools.wraps(method)
    def call(*args, **kwargs):
        reshard(model)
        return method(*args, **kwargs)
    return call
