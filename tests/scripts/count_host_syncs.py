"""TEST ONLY: examples/train_qwen.py with its host synchronisations counted per optimizer step.

    python tests/scripts/count_host_syncs.py OUT_DIR [train_qwen.py arguments]   (or under torchrun)

Counted, per optimizer step (from one ``MetricsLogger.log_step`` return to the next; the window's
flush happens inside the logging step's call):
* reads: ``Tensor.item``/``cpu``/``tolist``/``__float__``/``__int__``/``__bool__`` of a tensor on a
  non-CPU device anywhere, or of a floating-point tensor when called from hyperacc's or the example's
  own code. On a CPU run no tensor lives on a device, so the second rule stands in for it: the loss,
  the gradient norm and the metrics values are float tensors hyperacc reads, while the token counts
  are integer host tensors from the loader and AdamW's CPU ``step`` reads happen inside torch.optim.
* host collectives: torch.distributed collectives issued by code outside torch (hyperacc, the
  example, accelerate); those torch issues itself (FSDP's all-gathers/reduce-scatters, DTensor's
  gradient-norm reduction) are device collectives and counted apart as ``device_collectives``.
Writes OUT_DIR/rank<R>.json: a list of {"step", "logging", "reads", "host_collectives", "device_collectives"}.
"""
import json
import os
import sys
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(REPO, "examples"), REPO]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import train_qwen  # noqa: E402
from hyperacc.training.metrics import MetricsLogger  # noqa: E402

TORCH = os.path.dirname(torch.__file__)
OURS = (os.path.join(REPO, "hyperacc"), os.path.join(REPO, "examples"))
WRAPPERS = (os.path.join(TORCH, "distributed", "c10d_logger.py"), os.path.join(TORCH, "distributed", "distributed_c10d.py"))
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "reduce", "broadcast", "gather", "scatter",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
               "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
               "monitored_barrier")
counts = {"reads": [], "host_collectives": [], "device_collectives": []}
steps = []


def _caller(skip=()):
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in skip:
        frame = frame.f_back
    return frame


def _read(name, original):
    def wrapper(self, *args, **kwargs):
        frame = _caller()
        where = frame.f_code.co_filename if frame is not None else ""
        if self.device.type != "cpu" or (self.is_floating_point() and where.startswith(OURS)):
            counts["reads"].append(f"{name} {os.path.relpath(where, REPO)}:{frame.f_lineno}")
        return original(self, *args, **kwargs)
    return wrapper


def _collective(name, original):
    def wrapper(*args, **kwargs):
        frame = _caller(WRAPPERS)
        where = frame.f_code.co_filename if frame is not None else ""
        kind = "device_collectives" if where.startswith(TORCH) else "host_collectives"
        counts[kind].append(f"{name} {os.path.relpath(where, REPO)}:{frame.f_lineno}")
        return original(*args, **kwargs)
    return wrapper


for attr in ("item", "cpu", "tolist", "__float__", "__int__", "__bool__"):
    setattr(torch.Tensor, attr, _read(attr, getattr(torch.Tensor, attr)))
for attr in COLLECTIVES:
    if hasattr(dist, attr):
        setattr(dist, attr, _collective(attr, getattr(dist, attr)))

_start, _log_step = MetricsLogger.start, MetricsLogger.log_step


def start(self):
    for value in counts.values():
        value.clear()
    return _start(self)


def log_step(self, **kwargs):
    records = _log_step(self, **kwargs)
    steps.append({"step": kwargs["step"], "logging": records is not None,
                  **{key: list(value) for key, value in counts.items()}})
    for value in counts.values():
        value.clear()
    return records


MetricsLogger.start, MetricsLogger.log_step = start, log_step

if __name__ == "__main__":
    out_dir, rank = sys.argv[1], int(os.environ.get("RANK", "0"))
    try:
        train_qwen.main(sys.argv[2:])
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise
    except Exception:
        traceback.print_exc()
        raise
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(steps, handle, indent=1)
