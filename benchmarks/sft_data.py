"""Instruction data: tokens/s of training on chat data, packed (padding-free) vs padded.

The same conversations, the same steps, the same model from the same seed; only the collator
(`hyperacc.data.chat_dataset.chat_collate(tok, packing=...)`) and the attention implementation differ:
  padded       each micro-batch's conversations padded to its longest (`pad_collate`, attention_mask), sdpa
  packed       each micro-batch's conversations end to end in one row (`pack_collate`: position_ids restart
               at every conversation; no padding at all), sdpa: transformers masks the row block-diagonally
               and computes attention over all (sum of lengths)^2 token pairs
  packed_sdpa  packed, attn_implementation="packed_sdpa" (`hyperacc.models.packed_attention`): sdpa on each
               conversation's slice, sum of length^2 pairs
Data: the embedded chat corpus (`build_chat_dataset(None, ...)`, ~2,000 stdlib-docstring conversations
rendered with hyperacc's ChatML training template, 41..SEQ tokens, median ~170, mean ~210: the long-tailed
spread of real instruction data), assistant-only labels.
Models (use_cache False, vocab = the chat tokenizer's 514 tokens):
  moe     the example's tiny Qwen3-MoE preset (`hyperacc.models.qwen3_moe_config()`, hidden 64)
  dense   a Qwen3 at hidden 512 (4 layers, 8 / 4 heads of 64, MLP 1536): compute-bound enough that
          tokens/s follows the tokens computed
One torchrun launch of 2 CPU processes (gloo, FSDP2 dp_shard=2, fp32, AdamW, one thread per core),
global batch GBS conversations, micro-batch MBS. Per model the two runs' steps alternate (load on a
shared machine hits both alike). Step time = the slower rank's, each step starting after a barrier.
Tokens/s = the conversations' real tokens per second (the same count for both runs). Printed last,
per model: packed / padded tokens/s over the steps after the warm-up, both packed runs (goal >= 1.5),
the share of padding in the padded and packed runs (goal <= 5 % packed), and the largest relative
difference of the step losses, packed vs padded (the same computation in another layout: float rounding
only).

    python benchmarks/sft_data.py [--steps 12] [--models moe dense] [--seq-len 512] [--json F]
"""
import argparse
import json
import os
import statistics
import tempfile
import time

from step_timing import finish_workers, launch_workers, threads, timed_step

MODELS = {
    "moe": {},
    "dense": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64),
}
GBS, MBS, WARMUP = 16, 4, 2
RUNS = {"padded": (False, "sdpa"), "packed": (True, "sdpa"), "packed_sdpa": (True, "packed_sdpa")}


def build_model(name: str, vocab: int, attn: str):
    from transformers import Qwen3Config

    from hyperacc.models import build_causal_lm, qwen3_moe_config

    config = (qwen3_moe_config(vocab_size=vocab, use_cache=False) if name == "moe"
              else Qwen3Config(**MODELS[name], vocab_size=vocab, use_cache=False))
    return build_causal_lm(config, meta_device=True, attn_implementation=attn)


class Run:
    """One training run (its own Accelerator, model, optimizer and loader); `step` trains one step and
    records the slower rank's wall time, the step loss, and the tokens and padding both ranks computed."""

    def __init__(self, name: str, packing: bool, attn: str, dataset, tokenizer):
        import torch

        import hyperacc
        from hyperacc.data.chat_dataset import chat_collate

        self.acc = hyperacc.Accelerator(checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=0)
        model = build_model(name, len(tokenizer), attn)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = hyperacc.MicroBatchDataLoader(dataset, global_batch_size=GBS, micro_batch_size=MBS, seed=3,
                                               collate_fn=chat_collate(tokenizer, packing=packing))
        self.model, self.optimizer, loader = self.acc.prepare(model, optimizer, loader)
        self.batches = iter(loader)
        self.record = {"times": [], "losses": [], "real": [], "positions": []}

    def step(self) -> None:
        import torch.distributed as dist

        batch = next(self.batches)
        elapsed = timed_step(self.acc, self.model, self.optimizer, batch)
        positions = sum(mb["input_ids"].numel() for mb in batch)
        real = sum(int(mb["attention_mask"].sum()) if "attention_mask" in mb else mb["input_ids"].numel()
                   for mb in batch)
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, (elapsed, real, positions))
        self.record["times"].append(max(rank[0] for rank in ranks))
        self.record["real"].append(sum(rank[1] for rank in ranks))
        self.record["positions"].append(sum(rank[2] for rank in ranks))
        self.record["losses"].append(self.acc.step_loss)

    def finish(self) -> dict:
        self.acc.end_training()
        return self.record


