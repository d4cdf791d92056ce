"""Run documentation snippets, each in a process of its own, without paying the heavy imports each time.

    run_snippets.py OUT.json SNIPPET.py[:CWD] [SNIPPET.py[:CWD] ...]     (as many at a time as there are CPUs)

This process imports the third-party libraries the snippets use (torch with torch.distributed, accelerate,
transformers, datasets: ~3 s of start-up per process) once, then forks one child per snippet: a new process
with nothing of the snippet's own -- no hyperacc module (a snippet that forgets an import of hyperacc fails
as it would for a user), no process group, no Accelerator -- that runs the file as ``python SNIPPET.py``
does (``__main__``, ``sys.argv``, ``sys.path[0]`` the file's folder) in CWD (default: the file's folder),
its output in SNIPPET.py.stdout / .stderr. OUT.json: {snippet: exit code}, in the order given. A
single-process Accelerator uses an in-memory store (no port), so snippets can run side by side.
"""
import json
import os
import runpy
import sys
import traceback

import accelerate  # noqa: F401  the imports every snippet's process would otherwise pay for again
import datasets  # noqa: F401
import torch  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import transformers.modeling_utils  # noqa: F401

if any(name == "hyperacc" or name.startswith("hyperacc.") for name in sys.modules):
    raise SystemExit("run_snippets.py must not import hyperacc before the snippets run")


def run_child(path: str, cwd: str) -> int:
    out = os.open(path + ".stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(path + ".stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.chdir(cwd)
    sys.argv = [path]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter would print, and its exit code
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def start(spec: str) -> int:
    path, _, cwd = spec.partition(":")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = run_child(path, cwd or os.path.dirname(os.path.abspath(path)))
        finally:
            os._exit(code)
    return pid


def main():
    out, specs = sys.argv[1], sys.argv[2:]
    jobs = os.cpu_count() or 1          # snippets side by side: each its own process, folder and (HashStore) group
    codes, running, waiting = {}, {}, list(specs)
    while waiting or running:
        while waiting and len(running) < jobs:
            spec = waiting.pop(0)
            running[start(spec)] = spec
        pid, status = os.wait()
        codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    with open(out, "w") as handle:
        json.dump({spec: codes[spec] for spec in specs}, handle)


if __name__ == "__main__":
    main()
