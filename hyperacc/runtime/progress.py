"""Training progress counters: the "progress" checkpoint bucket, updated once per optimizer step."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Progress:
    """Where training stands. ``epoch`` mirrors the train loader's own epoch when one is prepared."""

    global_step: int = 0
    epoch: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, int(state[field.name]))
