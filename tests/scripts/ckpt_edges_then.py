"""Several modes of tests/scripts/ckpt_edges.py one after another in one process (a start-up costs more than
a tiny run): ``ckpt_edges_then.py MODE ARGS ... --then MODE ARGS ...``. tests/test_checkpoint_edges.py runs
``accelerate_save DIR --then accelerate_fix DIR OUT``: the fix builds its own Accelerator, model (another
init) and optimizer and loads DIR from disk, as a new script of its own would."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckpt_edges  # noqa: E402
from run_sequence import split_runs  # noqa: E402

MODES = {"policy": ckpt_edges.policy, "accelerate_save": ckpt_edges.accelerate_save,
         "accelerate_fix": ckpt_edges.accelerate_fix}

if __name__ == "__main__":
    for mode, *args in split_runs(sys.argv[1:]):
        MODES[mode](*args)
