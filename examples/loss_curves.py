"""Loss-curve consistency across parallel layouts (the RFC's first acceptance item).

Runs examples/train_qwen.py once per layout -- same seed, same data, same global batch -- and
compares every step's loss with the first layout's (the reference):

    python examples/loss_curves.py                       # the default layouts, 500 steps
    python examples/loss_curves.py --steps 100 --layouts dp1 dp2 dp2-rc dp1-mb4 --out runs/curves
    python examples/loss_curves.py -- --fsdp.precision=bf16     # anything after -- goes to every run
    python examples/loss_curves.py --replot --out runs/curves   # analyse a saved run again

A layout is tokens joined by "-": dp<N> (data-parallel shards), tp<N>, cp<N>, ep<N> (expert
parallelism inside the dp x cp x tp ranks), mb<N> (micro-batch size: with the global batch fixed,
a smaller one means more accumulation), rc (activation recompute); every N is >= 1. It runs on
dp x cp x tp processes (plain python for one, `accelerate launch` on gloo otherwise).

Writes OUT/curves.json (the reference and, per layout: steps, loss, aux_loss, grad_norm),
OUT/curves.png (the curves and their relative deviation from the reference; needs matplotlib:
pip install hyperacc[plot]) and prints, per layout: the largest relative deviation of the loss at
any step, how many steps stayed within 1e-5 (the exact regime), and the largest relative deviation
of the moving average over --window steps. Why the last one decides: layouts sum in different
orders, so fp32 results differ in the last bits; in an MoE, once such a difference flips one
token's top-k choice the curves part like two runs of a chaotic system (here after ~60-80 steps)
while staying the same curve.

Curves are compared by step number, not by position. A step recorded more than once (a metrics
file that a resumed run appended to) counts with its LAST record, and the tool says so. A curve
that cannot be compared fails: a loss that is NaN/inf (or missing) at any step, in a layout or in
the reference (the first such step is named); a layout missing steps the reference has, or having
steps it lacks (the steps are named); a reference lacking some of the steps 1..--steps asked for
(with --replot: the number recorded in curves.json).

Exit codes: 0 every layout within --tolerance; 1 a layout beyond it, or a curve that cannot be
compared (above), or a run that failed; 2 bad input, reported in one line before anything runs
and before anything is written to OUT: a bad argument (--steps/--window < 1, --tolerance negative
or not finite), a layout that cannot be parsed, or that this machine or the example cannot run
(process count, ep vs ranks, the global batch vs dp x mb, tp/cp vs the heads, ep vs the experts,
a flag after --); with --replot, a missing or malformed OUT/curves.json.

--replot re-reads OUT/curves.json instead of training and compares against the reference recorded
there; with --layouts as well, only those saved layouts are analysed, the first as the reference.
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
if EXAMPLES not in sys.path:                 # the analysis module beside this file, however this one was loaded
    sys.path.insert(0, EXAMPLES)

from loss_curve_analysis import InputError, analyse, plot, report  # noqa: E402
from loss_curve_analysis import EXACT, Row, Series, passed, relative_deviation  # noqa: E402,F401 - the tool's analysis names

SCRIPT = os.path.join(EXAMPLES, "train_qwen.py")
LAUNCH_CONFIG = os.path.join(REPO, "accelerate_configs", "cpu_fsdp2_2proc.yaml")
DEFAULT_LAYOUTS = ["dp1", "dp2", "dp1-mb4", "dp2-rc", "dp2-ep2", "cp2", "tp2"]
TOKEN = re.compile(r"^(dp|tp|cp|ep|mb)(\d+)$|^rc$")


class LayoutError(InputError):
    """A layout that cannot be parsed or run here."""


# ------------------------------------------------------------------ arguments and layouts
def check_args(args) -> None:
    """Nonsense numbers fail here, in one line, rather than as a ZeroDivisionError mid-analysis or a
    tolerance that no deviation can exceed (NaN compares False with everything)."""
    if args.steps < 1:
        raise InputError(f"--steps {args.steps}: the run needs at least one step. Fix: e.g. --steps 100.")
    if args.window < 1:
        raise InputError(f"--window {args.window}: the moving average needs at least one step. Fix: e.g. --window 25.")
    if not math.isfinite(args.tolerance) or args.tolerance < 0:
        raise InputError(f"--tolerance {args.tolerance:g}: must be a finite number >= 0. Fix: e.g. --tolerance 5e-3.")
    names = args.layouts or []
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise InputError(f"--layouts: {', '.join(twice)} given more than once. Fix: name each layout once.")


def parse_layout(text: str) -> dict:
    """"dp2-ep2-rc" -> {"dp": 2, "tp": 1, "cp": 1, "ep": 2, "mb": None, "rc": True}.

    Sizes must be >= 1 (ep0 would divide by zero) and each token may appear once (dp2-dp4 is
    ambiguous)."""
    layout = {"dp": 1, "tp": 1, "cp": 1, "ep": 1, "mb": None, "rc": False}
    seen = set()
    for token in text.split("-"):
        match = TOKEN.match(token)
        if not match:
            raise LayoutError(f"layout {text!r}: {token!r} is not one of dp<N>, tp<N>, cp<N>, ep<N>, mb<N>, rc")
        kind = match.group(1) or "rc"
        if kind in seen:
            raise LayoutError(f"layout {text!r}: {kind} is given twice. Fix: give each of dp, tp, cp, ep, mb, rc once.")
        seen.add(kind)
        if kind == "rc":
            layout["rc"] = True
            continue
        size = int(match.group(2))
        if size < 1:
            raise LayoutError(f"layout {text!r}: {token!r} must be >= 1. Fix: e.g. {kind}1, or leave {kind} out.")
        layout[kind] = size
    return layout


def processes(layout: dict) -> int:
    return layout["dp"] * layout["tp"] * layout["cp"]


def check_layouts(layouts, cpus: int) -> None:
    """The cheap checks first: sizes that do not compose, or more processes than can run here."""
    for name, layout in layouts.items():
        procs = processes(layout)
        if procs % layout["ep"]:
            raise LayoutError(f"layout {name!r}: ep{layout['ep']} must divide the dp x cp x tp = {procs} ranks.")
        if procs > max(8, 2 * cpus):
            raise LayoutError(f"layout {name!r} needs {procs} processes; this machine has {cpus} CPU(s) "
                              "(at most 8 or 2 per CPU). Use a smaller layout.")


def flags(layout: dict) -> list:
    out = [f"--parallel.dp_shard_size={layout['dp']}", f"--parallel.tp_size={layout['tp']}",
           f"--parallel.cp_size={layout['cp']}", f"--parallel.ep_size={layout['ep']}",
           f"--fsdp.activation_checkpointing={str(layout['rc']).lower()}"]
    if layout["mb"]:
        out.append(f"--training.micro_batch_size={layout['mb']}")
    return out


def train_args(name: str, layout: dict, steps: int, out_dir: str, extra: list) -> list:
    """The example's arguments for one layout: what run() launches and check_runnable() checks."""
    metrics = os.path.join(out_dir, f"{name}.jsonl")
    return [*flags(layout), f"--training.max_steps={steps}", "--training.epochs=1000", "--eval.eval_steps=0",
            f"--logging.metrics_file={metrics}", "--logging.progress_bar=false", "--checkpoint.save_ckpt=false",
            *extra]


