"""Loss-curve consistency across parallel layouts (the RFC's first acceptance item).

Runs examples/train_qwen.py once per layout -- same seed, same data, same global batch -- and
compares every step's loss with the first layout's:

    python examples/loss_curves.py                       # the default layouts, 500 steps
    python examples/loss_curves.py --steps 100 --layouts dp1 dp2 dp2-rc dp1-mb4 --out runs/curves
    python examples/loss_curves.py -- --fsdp.precision=bf16     # anything after -- goes to every run

A layout is tokens joined by "-": dp<N> (data-parallel shards), tp<N>, cp<N>, ep<N> (expert
parallelism inside the dp x cp x tp ranks), mb<N> (micro-batch size: with the global batch fixed,
a smaller one means more accumulation), rc (activation recompute). It runs on dp x cp x tp
processes (plain python for one, `accelerate launch` on gloo otherwise).

Writes OUT/curves.json (per layout: steps, loss, aux_loss, grad_norm), OUT/curves.png (the curves
and their relative deviation from the reference; needs matplotlib: pip install hyperacc[plot])
and prints, per layout: the largest relative deviation of the loss at any step, how many steps
stayed within 1e-5 (the exact regime), and the largest relative deviation of the moving average
over --window steps. Why the last one decides: layouts sum in different orders, so fp32 results
differ in the last bits; in an MoE, once such a difference flips one token's top-k choice the
curves part like two runs of a chaotic system (here after ~60-80 steps) while staying the same
curve. Exit code 1 when a layout's moving average deviates by more than --tolerance, 2 for a
layout this machine cannot run; --replot re-reads OUT/curves.json instead of training.
"""
import argparse
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "train_qwen.py")
LAUNCH_CONFIG = os.path.join(REPO, "accelerate_configs", "cpu_fsdp2_2proc.yaml")
DEFAULT_LAYOUTS = ["dp1", "dp2", "dp1-mb4", "dp2-rc", "dp2-ep2", "cp2", "tp2"]
TOKEN = re.compile(r"^(dp|tp|cp|ep|mb)(\d+)$|^rc$")


class LayoutError(ValueError):
    """A layout that cannot be parsed or run here."""


def parse_layout(text: str) -> dict:
    """"dp2-ep2-rc" -> {"dp": 2, "tp": 1, "cp": 1, "ep": 2, "mb": None, "rc": True}."""
    layout = {"dp": 1, "tp": 1, "cp": 1, "ep": 1, "mb": None, "rc": False}
    for token in text.split("-"):
        match = TOKEN.match(token)
        if not match:
            raise LayoutError(f"layout {text!r}: {token!r} is not one of dp<N>, tp<N>, cp<N>, ep<N>, mb<N>, rc")
        if token == "rc":
            layout["rc"] = True
        else:
            layout[match.group(1)] = int(match.group(2))
    return layout


def check_layouts(layouts, cpus: int) -> None:
    """Every problem before anything runs: sizes that do not compose, or more processes than can run."""
    for name, layout in layouts.items():
        procs = layout["dp"] * layout["tp"] * layout["cp"]
        if (procs % layout["ep"]) or min(v for k, v in layout.items() if k in ("dp", "tp", "cp", "ep")) < 1:
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


