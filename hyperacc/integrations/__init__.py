"""Integrations with libraries hyperacc does not depend on, and with frameworks that build their own
accelerator: each module imports its library only when a user's object comes from it (`peft` for
adapters) or when the user imports that module (`trl` for `hyperacc.integrations.trl.SFTTrainer`).
`transformers` (`hyperacc.integrations.transformers.Trainer`, `HyperaccTrainerMixin`) is a core dependency.

Model kinds (`hyperacc.kinds`) are declared here, lazily: the core asks `kinds.for_model(model)` and
never names an integration; a predicate that imports nothing decides when `peft_kind` is imported
(a `peft.PeftModel` cannot exist unless ``peft`` is imported, so ``sys.modules`` answers exactly).
The package root imports this package, so the declaration holds whatever hyperacc module a user
imports first.
"""
import sys

from hyperacc import kinds


def _is_peft_model(model) -> bool:
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


kinds.register_lazy(_is_peft_model, "hyperacc.integrations.peft_kind")