def worker(out: str, models: list, steps: int, seq_len: int) -> None:
    import torch.distributed as dist

    from hyperacc.data.chat import prepare_chat_tokenizer
    from hyperacc.data.chat_dataset import build_chat_dataset
    from hyperacc.data.text import load_tokenizer

    dist.init_process_group("gloo")
    tokenizer = prepare_chat_tokenizer(load_tokenizer("default"), "chatml")
    dataset = build_chat_dataset(None, tokenizer, seq_len=seq_len)
    results = {}
    for name in models:
        start, load = time.perf_counter(), os.getloadavg()[0]
        runs = {key: Run(name, packing, attn, dataset, tokenizer) for key, (packing, attn) in RUNS.items()}
        for _ in range(WARMUP + steps):
            for run in runs.values():
                run.step()
        results[name] = {key: run.finish() for key, run in runs.items()}
        results[name]["load"] = f"{load:.1f} / {os.getloadavg()[0]:.1f}"
        if dist.get_rank() == 0:
            print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    finish_workers(out, results)


def launch(args, tmp: str) -> dict:
    return launch_workers(__file__, os.path.join(tmp, "sft_data.json"),
                          ["--steps", str(args.steps), "--seq-len", str(args.seq_len), "--models", *args.models])


def tokens_per_s(run: dict) -> float:
    """Real tokens over the steps after the warm-up / their summed step times."""
    return sum(run["real"][WARMUP:]) / sum(run["times"][WARMUP:])


def padding_share(run: dict) -> float:
    return 1 - sum(run["real"]) / sum(run["positions"])


def rel_diff(a: list, b: list) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def report(results: dict, args) -> None:
    print(f"\n2 CPU processes (gloo, FSDP2 dp_shard=2, fp32, OMP_NUM_THREADS {threads()}), embedded chat "
          f"corpus at seq_len {args.seq_len}, global batch {GBS} conversations x micro-batch {MBS}, {WARMUP} "
          f"warm-up + {args.steps} steps, the runs' steps alternated. Step time: slower rank.")
    print("| model | run | tokens/s | step ms: median (min) | positions / step | padding | load avg |")
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        for key in RUNS:
            run = runs[key]
            times = run["times"][WARMUP:]
            print(f"| {name} | {key} | {tokens_per_s(run):,.0f} | {1000 * statistics.median(times):.0f} "
                  f"({1000 * min(times):.0f}) | {statistics.mean(run['positions']):,.0f} | "
                  f"{100 * padding_share(run):.1f} % | {runs['load']} |")
    print()
    for name, runs in results.items():
        padded = runs["padded"]
        speedups = ", ".join(f"{tokens_per_s(runs[key]) / tokens_per_s(padded):.2f} ({key})" for key in RUNS
                             if key != "padded")
        losses = max(rel_diff(runs[key]["losses"], padded["losses"]) for key in RUNS if key != "padded")
        print(f"{name}: packed / padded tokens/s {speedups} (goal >= 1.5); padding "
              f"{100 * padding_share(padded):.1f} % padded, {100 * padding_share(runs['packed']):.1f} % packed "
              f"(goal <= 5 %); max rel. step-loss diff packed vs padded {losses:.1e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--json", help="also write the raw per-step figures here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)     # what each torchrun process runs
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.models, args.steps, args.seq_len)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hyperacc_sft_bench_") as tmp:
        results = launch(args, tmp)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    report(results, args)
    print(f"\nbenchmark wall time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
