"""transformers' `Trainer` / TRL's `SFTTrainer` on hyperacc (or on plain accelerate): one run, or several in turn.

    trainer_run.py --out DIR --result JSON [--trainer trainer|sft] [--model dense|moe] [--lora] [--packing]
        [--per-device 2] [--grad-accum 1] [--max-steps 8] [--save-steps 0] [--save-total-limit 0]
        [--kill-after-step K] [--resume [latest|PATH]] [--rows 24] [--lr 1e-2] [--engine hyperacc|plain]
        [--save-model DIR] [--logits] [--router-aux]
    trainer_run.py --refusals JSON --out DIR [--corrupt ROOT]   (the bad inputs, each caught and recorded)
    trainer_run.py RUN --then RUN [--then RUN ...]              (several runs, in turn, in one launch)

The model is a tiny transformers Qwen3 (dense) or Qwen3-MoE built from its config on CPU right after
``torch.manual_seed(0)``: the same initial weights at every world size. Fp32 throughout.

Data (local, deterministic, not depending on the world size):
* ``--trainer trainer``: ``--rows`` rows of token ids of lengths 5..24 (an arithmetic sequence mod the
  vocabulary from a seeded start, so it is learnable), right-padded to 24 with ``attention_mask`` 0 and
  ``labels`` -100 on the padding: rows carry different numbers of tokens, so token weighting matters.
* ``--trainer sft``: the first documents of hyperacc's offline corpus (``text`` column) with its
  offline tokenizer; ``--packing`` packs them to ``max_length`` 64.

Rank 0 writes ``--result`` (JSON): the per-step ``loss`` / ``grad_norm`` / ``learning_rate`` / ``epoch`` from
``trainer.state.log_history`` (logging_steps=1; after a resume that history includes the steps restored
from ``trainer_state.json``), the steps this process itself logged (``fresh_steps``), each rank's sharding
facts (every parameter a DTensor? its local numel against the full numel), the global step, and a
sha256 digest of the final full weights (``accelerator.get_state_dict``), also written as
``<result>.safetensors``. ``--logits``: every rank runs the trained model on a fixed batch; rank 0 writes
the logits to ``<result>.logits.pt``. ``--save-model DIR``: ``trainer.save_model(DIR)`` at the end.

``--kill-after-step K``: right after the checkpoint of step K is saved (``on_save``), every rank checks
that ``global_step_K`` is complete (``.metadata``, integrity manifest, ``trainer_state.json``, LATEST = K),
rank 0 writes the result so far, and after a barrier every rank leaves with ``os._exit(0)``.
``--resume``: ``trainer.train(resume_from_checkpoint=True)`` (LATEST), or the given path.
``--engine plain``: the same with `transformers.Trainer` / `trl.SFTTrainer` (accelerate's engine).

``--refusals JSON``: a plain `transformers.Trainer` writes a ``checkpoint-1``; then each bad input in turn
(deepspeed=, fsdp_config version 1, load_best_model_at_end, auto_find_batch_size, ignore_data_skip,
cp_size=2, resume=True with nothing saved, resume from that ``checkpoint-1``, from a path that does not
exist; with ``--corrupt ROOT`` also resume=True on ROOT and ROOT/global_step_6 with another global batch),
each recorded as exception type, message and the number of steps begun before it.
"""
import argparse
import gc
import hashlib
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

SEQ = 24
VOCAB = 128
SFT_MAX_LENGTH = 64
LOGITS_SHAPE = (2, 16)


# ----------------------------------------------------------------------------- model and data
def model_config(kind: str, vocab: int = VOCAB, router_aux: bool = False):
    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=128, use_cache=False,
                  tie_word_embeddings=False)
    if kind == "dense":
        from transformers import Qwen3Config

        return Qwen3Config(intermediate_size=64, **common)
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                          mlp_only_layers=[], output_router_logits=router_aux, router_aux_loss_coef=0.01,
                          norm_topk_prob=True, **common)


