"""What a node's death costs under torch's elastic launcher: seconds until training runs again, steps lost.

Two "nodes" on localhost -- two torchrun launchers, one worker each, `--nnodes=1:2`, c10d rendezvous on
127.0.0.1, `--max-restarts=3` -- train examples/train_qwen.py (tiny Qwen3-MoE, checkpoint every
SAVE steps, `--checkpoint.restore_from=LATEST`). Once step KILL_AFTER is logged the second launcher is
SIGKILLed (its worker dies with it). Measured: from the kill to the first step the survivor logs after
its restart (the failed collective, the agent's restart, the re-rendezvous on one node, start-up,
loading LATEST, one step), and the steps of work lost (the step reached minus the step resumed from).
Also the cost of a hang: a SIGSTOPped rank, from the stop to the error line naming it.

    python benchmarks/fault_tolerance.py [--save 2] [--kill-after 5] [--repeats 2]
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "train_qwen.py")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
RDZV_CONF = "join_timeout=120,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _steps(path) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line)["step"] for line in handle if '"loss"' in line]


def _launcher(port, args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bench", "--max-restarts=3",
           "--monitor-interval=1", f"--rdzv-conf={RDZV_CONF}", EXAMPLE, *args]
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def node_loss(tmp: str, save: int, kill_after: int, steps: int) -> dict:
    metrics = os.path.join(tmp, "m.jsonl")
    args = [f"--training.max_steps={steps}", "--checkpoint.save_ckpt=true", f"--checkpoint.save_steps={save}",
            f"--checkpoint.checkpoint_dir={os.path.join(tmp, 'ckpt')}", "--checkpoint.restore_from=LATEST",
            f"--logging.metrics_file={metrics}", "--logging.logging_steps=1", "--logging.progress_bar=false",
            "--eval.eval_steps=0"]
    port = _port()
    host = _launcher(port, args)
    time.sleep(3)
    other = _launcher(port, args)
    try:
        while max(_steps(metrics), default=0) < kill_after:
            time.sleep(0.05)
        reached = max(_steps(metrics))
        killed = time.monotonic()
        os.killpg(other.pid, signal.SIGKILL)
        seen = len(_steps(metrics))
        while len(_steps(metrics)) == seen:               # the first step logged after the restart
            if host.poll() is not None:
                raise SystemExit("the surviving node's job ended before it trained again")
            time.sleep(0.05)
        recovered = time.monotonic() - killed
        resumed_from = _steps(metrics)[seen] - 1
        host.wait(timeout=600)
    finally:
        for proc in (host, other):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return {"recovery_s": recovered, "steps_lost": reached - resumed_from, "reached": reached,
            "resumed_from": resumed_from, "exit": host.returncode}


def hang(tmp: str, timeout_s: int) -> float:
    """Seconds from a rank's SIGSTOP (at step 4) to the error line naming it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "tests", "scripts", "train_qwen_hang.py"), "--training.max_steps=20",
           f"--training.collective_timeout_s={timeout_s}", "--logging.progress_bar=false", "--eval.eval_steps=0",
           f"--logging.metrics_file={os.path.join(tmp, 'h.jsonl')}", "--logging.logging_steps=1"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**ENV, "HANG_AT_STEP": "4"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = os.path.join(tmp, "h.jsonl")
    while max(_steps(metrics), default=0) < 3:
        time.sleep(0.05)
    stopped = time.monotonic()                           # step 3 logged: rank 1 stops right after
    for line in proc.stdout:
        if line.startswith("error: step 4: a collective timed out"):
            named = time.monotonic() - stopped
            break
    else:
        raise SystemExit("no error line")
    proc.wait(timeout=120)
    return named


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save", type=int, default=2)
    parser.add_argument("--kill-after", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hang-timeout", type=int, default=10)
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(node_loss(tmp, args.save, args.kill_after, args.steps))
            print(runs[-1], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        named = hang(tmp, args.hang_timeout)
    print(f"\nnode loss (2 -> 1 node, tiny model, checkpoint every {args.save} steps), {args.repeats} runs:")
    print("| death -> first step after restart (s) | steps lost | reached / resumed from | exit |")
    print("|---|---|---|---|")
    for r in runs:
        print(f"| {r['recovery_s']:.1f} | {r['steps_lost']} | {r['reached']} / {r['resumed_from']} | {r['exit']} |")
    print(f"\nhang: SIGSTOP of rank 1 -> the line naming it: {named:.1f} s (collective_timeout_s={args.hang_timeout}; "
          "the launcher then needs up to 30 s more to SIGKILL the stopped worker)")


if __name__ == "__main__":
    main()
