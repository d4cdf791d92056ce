"""Is the dry run's memory plan right? Measured per-rank peak memory vs `hyperacc.tools.dry_run.plan_sharding`.

For each case (model x layout x precision recipe x recompute x sequence length x attention) two
torchrun jobs run the same script on 2 CPU processes, and the difference of their peaks is compared
with the difference of their plans:
  - "weights" cases (a Qwen3-MoE of >= 0.5 GB, vocabulary 32k: weights dominate): the second job
    does everything but the model (imports, process group, Accelerator, batches); its plan is 0.
  - "acts" cases (vocabulary 512, 6 layers of hidden 512, 8 experts, sequences of 512-1024 tokens:
    activations dominate): the second job trains a 1-layer hidden-64 twin of the same model on the
    same batches, which cancels what any model's run holds whatever its size (the kernels' code
    pages, autograd's, gloo's and the allocator's first-use buffers: ~80 MiB, as much as these
    models' plans). A third job without a model measures that ("twin's overhead" in the table).
Measured = peak RSS (VmHWM) of the first job minus the second's, per rank; planned = the plan's
device peak for the first model minus the second's (the same layout and recipe).
glibc's malloc is told to map every block >= 64 KiB on its own (MALLOC_MMAP_THRESHOLD_), so freed
tensors leave RSS at once and the peak is the peak of live memory, as on a device allocator, and
oneDNN's primitive cache (CPU bf16 kernels keep reordered weights and scratch pads there) is off;
the "acts" jobs do not use oneDNN at all (see `worker`).

    python benchmarks/memory_plan.py                 # every case, Markdown table, ratios last
    python benchmarks/memory_plan.py --cases fsdp:bf16:1 --steps 3
    python benchmarks/memory_plan.py --cases fsdp:fp32_master:1:acts:512:eager
Case: LAYOUT:RECIPE:RECOMPUTE(0|1)[:MODEL(weights|acts)[:SEQ[:ATTN(sdpa|eager)[:MICRO_BATCHES]]]]
(defaults weights, 512, sdpa, 1: one micro-batch of 2 sequences per rank and step).
Worker (what the jobs run):
    torchrun --nproc_per_node=2 benchmarks/memory_plan.py --worker OUT.json CASE [--job model|twin|none]
"""
import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
COMMON = dict(max_position_embeddings=1024, tie_word_embeddings=False, use_cache=False)
MODELS = {
    # ~263 M parameters: 1.05 GB in fp32, 0.53 GB in bf16. 16 experts of 1024, top-2, vocab 32k.
    "weights": dict(vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=1024,
                    num_hidden_layers=9, num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=16,
                    num_experts_per_tok=2, **COMMON),
    # 3.5 M parameters (56 MB in fp32_master with AdamW) against ~50-400 MB of activations: the
    # shapes of a reported under-estimate (the tiny preset's heads and experts, hidden 512, 6 layers,
    # 8 experts, vocab 512).
    "acts": dict(vocab_size=512, hidden_size=512, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                 num_experts_per_tok=2, **COMMON),
}
TWIN = dict(num_hidden_layers=1, hidden_size=64)    # the "acts" cases' baseline model
MICRO_BATCH = 2
LAYOUTS = {"fsdp": {}, "ep": {"ep_size": 2}, "tp": {"tp_size": 2}}
DEFAULT_CASES = ["fsdp:fp32_master:0", "fsdp:fp32_master:1", "ep:fp32_master:1", "tp:fp32_master:1",
                 "fsdp:bf16:0", "fsdp:bf16:1", "ep:bf16:1", "tp:bf16:1", "fsdp:bf16_sr:1",
                 # activations dominate: recompute on and off, eager attention (heads x seq x seq
                 # scores) and SDPA, 512 and 1024 tokens, one micro-batch per step or two (as the
                 # example runs that model: accumulated gradients)
                 "fsdp:fp32_master:1:acts:512:eager", "fsdp:fp32_master:1:acts:512:eager:2",
                 "fsdp:fp32_master:0:acts:512:eager", "fsdp:fp32_master:1:acts:1024:eager",
                 "fsdp:fp32_master:0:acts:1024:eager", "fsdp:fp32_master:1:acts:1024:sdpa",
                 "fsdp:fp32_master:0:acts:1024:sdpa", "fsdp:bf16:1:acts:1024:eager", "fsdp:bf16:0:acts:1024:sdpa",
                 "ep:fp32_master:1:acts:1024:eager", "tp:fp32_master:1:acts:1024:sdpa"]


