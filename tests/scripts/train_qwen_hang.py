"""TEST ONLY: examples/train_qwen.py where one rank stops responding (SIGSTOP) at an optimizer step.

    torchrun ... tests/scripts/train_qwen_hang.py [train_qwen.py arguments]
    HANG_AT_STEP=N (1-based optimizer step: the rank stops before its first forward of step N),
    HANG_RANK=R (default 1).
The example holds no test hook: this wrapper adds a forward pre-hook to the model it builds.
"""
import os
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples"))
sys.path.insert(0, REPO)

from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: E402

import train_qwen  # noqa: E402

AT, RANK = int(os.environ["HANG_AT_STEP"]), int(os.environ.get("HANG_RANK", "1"))
steps = [0]
register_optimizer_step_pre_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))


def _stop(module, args):
    if module.training and steps[0] + 1 == AT and int(os.environ.get("RANK", "0")) == RANK:
        os.kill(os.getpid(), signal.SIGSTOP)      # the whole process, heartbeat thread included


original_build = train_qwen.build_model


def build_model(*args, **kwargs):
    model = original_build(*args, **kwargs)
    model.register_forward_pre_hook(_stop)
    return model


train_qwen.build_model = build_model

if __name__ == "__main__":
    train_qwen.main()
