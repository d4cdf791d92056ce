"""TRL's `DPOTrainer` on hyperacc vs on plain accelerate, full fine-tune: step time and memory per rank.

One DPO script, two engines, the only difference the class (plus hyperacc's SFT on the same sequences, for
what the reference model costs):
  plain     `trl.DPOTrainer` on accelerate: with `use_cpu=True` under torchrun and no FSDP configuration,
            DistributedType.MULTI_CPU: DDP (gloo); every rank holds the whole policy, its gradients and AdamW
            moments, and the whole reference model (TRL loads it from the policy's path).
  hyperacc  `hyperacc.integrations.trl.DPOTrainer`: FSDP2 over both ranks (dp_shard=2) for the policy; the
            reference sharded the same way by `Accelerator.prepare_model(evaluation_mode=True)`: frozen, no
            gradients, no optimizer state, half of it per rank, resharded after each forward.
  sft       `hyperacc.integrations.trl.SFTTrainer` on the same sequences (each pair's chosen and rejected
            completion as two rows, so the same rows per step as DPO's policy forward): no reference.
The model: a dense Qwen3 (hidden 768, LAYERS layers, vocab 8192 untied) saved once with `save_pretrained`
and loaded by path by every engine (as `trl/scripts/dpo.py` does), fp32, sdpa, lr 1e-6, per_device 2 pairs
x gradient_accumulation 1, max_length 256, preference pairs cut from the offline default corpus
(`hyperacc.data.default_corpus`, its 8192-token BPE). Each engine: its own torchrun launch of 2 CPU
processes (1 thread each), in the order plain, hyperacc, sft (``--rounds 2`` repeats in reverse).

Measured per rank by a TrainerCallback: step time between consecutive `on_step_end` (median of the steps
after WARMUP, the slower rank's); peak RSS above the RSS before the trainer was built (VmHWM reset through
/proc/self/clear_refs): ``training`` from `on_train_begin` to the last step, ``whole`` from the
constructor on (the reference is loaded and sharded in the constructor). MALLOC_MMAP_THRESHOLD_=65536 and
oneDNN's primitive cache off, as in trainer.py. Goals (issue 42): hyperacc DPO / plain DPO step time
<= 1.0, peak RSS per rank < 1; hyperacc DPO peak / hyperacc SFT peak <= 1.35.

``--trainer grpo``: `GRPOTrainer` instead, hyperacc vs plain TRL (no SFT run): GENERATIONS completions of up
to COMPLETION tokens per rank and step from the same prompts, the toy reward `even_share`, beta 0.04 (a
reference model); the step time includes generation (on hyperacc every decoding step gathers each block's
weights, as FSDP2 does on accelerate; DDP holds them whole).

    python benchmarks/preference.py [--trainer dpo|grpo] [--steps 6] [--layers 4] [--rounds 1] [--json F]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
from rss import peak, reset_peak, status  # noqa: E402  (before this folder leaves sys.path)

sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]   # benchmarks/peft.py vs peft
VOCAB, SEQ, PAIRS, WARMUP = 8192, 256, 2, 2
MODEL = dict(vocab_size=VOCAB, hidden_size=768, intermediate_size=2048, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False,
             use_cache=False)
ENGINES = {"plain": "trl.DPOTrainer on accelerate (DDP; whole policy and reference per rank)",
           "hyperacc": "hyperacc DPOTrainer (FSDP2 dp_shard=2; reference sharded frozen)",
           "sft": "hyperacc SFTTrainer, same rows (no reference)"}
GRPO_ENGINES = {"grpo_plain": "trl.GRPOTrainer on accelerate (DDP; whole policy and reference per rank)",
                "grpo_hyperacc": "hyperacc GRPOTrainer (FSDP2 dp_shard=2; reference sharded frozen; seeded "
                                 "per-sample sampling, synced decoding)"}
GENERATIONS, COMPLETION = 4, 32


def even_share(completions, completion_ids, **kwargs):
    """GRPO's toy reward: the share of even token ids in a completion."""
    return [sum(1 for t in ids if t % 2 == 0) / max(1, len(ids)) for ids in completion_ids]


def pairs(tokenizer, count: int) -> list:
    """Preference pairs from the offline corpus: a prompt, its document's continuation (chosen) and another
    document's text (rejected), ~100 tokens each."""
    from hyperacc.data.default_corpus import collect_documents

    docs = [d for d in collect_documents() if len(tokenizer(d)["input_ids"]) > 220]
    out = []
    for i in range(count):
        ids = tokenizer(docs[i % len(docs)])["input_ids"]
        other = tokenizer(docs[(i * 7 + 3) % len(docs)])["input_ids"]
        out.append({"prompt": tokenizer.decode(ids[:48]), "chosen": tokenizer.decode(ids[48:150]),
                    "rejected": tokenizer.decode(other[48:150])})
    return out


