"""LoRA under FSDP2: per-rank peak memory and checkpoint size against full fine-tuning.

One ~1 GB bf16 model (a dense Qwen3 built on the meta device in bf16, vocab 32k), trained for a few
AdamW steps on 2 CPU processes, three ways, each in its own torchrun launch (so peaks do not mix):
  full      every parameter trainable: the fp32_master recipe stores fp32 master weights, fp32
            gradients and fp32 AdamW moments (16 bytes per parameter)
  lora      a `peft` LoRA (r=16 on q, k, v, o, gate, up, down) on the bf16 base: the frozen base
            stays bf16 (2 bytes per parameter), the adapters follow the recipe (16)
  upcast    the same LoRA with the base cast to fp32 before `get_peft_model` (what every PEFT
            model got before frozen parameters kept their dtype: 4 bytes per base parameter)
Every run: `Accelerator(seed=0)` with the default fp32_master recipe and
`FSDPConfig(mixed_precision="bf16")` (bf16 all-gathers and compute, fp32 gradient reduction),
eager attention, no recompute, `torch.optim.AdamW` over the trainable parameters, one micro-batch of
2 x 128 tokens per rank and step (short: weights, gradients and optimizer states dominate), then a
checkpoint (`CheckpointConfig(checkpoint_dir=...)` + `acc.save_state()`) whose files are summed.

Peak memory per rank = peak RSS (VmHWM) during prepare + training minus the RSS just before
`prepare` (imports, process group, Accelerator, batches, the meta model). VmHWM is reset through
/proc/self/clear_refs there and at the start of each phase (prepare, forward, backward, optimizer
step), and the largest phase peak is the run's: the table shows where it lies (where clear_refs is
refused: ru_maxrss minus that RSS, no phases).
As in memory_plan.py, glibc maps every block >= 64 KiB on its own (MALLOC_MMAP_THRESHOLD_) so freed
tensors leave RSS at once, and oneDNN's primitive cache is off. The save's own peak is measured the
same way (reset before `save_state`). Ratios are printed last:
LoRA peak / full peak (goal <= 0.6), LoRA peak / upcast-LoRA peak, adapter checkpoint / full
checkpoint (goal <= 0.05). The lora run then times the adapter export (`acc.save_model`: PEFT's own
key choice, gathered one tensor at a time) against PEFT's own ``save_pretrained`` of the same
adapters on an unsharded model in one process, in the same run: seconds and their ratio.

    python benchmarks/peft.py [--steps 3] [--layers 32] [--runs full lora upcast]
Worker (what each launch runs):
    torchrun --nproc_per_node=2 benchmarks/peft.py --worker OUT.json RUN --steps N --layers L --ckpt DIR
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from rss import local_bytes, reset_peak, status

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# This file is named like the `peft` package, and Python puts its folder first on sys.path: drop it,
# so that `import peft` finds the library, not this script.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
# dense Qwen3, hidden 1024, 16 / 8 heads of 64, MLP 3072, vocab 32k, untied head: 32 layers = 468 M
# parameters, 0.94 GB in bf16
MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
             use_cache=False)
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
MICRO_BATCH, SEQ = 2, 128
EXPORT_REPEATS = 3
RUNS = {"full": "full fine-tuning", "lora": "LoRA, bf16 base kept bf16", "upcast": "LoRA, base upcast to fp32"}




class PeakMeter:
    """Peak RSS above the RSS at `start`. Where /proc/self/clear_refs takes "5" (resets VmHWM to the
    current RSS), `phase` ends a phase: its peak, and VmHWM reset for the next one (the run's peak
    is then the largest phase peak). Elsewhere: ru_maxrss (since the process started), no phases."""

    def start(self) -> None:
        self.base = status("VmRSS")
        self.phases = reset_peak()
        self.method = "VmHWM reset by clear_refs" if self.phases else "ru_maxrss (since process start)"

    def peak(self) -> int:
        if self.phases:
            return status("VmHWM") - self.base
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.base

    def phase(self) -> int:
        value = self.peak()
        if self.phases:
            reset_peak()
        return value






def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def worker(out_path: str, run: str, steps: int, layers: int, ckpt_dir: str) -> None:
    import peft  # noqa: F401  (imported by every run: the same baseline)
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen3Config

    import hyperacc

    acc = hyperacc.Accelerator(fsdp=hyperacc.FSDPConfig(mixed_precision="bf16"),
                               checkpoint=hyperacc.CheckpointConfig(checkpoint_dir=ckpt_dir), seed=0)
    gen = torch.Generator().manual_seed(1000 + acc.dp_rank)
    batches = [torch.randint(0, MODEL["vocab_size"], (MICRO_BATCH, SEQ), generator=gen) for _ in range(steps)]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**MODEL, num_hidden_layers=layers),
                                                 dtype=torch.bfloat16, attn_implementation="eager")
    if run == "upcast":
        model.float()           # the old behaviour: every parameter, frozen or not, in the recipe's fp32
    if run != "full":
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    total_params = sum(p.numel() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable_params = sum(p.numel() for p in trainable)
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)

    meter = PeakMeter()
    dist.barrier()
    meter.start()
    model, optimizer = acc.prepare(model, optimizer)
    phases = {"prepare": meter.phase(), "forward": 0, "backward": 0, "step": 0}
    losses, times = [], []
    for ids in batches:
        dist.barrier()
        meter.phase()
        start = time.perf_counter()
        with acc.accumulate(model, [{"input_ids": ids, "labels": ids}]) as micro_batches:
            for mb in micro_batches:
                loss = model(**mb).loss
                phases["forward"] = max(phases["forward"], meter.phase())
                acc.backward(loss)
                phases["backward"] = max(phases["backward"], meter.phase())
        optimizer.step()        # with the accumulation's end (token all-reduce) and zero_grad
        optimizer.zero_grad()
        phases["step"] = max(phases["step"], meter.phase())
        times.append(time.perf_counter() - start)
        losses.append(acc.step_loss)
    train_peak = max(phases.values()) if meter.phases else meter.peak()
    params_bytes = local_bytes(model.parameters())
    trainable_bytes = local_bytes(p for p in model.parameters() if p.requires_grad)
    state_bytes = local_bytes(v for s in optimizer.state.values() for v in s.values()
                              if isinstance(v, torch.Tensor) and v.dim() > 0)

    dist.barrier()
    before_save = status("VmRSS") - meter.base
    meter.start()
    start = time.perf_counter()
    saved = acc.save_state()
    save_seconds = time.perf_counter() - start
    save_peak = meter.peak()
    save_phases = dict(getattr(acc._get_checkpointer(), "last_save_timings", None) or {})
    dist.barrier()
    ckpt_bytes = dir_bytes(saved) if acc.is_main_process else 0

    exports = export_timing(acc, model, out_path + ".exports") if run == "lora" else None
    mine = {"phases": phases if meter.phases else None, "train_peak": train_peak, "save_peak": save_peak,
            "run_peak": max(train_peak, before_save + save_peak),
            "params_bytes": params_bytes, "trainable_bytes": trainable_bytes, "state_bytes": state_bytes,
            "times": times}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        dtypes = sorted({str(p.dtype).replace("torch.", "") + (" trainable" if p.requires_grad else " frozen")
                         for p in model.parameters()})
        with open(out_path, "w") as handle:
            json.dump({"run": run, "ranks": gathered, "losses": losses, "ckpt_bytes": ckpt_bytes,
                       "save_seconds": save_seconds, "save_phases": save_phases, "total_params": total_params,
                       "trainable_params": trainable_params, "dtypes": dtypes, "method": meter.method,
                       "files": sorted(os.listdir(saved)), "exports": exports}, handle)
    acc.end_training()


def export_timing(acc, model, folder: str, repeats: int = EXPORT_REPEATS) -> dict:
    """Seconds (median of ``repeats``, each into a new directory) of the adapter export of the
    sharded model (`acc.save_model`, both ranks: PEFT's own key choice, one gather per tensor, rank 0
    writes), against PEFT's own ``save_pretrained`` of the same adapters on an unsharded copy of the
    model in one process (rank 0; its frozen base stays on the meta device: PEFT writes none of it).
    Measured after training and the checkpoint, so no memory figure above includes it."""
    import peft
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen3Config

    from hyperacc.integrations.peft_export import adapter_state_dict

    ours = []
    for i in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        acc.save_model(model, os.path.join(folder, f"hyperacc-{i}"))
        ours.append(time.perf_counter() - start)
    state = adapter_state_dict(model)       # the trained adapters, full size, on every rank
    theirs, keys = [], None
    if dist.get_rank() == 0:
        layers = model.get_base_model().config.num_hidden_layers
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(Qwen3Config(**MODEL, num_hidden_layers=layers),
                                                    dtype=torch.bfloat16, attn_implementation="eager")
        plain = peft.get_peft_model(base, peft.LoraConfig(**LORA))
        plain.load_state_dict(state, strict=False, assign=True)
        for i in range(repeats):
            start = time.perf_counter()
            plain.save_pretrained(os.path.join(folder, f"peft-{i}"))
            theirs.append(time.perf_counter() - start)
        from safetensors import safe_open

        with safe_open(os.path.join(folder, "peft-0", "adapter_model.safetensors"), "pt") as a, \
                safe_open(os.path.join(folder, "hyperacc-0", "adapter_model.safetensors"), "pt") as b:
            keys = sorted(a.keys()) == sorted(b.keys())
    dist.barrier()
    shutil.rmtree(folder, ignore_errors=True)
    return {"hyperacc": statistics.median(ours), "peft": statistics.median(theirs) if theirs else None,
            "same_keys": keys, "tensors": len(state), "bytes": sum(t.numel() * t.element_size() for t in state.values())}


def launch(run: str, args, out_dir: str) -> dict:
    out = os.path.join(out_dir, f"{run}.json")
    ckpt = os.path.join(out_dir, f"ckpt-{run}")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "--worker",
           out, run, "--steps", str(args.steps), "--layers", str(args.layers), "--ckpt", ckpt]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    with open(out) as handle:
        result = json.load(handle)
    result["wall"] = time.perf_counter() - start
    shutil.rmtree(ckpt, ignore_errors=True)     # the full checkpoint is 12 bytes per parameter
    return result


def mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def step_seconds(r: dict) -> float:
    """Median over the steps after the first of the slower rank's step time."""
    per_step = [max(rank["times"][i] for rank in r["ranks"]) for i in range(len(r["ranks"][0]["times"]))]
    return statistics.median(per_step[1:] or per_step)


