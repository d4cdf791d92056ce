"""Pretrained weights at scale: sharded load vs `from_pretrained` on every rank, and sharded export
vs the rank-0 gather export, on 2 and 4 CPU processes, with a >= 1 GiB fp32 model.

    python benchmarks/weights.py [--worlds 2 4] [--layers 17] [--hidden 1024]

Per rank: peak RSS above the process's RSS just before the load (sampled every 2 ms, so page-cache
and allocator effects count), this rank's shard bytes, wall time between barriers. Each mode runs in
its own launch so that one mode's freed memory cannot hide another's peak. Ratios print last.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from hyperacc.config.launch_env import free_port  # noqa: E402
MiB = 2**20


class PeakRSS:
    """Peak resident set size (bytes) of this process during a ``with`` block."""

    def __enter__(self):
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --------------------------------------------------------------------------- worker (one rank)
def worker(args):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import hyperacc
    from hyperacc.models import load_pretrained
    acc = hyperacc.Accelerator()
    results = {}

    def window(name, fn):
        dist.barrier()
        base = _rss()
        start = time.perf_counter()
        with PeakRSS() as peak:
            out = fn()
            dist.barrier()
        results[name] = {"seconds": time.perf_counter() - start, "peak_above_mib": (peak.peak - base) / MiB}
        return out

    if args.mode == "baseline_load":
        model = window("load", lambda: acc.prepare(load_pretrained(args.model)))
    else:
        model = window("load", lambda: acc.prepare(load_pretrained(args.model, accelerator=acc)))
    shard = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())
    results["shard_mib"] = shard / MiB
    if args.mode == "sharded_export":
        window("export", lambda: acc.save_model(model, args.out_dir, max_shard_size="10GB"))
    elif args.mode == "gather_export":
        window("export", lambda: _gather_export(model, args.out_dir))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(args.result, "w") as handle:
            json.dump(gathered, handle)
    acc.end_training()


def _gather_export(model, out_dir, max_bytes=10 * 10**9):
    """The export hyperacc had before (what accelerate does too): the full state dict gathered to
    rank 0's CPU memory, written there with safetensors' save_file."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        os.makedirs(out_dir)
        save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(out_dir, "model.safetensors"),
                  metadata={"format": "pt"})
        model.config.save_pretrained(out_dir)
    del full


# --------------------------------------------------------------------------- driver
def make_model(directory, layers, hidden):
    from transformers import Qwen3Config

    from hyperacc.models import build_causal_lm

    config = Qwen3Config(vocab_size=32000, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=hidden // 16,
                         tie_word_embeddings=False)
    model = build_causal_lm(config, seed=0)
    model.save_pretrained(directory, max_shard_size="400MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def launch(world, mode, model, tmp):
    result = os.path.join(tmp, f"{mode}-{world}.json")
    out_dir = os.path.join(tmp, f"out-{mode}-{world}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", os.path.abspath(__file__), "--worker", "--mode", mode,
           "--model", model, "--result", result, "--out-dir", out_dir]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"}
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    with open(result) as handle:
        return json.load(handle)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--mode")
    parser.add_argument("--model")
    parser.add_argument("--result")
    parser.add_argument("--out-dir")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=17)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="hyperacc-bench-weights-") as tmp:
        model = os.path.join(tmp, "model")
        nbytes = make_model(model, args.layers, args.hidden)
        print(f"model: {nbytes / 2**30:.2f} GiB fp32 in {len([f for f in os.listdir(model) if f.endswith('.safetensors')])} files")
        lines = []
        for world in args.worlds:
            runs = {mode: launch(world, mode, model, tmp) for mode in
                    ("baseline_load", "sharded_export", "gather_export")}
            sharded, baseline = runs["sharded_export"], runs["baseline_load"]
            for rank, (s, b) in enumerate(zip(sharded, baseline)):
                budget = 1.3 * s["shard_mib"] + 300
                print(f"world {world} rank {rank}: shard {s['shard_mib']:.0f} MiB | sharded load {s['load']['seconds']:.2f} s, "
                      f"peak +{s['load']['peak_above_mib']:.0f} MiB (budget {budget:.0f}) | from_pretrained on every "
                      f"rank {b['load']['seconds']:.2f} s, peak +{b['load']['peak_above_mib']:.0f} MiB")
            g = runs["gather_export"]
            print(f"world {world} export: sharded {sharded[0]['export']['seconds']:.2f} s, rank-0 peak "
                  f"+{sharded[0]['export']['peak_above_mib']:.0f} MiB (max over ranks "
                  f"+{max(r['export']['peak_above_mib'] for r in sharded):.0f}) | rank-0 gather {g[0]['export']['seconds']:.2f} s,"
                  f" rank-0 peak +{g[0]['export']['peak_above_mib']:.0f} MiB")
            worst = max(s["load"]["peak_above_mib"] / (1.3 * s["shard_mib"] + 300) for s in sharded)
            lines.append(f"world {world}: load peak / budget (max over ranks) {worst:.3f} (goal <= 1); load time "
                         f"sharded / every-rank {sharded[0]['load']['seconds'] / baseline[0]['load']['seconds']:.3f} "
                         f"(goal <= 1.0); export rank-0 peak sharded / gather "
                         f"{max(sharded[0]['export']['peak_above_mib'], 1) / max(g[0]['export']['peak_above_mib'], 1):.3f}; "
                         f"export time sharded / gather {sharded[0]['export']['seconds'] / g[0]['export']['seconds']:.3f}")
        print("\n".join(["--- ratios ---", *lines]))


if __name__ == "__main__":
    main()