def run(name: str, layout: dict, steps: int, out_dir: str, extra: list) -> dict:
    metrics = os.path.join(out_dir, f"{name}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    args = [*flags(layout), f"--training.max_steps={steps}", "--training.epochs=1000", "--eval.eval_steps=0",
            f"--logging.metrics_file={metrics}", "--logging.progress_bar=false", "--checkpoint.save_ckpt=false",
            *extra]
    procs = layout["dp"] * layout["tp"] * layout["cp"]
    if procs == 1:
        cmd = [sys.executable, SCRIPT, *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", LAUNCH_CONFIG,
               "--num_processes", str(procs), "--main_process_port", str(29600 + os.getpid() % 300), SCRIPT, *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    log = os.path.join(out_dir, f"{name}.log")
    with open(log, "w") as handle:
        code = subprocess.run(cmd, env=env, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT).returncode
    if code:
        raise SystemExit(f"layout {name} failed (exit {code}); see {log}")
    with open(metrics) as handle:
        rows = [json.loads(line) for line in handle if '"loss"' in line]
    return {key: [r.get(key) for r in rows] for key in ("step", "loss", "aux_loss", "grad_norm")}


def deviation(curve: list, reference: list) -> list:
    return [abs(a - b) / abs(b) for a, b in zip(curve, reference)]


def moving_average(values: list, window: int) -> list:
    """The mean of the last ``window`` values at each step (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(curves: dict, reference: str, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install hyperacc[plot])")
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, curve in curves.items():
        top.plot(curve["step"], curve["loss"], label=name, linewidth=1)
        if name != reference:
            dev = [max(d, 1e-12) for d in deviation(curve["loss"], curves[reference]["loss"])]
            bottom.semilogy(curve["step"], dev, label=name, linewidth=1)
    top.set_ylabel("loss")
    top.set_title(f"loss per step, every layout (reference: {reference})")
    top.legend(fontsize=8)
    bottom.set_ylabel(f"|loss - loss[{reference}]| / loss[{reference}]")
    bottom.set_xlabel("optimizer step")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS, help="the first one is the reference")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--tolerance", type=float, default=5e-3,
                        help="largest relative deviation of the moving-average loss allowed")
    parser.add_argument("--window", type=int, default=25, help="steps in the moving average")
    parser.add_argument("--replot", action="store_true", help="analyse OUT/curves.json again, no training")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "loss_curves"))
    args = parser.parse_args(argv)
    try:
        layouts = {name: parse_layout(name) for name in args.layouts}
        check_layouts(layouts, os.cpu_count() or 1)
    except LayoutError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    saved = os.path.join(args.out, "curves.json")
    if args.replot:
        with open(saved) as handle:
            curves = json.load(handle)["curves"]
    else:
        curves = {}
        for name, layout in layouts.items():
            curves[name] = run(name, layout, args.steps, args.out, extra)
            print(f"{name}: {len(curves[name]['loss'])} steps, loss {curves[name]['loss'][0]:.4f} -> "
                  f"{curves[name]['loss'][-1]:.4f}", flush=True)
        with open(saved, "w") as handle:
            json.dump({"reference": args.layouts[0], "steps": args.steps, "extra": extra, "curves": curves}, handle)
    reference = args.layouts[0]
    plotted = plot(curves, reference, os.path.join(args.out, "curves.png"))
    print(f"\n| layout | exact (within 1e-5) for | max rel. loss deviation (at step) | max rel. deviation of "
          f"the {args.window}-step moving average | last {args.window} steps' mean loss |")
    print("|---|---|---|---|---|")
    worst = 0.0
    ref = curves[reference]["loss"]
    for name, curve in curves.items():
        if len(curve["loss"]) != len(ref):
            print(f"| {name} | ran {len(curve['loss'])} steps, the reference {len(ref)} | | | |")
            worst = float("inf")
            continue
        dev = deviation(curve["loss"], ref)
        smooth = deviation(moving_average(curve["loss"], args.window), moving_average(ref, args.window))
        exact = next((i for i, d in enumerate(dev) if d > 1e-5), len(dev))
        at = max(range(len(dev)), key=dev.__getitem__)
        worst = max(worst, max(smooth))
        tail = curve["loss"][-args.window:]
        print(f"| {name} | {exact} steps | {dev[at]:.1e} ({curve['step'][at]}) | {max(smooth):.1e} | "
              f"{sum(tail) / len(tail):.4f} |")
    print(f"\ncurves: {saved}" + (f", plot: {os.path.join(args.out, 'curves.png')}" if plotted else ""))
    verdict = "within" if worst <= args.tolerance else "BEYOND"
    print(f"largest moving-average deviation {worst:.2e}: {verdict} the tolerance {args.tolerance:g}")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
