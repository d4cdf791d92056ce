"""Integrations with libraries hyperacc does not depend on, and with frameworks that build their own
accelerator: each module imports its library only when a user's object comes from it (`peft` for
adapters) or when the user imports that module (`trl` for `hyperacc.integrations.trl.SFTTrainer`).
`transformers` (`hyperacc.integrations.transformers.Trainer`, `HyperaccTrainerMixin`) is a core dependency."""
