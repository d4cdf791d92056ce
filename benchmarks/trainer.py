"""TRL's `SFTTrainer` on hyperacc vs on plain accelerate: step time and memory per rank.

One SFT script, two engines, the only difference the class:
  plain     `trl.SFTTrainer`: transformers' Trainer builds accelerate's own Accelerator. With
            `use_cpu=True` under torchrun and no FSDP configuration that is DistributedType.MULTI_CPU:
            accelerate wraps the model in DistributedDataParallel (gloo): every rank holds the whole
            model, its gradients and AdamW moments, and DDP all-reduces the gradients in buckets.
  hyperacc  `hyperacc.integrations.trl.SFTTrainer`: hyperacc's Accelerator, FSDP2 `fully_shard` of
            every decoder block and of the root over both ranks (dp_shard=2): every rank holds half of
            the parameters, gradients and AdamW moments; all-gathers and reduce-scatters over gloo.
Both: the same dense Qwen3 (hidden 768, 4 layers, vocab 8192 untied: 37.8 M parameters) built from
the same seed on every rank and handed to the trainer, fp32 (no mixed precision), sdpa attention, no
recompute, the Trainer's default AdamW (adamw_torch_fused), lr 1e-4 linear, max_grad_norm 1.0,
packing of the offline default corpus (`hyperacc.data.default_corpus`, its 8192-token BPE, tokenized
before the baseline below) into rows of SEQ (256) tokens,
per_device_train_batch_size 1, gradient_accumulation_steps 2 (SFTConfig's defaults otherwise: with
accumulation, both reduce gradients only after the last micro-batch; ``--sync-each-batch`` sets
accelerate's `sync_each_batch` for both: reduce after every micro-batch), logging every step.
Each engine runs in its own torchrun launch of 2 CPU processes (one thread each), back to back in
one invocation (``--rounds 2``: plain, hyperacc, hyperacc, plain, so slow drift hits both alike).

Measured per rank by a TrainerCallback:
  step time  between consecutive `on_step_end` calls (the whole optimizer step: batch fetch, forward,
             backward, clip, AdamW, scheduler, logging); per step the slower rank's; median over the
             steps after WARMUP; also the process's CPU time over the same interval (time.process_time,
             all threads), which other jobs on the machine disturb less than wall time
  state      bytes of the parameters, gradients and optimizer state the rank holds (local shards of
             DTensors), read in `on_optimizer_step` (after AdamW, before zero_grad); for DDP also its
             gradient buckets (`_get_ddp_logging_data`: a second copy of the gradients unless
             gradient_as_bucket_view, which accelerate leaves off)
  peak RSS   VmHWM (reset through /proc/self/clear_refs) minus the RSS just before the model was built
             (imports, tokenizer and tokenized dataset already loaded): `train` = from `on_train_begin`
             (after the Trainer prepared model and optimizer) to the end of the last step, the largest
             of four phases per step (PHASES below), `whole` = from the model's construction on (so also
             the prepare, where the whole model still exists on every rank: the script hands the
             trainer a built model). Where clear_refs is refused, ru_maxrss (since process start).
As in peft.py / memory_plan.py: MALLOC_MMAP_THRESHOLD_=65536 (freed tensors leave RSS at once) and
oneDNN's primitive cache off, for both engines. Goals (issue): hyperacc / plain step time <= 1.0,
per-rank memory <= 0.6.

    python benchmarks/trainer.py [--steps 8] [--rounds 1] [--layers 4] [--seq 256] [--micro 1] [--accum 2]
                                 [--sync-each-batch] [--json F]
Worker (what each launch runs):
    torchrun --nproc_per_node=2 benchmarks/trainer.py --worker OUT.json ENGINE --steps N --layers L ...
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
from rss import local_bytes, peak, reset_peak, status  # noqa: E402  (before this folder leaves sys.path)

# benchmarks/peft.py is named like the `peft` package that transformers' Trainer imports, and Python
# puts this script's folder first on sys.path: drop it, so that `import peft` finds the library.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
VOCAB, SEQ, MICRO, ACCUM, WARMUP = 8192, 256, 1, 2, 2
MODEL = dict(vocab_size=VOCAB, hidden_size=768, intermediate_size=2048, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False,
             use_cache=False)
# Where the training peak lies: the forward + backward of a micro-batch that does not reduce
# (accumulating), of the last one (backward with the gradient reduction, then the clip), AdamW's step,
# and everything else (zero_grad, scheduler, logging, the next batch).
PHASES = ("accumulating", "last micro-batch", "optimizer", "between")
ENGINES = {"plain": "trl.SFTTrainer on accelerate (DDP, whole model per rank)",
           "hyperacc": "hyperacc SFTTrainer (FSDP2, dp_shard=2)"}










def worker(out_path: str, engine: str, steps: int, layers: int, seq: int, micro: int, accum: int,
           sync_each_batch: bool) -> None:
    import torch
    import torch.distributed as dist
    import trl
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerCallback

    import hyperacc.integrations.trl as hyperacc_trl     # imported by both engines: the same baseline
    from hyperacc.data.default_corpus import collect_documents, load_default_tokenizer

    trainer_class = hyperacc_trl.SFTTrainer if engine == "hyperacc" else trl.SFTTrainer
    tokenizer = load_default_tokenizer(VOCAB)
    dataset = Dataset.from_dict({"text": collect_documents()})
    out_dir = os.path.splitext(out_path)[0] + "-output"     # the same on both ranks (nothing is saved)
    args = trl.SFTConfig(output_dir=out_dir, use_cpu=True, max_steps=steps, per_device_train_batch_size=micro,
                         gradient_accumulation_steps=accum, learning_rate=1e-4, max_grad_norm=1.0, seed=0,
                         packing=True, max_length=seq, logging_steps=1, save_strategy="no", report_to=[],
                         disable_tqdm=True, dataset_num_proc=None, dataloader_num_workers=0,
                         accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": sync_each_batch}})
    # Tokenized before the baseline (the trainer's constructor then only packs it).
    dataset = dataset.map(lambda row: tokenizer(row["text"]), remove_columns=["text"])

    phases = {}

    class Meter(TrainerCallback):
        def __init__(self):
            self.ends, self.cpu, self.state, self.mode = [], [], None, None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            phases["prepared"] = status("VmRSS") - base
            phases["prepare_peak"] = peak() - base
            self.kind = f"{type(model).__module__}.{type(model).__name__}"
            self.mode = "VmHWM reset by clear_refs" if reset_peak() else "ru_maxrss (since process start)"
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())
            self.phases = dict.fromkeys(PHASES, 0)

        def _phase(self, name):
            """The peak since the last phase ended, above the baseline; VmHWM reset for the next one."""
            self.phases[name] = max(self.phases[name], peak() - base)
            reset_peak()

        def on_step_begin(self, args, state, control, **kwargs):
            self._phase("between")

        def on_substep_end(self, args, state, control, **kwargs):
            self._phase("accumulating")

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self._phase("last micro-batch")

        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            self._phase("optimizer")
            if self.state is None:
                params = list(model.parameters())
                moments = [v for s in optimizer.state.values() for v in s.values()
                           if isinstance(v, torch.Tensor) and v.dim() > 0]
                self.state = {"params": local_bytes(params),
                              "grads": local_bytes(p.grad for p in params if p.grad is not None),
                              "optimizer": local_bytes(moments)}

        def on_step_end(self, args, state, control, **kwargs):
            self._phase("between")
            self.ends.append(time.perf_counter())
            self.cpu.append(time.process_time())

    meter = Meter()
    reset_peak()
    base = status("VmRSS")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**MODEL, num_hidden_layers=layers, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id))
    total_params = sum(p.numel() for p in model.parameters())
    trainer = trainer_class(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                            callbacks=[meter])
    phases["built"] = status("VmRSS") - base
    trainer.train()
    meter._phase("between")
    train_peak = max(meter.phases.values())
    accelerator = trainer.accelerator
    buckets = 0
    if isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel):
        ddp = trainer.model_wrapped._get_ddp_logging_data()     # DDP's gradient buckets, separate from .grad
        if not ddp.get("gradient_as_bucket_view"):
            buckets = sum(int(x) for x in str(ddp.get("bucket_sizes", "")).split(",") if x.strip())
    record = {"times": [b - a for a, b in zip(meter.ends, meter.ends[1:])],
              "cpu": [b - a for a, b in zip(meter.cpu, meter.cpu[1:])], "state": meter.state,
              "buckets": buckets, "train_peak": train_peak, "phases": meter.phases,
              "whole_peak": max(train_peak, phases["prepare_peak"]), **phases}
    dist_ready = dist.is_initialized()
    gathered = [None] * (dist.get_world_size() if dist_ready else 1)
    if dist_ready:
        dist.all_gather_object(gathered, record)
    else:
        gathered[0] = record
    if trainer.is_world_process_zero():
        wrapped = trainer.model_wrapped
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        with open(out_path, "w") as handle:
            json.dump({"engine": engine, "ranks": gathered, "losses": losses, "total_params": total_params,
                       "distributed_type": str(getattr(accelerator, "distributed_type", "?")),
                       "accelerator": f"{type(accelerator).__module__}.{type(accelerator).__name__}",
                       "wrapped": f"{type(wrapped).__module__}.{type(wrapped).__name__}",
                       "model": meter.kind, "method": meter.mode, "world": len(gathered)},
                      handle)
    trainer.end()       # as trl/scripts/sft.py ends
    if dist.is_initialized():     # accelerate's PartialState made the group (both engines): release it
        dist.barrier()
        dist.destroy_process_group()


def launch(engine: str, args, out_dir: str, index: int) -> dict:
    out = os.path.join(out_dir, f"{engine}-{index}.json")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "--worker",
           out, engine, *(str(x) for name in ("steps", "layers", "seq", "micro", "accum")
                          for x in (f"--{name}", getattr(args, name)))]
    if args.sync_each_batch:
        cmd.append("--sync-each-batch")
    start = time.perf_counter()
    load = os.getloadavg()[0]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    with open(out) as handle:
        result = json.load(handle)
    result["wall"] = time.perf_counter() - start
    result["load"] = f"{load:.1f} / {os.getloadavg()[0]:.1f}"
    return result


def mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def per_step(r: dict, key: str = "times") -> list:
    """Each step's time (wall, or with ``key="cpu"`` the process's CPU time), the slower rank's."""
    return [max(rank[key][i] for rank in r["ranks"]) for i in range(len(r["ranks"][0][key]))]


