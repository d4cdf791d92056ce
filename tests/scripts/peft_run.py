"""PEFT (LoRA) models under hyperacc's FSDP2 on real processes (torchrun, gloo, CPU); real `peft`.

    peft_run.py train OUT [--base meta|DIR] [--model dense|moe] [--dtype fp32|bf16]
        [--precision fp32_master] [--steps 10] [--save-steps 0] [--ckpt DIR] [--restore PATH|LATEST]
        [--kill-after K] [--modules-to-save] [--trainable-only] [--export DIR] [--consolidated] [--lr 1e-2]
        [--mixed-precision bf16] [--tp 1] [--ep 1]
    peft_run.py checks --tmp DIR
    peft_run.py train OUT ... --checks --tmp DIR     (the checks, then the training, in one launch)
    peft_run.py train OUT ... --then train OUT2 ...   (several runs in one launch: run_sequence.py)

train: a tiny Qwen3 (dense) or Qwen3-MoE base, on the meta device (`--base meta`, initialised from
the Accelerator's seed) or read from a save_pretrained directory (`--base DIR`,
`hyperacc.models.load_pretrained(DIR, accelerator=acc)`), wrapped with LoRA, trained for --steps
optimizer steps (global batch 4 of a fixed, unshuffled dataset: the same samples at every world
size). Rank 0 writes OUT (JSON: per-step losses, dtypes, the probe losses with and without the
adapters, the frozen parameters' gradients, the optimizer's state) and OUT.pt (the full adapter
tensors at start and end, the logits of the probe batch at the end). --kill-after K: every rank
SIGKILLs itself right after step K's `step_end` (a crash after a completed save). --export DIR:
`export_adapter` -> DIR/adapter, `export_merged` -> DIR/merged, `acc.save_model` -> DIR/save_model,
accelerate's `unwrap_model(...).save_pretrained(state_dict=get_state_dict(...))` -> DIR/accelerate.

checks: several Accelerators in one launch, writing DIR/checks.json (rank 0): the dtypes of frozen
and trainable tensors under fp32_master and bf16_sr (dense and MoE, bf16 bases on the meta device),
gradients and optimizer state after one step, the probe loss with and without the adapters, the
exports of a LoRA-only model; HSDP (dp_replicate_size=2) against FSDP; pretrained bases with tied
embeddings; the refusals (tp_size=2, ep_size=2, init_lora_weights='pissa'/'olora' on the meta device,
PEFT checkpoint -> plain model and back, adapters onto another base) and a resume after an
evaluation forward, each caught on every rank and recorded.
"""
import argparse
import json
import os
import signal
import time
import traceback

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen3Config

import hyperacc
from hyperacc.integrations.peft import export_adapter, export_merged
from hyperacc.models import build_causal_lm, load_pretrained, qwen3_moe_config
from hyperacc.precision.adamw import AdamW
from run_sequence import run_all

SEQ = 16
GLOBAL_BATCH = 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DENSE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MOE_TARGETS = ["q_proj", "v_proj"]       # the experts are fused parameters, not Linear layers


def dense_config():
    return Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False)


def vocab(kind):
    return dense_config().vocab_size if kind == "dense" else qwen3_moe_config().vocab_size


class Tokens:
    """Arithmetic sequences (step 3) from a random start: learnable in a few steps; sample i is fixed."""

    def __init__(self, vocab_size, n=64):
        self.vocab, self.n = vocab_size, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        start = torch.randint(0, self.vocab, (1,), generator=torch.Generator().manual_seed(100 + i))
        ids = (start * 7 + torch.arange(SEQ) * 3) % self.vocab
        return {"input_ids": ids, "labels": ids.clone()}


def first_step_batch(vocab_size):
    """The samples of optimizer step 1 (the loader is not shuffled), as one batch."""
    data = Tokens(vocab_size)
    ids = torch.stack([data[i]["input_ids"] for i in range(GLOBAL_BATCH)])
    return {"input_ids": ids, "labels": ids.clone()}


