"""TEST ONLY: examples/train_qwen.py with other flags on one rank, as if that node were launched
differently: EXTRA_ARGS_RANK=R, EXTRA_ARGS="--a=1 --b=2" (replacing --a/--b when given)."""
import os
import shlex
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "examples"))
sys.path.insert(0, REPO)

import train_qwen  # noqa: E402

if __name__ == "__main__":
    extra = shlex.split(os.environ["EXTRA_ARGS"]) if os.environ.get("RANK") == os.environ["EXTRA_ARGS_RANK"] else []
    replaced = {flag.split("=")[0] for flag in extra}
    train_qwen.main([a for a in sys.argv[1:] if a.split("=")[0] not in replaced] + extra)
