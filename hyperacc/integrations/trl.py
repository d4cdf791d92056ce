"""hyperacc as the engine under TRL's `SFTTrainer`: same constructor, one import.

    from hyperacc.integrations.trl import SFTTrainer        # instead of: from trl import SFTTrainer

TRL's own options keep their meaning (``peft_config=`` LoRA through hyperacc's PEFT support, packing,
padding-free, completion-only and assistant-only loss): TRL prepares the data and computes the loss;
hyperacc shards, accumulates, checkpoints and resumes (`hyperacc.integrations.transformers`).
`trl` is an optional extra (``pip install hyperacc[trl]``): it is imported only by this module.
"""
from __future__ import annotations

import trl

from hyperacc.integrations.transformers import HyperaccTrainerMixin


class SFTTrainer(HyperaccTrainerMixin, trl.SFTTrainer):
    """`trl.SFTTrainer` on hyperacc: same constructor and arguments."""