def build_model(kind: str, vocab: int = VOCAB, router_aux: bool = False):
    """The seeded initial model (on CPU, fp32): the same weights in every process and at every world size."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model_config(kind, vocab, router_aux), dtype=torch.float32,
                                            attn_implementation="eager")


def token_rows(n: int):
    """Variable-length learnable rows, right-padded to SEQ; labels -100 on the padding."""
    rows = []
    for i in range(n):
        g = torch.Generator().manual_seed(1000 + i)
        length = int(torch.randint(5, SEQ + 1, (1,), generator=g))
        start = int(torch.randint(0, VOCAB, (1,), generator=g))
        step = int(torch.randint(1, 4, (1,), generator=g))
        ids = [(start + step * t) % VOCAB for t in range(length)]
        pad = SEQ - length
        rows.append({"input_ids": ids + [0] * pad, "attention_mask": [1] * length + [0] * pad,
                     "labels": ids + [-100] * pad})
    return rows


def sft_documents(n: int):
    from hyperacc.data.default_corpus import collect_documents

    return [doc[:16 + (37 * i) % 104] for i, doc in enumerate(collect_documents()[:n])]   # 16..119 characters


def sft_tokenizer():
    from hyperacc.data.default_corpus import load_default_tokenizer

    tok = load_default_tokenizer()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def logits_batch(vocab: int):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, LOGITS_SHAPE, generator=g)


# ----------------------------------------------------------------------------- the trainer
def trainer_classes(engine: str):
    if engine == "plain":
        import transformers
        import trl

        return transformers.Trainer, trl.SFTTrainer
    from hyperacc.integrations.transformers import Trainer
    from hyperacc.integrations.trl import SFTTrainer

    return Trainer, SFTTrainer


def common_args(a):
    return dict(output_dir=a.out, per_device_train_batch_size=a.per_device, gradient_accumulation_steps=a.grad_accum,
                max_steps=a.max_steps, logging_steps=1, save_strategy="steps" if a.save_steps else "no",
                save_steps=a.save_steps or 500, save_total_limit=a.save_total_limit or None, use_cpu=True,
                report_to=[], learning_rate=a.lr, seed=0, lr_scheduler_type="linear", warmup_steps=0,
                weight_decay=0.0, max_grad_norm=1.0, disable_tqdm=True, dataloader_num_workers=0,
                bf16=False, fp16=False)                 # fp32 (TRL's SFTConfig defaults to bf16=True)


def build_trainer(a, callbacks=(), **overrides):
    from datasets import Dataset

    Trainer, SFTTrainer = trainer_classes(a.engine)
    options = {**common_args(a), **overrides}
    if a.trainer == "trainer":
        from transformers import TrainingArguments

        model = build_model(a.model, router_aux=a.router_aux)
        if a.lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        return Trainer(model=model, args=TrainingArguments(**options), train_dataset=Dataset.from_list(token_rows(a.rows)),
                       callbacks=list(callbacks))
    from trl import SFTConfig

    tok = sft_tokenizer()
    model = build_model(a.model, vocab=len(tok), router_aux=a.router_aux)
    peft_config = None
    if a.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    config = SFTConfig(**options, packing=a.packing, max_length=SFT_MAX_LENGTH, dataset_num_proc=None)
    return SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": sft_documents(a.rows)}),
                      processing_class=tok, peft_config=peft_config, callbacks=list(callbacks))


# ----------------------------------------------------------------------------- what is recorded
def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier():
    if dist.is_initialized() and world() > 1:
        dist.barrier()


def gather(obj):
    if dist.is_initialized() and world() > 1:
        out = [None] * world()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def shard_facts(model) -> dict:
    from torch.distributed.tensor import DTensor

    params = list(model.named_parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for _, p in params)
    full = sum(p.numel() for _, p in params)           # a DTensor's numel is its global one
    return {"rank": rank(), "params": len(params), "dtensors": sum(isinstance(p, DTensor) for _, p in params),
            "not_dtensor": [n for n, p in params if not isinstance(p, DTensor)][:5],
            "local_numel": local, "full_numel": full,
            "trainable": sum(p.requires_grad for _, p in params),
            "dtypes": sorted({str(p.dtype) for _, p in params})}


def per_step(history) -> dict:
    steps = {}
    for entry in history:
        if "loss" in entry and "step" in entry:
            steps[str(entry["step"])] = {k: entry.get(k) for k in ("loss", "grad_norm", "learning_rate", "epoch")}
    return steps


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def recorder(a, result):
    """A TrainerCallback: the steps this process logged, and the hard exit right after step K's save."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.fresh, self.trainer = [], None

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.fresh.append(state.global_step)

        def on_save(self, args, state, control, **kwargs):
            if not a.kill_after_step or state.global_step != a.kill_after_step:
                return
            problems = checkpoint_problems(a.out, state.global_step, a.engine)
            if problems:
                print(f"rank {rank()}: checkpoint of step {state.global_step} incomplete: {problems}",
                      file=sys.stderr, flush=True)
                os._exit(3)
            if rank() == 0:
                write_result(a, result, self.trainer, self, killed=True)
            barrier()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    return Recorder()


