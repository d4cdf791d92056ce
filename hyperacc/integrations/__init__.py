"""Integrations with libraries hyperacc does not depend on: each module imports its library only when
a user's object comes from it (`peft` for adapters)."""
