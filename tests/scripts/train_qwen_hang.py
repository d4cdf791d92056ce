"""TEST ONLY: examples/train_qwen.py where one rank stops responding (SIGSTOP) at an optimizer step.

    torchrun ... tests/scripts/train_qwen_hang.py [train_qwen.py arguments]
    HANG_AT_STEP=N (1-based optimizer step: the rank stops before its first forward of step N),
    or HANG_PHASE=data|load_state (the rank stops as it starts building the data / loading the checkpoint),
    HANG_RANK=R (default 1).
The example holds no test hook: this wrapper adds a forward pre-hook to the model it builds, or wraps
the function of the phase.
"""
import os
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples"))
sys.path.insert(0, REPO)

from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: E402

import train_qwen  # noqa: E402

AT, RANK = int(os.environ.get("HANG_AT_STEP", "0")), int(os.environ.get("HANG_RANK", "1"))
PHASE = os.environ.get("HANG_PHASE")
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


def stop_first(function):
    """``function``, except that rank RANK stops (SIGSTOP) as it starts it."""
    def wrapped(*args, **kwargs):
        if int(os.environ.get("RANK", "0")) == RANK:
            os.kill(os.getpid(), signal.SIGSTOP)
        return function(*args, **kwargs)
    return wrapped


if PHASE == "data":
    train_qwen.build_data = stop_first(train_qwen.build_data)
elif PHASE == "load_state":
    import hyperacc.accelerator
    hyperacc.accelerator.Accelerator.load_state = stop_first(hyperacc.accelerator.Accelerator.load_state)

if __name__ == "__main__":
    train_qwen.main()
