"""hyperacc as the engine under TRL's trainers: same constructors, one import.

    from hyperacc.integrations.trl import SFTTrainer, DPOTrainer, GRPOTrainer  # instead of: from trl import ...

TRL's own options keep their meaning (``peft_config=`` LoRA through hyperacc's PEFT support, packing,
padding-free, completion-only and assistant-only loss, ``precompute_ref_log_probs``, reward functions): TRL
prepares the data, generates and computes the loss; hyperacc shards, accumulates, checkpoints and resumes
(`hyperacc.integrations.transformers`). A frozen reference model is sharded on the policy's mesh
(`hyperacc.integrations.trl_reference`); the online trainers' completions are seeded per sample and their
generation kept in step across ranks (`hyperacc.integrations.trl_online`). Any other TRL trainer built on
`Trainer` runs with ``class MyTrainer(HyperaccTRLMixin, trl.SomeTrainer)``.
`trl` is an optional extra (``pip install hyperacc[trl]``): it is imported only by this module.
"""
from __future__ import annotations

import trl

from hyperacc.integrations.transformers import HyperaccTrainerMixin
from hyperacc.integrations.trl_online import HyperaccOnlineMixin
from hyperacc.integrations.trl_reference import HyperaccTRLMixin

__all__ = ["SFTTrainer", "DPOTrainer", "KTOTrainer", "RewardTrainer", "GRPOTrainer", "RLOOTrainer",
           "HyperaccTRLMixin", "HyperaccOnlineMixin"]


class SFTTrainer(HyperaccTrainerMixin, trl.SFTTrainer):
    """`trl.SFTTrainer` on hyperacc: same constructor and arguments."""


class DPOTrainer(HyperaccTRLMixin, trl.DPOTrainer):
    """`trl.DPOTrainer` on hyperacc: same constructor and arguments; the reference sharded frozen."""


class KTOTrainer(HyperaccTRLMixin, trl.KTOTrainer):
    """`trl.KTOTrainer` on hyperacc: same constructor and arguments; the reference sharded frozen."""


class RewardTrainer(HyperaccTrainerMixin, trl.RewardTrainer):
    """`trl.RewardTrainer` on hyperacc: same constructor and arguments."""


class GRPOTrainer(HyperaccOnlineMixin, trl.GRPOTrainer):
    """`trl.GRPOTrainer` on hyperacc: same constructor and arguments; completions seeded per sample, the
    reference (``beta > 0``) sharded frozen."""


class RLOOTrainer(HyperaccOnlineMixin, trl.RLOOTrainer):
    """`trl.RLOOTrainer` on hyperacc: same constructor and arguments; completions seeded per sample, the
    reference (``beta > 0``) sharded frozen."""