def build_meta(kind, dtype):
    if kind == "dense":
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(dense_config(), dtype=dtype, attn_implementation="eager")
    model = build_causal_lm(qwen3_moe_config(), meta_device=True, router_aux_loss=False)
    return model.to(dtype)


def lora(kind, modules_to_save=False, **kwargs):
    targets = DENSE_TARGETS if kind == "dense" else MOE_TARGETS
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                      modules_to_save=["lm_head"] if modules_to_save else None, **kwargs)


def names_of(params):
    return sorted(n for n, _ in params)


def dtypes(tensors):
    return sorted({str(t.dtype).replace("torch.", "") for t in tensors})


def full(tensor):
    """Collective for a DTensor (every rank, same order)."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu().clone()


def trainable_full(model):
    return {n: full(p) for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def probe_losses(model, batch):
    """The loss of ``batch`` (the same on every rank) with the adapters and with them disabled."""
    with_adapters = model(**batch).loss.item()
    with model.disable_adapter():
        base = model(**batch).loss.item()
    return with_adapters, base


def state_report(model, optimizer):
    """Which parameters hold AdamW state, and in which dtypes (after at least one step)."""
    opt = getattr(optimizer, "optimizer", optimizer)
    by_id = {id(p): n for n, p in model.named_parameters()}
    with_state = [by_id[id(p)] for p, s in opt.state.items() if s]
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    return {"with_state": sorted(with_state), "frozen_with_state": sorted(set(with_state) & frozen),
            "state_dtypes": dtypes(v for s in opt.state.values() for k, v in s.items() if k != "step")}


def grad_report(model):
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return {"frozen_with_grad": names_of((n, p) for n, p in frozen if p.grad is not None),
            "trainable_without_grad": names_of((n, p) for n, p in trainable if p.grad is None),
            "grad_dtypes": dtypes(p.grad for _, p in trainable if p.grad is not None)}


def dtype_report(model):
    return {"trainable": dtypes(p for p in model.parameters() if p.requires_grad),
            "frozen": dtypes(p for p in model.parameters() if not p.requires_grad and p.is_floating_point()),
            "n_trainable": sum(p.requires_grad for p in model.parameters()),
            "n_frozen": sum(not p.requires_grad for p in model.parameters())}


def export_all(acc, model, out_dir, merged=True):
    """Every export of a prepared PEFT model (collective); returns, per rank, the error accelerate's
    save pattern raised there (None: none)."""
    export_adapter(model, os.path.join(out_dir, "adapter"))
    if merged:
        export_merged(model, os.path.join(out_dir, "merged"))
    acc.save_model(model, os.path.join(out_dir, "save_model"))
    state = acc.get_state_dict(model)       # collective; the full state on the main process
    error = None
    try:        # not collective: every rank calls it, as accelerate's examples do
        acc.unwrap_model(model).save_pretrained(os.path.join(out_dir, "accelerate"), state_dict=state,
                                                is_main_process=acc.is_main_process)
    except Exception as err:  # noqa: BLE001 - recorded for the test to judge
        error = f"{type(err).__name__}: {err}"
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    return errors


# --------------------------------------------------------------------------- train
def train(args):
    clock = [time.perf_counter()]
    acc = hyperacc.Accelerator(
        seed=11, fsdp=hyperacc.FSDPConfig(precision=args.precision, mixed_precision=args.mixed_precision),
        parallel=hyperacc.ParallelConfig(tp_size=args.tp, ep_size=args.ep),
        checkpoint=hyperacc.CheckpointConfig(checkpoint_dir=args.ckpt, save_steps=args.save_steps, save_epochs=0,
                                             save_ckpt=args.ckpt is not None,
                                             save_consolidated="every" if args.consolidated else "none"))
    dtype = DTYPES[args.dtype]
    if args.base == "meta":
        base = build_meta(args.model, dtype)
    else:
        base = load_pretrained(args.base, accelerator=acc, dtype=dtype)
    model = get_peft_model(base, lora(args.model, args.modules_to_save))
    params = [p for p in model.parameters() if p.requires_grad] if args.trainable_only else model.parameters()
    optimizer = AdamW(params, lr=args.lr, weight_decay=0.0)
    loader = hyperacc.MicroBatchDataLoader(Tokens(vocab(args.model)), global_batch_size=GLOBAL_BATCH,
                                           micro_batch_size=1, shuffle=False)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    probe = first_step_batch(vocab(args.model))
    record = {"world": acc.num_processes, "dtypes": dtype_report(model), "steps": {}, "seconds": {}}

    def lap(phase):     # where a launch spends its time (the test budget is mostly start-up)
        clock.append(time.perf_counter())
        record["seconds"][phase] = round(clock[-1] - clock[-2], 3)
    lap("setup")
    initial = trainable_full(model)
    record["probe"] = probe_losses(model, probe)
    record["restored"] = acc.load_state(args.restore) if args.restore else None
    record["start"] = acc.progress.global_step
    while acc.progress.global_step < args.steps:
        for batch in loader:
            if acc.progress.global_step >= args.steps:
                break
            with acc.accumulate(model, batch) as micro_batches:
                for mb in micro_batches:
                    acc.backward(model(**mb).loss)
            if acc.progress.global_step == record["start"]:
                record["grads"] = grad_report(model)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            record["steps"][acc.progress.global_step] = acc.step_loss
            acc.step_end()
            if args.kill_after == acc.progress.global_step:
                if acc.is_main_process:
                    with open(args.out, "w") as handle:
                        json.dump(record, handle)
                os.kill(os.getpid(), signal.SIGKILL)
    lap("train")
    record["state"] = state_report(model, optimizer)
    final = trainable_full(model)
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"]).logits.detach().float().cpu()
    if args.export:
        record["accelerate_errors"] = export_all(acc, model, args.export)
        lap("export")
    acc.end_training()
    lap("end")
    if acc.is_main_process:
        torch.save({"initial": initial, "final": final, "logits": logits}, args.out + ".pt")
        with open(args.out, "w") as handle:
            json.dump(record, handle)


# --------------------------------------------------------------------------- checks
def _caught(fn):
    """Run ``fn``; its exception as {"type", "message", "seconds"} (None: it raised nothing)."""
    start = time.perf_counter()
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - recorded for the test to judge
        return {"type": type(err).__name__, "message": str(err), "seconds": time.perf_counter() - start,
                "where": traceback.format_exc(limit=-3)}
    return None


def _accelerator(precision="fp32_master", ckpt=None, seed=11, **parallel):
    return hyperacc.Accelerator(seed=seed, fsdp=hyperacc.FSDPConfig(precision=precision),
                                parallel=hyperacc.ParallelConfig(**parallel),
                                checkpoint=hyperacc.CheckpointConfig(checkpoint_dir=ckpt, save_steps=0, save_epochs=0,
                                                                     save_ckpt=ckpt is not None))


def one_step(acc, model, optimizer, kind):
    """One optimizer step on the first global batch; (gradient report before the step, loss)."""
    data = Tokens(vocab(kind))
    rank, world = acc.process_index, acc.num_processes
    samples = [data[i] for i in range(rank, GLOBAL_BATCH, world)]
    with acc.accumulate(model, [{k: v[None] for k, v in s.items()} for s in samples]) as micro_batches:
        for mb in micro_batches:
            acc.backward(model(**mb).loss)
    grads = grad_report(model)
    optimizer.step()
    optimizer.zero_grad()
    return grads, acc.step_loss


def dtype_case(kind, precision, ckpt=None, export=None):
    acc = _accelerator(precision, ckpt)
    model = get_peft_model(build_meta(kind, torch.bfloat16), lora(kind))
    optimizer = AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    model, optimizer = acc.prepare(model, optimizer)
    out = {"dtypes": dtype_report(model)}
    probe = first_step_batch(vocab(kind))
    out["probe"] = probe_losses(model, probe)
    out["lora_B_max"] = max(float(full(p).abs().max()) for n, p in model.named_parameters() if ".lora_B." in n)
    out["lora_A_max"] = max(float(full(p).abs().max()) for n, p in model.named_parameters() if ".lora_A." in n)
    out["grads"], out["step_loss"] = one_step(acc, model, optimizer, kind)
    out["state"] = state_report(model, optimizer)
    out["probe_after"] = probe_losses(model, probe)
    if ckpt:
        out["saved"] = acc.save_state()
    if export:
        out["accelerate_errors"] = export_all(acc, model, export, merged=False)
        adapters = trainable_full(model)
        if acc.is_main_process:
            torch.save(adapters, os.path.join(export, "adapters.pt"))
    return out


def layout_case(**parallel):
    """3 steps of a meta-device fp32 base with LoRA and a modules_to_save copy; the losses, and
    whether every rank holds the same local adapter values (true for HSDP replicas)."""
    acc = _accelerator(**parallel)
    model = get_peft_model(build_meta("dense", torch.float32), lora("dense", modules_to_save=True))
    optimizer = AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    model, optimizer = acc.prepare(model, optimizer)
    losses = [one_step(acc, model, optimizer, "dense")[1] for _ in range(3)]
    local = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
             for n, p in model.named_parameters() if p.requires_grad}
    every = [None] * acc.num_processes
    dist.all_gather_object(every, local)
    return {"losses": losses, "ranks_alike": all(torch.equal(every[0][n], e[n]) for e in every for n in local)}


def tied_case(directory, modules_to_save):
    """A pretrained base with tied embeddings (no lm_head.weight in its files) under LoRA."""
    acc = _accelerator()
    config = lora("dense")
    config.modules_to_save = modules_to_save
    model = get_peft_model(load_pretrained(directory, accelerator=acc), config)
    optimizer = AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    model, optimizer = acc.prepare(model, optimizer)
    batch = first_step_batch(vocab("dense"))
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager")(**batch).loss.item()
    probe = probe_losses(model, batch)
    grads, loss = one_step(acc, model, optimizer, "dense")
    return {"reference": reference, "probe": probe, "step_loss": loss, "grads": grads,
            "probe_after": probe_losses(model, batch)}


def checks(args, finish=True):
    record = {}
    tmp = args.tmp
    peft_ckpt, plain_ckpt = os.path.join(tmp, "ck_peft"), os.path.join(tmp, "ck_plain")
    record["dense_fp32_master"] = dtype_case("dense", "fp32_master", peft_ckpt, os.path.join(tmp, "exports"))
    record["dense_bf16_sr"] = dtype_case("dense", "bf16_sr")
    record["moe_fp32_master"] = dtype_case("moe", "fp32_master")
    record["moe_bf16_sr"] = dtype_case("moe", "bf16_sr")

    # a plain (non-PEFT) model's checkpoint, for the cross-loading refusals
    acc = _accelerator(ckpt=plain_ckpt)
    plain = build_meta("dense", torch.float32)
    optimizer = AdamW(plain.parameters(), lr=1e-2)
    plain, optimizer = acc.prepare(plain, optimizer)
    record["plain_saved"] = acc.save_state()

    def load_into(peft, path, seed=11, evaluate=False):
        acc = _accelerator(seed=seed)
        model = build_meta("dense", torch.bfloat16)
        if peft:
            model = get_peft_model(model, lora("dense"))
        optimizer = AdamW(model.parameters(), lr=1e-2)
        model, optimizer = acc.prepare(model, optimizer)
        if evaluate:        # an evaluation forward (no backward) before resuming
            with torch.no_grad():
                model(**first_step_batch(vocab("dense")))
        acc.load_state(path)
        return model
    saved = record["dense_fp32_master"]["saved"]
    record["peft_ckpt_into_plain"] = _caught(lambda: load_into(False, saved))
    record["plain_ckpt_into_peft"] = _caught(lambda: load_into(True, record["plain_saved"]))
    record["peft_ckpt_onto_another_base"] = _caught(lambda: load_into(True, saved, seed=12))
    record["load_after_evaluation"] = _caught(lambda: load_into(True, saved, evaluate=True))

    def prepare_peft(kind, config, low_cpu_mem_usage=False, **parallel):
        acc = _accelerator(**parallel)
        acc.prepare(get_peft_model(build_meta(kind, torch.bfloat16), config, low_cpu_mem_usage=low_cpu_mem_usage))
    record["tp"] = _caught(lambda: prepare_peft("dense", lora("dense"), tp_size=2))
    record["ep"] = _caught(lambda: prepare_peft("moe", lora("moe"), ep_size=2))
    # PEFT's own get_peft_model computes PiSSA at once (and fails on meta weights with its own error);
    # with low_cpu_mem_usage=True it leaves the adapters on the meta device and prepare() must refuse
    record["pissa"] = _caught(lambda: prepare_peft("dense", lora("dense", init_lora_weights="pissa"),
                                                   low_cpu_mem_usage=True))
    record["olora"] = _caught(lambda: prepare_peft("dense", lora("dense", init_lora_weights="olora"),
                                                   low_cpu_mem_usage=True))

    record["hsdp"], record["fsdp"] = layout_case(dp_replicate_size=2), layout_case()
    tied = os.path.join(tmp, "tied_base")
    if acc.is_main_process:
        config = dense_config()
        config.tie_word_embeddings = True       # as Qwen3-0.6B/1.7B/4B
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, attn_implementation="eager").save_pretrained(tied)
    acc.wait_for_everyone()
    for key, modules_to_save in (("tied", None), ("tied_embed_tokens", ["embed_tokens"]),
                                 ("tied_lm_head", ["lm_head"])):
        outcome = {}
        outcome["error"] = _caught(lambda: outcome.update(result=tied_case(tied, modules_to_save)))
        record[key] = outcome
    # every rank got here: no rank is left waiting in a collective after the refusals
    acc = _accelerator()
    acc.wait_for_everyone()
    record["world"] = acc.num_processes
    if finish:
        acc.end_training()
    if acc.is_main_process:
        with open(os.path.join(tmp, "checks.json"), "w") as handle:
            json.dump(record, handle)


def parse_args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "checks"])
    p.add_argument("out", nargs="?")
    p.add_argument("--tmp", help="checks: the folder for its checkpoints, exports and checks.json")
    p.add_argument("--checks", action="store_true", help="train: run the checks (in --tmp) first, in the same "
                   "processes (one launch instead of two)")
    p.add_argument("--base", default="meta")
    p.add_argument("--model", default="dense", choices=["dense", "moe"])
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--precision", default="fp32_master")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--restore", default=None)
    p.add_argument("--kill-after", type=int, default=None)
    p.add_argument("--modules-to-save", action="store_true", help="LoRA's modules_to_save=['lm_head']")
    p.add_argument("--trainable-only", action="store_true", help="the optimizer gets the trainable parameters only "
                   "(default: model.parameters(), frozen ones included)")
    p.add_argument("--export", default=None)
    p.add_argument("--consolidated", action="store_true", help="CheckpointConfig.save_consolidated='every' "
                   "(each checkpoint's hf/ export: the adapter, for a PEFT model)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--mixed-precision", default=None, help="FSDPConfig.mixed_precision (e.g. bf16)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    return p.parse_args(argv)


def run(args):
    if args.mode == "checks" or args.checks:
        checks(args, finish=args.mode == "checks")
    if args.mode == "train":
        train(args)


def main():
    run_all(run, parse_args)      # one run, or several separated by --then (run_sequence.py)


if __name__ == "__main__":
    main()
