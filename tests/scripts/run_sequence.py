"""Several runs of a test script in one job: ``script.py ARGS ... --then ARGS ... [--then ...]``.

A 2-process launch costs several seconds of start-up (interpreters, imports, the process group) and a
tiny run a second or two, so tests that need several runs of the same script on the same number of
processes make them in one launch. Each run builds its own Accelerator, model, optimizer and loader on
the one process group (created here when there are several runs; an Accelerator leaves a process
group it did not create up), exactly as a job of its own would, and writes its own output file.
"""
import os
import sys
import time

import torch.distributed as dist


def split_runs(argv):
    """``argv`` cut at each ``--then``: one argument list per run."""
    runs = [[]]
    for arg in argv:
        if arg == "--then":
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


def run_all(run, parse, argv=None):
    """``run(parse(args))`` for each run of ``argv`` (default: the command line), in order."""
    runs = split_runs(sys.argv[1:] if argv is None else argv)
    if len(runs) > 1 and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    for args in runs:
        run(parse(args))
    if len(runs) > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        time.sleep(0.05)   # as hyperacc.runtime.process.shutdown: gloo threads finish before the interpreter


def then(*runs):
    """The command-line arguments of ``runs`` (argument lists) for one launch."""
    out = []
    for args in runs:
        out += [*(["--then"] if out else []), *map(str, args)]
    return out
