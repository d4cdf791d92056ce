"""How cheap the example's preflight is: time from `accelerate launch` to a resume's config error vs
time from `accelerate launch` to the first training step, same machine, same 2 CPU processes.

    python benchmarks/preflight.py [--repeats 3] [example flags, e.g. --model.overrides.hidden_size=1024]

One training launch on a local JSONL text file saves a checkpoint (and gives "launch -> step 1": its
first step's log line); a resume of it with another --data.seq_len stops in preflight (issue 38: before
data, model and process group); a resume after the file grew in place (what preflight cannot see) is
refused by the loader inside load_state -- the path every data refusal took before issue 38 -- and
gives "launch -> load_state refusal". Launches alternate in one directory whose caches are warm after
the first round (not counted); medians are compared.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "train_qwen.py")
CONFIG = os.path.join(REPO, "accelerate_configs", "cpu_fsdp2_2proc.yaml")


def _launch(args, env, until):
    """Seconds from the launch to ``until(output_lines)`` (checked every 20 ms as lines arrive), and the
    exit code; the process is left to finish."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIG, SCRIPT, *args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, reached = [], None

    def read():
        for line in proc.stdout:
            lines.append(line)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while reached is None and (proc.poll() is None or reader.is_alive()):
        if until(lines):
            reached = time.perf_counter() - start
        time.sleep(0.02)
    if reached is None and until(lines):
        reached = time.perf_counter() - start
    proc.wait()
    reader.join()
    if reached is None:
        raise RuntimeError(f"{' '.join(args)}: never reached (exit {proc.returncode}):\n{''.join(lines)[-3000:]}")
    return reached, proc.returncode


def _with(flags, *changes):
    """``flags`` with ``changes`` replacing the flags of the same name (the example refuses a flag given twice)."""
    names = {change.split("=")[0] for change in changes}
    return [flag for flag in flags if flag.split("=")[0] not in names] + list(changes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    opts, extra = parser.parse_known_args()      # the rest: flags of the example, for every launch
    work = tempfile.mkdtemp(prefix="hyperacc_preflight_bench_")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "HYPERACC_CACHE": os.path.join(work, "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    env["HF_DATASETS_CACHE"] = os.path.join(work, "datasets")
    sys.path.insert(0, REPO)
    from hyperacc.data.default_corpus import collect_documents

    data = os.path.join(work, "docs.jsonl")
    text = "".join(json.dumps({"text": doc}) + "\n" for doc in collect_documents()[:400])
    common = ["--logging.progress_bar=false", "--eval.eval_steps=0", "--training.max_steps=2",
              f"--data.dataset={data}", f"--checkpoint.checkpoint_dir={os.path.join(work, 'ckpt')}", *extra]
    def errors(lines):          # the refusal each launch is for, not another config error
        return any(line.startswith("config error:") and ("resuming" in line or "cannot resume" in line)
                   for line in lines)
    times = {"first_step": [], "preflight": [], "load_state": []}
    try:
        for i in range(opts.repeats + 1):                  # round 0 warms the caches: not counted
            with open(data, "w") as handle:
                handle.write(text)
            shutil.rmtree(os.path.join(work, "ckpt"), ignore_errors=True)
            took = {}
            took["first_step"], code = _launch(common + ["--checkpoint.save_ckpt=true", "--checkpoint.save_steps=2",
                                                         "--logging.logging_steps=1"], env,
                                               lambda lines: any(line.startswith("step=1 ") for line in lines))
            assert code == 0, code
            seq_len = next((int(f.split("=")[1]) for f in common if f.startswith("--data.seq_len=")), 128)
            took["preflight"], code = _launch(_with(common, "--checkpoint.restore_from=LATEST",
                                                    f"--data.seq_len={seq_len // 2}"), env, errors)
            assert code != 0
            with open(data, "a") as handle:                 # the same path, more documents: more windows
                handle.write(text[: len(text) // 4].rsplit("\n", 1)[0] + "\n")
            took["load_state"], code = _launch(common + ["--checkpoint.restore_from=LATEST"], env, errors)
            assert code != 0
            if i:
                for key, value in took.items():
                    times[key].append(value)
            print("   ".join(f"launch -> {key}: {value:.2f} s" for key, value in took.items()), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {key: statistics.median(values) for key, values in times.items()}
    print(json.dumps({"launch_to_first_step_s": round(med["first_step"], 2),
                      "launch_to_preflight_error_s": round(med["preflight"], 2),
                      "launch_to_load_state_error_s": round(med["load_state"], 2),
                      "preflight_over_first_step": round(med["preflight"] / med["first_step"], 3),
                      "load_state_over_first_step": round(med["load_state"] / med["first_step"], 3),
                      "repeats": opts.repeats, "flags": extra}))
    print(f"ratio preflight error / first step: {med['preflight'] / med['first_step']:.3f}; "
          f"load_state error / first step: {med['load_state'] / med['first_step']:.3f}")


if __name__ == "__main__":
    main()
