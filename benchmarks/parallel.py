"""TP/EP benchmark on CPU processes (gloo): hyperacc vs transformers' own DistributedConfig, grouped_mm vs loop.

One layout per process job (so ru_maxrss is that layout's peak host memory per rank):
    python -m torch.distributed.run --nproc_per_node=4 benchmarks/parallel.py OUT.json IMPL LAYOUT [EXPERTS_IMPL]
    IMPL: hyperacc | transformers; LAYOUT: dp4, dp4ep4, dp2tp2; EXPERTS_IMPL: grouped_mm (default) | eager
A 32-expert Qwen3-MoE (top-2), fp32, AdamW; every DP rank runs one micro-batch of 4 x 128 tokens per
step; the mean step time over steps 3..STEPS (the slowest rank's) is reported.
``python benchmarks/parallel.py --all`` runs every case on 4 processes and prints a Markdown table.
"""
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from hyperacc.config.launch_env import free_port  # noqa: E402
STEPS, MBS, SEQ = 8, 4, 128
CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=32, num_experts_per_tok=2,
              max_position_embeddings=512, tie_word_embeddings=False, output_router_logits=True, use_cache=False)


def sizes(layout):
    out = {"dp_shard_size": 1, "tp_size": 1, "ep_size": 1}
    for key, value in re.findall(r"([a-z]+)(\d+)", layout):
        out[{"dp": "dp_shard_size", "tp": "tp_size", "ep": "ep_size"}[key]] = int(value)
    return out


def batch(step, dp_rank):
    gen = torch.Generator().manual_seed(step * 1000 + dp_rank)
    ids = torch.randint(0, CONFIG["vocab_size"], (MBS, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def run_hyperacc(layout, experts_impl):
    import hyperacc
    from hyperacc.models import build_causal_lm, qwen3_moe_config

    acc = hyperacc.Accelerator(parallel=hyperacc.ParallelConfig(**sizes(layout)),
                               checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=0)
    model = build_causal_lm(qwen3_moe_config(**CONFIG), meta_device=True, experts_implementation=experts_impl)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    times = []
    for step in range(STEPS):
        start = time.perf_counter()
        with acc.accumulate(model, [batch(step, acc.dp_rank)]) as micro_batches:
            for mb in micro_batches:
                out = model(**mb)
                acc.backward(out.loss, aux_loss=out.aux_loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return times, acc.step_loss


def run_transformers(layout, experts_impl, model_dir):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    s = sizes(layout)
    config = DistributedConfig(fsdp_size=s["dp_shard_size"], tp_size=s["tp_size"], ep_size=s["ep_size"])
    model = AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=config, dtype=torch.float32,
                                                 experts_implementation=experts_impl)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp_rank = dist.get_rank() // s["tp_size"]
    times, loss = [], None
    for step in range(STEPS):
        start = time.perf_counter()
        out = model(**batch(step, dp_rank))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        loss = float(out.loss)
    return times, loss


def worker(out_path, impl, layout, experts_impl, model_dir):
    if impl == "hyperacc":
        times, loss = run_hyperacc(layout, experts_impl)
    else:
        times, loss = run_transformers(layout, experts_impl, model_dir)
    mean = torch.tensor([sum(times[2:]) / len(times[2:]), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump({"impl": impl, "layout": layout, "experts": experts_impl, "step_s": float(mean[0]),
                       "peak_rss_mib": float(mean[1]), "loss": loss}, handle)
    dist.barrier()
    dist.destroy_process_group()


def all_gathered_bytes(layout):
    """Bytes all-gathered per rank and step (forward + backward, fp32), from the dry-run planner."""
    from hyperacc.tools.dry_run import plan_sharding
    from hyperacc.models import build_causal_lm, qwen3_moe_config

    s = sizes(layout)
    model = build_causal_lm(qwen3_moe_config(**CONFIG), meta_device=True)
    plan = plan_sharding(model, world_size=4, tp=s["tp_size"], ep=s["ep_size"], micro_batch_size=MBS, seq_len=SEQ)
    note = next(n for n in plan.notes if n.startswith("all-gathered"))
    return note.split(": ", 1)[1], plan.all_to_all_bytes


def run_all():
    from transformers import Qwen3MoeForCausalLM, Qwen3MoeConfig

    cases = [("hyperacc", "dp4", "grouped_mm"), ("transformers", "dp4", "grouped_mm"),
             ("hyperacc", "dp4ep4", "grouped_mm"), ("transformers", "dp4ep4", "grouped_mm"),
             ("hyperacc", "dp2tp2", "grouped_mm"), ("transformers", "dp2tp2", "grouped_mm"),
             ("hyperacc", "dp4", "eager"), ("hyperacc", "dp4ep4", "eager")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG)).save_pretrained(os.path.join(tmp, "model"))
        for n, (impl, layout, experts) in enumerate(cases):
            out = os.path.join(tmp, f"{n}.json")
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
                            f"--master_port={free_port()}", __file__, out, impl, layout, experts,
                            os.path.join(tmp, "model")], check=True, env=env, capture_output=True)
            results.append(json.load(open(out)))
            print(json.dumps(results[-1]), flush=True)
    print("\n| layout | experts | hyperacc s/step | transformers s/step | ratio | hyperacc peak RSS/rank | transformers peak RSS/rank |")
    print("|---|---|---|---|---|---|---|")
    by = {(r["impl"], r["layout"], r["experts"]): r for r in results}
    for layout in ("dp4", "dp4ep4", "dp2tp2"):
        h, t = by[("hyperacc", layout, "grouped_mm")], by[("transformers", layout, "grouped_mm")]
        print(f"| {layout} | grouped_mm | {h['step_s']:.3f} | {t['step_s']:.3f} | {h['step_s'] / t['step_s']:.2f} | "
              f"{h['peak_rss_mib']:.0f} MiB | {t['peak_rss_mib']:.0f} MiB |")
    for layout in ("dp4", "dp4ep4"):
        g, e = by[("hyperacc", layout, "grouped_mm")], by[("hyperacc", layout, "eager")]
        print(f"| {layout} hyperacc | grouped_mm {g['step_s']:.3f} s vs loop {e['step_s']:.3f} s | "
              f"{e['step_s'] / g['step_s']:.2f}x |")
    for layout in ("dp4", "dp4ep4", "dp2tp2"):
        gathered, a2a = all_gathered_bytes(layout)
        print(f"| {layout} | all-gathered/rank/step: {gathered} | all-to-all sent: {a2a / 2**20:.2f} MiB |")


if __name__ == "__main__":
    if sys.argv[1:] == ["--all"]:
        run_all()
    else:
        worker(*sys.argv[1:6])