def step_ms(runs: list, key: str = "times") -> float:
    """Median over the steps after WARMUP of every launch of one engine, in ms."""
    return 1000 * statistics.median(t for r in runs for t in per_step(r, key)[WARMUP:])


def worst(runs: list, key) -> int:
    """The largest value of ``key`` over ranks and launches."""
    return max(key(rank) for r in runs for rank in r["ranks"])


def state_total(rank: dict) -> int:
    return sum(rank["state"].values())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=SEQ, help="packed row length (max_length)")
    parser.add_argument("--micro", type=int, default=MICRO, help="per_device_train_batch_size")
    parser.add_argument("--accum", type=int, default=ACCUM, help="gradient_accumulation_steps")
    parser.add_argument("--sync-each-batch", action="store_true",
                        help="both engines reduce gradients after every micro-batch (accelerate's sync_each_batch)")
    parser.add_argument("--rounds", type=int, default=1, help="launches per engine (ABBA order)")
    parser.add_argument("--json", help="also write every launch's raw figures here")
    args = parser.parse_args()
    from hyperacc.data.default_corpus import load_default_tokenizer

    load_default_tokenizer(VOCAB)       # trained and cached once here, not by both ranks at once
    order = []
    for i in range(args.rounds):
        order += ["plain", "hyperacc"] if i % 2 == 0 else ["hyperacc", "plain"]
    results = {engine: [] for engine in ENGINES}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hyperacc_trainer_bench_") as tmp:
        for i, engine in enumerate(order):
            r = launch(engine, args, tmp, i)
            results[engine].append(r)
            print(f"{engine}: {1000 * statistics.median(per_step(r)[WARMUP:]):.0f} ms/step, train peak "
                  f"{' / '.join(mib(x['train_peak']) for x in r['ranks'])} MiB, {r['wall']:.0f} s launch "
                  f"(load {r['load']})", flush=True)
    plain, hyper = results["plain"], results["hyperacc"]
    any_run = plain[0]
    print(f"\nQwen3 dense, {args.layers} layers, hidden {MODEL['hidden_size']}, vocab {VOCAB} untied: "
          f"{any_run['total_params'] / 1e6:.1f} M parameters ({any_run['total_params'] * 4 / 2**20:.0f} MiB fp32); "
          f"2 CPU processes (torchrun, gloo, 1 thread each), fp32, packed rows of {args.seq} tokens, "
          f"per_device_train_batch_size {args.micro} x gradient_accumulation_steps {args.accum} "
          f"({args.micro * args.accum * args.seq} tokens per rank and step), "
          f"{'sync_each_batch, ' if args.sync_each_batch else ''}{args.steps} steps, {args.rounds} launch(es) "
          f"per engine. Step: median of steps {WARMUP + 1}.. of the slower rank. MiB per rank (rank 0 / 1); state = "
          "parameters + gradients + AdamW moments held; peaks above the RSS before the model was built "
          f"({any_run['method']}).")
    for engine, runs in results.items():
        r = runs[0]
        print(f"  {engine}: {r['accelerator']}, distributed_type {r['distributed_type']}, "
              f"model_wrapped {r['wrapped']}")
    print("| engine | ms/step (median) | CPU ms/step | state: params + grads + AdamW | DDP buckets | "
          "RSS after prepare | peak, training | phase peaks, rank 0: " + " / ".join(PHASES) + " | "
          "peak, whole run (prepare included) | loss first → last |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    per_rank = lambda r, f: " / ".join(mib(f(x)) for x in r["ranks"])  # noqa: E731
    for engine, runs in results.items():
        r = runs[0]
        s = r["ranks"][0]["state"]
        print(f"| {ENGINES[engine]} | {step_ms(runs):.0f} | {step_ms(runs, 'cpu'):.0f} | {per_rank(r, state_total)} "
              f"({mib(s['params'])} + {mib(s['grads'])} + {mib(s['optimizer'])}) | "
              f"{per_rank(r, lambda x: x['buckets'])} | "
              f"{per_rank(r, lambda x: x['prepared'])} | {per_rank(r, lambda x: x['train_peak'])} | "
              f"{' / '.join(mib(r['ranks'][0]['phases'][k]) for k in PHASES)} | "
              f"{per_rank(r, lambda x: x['whole_peak'])} | {r['losses'][0]:.4f} → {r['losses'][-1]:.4f} |")
    print()
    print(f"hyperacc / plain step time: {step_ms(hyper) / step_ms(plain):.3f} (goal <= 1.0); CPU time per step "
          f"(less sensitive to other load; gloo waits block): {step_ms(hyper, 'cpu') / step_ms(plain, 'cpu'):.3f}")
    print(f"hyperacc / plain peak RSS per rank, training: "
          f"{worst(hyper, lambda x: x['train_peak']) / worst(plain, lambda x: x['train_peak']):.3f} (goal <= 0.6); "
          f"whole run: {worst(hyper, lambda x: x['whole_peak']) / worst(plain, lambda x: x['whole_peak']):.3f}")
    print(f"hyperacc / plain state per rank (params + grads + AdamW): "
          f"{worst(hyper, state_total) / worst(plain, state_total):.3f}")
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        p = argparse.ArgumentParser()
        p.add_argument("out"), p.add_argument("engine", choices=list(ENGINES))
        p.add_argument("--steps", type=int, default=8)
        p.add_argument("--layers", type=int, default=4)
        p.add_argument("--seq", type=int, default=SEQ)
        p.add_argument("--micro", type=int, default=MICRO)
        p.add_argument("--accum", type=int, default=ACCUM)
        p.add_argument("--sync-each-batch", action="store_true")
        a = p.parse_args(sys.argv[2:])
        worker(a.out, a.engine, a.steps, a.layers, a.seq, a.micro, a.accum, a.sync_each_batch)
    else:
        main()