def check_runnable(layouts: dict, steps: int, out_dir: str, extra: list) -> None:
    """Every layout through the example's own checks (its config parser, preflight and sharding
    planner, in this process, without a process group) before the first launch: a layout the
    example would refuse -- a global batch that dp x mb does not divide, a tp or cp that does not
    divide the heads, an ep that does not divide the experts, a bad flag after -- -- is an input
    error now instead of a failed run after others have trained for minutes."""
    import train_qwen
    from hyperacc.errors import ConfigError

    for name, layout in layouts.items():
        world = processes(layout)
        argv = [*train_args(name, layout, steps, out_dir, extra),
                "--training.dry_run=true", f"--training.dry_run_world_size={world}"]   # plan for `world` ranks
        try:
            cfg, world = train_qwen.load_config(argv)
            tokenizer = train_qwen.preflight(cfg, world)
            train_qwen.memory_plan(cfg, world, len(tokenizer), "cpu")
        except ConfigError as err:
            text = " ".join(str(err).split())
            raise LayoutError(f"layout {name!r} cannot run: {text}") from None


# ------------------------------------------------------------------ running
def read_metrics(path: str) -> dict:
    """The per-step records of a metrics JSONL as lists (records without a loss are not steps)."""
    with open(path) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    rows = [row for row in rows if "loss" in row]
    return {key: [row.get(key) for row in rows] for key in ("step", "loss", "aux_loss", "grad_norm")}


