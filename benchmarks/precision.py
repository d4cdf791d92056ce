"""Do the bf16 recipes train as well as fp32 master weights? Loss curves of examples/train_qwen.py.

The embedded default (tiny Qwen3-MoE, offline corpus, 2 CPU processes under `accelerate launch`)
trained for STEPS steps from the same seed and data under each precision recipe; every step's loss
is compared with the fp32_master run's at the same step. Printed last: per recipe, the mean loss
of the last 50 steps relative to fp32's, the largest relative difference of the 25-step moving
average (goal: within 2 %), and of single steps (for information: like two layouts, two precisions
part into different trajectories of the same curve, so single steps differ by a few %).

    python benchmarks/precision.py [--steps 300] [--recipes fp32_master bf16 bf16_sr]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from hyperacc.config.launch_env import free_port  # noqa: E402


def run(recipe: str, steps: int, out_dir: str) -> list:
    metrics = os.path.join(out_dir, f"{recipe}.jsonl")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           os.path.join(REPO, "accelerate_configs", "cpu_fsdp2_2proc.yaml"),
           "--main_process_port", str(free_port()), os.path.join(REPO, "examples", "train_qwen.py"),
           f"--fsdp.precision={recipe}", f"--training.max_steps={steps}", "--training.epochs=100",
           f"--logging.metrics_file={metrics}", "--logging.progress_bar=false", "--logging.logging_steps=50",
           "--eval.eval_steps=0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(metrics) as handle:
        return [json.loads(line)["loss"] for line in handle if '"loss"' in line]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--recipes", nargs="+", default=["fp32_master", "bf16", "bf16_sr"])
    args = parser.parse_args()
    curves, seconds = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipes:
            start = time.perf_counter()
            curves[recipe] = run(recipe, args.steps, tmp)
            seconds[recipe] = time.perf_counter() - start
            print(f"{recipe}: loss {curves[recipe][0]:.4f} -> {curves[recipe][-1]:.4f} in {seconds[recipe]:.0f} s",
                  flush=True)
    reference = curves[args.recipes[0]]
    tail = lambda c: sum(c[-50:]) / len(c[-50:])  # noqa: E731
    print(f"\n{args.steps} steps of the tiny Qwen3-MoE on the embedded corpus, 2 processes; vs {args.recipes[0]}:")
    print("| recipe | bytes/param | first loss | last loss | mean of last 50 / reference | max rel. diff, 25-step "
          "moving average | max rel. diff, single step |")
    print("|---|---|---|---|---|---|---|")
    from hyperacc.precision import get_recipe
    from loss_curves import deviation, moving_average
    worst = 0.0
    for recipe, curve in curves.items():
        ratio = tail(curve) / tail(reference)
        smooth = max(deviation(moving_average(curve, 25), moving_average(reference, 25)))
        per_step = max(deviation(curve, reference))
        if recipe != args.recipes[0]:
            worst = max(worst, abs(ratio - 1), smooth)
        print(f"| {recipe} | {sum(get_recipe(recipe).bytes_per_param().values())} | {curve[0]:.4f} | {curve[-1]:.4f} | "
              f"{ratio:.4f} | {smooth:.4f} | {per_step:.4f} |")
    print(f"\nlargest relative difference of the bf16 recipes' loss (moving average, last 50) from {args.recipes[0]}: "
          f"{worst:.4f} (goal <= 0.02)")


if __name__ == "__main__":
    sys.path[:0] = [REPO, os.path.join(REPO, "examples")]
    main()
