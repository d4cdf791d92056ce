"""Rehearse the Qwen3-30B-A3B run at its true width on 8 CPU processes (`make rehearse`).

One decoder layer of examples/configs/qwen3_30b_a3b.yaml -- hidden 2048, 128 experts x 768 with
top-8 routing, 32 query / 4 KV heads of 128 -- trained by examples/train_qwen.py under
`accelerate launch` on 8 gloo processes, per layout:

  1. a few steps from the same weights, saving halfway (run "a");
  2. a resume from that checkpoint to the same last step (run "b");
then checks that every loss is finite, the loss fell, and run b's steps are bitwise run a's.

What memory forces, on a 24 GiB / 2-core machine (8 processes share it; each one's torch and
transformers alone take ~0.4 GB):
  * the vocabulary is 16384, not 151936: the embedding and the head are one FSDP unit, all-gathered
    on every rank in bf16 with its gradients and their fp32 reduce-scatter buffer (8 bytes per
    parameter: 151936 x 2048 x 2 x 8 = 5 GB per rank, 40 GB for 8);
  * FSDP 8 runs 32 experts instead of 128: without expert parallelism every rank all-gathers a
    layer's experts (128 x 3 x 2048 x 768 = 604 M parameters: 1.2 GB in bf16), its gradients
    (1.2 GB) and their fp32 reduce-scatter buffer (2.4 GB) -- 29 GB for 8 ranks. EP 8 keeps all 128
    (16 whole experts per rank, never all-gathered). On 8 x 64 GB devices neither limit applies:
    run `--training.dry_run=true` for the real figures.
The weights are random, written once as a Hugging Face checkpoint (bf16) that each rank reads its
own shards of (`model.name_or_path`): a rank never holds the whole model.

    python examples/rehearse_30b.py [--layouts ep8 fsdp8] [--steps 4] [--out runs/rehearsal]
"""
import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "examples", "configs", "qwen3_30b_a3b.yaml")
LAUNCH_CONFIG = os.path.join(REPO, "accelerate_configs", "cpu_fsdp2_2proc.yaml")
VOCAB = 16384
LAYOUTS = {"ep8": {"ep_size": 8, "num_experts": 128}, "fsdp8": {"ep_size": 1, "num_experts": 32}}


def model_overrides(layout: str) -> dict:
    return {"num_hidden_layers": 1, "vocab_size": VOCAB, "num_experts": LAYOUTS[layout]["num_experts"]}


def write_weights(layout: str, directory: str) -> None:
    """A random-weight Hugging Face checkpoint of the 30B config cut down as documented above."""
    if os.path.isfile(os.path.join(directory, "config.json")):
        return
    import torch
    import yaml

    sys.path.insert(0, REPO)
    from hyperacc.models import build_causal_lm, qwen3_moe_config

    overrides = {**yaml.safe_load(open(CONFIG))["model"]["overrides"], **model_overrides(layout)}
    torch.manual_seed(0)
    model = build_causal_lm(qwen3_moe_config(**overrides)).to(torch.bfloat16)
    model.save_pretrained(directory + ".tmp", safe_serialization=True)
    os.replace(directory + ".tmp", directory)
    print(f"{layout}: wrote {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B random parameters to "
          f"{directory}", flush=True)


class MemoryWatch:
    """The machine's peak used memory above what it used at start (sampled every 0.2 s)."""

    def __init__(self):
        import psutil

        self._used = lambda: psutil.virtual_memory().used   # noqa: E731
        self.start = self._used()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, self._used())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return (self.peak - self.start) / 2**30