def worker(out_path: str, engine: str, model_dir: str, steps: int) -> None:
    import torch.distributed as dist
    import trl
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback

    import hyperacc.integrations.trl as hyperacc_trl     # imported by every engine: the same baseline

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data_path = os.path.join(model_dir, "sft.jsonl" if engine == "sft" else "pairs.jsonl")
    dataset = load_dataset("json", data_files=data_path, split="train",
                           cache_dir=os.path.join(os.path.dirname(out_path), f"cache-{engine}"))
    common = dict(output_dir=os.path.splitext(out_path)[0] + "-output", use_cpu=True, max_steps=steps,
                  learning_rate=1e-6, seed=0, logging_steps=1, save_strategy="no", report_to=[],
                  disable_tqdm=True, max_length=SEQ, dataloader_num_workers=0, bf16=False)   # TRL defaults to bf16
    extra = {}
    if engine == "sft":
        args = trl.SFTConfig(**common, per_device_train_batch_size=2 * PAIRS, packing=False)
        cls = hyperacc_trl.SFTTrainer
    elif engine.startswith("grpo"):
        common.pop("max_length")
        args = trl.GRPOConfig(**common, per_device_train_batch_size=GENERATIONS, num_generations=GENERATIONS,
                              max_completion_length=COMPLETION, beta=0.04)
        cls = hyperacc_trl.GRPOTrainer if engine == "grpo_hyperacc" else trl.GRPOTrainer
        extra["reward_funcs"] = even_share
    else:
        args = trl.DPOConfig(**common, per_device_train_batch_size=PAIRS)
        cls = hyperacc_trl.DPOTrainer if engine == "hyperacc" else trl.DPOTrainer

    class Meter(TrainerCallback):
        def __init__(self):
            self.ends, self.train_peak = [], 0

        def on_train_begin(self, args, state, control, **kwargs):
            record["built"] = status("VmRSS") - base
            record["constructor_peak"] = peak() - base
            record["method"] = "VmHWM reset by clear_refs" if reset_peak() else "ru_maxrss (since process start)"
            self.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.train_peak = max(self.train_peak, peak() - base)
            reset_peak()
            self.ends.append(time.perf_counter())

    record = {}
    meter = Meter()
    reset_peak()
    base = status("VmRSS")
    trainer = cls(model=model_dir, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[meter],
                  **extra)
    trainer.train()
    record.update(times=[b - a for a, b in zip(meter.ends, meter.ends[1:])], train_peak=meter.train_peak,
                  whole_peak=max(meter.train_peak, record["constructor_peak"]))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        with open(out_path, "w") as handle:
            json.dump({"engine": engine, "ranks": gathered, "losses": losses,
                       "accelerator": f"{type(trainer.accelerator).__module__}.{type(trainer.accelerator).__name__}",
                       "reference": type(getattr(trainer, "ref_model", None)).__name__}, handle)
    dist.barrier()
    dist.destroy_process_group()


def prepare(model_dir: str, layers: int) -> int:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hyperacc.data.default_corpus import load_default_tokenizer

    tokenizer = load_default_tokenizer(VOCAB)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**MODEL, num_hidden_layers=layers, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rows = pairs(tokenizer, 64)
    with open(os.path.join(model_dir, "pairs.jsonl"), "w") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(model_dir, "sft.jsonl"), "w") as handle:
        handle.writelines(json.dumps({"prompt": r["prompt"], "completion": r[k]}) + "\n"
                          for r in rows for k in ("chosen", "rejected"))
    return sum(p.numel() for p in model.parameters())


def launch(engine: str, model_dir: str, steps: int, out_dir: str, index: int) -> dict:
    out = os.path.join(out_dir, f"{engine}-{index}.json")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           "--worker", out, engine, model_dir, str(steps)]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as handle:
        result = json.load(handle)
    result["wall"] = time.perf_counter() - start
    return result


def mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def step_ms(runs: list) -> float:
    steps = [max(rank["times"][i] for rank in r["ranks"]) for r in runs for i in range(len(r["ranks"][0]["times"]))
             if i >= WARMUP]
    return 1000 * statistics.median(steps)