def checkpoint_problems(out: str, step: int, engine: str):
    if engine == "plain":
        path = os.path.join(out, f"checkpoint-{step}")
        return [] if os.path.isfile(os.path.join(path, "trainer_state.json")) else [f"{path}: no trainer_state.json"]
    path = os.path.join(out, f"global_step_{step}")
    problems = [f"{path}: no {name}" for name in (".metadata", "hyperacc_manifest.json", "trainer_state.json")
                if not os.path.isfile(os.path.join(path, name))]
    pointer = os.path.join(out, "latest_checkpoint_iteration.txt")
    latest = open(pointer).read().strip() if os.path.isfile(pointer) else None
    if latest != str(step):
        problems.append(f"LATEST is {latest!r}, not {step}")
    return problems


def write_result(a, result, trainer, record, killed=False):
    result.update(steps=per_step(trainer.state.log_history), fresh_steps=list(record.fresh),
                  global_step=trainer.state.global_step, killed=killed)
    with open(a.result, "w") as handle:
        json.dump(result, handle, indent=1, sort_keys=True)


def train(a):
    result = {"args": vars(a)}
    record = recorder(a, result)
    trainer = build_trainer(a, callbacks=[record])
    record.trainer = trainer
    result["world"] = world()                      # the process group exists once the Trainer does
    resume = None
    if a.resume is not None:
        resume = True if a.resume == "latest" else a.resume
    trainer.train(resume_from_checkpoint=resume)
    result.update(shards=gather(shard_facts(trainer.model)))
    state = trainer.accelerator.get_state_dict(trainer.model)     # collective; full weights on rank 0
    if a.logits:
        model = trainer.model
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=logits_batch(model.config.vocab_size)).logits
        if rank() == 0:
            torch.save(logits.detach().float().cpu(), a.result + ".logits.pt")
        model.train()
    if a.save_model:
        trainer.save_model(a.save_model)
    if rank() == 0:
        from safetensors.torch import save_file

        cpu = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
        save_file(cpu, a.result + ".safetensors")
        result.update(digest=digest(cpu), n_tensors=len(cpu))
        write_result(a, result, trainer, record)
    barrier()


