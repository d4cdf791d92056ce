"""TRL trainers that keep a frozen reference model (DPO, KTO; GRPO and RLOO with ``beta > 0``) on hyperacc.

On accelerate, TRL shards the reference with its FSDP helper, which reads accelerate's ``parallelism_config``
(None on hyperacc: a DPO full fine-tune failed with "'NoneType' object has no attribute 'fsdp_dim_names'")
and wraps the whole model as one unit (the whole reference gathered at once). Here, while TRL's constructor
runs its own part (after `Trainer.__init__`), the trainer reports no FSDP, so TRL takes its generic branch,
``accelerator.prepare_model(ref, evaluation_mode=True)``: hyperacc shards the reference block by block on the
policy's mesh, frozen, in its own dtype, outside the checkpoints. With LoRA there is no reference copy (TRL
disables the adapters), and ``precompute_ref_log_probs`` runs the policy before it is sharded, as TRL does
without FSDP.
"""
from __future__ import annotations

import inspect
import weakref

import transformers

from hyperacc.integrations.transformers import HyperaccTrainerMixin


class _OwnSetup(transformers.TrainerCallback):
    """Marks the end of `Trainer.__init__` (``on_init_end``): from there until the TRL constructor returns,
    the trainer reports no FSDP so that TRL prepares its reference through `Accelerator.prepare_model`."""

    def __init__(self, trainer):
        self.trainer = weakref.ref(trainer)

    def on_init_end(self, args, state, control, **kwargs):
        trainer = self.trainer()
        if trainer is not None:
            trainer.__dict__["_hyperacc_trl_own_setup"] = True


class HyperaccTRLMixin(HyperaccTrainerMixin):
    """`HyperaccTrainerMixin` for a TRL trainer with a reference model (see the module doc)."""

    def __init__(self, *args, **kwargs):
        parent = super().__init__
        bound = inspect.signature(parent).bind(*args, **kwargs)
        mark = _OwnSetup(self)
        bound.arguments["callbacks"] = list(bound.arguments.get("callbacks") or []) + [mark]
        try:
            parent(*bound.args, **bound.kwargs)
        finally:
            self.__dict__["_hyperacc_trl_own_setup"] = False
        self.remove_callback(mark)

    @property
    def is_fsdp_enabled(self) -> bool:
        return self.__dict__.get("_hyperacc_fsdp", False) and not self.__dict__.get("_hyperacc_trl_own_setup", False)

    @is_fsdp_enabled.setter
    def is_fsdp_enabled(self, value: bool) -> None:
        self.__dict__["_hyperacc_fsdp"] = bool(value)
