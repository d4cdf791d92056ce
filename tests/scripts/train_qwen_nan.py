"""TEST ONLY: examples/train_qwen.py with a NaN loss planted at one optimizer step on one rank.

    accelerate launch ... tests/scripts/train_qwen_nan.py [train_qwen.py arguments]
    NAN_AT_STEP=N (1-based optimizer step), NAN_RANK=R (default 1), NAN_AT_STEPS_FROM=1: every
    step >= N instead of step N only.

The example itself holds no test hook: this wrapper adds a forward hook to the model the example
builds (its first training micro-batch of step N on rank R returns loss * NaN) and counts
optimizer steps with torch's public global optimizer step hook.
"""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples"))
sys.path.insert(0, REPO)

from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: E402

import train_qwen  # noqa: E402

AT = int(os.environ["NAN_AT_STEP"])
RANK = int(os.environ.get("NAN_RANK", "1"))
FROM = os.environ.get("NAN_AT_STEPS_FROM") == "1"
state = {"steps": 0, "planted_in_step": None}


def _count_step(optimizer, args, kwargs):
    state["steps"] += 1


register_optimizer_step_pre_hook(_count_step)


def _plant(module, args, kwargs, output):
    step = state["steps"] + 1
    hit = step >= AT if FROM else step == AT
    if (module.training and hit and int(os.environ.get("RANK", "0")) == RANK
            and state["planted_in_step"] != step and getattr(output, "loss", None) is not None):
        state["planted_in_step"] = step           # the first micro-batch of the step only
        output.loss = output.loss * float("nan")
    return output


_build = train_qwen.build_model


def build_model(cfg, vocab_size=None, **kwargs):
    model = _build(cfg, vocab_size, **kwargs)
    model.register_forward_hook(_plant, with_kwargs=True)
    return model


train_qwen.build_model = build_model

if __name__ == "__main__":
    train_qwen.main()