# ----------------------------------------------------------------------------- refusals
def refusals(a):
    """Each bad input in turn, caught and recorded: type, message, and whether any step ran first."""
    from transformers import TrainerCallback

    class Steps(TrainerCallback):
        def __init__(self):
            self.begun = 0

        def on_step_begin(self, args, state, control, **kwargs):
            self.begun += 1

    record = {}

    def case(name, build_kwargs=None, resume=None, pre=None):
        steps = Steps()
        try:
            if pre:
                pre()
            trainer = build_trainer(a, callbacks=[steps], **(build_kwargs or {}))
            trainer.train(resume_from_checkpoint=resume)
            record[name] = {"error": None, "message": None, "steps": steps.begun}
        except Exception as exc:       # recorded, asserted on by the test
            record[name] = {"error": type(exc).__name__, "message": str(exc), "steps": steps.begun,
                            "where": traceback.format_exc()[-1500:]}

    out = a.out
    # a checkpoint-N written by plain transformers.Trainer on plain accelerate
    plain_dir = os.path.join(out, "plain")
    plain = argparse.Namespace(**{**vars(a), "engine": "plain", "out": plain_dir, "save_steps": 1, "max_steps": 1})
    build_trainer(plain).train()
    record["plain_checkpoint"] = sorted(os.listdir(plain_dir))
    a.out = os.path.join(out, "hyperacc")
    deepspeed = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
                 "gradient_accumulation_steps": "auto"}
    case("deepspeed", {"deepspeed": deepspeed})
    if record["deepspeed"]["error"] == "PackageNotFoundError":
        # transformers' TrainingArguments itself refuses deepspeed= when DeepSpeed is not installed; with it
        # installed the arguments are accepted and the Trainer is what must refuse them: set it afterwards
        from transformers import TrainingArguments

        original = TrainingArguments.__post_init__

        def post_init(self):
            original(self)
            self.deepspeed = deepspeed

        TrainingArguments.__post_init__ = post_init
        try:
            case("deepspeed_accepted_by_arguments")
        finally:
            TrainingArguments.__post_init__ = original
    case("fsdp_v1", {"fsdp": "full_shard", "fsdp_config": {"version": 1}})
    case("load_best_model_at_end", {"load_best_model_at_end": True, "eval_strategy": "steps",
                                    "save_strategy": "steps", "eval_steps": 1, "save_steps": 1})
    case("auto_find_batch_size", {"auto_find_batch_size": True})
    case("ignore_data_skip", {"ignore_data_skip": True})
    try:
        from accelerate.parallelism_config import ParallelismConfig

        case("context_parallel", {"parallelism_config": ParallelismConfig(cp_size=2)})
    except ImportError as exc:
        record["context_parallel"] = {"error": "ImportError", "message": str(exc), "steps": 0}
    case("resume_true_nothing_saved", resume=True)
    case("resume_plain_checkpoint", resume=os.path.join(plain_dir, "checkpoint-1"))
    case("resume_missing_path", resume=os.path.join(out, "no_such_dir", "global_step_3"))
    if a.corrupt:
        case("resume_corrupt", {"output_dir": a.corrupt}, resume=True)
        # an intact older checkpoint of the same root, resumed with another global batch (1 x 2 x GA 1)
        case("resume_other_global_batch", resume=os.path.join(a.corrupt, "global_step_6"))
    record["hyperacc_out_listing"] = sorted(os.listdir(a.out)) if os.path.isdir(a.out) else None
    with open(a.refusals, "w") as handle:
        json.dump(record, handle, indent=1, sort_keys=True)


def parser():
    p = argparse.ArgumentParser()
    p.add_argument("--trainer", choices=["trainer", "sft"], default="trainer")
    p.add_argument("--model", choices=["dense", "moe"], default="dense")
    p.add_argument("--router-aux", action="store_true", help="moe: output_router_logits=True (aux loss in the loss)")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--packing", action="store_true")
    p.add_argument("--per-device", type=int, default=2)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--save-total-limit", type=int, default=0)
    p.add_argument("--kill-after-step", type=int, default=0)
    p.add_argument("--resume", nargs="?", const="latest", default=None)
    p.add_argument("--rows", type=int, default=None, help="rows (trainer: 24) or documents (sft: 50 -> 24 packed rows)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--engine", choices=["hyperacc", "plain"], default="hyperacc")
    p.add_argument("--save-model", default=None)
    p.add_argument("--logits", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--result", default=None)
    p.add_argument("--refusals", default=None)
    p.add_argument("--corrupt", default=None, help="with --refusals: resume this (damaged) checkpoint root too")
    return p


def main(argv=None):
    """Runs separated by ``--then`` run one after the other in this launch (process start-up is most of
    a launch's cost); only the last one may be killed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    segments, current = [], []
    for token in argv:
        if token == "--then":
            segments.append(current)
            current = []
        else:
            current.append(token)
    segments.append(current)
    runs = [parser().parse_args(segment) for segment in segments]
    if any(a.kill_after_step for a in runs[:-1]):
        raise SystemExit("--kill-after-step: only in the last run of a launch")
    for a in runs:
        if a.rows is None:
            a.rows = 24 if a.trainer == "trainer" else 50
        if a.refusals:
            refusals(a)
        else:
            train(a)
        gc.collect()
        barrier()


if __name__ == "__main__":
    main()
