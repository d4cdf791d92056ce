"""The layered architecture (issue 39) against the previous flat package, measured in one run.

    .venv/bin/python benchmarks/architecture.py [--baseline f56f13a] [--rounds 5] [--skip-steps]

The baseline is a git revision of this repository (default: the last commit before the layering),
checked out into a temporary worktree. Printed, baseline -> now:
* the package's shape: modules, modules at the package root, modules over 400 lines, hyperacc imports
  inside functions, import cycles, imports against the layers of `.importlinter`;
* import time of ``from hyperacc import Accelerator`` and of the light entry points (``hyperacc.config``,
  the convert CLI's ``hyperacc.data.convert``), median of ``--rounds`` fresh interpreters each;
* `benchmarks/overhead.py` of each tree (hyperacc's step time over a hand-written raw FSDP2 loop on the
  same 2-process mesh): the layering must not add per-step cost.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("architecture_report", REPO / ".ci" / "architecture_report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

IMPORTS = {
    "from hyperacc import Accelerator": "from hyperacc import Accelerator",
    "import hyperacc.config": "import hyperacc.config",
    "import hyperacc.data.convert": "import hyperacc.data.convert",
}


def _moved_modules() -> dict:
    """Old flat module -> its package now (hyperacc/_moved.py's table), read without importing hyperacc."""
    import ast

    tree = ast.parse((REPO / "hyperacc" / "_moved.py").read_text())
    table = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and getattr(node.targets[0], "id", None) == "MOVED")
    return {f"hyperacc.{k}": f"hyperacc.{v}" for k, v in ast.literal_eval(table).items()}


def import_seconds(tree: pathlib.Path, statement: str, rounds: int) -> float:
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    times = []
    for _ in range(rounds):
        out = subprocess.run([sys.executable, "-c", code], cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin",
                             "HF_HUB_OFFLINE": "1"}, check=True, capture_output=True, text=True)
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(times)


def overhead_ratio(tree: pathlib.Path) -> float:
    out = subprocess.run([sys.executable, str(tree / "benchmarks" / "overhead.py"), "--rounds", "1", "--steps", "8"],
                         cwd=tree, check=True, capture_output=True, text=True, timeout=1800)
    return float(re.search(r"ratio hyperacc/raw: ([0-9.]+)", out.stdout).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="f56f13a", help="git revision of the flat package")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-steps", action="store_true", help="skip the overhead.py comparison (~3 min)")
    args = parser.parse_args()
    order = report.layers(REPO)
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.baseline],
                       check=True, capture_output=True)
        try:
            moved = _moved_modules()
            before, after = report.shape(base, order, renamed=moved), report.shape(REPO, order)
            print(f"shape of the package, {args.baseline} -> now (layers as in .importlinter now; an old module "
                  "counts in the layer of the package it moved to)")
            for key, label in (("modules", "modules"), ("root_modules", "modules at the package root"),
                               ("lines", "lines"), ("over_400", "modules over 400 lines"),
                               ("imports_in_functions", "hyperacc imports inside functions"),
                               ("cycles", "import cycles"), ("against_layers", "imports against the layers")):
                value = lambda numbers: numbers[key] if isinstance(numbers[key], int) else len(numbers[key])  # noqa: E731
                print(f"  {label:36s} {value(before):6d} -> {value(after):6d}")
            print(f"import time, median of {args.rounds} fresh interpreters (now / {args.baseline})")
            for label, statement in IMPORTS.items():
                old, new = import_seconds(base, statement, args.rounds), import_seconds(REPO, statement, args.rounds)
                print(f"  {label:36s} {old * 1000:7.0f} ms -> {new * 1000:7.0f} ms   ratio {new / old:.2f}")
            if not args.skip_steps:
                old, new = overhead_ratio(base), overhead_ratio(REPO)
                print(f"step time hyperacc / raw FSDP2 loop (benchmarks/overhead.py, 2 processes): "
                      f"{args.baseline} {old:.3f} -> now {new:.3f}   ratio {new / old:.2f}")
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], capture_output=True)


if __name__ == "__main__":
    main()
