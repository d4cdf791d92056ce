"""torchrun worker for tests/test_metrics.py: MetricsLogger over gloo on 2 ranks.

Every torch.distributed collective is wrapped to count calls made during each log_step. Each
rank writes what it saw to <out_dir>/rank<R>.json.
"""
import io
import json
import os
import sys

import torch.distributed as dist

from hyperacc.training.metrics import MetricsLogger

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "reduce", "broadcast", "gather",
               "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "barrier", "all_gather_object", "broadcast_object_list", "gather_object",
               "scatter_object_list", "send", "recv", "isend", "irecv", "monitored_barrier")
calls = []


def counting(name, fn):
    def wrapper(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return wrapper


def main():
    out_dir, metrics_file = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, counting(name, getattr(dist, name)))
    bar_stream = io.StringIO()
    lines = []
    logger = MetricsLogger(metrics_file=metrics_file, logging_steps=2, max_steps=5, initial_step=0,
                           progress_bar=True, progress_file=bar_stream, log_fn=lines.append)
    records, per_step_calls = [], []
    for step in range(1, 6):
        before = len(calls)
        records.append(logger.log_step(step=step, epoch=0, rank_shares={"loss": (rank + 1.0) / step}, grad_norm=1.0, lr=1e-3,
                                       step_time=0.1 * (rank + 1) * step, tokens=300, samples=3))
        per_step_calls.append(calls[before:])
    logger.close()
    result = {"rank": rank, "records": records, "calls": per_step_calls, "lines": lines,
              "bar": bar_stream.getvalue(), "has_bar": logger.is_main_process}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