def worst(runs: list, key: str) -> int:
    return max(rank[key] for r in runs for rank in r["ranks"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="launches per engine (the second round reversed)")
    parser.add_argument("--json", help="also write every launch's raw figures here")
    parser.add_argument("--trainer", choices=("dpo", "grpo"), default="dpo",
                        help="grpo: GRPOTrainer on hyperacc vs on accelerate instead (generation included)")
    args = parser.parse_args()
    engines = GRPO_ENGINES if args.trainer == "grpo" else ENGINES
    order = []
    for i in range(args.rounds):
        order += list(engines) if i % 2 == 0 else list(reversed(engines))
    results = {engine: [] for engine in engines}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hyperacc_preference_bench_") as tmp:
        model_dir = os.path.join(tmp, "model")
        total = prepare(model_dir, args.layers)
        for i, engine in enumerate(order):
            r = launch(engine, model_dir, args.steps, tmp, i)
            results[engine].append(r)
            print(f"{engine}: {step_ms([r]):.0f} ms/step, peak (whole) "
                  f"{' / '.join(mib(x['whole_peak']) for x in r['ranks'])} MiB, {r['wall']:.0f} s", flush=True)
    if args.trainer == "grpo":
        return grpo_report(results, args, total, started)
    print(f"\nQwen3 dense, {args.layers} layers, hidden {MODEL['hidden_size']}, vocab {VOCAB} untied: {total / 1e6:.1f} M "
          f"parameters ({total * 4 / 2**20:.0f} MiB fp32); 2 CPU processes (torchrun, gloo, 1 thread each), fp32, "
          f"{PAIRS} pairs per rank and step (SFT: their {2 * PAIRS} rows), max_length {SEQ}, {args.steps} steps, "
          f"{args.rounds} launch(es) per engine. Step: median of steps {WARMUP + 1}.. of the slower rank. MiB per "
          f"rank (rank 0 / 1) above the RSS before the trainer was built "
          f"({results['plain'][0]['ranks'][0]['method']}).")
    print("| engine | ms/step (median) | RSS after constructor | peak, constructor | peak, training | loss first → last |")
    print("|---|---|---|---|---|---|")
    per_rank = lambda r, k: " / ".join(mib(x[k]) for x in r["ranks"])  # noqa: E731
    for engine, runs in results.items():
        r = runs[0]
        print(f"| {ENGINES[engine]} | {step_ms(runs):.0f} | {per_rank(r, 'built')} | {per_rank(r, 'constructor_peak')} | "
              f"{per_rank(r, 'train_peak')} | {r['losses'][0]:.4f} → {r['losses'][-1]:.4f} |")
    plain, hyper, sft = results["plain"], results["hyperacc"], results["sft"]
    print()
    print(f"hyperacc DPO / plain DPO step time: {step_ms(hyper) / step_ms(plain):.3f} (goal <= 1.0)")
    print(f"hyperacc DPO / plain DPO peak RSS per rank: training {worst(hyper, 'train_peak') / worst(plain, 'train_peak'):.3f}, "
          f"whole run {worst(hyper, 'whole_peak') / worst(plain, 'whole_peak'):.3f}")
    print(f"hyperacc DPO / hyperacc SFT peak RSS per rank (the reference's cost): training "
          f"{worst(hyper, 'train_peak') / worst(sft, 'train_peak'):.3f} (goal <= 1.35), whole run "
          f"{worst(hyper, 'whole_peak') / worst(sft, 'whole_peak'):.3f}")
    print(f"first loss: plain {plain[0]['losses'][0]:.6f}, hyperacc {hyper[0]['losses'][0]:.6f} (ln 2 = 0.693147)")
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


def grpo_report(results: dict, args, total: int, started: float) -> None:
    print(f"\nQwen3 dense, {args.layers} layers, {total / 1e6:.1f} M parameters, fp32; 2 CPU processes; GRPO: "
          f"{GENERATIONS} completions of up to {COMPLETION} tokens per rank and step (one prompt per rank), beta "
          f"0.04 (a reference model), {args.steps} steps, {args.rounds} launch(es) per engine; step time includes "
          "generation. MiB per rank above the RSS before the trainer was built.")
    print("| engine | ms/step (median) | peak, constructor | peak, training |")
    print("|---|---|---|---|")
    per_rank = lambda r, k: " / ".join(mib(x[k]) for x in r["ranks"])  # noqa: E731
    for engine, runs in results.items():
        print(f"| {GRPO_ENGINES[engine]} | {step_ms(runs):.0f} | {per_rank(runs[0], 'constructor_peak')} | "
              f"{per_rank(runs[0], 'train_peak')} |")
    plain, hyper = results["grpo_plain"], results["grpo_hyperacc"]
    print(f"\nhyperacc GRPO / plain GRPO step time: {step_ms(hyper) / step_ms(plain):.3f}; peak RSS per rank: "
          f"training {worst(hyper, 'train_peak') / worst(plain, 'train_peak'):.3f}, whole run "
          f"{worst(hyper, 'whole_peak') / worst(plain, 'whole_peak'):.3f}")
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        main()