def phase_peaks(rank: dict) -> str:
    phases = rank["phases"]
    return " / ".join(mib(phases[k]) for k in ("prepare", "forward", "backward", "step")) if phases else "-"


def peak(r: dict, key: str = "train_peak") -> int:
    return max(rank[key] for rank in r["ranks"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--json", help="also write every run's raw figures here")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="hyperacc_peft_bench_") as tmp:
        for run in args.runs:
            results[run] = r = launch(run, args, tmp)
            print(f"{run}: train peak {' / '.join(mib(x['train_peak']) for x in r['ranks'])} MiB, "
                  f"checkpoint {mib(r['ckpt_bytes'])} MiB, {step_seconds(r):.2f} s/step, {r['wall']:.0f} s in all",
                  flush=True)
    any_run = next(iter(results.values()))
    base_params = any_run["total_params"] - (0 if any_run["run"] == "full" else any_run["trainable_params"])
    print(f"\nQwen3 dense, {args.layers} layers, hidden {MODEL['hidden_size']}, vocab {MODEL['vocab_size']}: "
          f"{base_params / 1e6:.1f} M parameters (bf16 weights {base_params * 2 / 1e9:.2f} GB); 2 CPU processes "
          f"(gloo), fp32_master, mixed_precision bf16, {args.steps} AdamW steps of {MICRO_BATCH} x {SEQ} tokens per "
          f"rank; LoRA r={LORA['r']} on {', '.join(LORA['target_modules'])}. MiB per rank (rank 0 / 1); peak = "
          f"{any_run['method']}, above the RSS just before prepare (the save's own: above the RSS just before "
          "save_state); state = the parameter, gradient and AdamW moment shards each rank holds. Step times: "
          "median of steps 2.., slower rank, under MALLOC_MMAP_THRESHOLD_ (every large tensor fresh from the "
          "kernel: ~2x slower steps than plain malloc on this machine; compare them with each other only).")
    print("| run | trainable params | stored dtypes | state / rank | peak, prepare + train | phase peaks, rank 0: "
          "prepare / forward / backward / step | save's own peak | peak, whole run | s/step | save s | checkpoint | "
          "losses |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    per_rank = lambda r, f: " / ".join(mib(f(x)) for x in r["ranks"])  # noqa: E731
    for run, r in results.items():
        share = 100 * r["trainable_params"] / r["total_params"]
        print(f"| {RUNS[run]} | {r['trainable_params'] / 1e6:.2f} M ({share:.2f} %) | {', '.join(r['dtypes'])} | "
              f"{per_rank(r, lambda x: x['params_bytes'] + x['trainable_bytes'] + x['state_bytes'])} | "
              f"{per_rank(r, lambda x: x['train_peak'])} | {phase_peaks(r['ranks'][0])} | "
              f"{per_rank(r, lambda x: x['save_peak'])} | "
              f"{per_rank(r, lambda x: x['run_peak'])} | {step_seconds(r):.2f} | {r['save_seconds']:.1f} | "
              f"{r['ckpt_bytes'] / 2**20:.1f} MiB ({len(r['files'])} files) | "
              f"{' '.join(f'{x:.4f}' for x in r['losses'])} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    print()
    if "lora" in results and "full" in results:
        lora, full = results["lora"], results["full"]
        print(f"LoRA peak / full fine-tuning peak: {peak(lora) / peak(full):.3f} (goal <= 0.6); whole run, save "
              f"included: {peak(lora, 'run_peak') / peak(full, 'run_peak'):.3f}")
        print(f"adapter checkpoint / full checkpoint: {lora['ckpt_bytes'] / full['ckpt_bytes']:.4f} (goal <= 0.05)")
        print(f"LoRA step time / full fine-tuning step time: {step_seconds(lora) / step_seconds(full):.3f}")
    exports = results.get("lora", {}).get("exports")
    if exports:
        print(f"adapter export ({exports['tensors']} tensors, {mib(exports['bytes'])} MiB; median of "
              f"{EXPORT_REPEATS}): hyperacc save_model of the sharded model (2 processes) {exports['hyperacc']:.3f} s, "
              f"PEFT's save_pretrained of the unsharded model (1 process) {exports['peft']:.3f} s: ratio "
              f"{exports['hyperacc'] / exports['peft']:.2f} (same keys: {exports['same_keys']})")
    if "lora" in results and "upcast" in results:
        lora, upcast = results["lora"], results["upcast"]
        print(f"LoRA peak / upcast-LoRA peak: {peak(lora) / peak(upcast):.3f}; whole run, save included: "
              f"{peak(lora, 'run_peak') / peak(upcast, 'run_peak'):.3f}")
        print(f"LoRA step time / upcast-LoRA step time: {step_seconds(lora) / step_seconds(upcast):.3f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        p = argparse.ArgumentParser()
        p.add_argument("out"), p.add_argument("run", choices=list(RUNS))
        p.add_argument("--steps", type=int, default=3)
        p.add_argument("--layers", type=int, default=32)
        p.add_argument("--ckpt", required=True)
        a = p.parse_args(sys.argv[2:])
        worker(a.out, a.run, a.steps, a.layers, a.ckpt)
    else:
        main()