def train(layout: str, weights: str, out: str, steps: int, *, restore: str = None) -> dict:
    name = "b" if restore else "a"
    flags = [f"--model.name_or_path={weights}", "--data.dataset=null", "--data.tokenizer=default",
             "--data.seq_len=128", "--data.num_proc=1",
             f"--parallel.ep_size={LAYOUTS[layout]['ep_size']}", "--fsdp.precision=bf16_sr",
             f"--training.max_steps={steps}", "--training.global_batch_size=8", "--training.micro_batch_size=1",
             "--training.device_memory_gb=null", "--training.gc_steps=0", "--lr_scheduler.warmup_steps=1",
             "--optimizer.lr=1e-3", f"--checkpoint.checkpoint_dir={os.path.join(out, name)}",
             f"--checkpoint.save_steps={steps // 2}", "--checkpoint.is_async=false", "--checkpoint.keep_last_n=0",
             f"--logging.metrics_file={os.path.join(out, name + '.jsonl')}", "--logging.logging_steps=1",
             "--logging.tensorboard_dir=null", "--logging.progress_bar=false", "--eval.eval_steps=0"]
    flags += [f"--model.overrides.{key}={value}" for key, value in model_overrides(layout).items()]
    if restore:
        flags.append(f"--checkpoint.restore_from={restore}")
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from hyperacc.config.launch_env import free_port

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", LAUNCH_CONFIG, "--num_processes", "8",
           "--main_process_port", str(free_port()), os.path.join(REPO, "examples", "train_qwen.py"),
           CONFIG] + flags
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    watch, start = MemoryWatch(), time.perf_counter()
    log = os.path.join(out, name + ".log")
    with open(log, "w") as handle:
        code = subprocess.run(cmd, env=env, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT).returncode
    memory, seconds = watch.stop(), time.perf_counter() - start
    if code:
        tail = open(log).read()[-3000:]
        raise SystemExit(f"{layout} run {name} failed (exit {code}); last lines of {log}:\n{tail}")
    with open(os.path.join(out, name + ".jsonl")) as handle:
        records = [json.loads(line) for line in handle if '"loss"' in line]
    return {"records": records, "memory_gib": memory, "seconds": seconds}


def rehearse(layout: str, root: str, steps: int) -> dict:
    out = os.path.join(root, layout)
    os.makedirs(out, exist_ok=True)
    weights = os.path.join(root, f"weights-{LAYOUTS[layout]['num_experts']}e")
    write_weights(layout, weights)
    a = train(layout, weights, out, steps)
    half = steps // 2
    b = train(layout, weights, out, steps, restore=os.path.join(out, "a", f"global_step_{half}"))
    losses = [r["loss"] for r in a["records"]]
    problems = []
    if [r["step"] for r in a["records"]] != list(range(1, steps + 1)):
        problems.append(f"run a logged steps {[r['step'] for r in a['records']]}")
    if not all(math.isfinite(x) for x in losses):
        problems.append(f"non-finite loss {losses}")
    elif not losses[-1] < losses[0]:
        problems.append(f"the loss did not fall: {losses}")
    resumed = [(r["step"], r["loss"], r["grad_norm"]) for r in b["records"] if r["step"] > half]
    expected = [(r["step"], r["loss"], r["grad_norm"]) for r in a["records"] if r["step"] > half]
    if resumed != expected:
        problems.append(f"resume differs: {resumed} vs uninterrupted {expected}")
    return {"layout": layout, "losses": losses, "resumed": resumed, "problems": problems,
            "memory_gib": max(a["memory_gib"], b["memory_gib"]), "seconds": a["seconds"] + b["seconds"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=4, help="steps of run a (even; run b resumes halfway)")
    parser.add_argument("--out", default=os.path.join(REPO, "runs", "rehearsal"))
    args = parser.parse_args()
    if args.steps < 2 or args.steps % 2:
        parser.error("--steps must be an even number >= 2")
    results = [rehearse(layout, os.path.abspath(args.out), args.steps) for layout in args.layouts]
    for r in results:
        verdict = "ok" if not r["problems"] else "FAILED: " + "; ".join(r["problems"])
        print(f"{r['layout']}: losses {' '.join(f'{x:.4f}' for x in r['losses'])}; resumed steps bitwise equal: "
              f"{not any('resume' in p for p in r['problems'])}; peak memory +{r['memory_gib']:.1f} GiB; "
              f"{r['seconds']:.0f} s -- {verdict}", flush=True)
    sys.exit(1 if any(r["problems"] for r in results) else 0)


if __name__ == "__main__":
    main()