@dataclasses.dataclass(frozen=True)
class Case:
    layout: str
    recipe: str
    recompute: bool
    model: str = "weights"
    seq: int = 512
    attn: str = "sdpa"
    micro_batches: int = 1      # per rank and optimizer step (gradients accumulate in between)

    @classmethod
    def parse(cls, text: str) -> "Case":
        fields = text.split(":")
        layout, recipe, recompute = fields[:3]
        extra = dict(zip(("model", "seq", "attn", "micro_batches"), fields[3:]))
        for key in ("seq", "micro_batches"):
            if key in extra:
                extra[key] = int(extra[key])
        return cls(layout, recipe, bool(int(recompute)), **extra)

    def __str__(self) -> str:
        return (f"{self.layout}:{self.recipe}:{int(self.recompute)}:{self.model}:{self.seq}:{self.attn}:"
                f"{self.micro_batches}")

    def config(self, job: str = "model") -> dict:
        """The config a job trains: "model" the case's, "twin" the baseline's (the "acts" cases: the
        1-layer hidden-64 twin; the "weights" cases: none), "none" no model at all (None)."""
        if job == "model":
            return MODELS[self.model]
        return {**MODELS[self.model], **TWIN} if job == "twin" and self.model != "weights" else None


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def build_model(config: dict, attn: str):
    from hyperacc.models import build_causal_lm, qwen3_moe_config

    return build_causal_lm(qwen3_moe_config(**config), meta_device=True, attn_implementation=attn,
                           experts_implementation="grouped_mm", router_aux_loss=False)


def worker(out_path, case: Case, job: str, steps: int):
    import torch
    import torch.distributed as dist

    import hyperacc
    from hyperacc.precision.adamw import AdamW

    if case.model != "weights":
        # oneDNN's bf16 kernels keep reordered weights and scratch pads outside torch's tensors (in
        # the first step ~10 MiB per layer of the "acts" model, which no device allocator has, and
        # more than its plan); ATen's own CPU kernels instead (too slow for the "weights" model).
        torch.backends.mkldnn.enabled = False
    acc = hyperacc.Accelerator(
        parallel=hyperacc.ParallelConfig(**LAYOUTS[case.layout]),
        fsdp=hyperacc.FSDPConfig(precision=case.recipe, activation_checkpointing=case.recompute, mixed_precision="no"),
        checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=0)
    vocab = case.config("model")["vocab_size"]
    batches = []
    for step in range(steps):
        batch = []
        for index in range(case.micro_batches):
            seed = (step * 100 + index) * 10 + acc.dp_rank
            ids = torch.randint(0, vocab, (MICRO_BATCH, case.seq), generator=torch.Generator().manual_seed(seed))
            batch.append({"input_ids": ids, "labels": ids.clone()})
        batches.append(batch)
    losses = []
    config = case.config(job)
    if config is not None:
        model = build_model(config, case.attn)
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


def planned_bytes(case: Case, job: str = "model", world=2) -> dict:
    """The plan of what ``job`` trains (see `Case.config`; zero without a model)."""
    from hyperacc.tools.dry_run import plan_sharding

    config = case.config(job)
    if config is None:
        return {"total": 0.0, "bytes": {}, "params": 0}
    sizes = LAYOUTS[case.layout]
    plan = plan_sharding(build_model(config, case.attn), world_size=world, tp=sizes.get("tp_size", 1),
                         ep=sizes.get("ep_size", 1), precision=case.recipe, activation_checkpointing=case.recompute,
                         micro_batch_size=MICRO_BATCH, seq_len=case.seq, eager_attention=case.attn == "eager",
                         micro_batches=case.micro_batches, device_type="cpu")
    return {"total": plan.device_bytes, "bytes": plan.bytes, "params": plan.total_params}