def run(name: str, layout: dict, steps: int, out_dir: str, extra: list) -> dict:
    metrics = os.path.join(out_dir, f"{name}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    args = train_args(name, layout, steps, out_dir, extra)
    procs = processes(layout)
    if procs == 1:
        cmd = [sys.executable, SCRIPT, *args]
    else:
        if REPO not in sys.path:
            sys.path.insert(0, REPO)
        from hyperacc.config.launch_env import free_port

        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", LAUNCH_CONFIG,
               "--num_processes", str(procs), "--main_process_port", str(free_port()), SCRIPT, *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    log = os.path.join(out_dir, f"{name}.log")
    with open(log, "w") as handle:
        code = subprocess.run(cmd, env=env, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"layout {name} failed (exit {code}); see {log}")
    if not os.path.exists(metrics):
        raise SystemExit(f"layout {name} wrote no metrics file {metrics}; see {log}")
    return read_metrics(metrics)


def load_saved(path: str, names: Optional[list]):
    """(curves, reference, steps asked for or None) of a saved run: the reference recorded there
    (older files without one: the first layout saved), or, with ``names``, those layouts with the
    first as the reference."""
    try:
        with open(path) as handle:
            saved = json.load(handle)
    except FileNotFoundError:
        raise InputError(f"--replot: no {path}. Fix: run without --replot first, or point --out at a "
                         "saved run.") from None
    except (OSError, ValueError) as err:
        raise InputError(f"--replot: {path} cannot be read as JSON ({err}).") from None
    curves = saved.get("curves") if isinstance(saved, dict) else None
    if not isinstance(curves, dict) or not curves:
        raise InputError(f"--replot: {path} holds no curves "
                         '(expected {"curves": {LAYOUT: {"step": [...], "loss": [...]}, ...}}).')
    expected = saved.get("steps")
    expected = expected if isinstance(expected, int) and not isinstance(expected, bool) and expected > 0 else None
    if names:
        missing = [name for name in names if name not in curves]
        if missing:
            raise InputError(f"--replot --layouts: {', '.join(missing)} not in {path} (it has {', '.join(curves)}).")
        return {name: curves[name] for name in names}, names[0], expected
    reference = saved.get("reference") or next(iter(curves))
    if not isinstance(reference, str) or reference not in curves:
        raise InputError(f"--replot: the recorded reference {reference!r} has no curve in {path}. "
                         "Fix: pick one with --layouts REFERENCE OTHER...")
    return curves, reference, expected


# ------------------------------------------------------------------ main
def parse_args(argv):
    """(args, extra): everything after -- goes to every run."""
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=None,
                        help=f"the first one is the reference (default: {' '.join(DEFAULT_LAYOUTS)}; with "
                             "--replot: the saved ones and the saved reference)")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--tolerance", type=float, default=5e-3,
                        help="largest relative deviation of the moving-average loss allowed")
    parser.add_argument("--window", type=int, default=25, help="steps in the moving average")
    parser.add_argument("--replot", action="store_true", help="analyse OUT/curves.json again, no training")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "loss_curves"))
    return parser.parse_args(argv), extra


def progress_line(name: str, curve: dict) -> str:
    """One line per finished run; never raises on what it shows (a NaN loss, no steps at all)."""
    loss = curve["loss"]
    if not loss:
        return f"{name}: no steps recorded"
    shown = [f"{v:.4f}" if isinstance(v, (int, float)) else repr(v) for v in (loss[0], loss[-1])]
    return f"{name}: {len(loss)} steps, loss {shown[0]} -> {shown[1]}"


def train_all(args, extra: list, saved: str) -> dict:
    """Validate every layout, then run them one by one and save the curves."""
    names = args.layouts or DEFAULT_LAYOUTS
    layouts = {name: parse_layout(name) for name in names}
    check_layouts(layouts, os.cpu_count() or 1)
    check_runnable(layouts, args.steps, args.out, extra)
    os.makedirs(args.out, exist_ok=True)
    curves = {}
    for name, layout in layouts.items():
        curves[name] = run(name, layout, args.steps, args.out, extra)
        print(progress_line(name, curves[name]), flush=True)
    with open(saved, "w") as handle:
        json.dump({"reference": names[0], "steps": args.steps, "extra": extra, "curves": curves}, handle)
    return curves


def main(argv=None):
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    saved = os.path.join(args.out, "curves.json")
    try:
        check_args(args)
        if args.replot:
            curves, reference, expected = load_saved(saved, args.layouts)
        else:
            reference, expected = (args.layouts or DEFAULT_LAYOUTS)[0], args.steps
            curves = train_all(args, extra, saved)
        rows = analyse(curves, reference, args.window, expected)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    plotted = plot(curves, reference, os.path.join(args.out, "curves.png"))
    print(f"curves: {saved}" + (f", plot: {os.path.join(args.out, 'curves.png')}" if plotted else ""))
    return 0 if report(rows, args.window, args.tolerance) else 1


if __name__ == "__main__":
    sys.exit(main())
