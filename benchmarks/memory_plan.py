"""Is the dry run's memory plan right? Measured per-rank peak memory vs `hyperacc.dry_run.plan_sharding`.

For each case (layout x precision recipe x recompute) two torchrun jobs run the same script on
2 CPU processes: one trains a Qwen3-MoE of >= 0.5 GB for a few steps, one does everything but the
model (imports, process group, Accelerator, batches). Measured = peak RSS (VmHWM) of the first minus
the second, per rank; planned = the plan's device peak for the same model, layout and recipe.
glibc's malloc is told to map every block >= 64 KiB on its own (MALLOC_MMAP_THRESHOLD_), so freed
tensors leave RSS at once and the peak is the peak of live memory, as on a device allocator, and
oneDNN's primitive cache (CPU bf16 kernels keep reordered weights and scratch pads there) is off.

    python benchmarks/memory_plan.py                 # every case, Markdown table, ratios last
    python benchmarks/memory_plan.py --cases fsdp:bf16 --steps 3
Worker (what the jobs run):
    torchrun --nproc_per_node=2 benchmarks/memory_plan.py --worker OUT.json LAYOUT RECIPE RECOMPUTE [--baseline]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# ~263 M parameters: 1.05 GB in fp32, 0.53 GB in bf16. 16 experts of 1024, top-2, vocab 32k.
CONFIG = dict(vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=1024,
              num_hidden_layers=9, num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=16,
              num_experts_per_tok=2, max_position_embeddings=1024, tie_word_embeddings=False, use_cache=False)
MICRO_BATCH, SEQ = 2, 512
LAYOUTS = {"fsdp": {}, "ep": {"ep_size": 2}, "tp": {"tp_size": 2}}
DEFAULT_CASES = ["fsdp:fp32_master:0", "fsdp:fp32_master:1", "ep:fp32_master:1", "tp:fp32_master:1",
                 "fsdp:bf16:0", "fsdp:bf16:1", "ep:bf16:1", "tp:bf16:1", "fsdp:bf16_sr:1"]


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def worker(out_path, layout, recipe, recompute, baseline, steps):
    import torch
    import torch.distributed as dist

    import hyperacc
    from hyperacc.models import build_causal_lm, qwen3_moe_config
    from hyperacc.optim import AdamW

    acc = hyperacc.Accelerator(
        parallel=hyperacc.ParallelConfig(**LAYOUTS[layout]),
        fsdp=hyperacc.FSDPConfig(precision=recipe, activation_checkpointing=bool(recompute), mixed_precision="no"),
        checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=0)
    batches = []
    for step in range(steps):
        ids = torch.randint(0, CONFIG["vocab_size"], (MICRO_BATCH, SEQ),
                            generator=torch.Generator().manual_seed(step * 100 + acc.dp_rank))
        batches.append([{"input_ids": ids, "labels": ids.clone()}])
    losses = []
    if not baseline:
        model = build_causal_lm(qwen3_moe_config(**CONFIG), meta_device=True, attn_implementation="sdpa",
                                experts_implementation="grouped_mm", router_aux_loss=False)
        optimizer_class = AdamW if acc.recipe.low_precision else torch.optim.AdamW
        optimizer = optimizer_class(model.parameters(), lr=1e-4)
        model, optimizer = acc.prepare(model, optimizer)
        for batch in batches:
            with acc.accumulate(model, batch) as micro_batches:
                for mb in micro_batches:
                    out = model(**mb)
                    acc.backward(out.loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(acc.step_loss)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_rss_bytes())
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump({"peaks": peaks, "losses": losses}, handle)
    acc.end_training()


def planned_bytes(layout, recipe, recompute, world=2) -> dict:
    from hyperacc.dry_run import plan_sharding
    from hyperacc.models import build_causal_lm, qwen3_moe_config

    model = build_causal_lm(qwen3_moe_config(**CONFIG), meta_device=True, attn_implementation="sdpa",
                            experts_implementation="grouped_mm", router_aux_loss=False)
    sizes = LAYOUTS[layout]
    plan = plan_sharding(model, world_size=world, tp=sizes.get("tp_size", 1), ep=sizes.get("ep_size", 1),
                         precision=recipe, activation_checkpointing=bool(recompute), micro_batch_size=MICRO_BATCH,
                         seq_len=SEQ, eager_attention=False, device_type="cpu")
    return {"total": plan.device_bytes, "bytes": plan.bytes, "params": plan.total_params}


def launch(layout, recipe, recompute, baseline, steps, out_dir) -> dict:
    out = os.path.join(out_dir, f"{layout}-{recipe}-{recompute}-{'base' if baseline else 'model'}.json")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "--worker",
           out, layout, recipe, str(recompute), "--steps", str(steps)] + (["--baseline"] if baseline else [])
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    with open(out) as handle:
        return json.load(handle)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES, help="LAYOUT:RECIPE:RECOMPUTE(0|1)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    rows, ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            layout, recipe, recompute = case.split(":")
            recompute = int(recompute)
            base = launch(layout, recipe, recompute, True, args.steps, tmp)
            run = launch(layout, recipe, recompute, False, args.steps, tmp)
            plan = planned_bytes(layout, recipe, recompute)
            measured = [m - b for m, b in zip(run["peaks"], base["peaks"])]
            ratio = max(measured) / plan["total"]
            ratios.append(ratio)
            rows.append(f"| {layout} | {recipe} | {'on' if recompute else 'off'} | {gib(plan['total'])} | "
                        f"{' / '.join(gib(m) for m in measured)} | {ratio:.3f} | "
                        f"{' '.join(f'{x:.3f}' for x in run['losses'])} |")
            print(rows[-1], flush=True)
    params = planned_bytes("fsdp", "fp32_master", 1)["params"]
    print(f"\nQwen3-MoE {params / 1e6:.0f} M params ({params * 4 / 1e9:.2f} GB fp32), 2 CPU processes, "
          f"micro-batch {MICRO_BATCH} x {SEQ} tokens, SDPA, {args.steps} steps; GiB per rank")
    print("| layout | recipe | recompute | planned | measured (rank 0 / 1) | measured / planned | losses |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nmeasured/planned: min {min(ratios):.3f}, max {max(ratios):.3f} (goal 0.8-1.25)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        p = argparse.ArgumentParser()
        p.add_argument("out"), p.add_argument("layout"), p.add_argument("recipe"), p.add_argument("recompute", type=int)
        p.add_argument("--baseline", action="store_true")
        p.add_argument("--steps", type=int, default=3)
        a = p.parse_args(sys.argv[2:])
        worker(a.out, a.layout, a.recipe, a.recompute, a.baseline, a.steps)
    else:
        main()