def launch(case: Case, job: str, steps: int, out_dir: str) -> dict:
    out = os.path.join(out_dir, f"{str(case).replace(':', '-')}-{job}.json")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "--worker",
           out, str(case), "--job", job, "--steps", str(steps)]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    with open(out) as handle:
        return json.load(handle)


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def measure(case: Case, steps: int, out_dir: str) -> dict:
    """One case: the jobs, their plans, the per-rank measured differences and their ratio to the
    plans'. For the "acts" cases also what the twin's run holds above a run without a model beyond
    the twin's own plan ("overhead"): what differencing against the twin cancels."""
    run, base = launch(case, "model", steps, out_dir), launch(case, "twin", steps, out_dir)
    plan, twin = planned_bytes(case), planned_bytes(case, "twin")
    raw = {"model": run["peaks"], "twin": base["peaks"], "planned_model": plan["total"], "planned_twin": twin["total"]}
    measured = [m - b for m, b in zip(run["peaks"], base["peaks"])]
    planned = plan["total"] - twin["total"]
    result = {"case": case, "planned": planned, "measured": measured, "ratio": max(measured) / planned,
              "activations": plan["bytes"].get("activations", 0.0), "losses": run["losses"], "overhead": None,
              "raw": raw}
    if case.config("twin") is not None:
        empty = launch(case, "none", steps, out_dir)
        raw["none"] = empty["peaks"]
        result["overhead"] = max(b - e for b, e in zip(base["peaks"], empty["peaks"])) - twin["total"]
    return result


def row(r: dict) -> str:
    c = r["case"]
    return (f"| {c.model} | {c.layout} | {c.recipe} | {'on' if c.recompute else 'off'} | {c.seq} | {c.attn} | "
            f"{c.micro_batches} | {mib(r['activations'])} | {mib(r['planned'])} | "
            f"{' / '.join(mib(m) for m in r['measured'])} | "
            f"{r['ratio']:.3f} | {'-' if r['overhead'] is None else mib(r['overhead'])} | "
            f"{' '.join(f'{x:.3f}' for x in r['losses'])} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES,
                        help="LAYOUT:RECIPE:RECOMPUTE(0|1)[:MODEL[:SEQ[:ATTN[:MICRO_BATCHES]]]]")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", help="also write every case's raw peaks and plans here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for text in args.cases:
            results.append(measure(Case.parse(text), args.steps, tmp))
            print(row(results[-1]), flush=True)
    print(f"\n2 CPU processes, micro-batch {MICRO_BATCH}, {args.steps} steps; MiB per rank. Models: "
          + "; ".join(f"{name} {planned_bytes(Case('fsdp', 'fp32_master', True, name))['params'] / 1e6:.1f} M params"
                      for name in MODELS)
          + f". Baselines: none for 'weights', a {TWIN} twin for 'acts' (planned and measured are differences)")
    print("| model | layout | recipe | recompute | seq | attention | micro-batches | planned activations | "
          "planned | measured (rank 0 / 1) | measured / planned | twin's overhead | losses |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(row(r) for r in results))
    ratios = [r["ratio"] for r in results]
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([{**r, "case": str(r["case"])} for r in results], handle, indent=1)
    print(f"\nmeasured/planned: min {min(ratios):.3f}, max {max(ratios):.3f} (goal 0.8-1.25)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        p = argparse.ArgumentParser()
        p.add_argument("out"), p.add_argument("case")
        p.add_argument("--job", choices=("model", "twin", "none"), default="model")
        p.add_argument("--steps", type=int, default=3)
        a = p.parse_args(sys.argv[2:])
        worker(a.out, Case.parse(a.case), a.job, a.steps)
    else:
        main()
