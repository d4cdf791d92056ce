"""Adapter exports that hold exactly what PEFT keeps, on real processes (torchrun, gloo, CPU); real `peft`.

    peft_export_exact.py BASE_DIR OUT_DIR

BASE_DIR: a tiny Qwen2 (q/k/v projections with biases, untied head, ``use_cache: true``) saved with
``save_pretrained``, and the offline default tokenizer beside it. Several runs in one launch, each a
new `hyperacc.Accelerator` on FSDP2, each 3 AdamW steps on a fixed batch (each rank its own rows):

  all      LoraConfig(bias="all") on a meta-device base (`load_pretrained(BASE_DIR, accelerator=acc)`):
           `acc.save_model` -> OUT/all/adapter, accelerate's `unwrap_model(m).save_pretrained` ->
           OUT/all/accelerate, `export_merged(..., tokenizer=tok)` -> OUT/all/merged; a checkpoint
           (`acc.save_state`) then a new Accelerator + model that `load_state`s it: every trainable tensor
           (the biases too) against the saved run's, bitwise -> OUT/all/resume.json
  lora_only bias="lora_only" + modules_to_save=["lm_head"], `export_adapter` -> OUT/lora_only/adapter
  dora     use_dora=True on a base loaded on CPU (from_pretrained): `acc.save_model` -> OUT/dora/adapter;
           DoRA on a meta-device base: the refusal of `prepare` on every rank -> OUT/refusals.json
  vblora   VB-LoRA with save_only_topk_weights=True: `export_adapter`'s refusal on every rank, nothing
           written -> OUT/refusals.json
  trainer  `hyperacc.integrations.transformers.Trainer` on a PEFT model (bias="all" + modules_to_save),
           `trainer.save_model(OUT/trainer/save_model)` (with the tokenizer as processing_class)

Rank 0 writes OUT/<run>/logits.pt (the trained model's fp32 logits of a fixed probe batch, every rank
running it) and OUT/record.json (what each run did, timings).
"""
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from peft import LoraConfig, VBLoRAConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import hyperacc
from hyperacc.integrations.peft import export_adapter, export_merged
from hyperacc.models import load_pretrained

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
SEQ, ROWS, STEPS = 12, 4, 3


def probe_ids(vocab):
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(5))


def rows(vocab):
    """ROWS learnable rows (arithmetic sequences mod vocab); rank r trains rows r, r + world, ..."""
    g = torch.Generator().manual_seed(3)
    starts = torch.randint(0, vocab, (ROWS, 1), generator=g)
    return (starts * 5 + torch.arange(SEQ) * 3) % vocab


def accelerator(ckpt=None):
    return hyperacc.Accelerator(seed=7, checkpoint=hyperacc.CheckpointConfig(
        checkpoint_dir=ckpt, save_steps=0, save_epochs=0, save_ckpt=ckpt is not None))


def train(acc, model, vocab):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    model, optimizer = acc.prepare(model, optimizer)
    data = rows(vocab)[acc.process_index::acc.num_processes]
    for _ in range(STEPS):
        loss = model(input_ids=data, labels=data).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def logits(model, vocab):
    with torch.no_grad():
        return model(input_ids=probe_ids(vocab)).logits.detach().float().cpu()


def full_trainable(model):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for n, p in model.named_parameters() if p.requires_grad}


def caught(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - recorded for the test to judge
        return {"type": type(err).__name__, "message": str(err), "where": traceback.format_exc(limit=-2)}
    return None


def save(path, obj):
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(obj, path)


def run_all(base, out, tok, vocab, record):
    ckpt = os.path.join(out, "all", "ckpt")
    acc = accelerator(ckpt)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, bias="all")
    base_model = load_pretrained(base, accelerator=acc)
    base_model.config.use_cache = False         # as training scripts set it: the merged export says true
    model, optimizer = train(acc, get_peft_model(base_model, lora), vocab)
    save(os.path.join(out, "all", "logits.pt"), logits(model, vocab))
    acc.save_model(model, os.path.join(out, "all", "adapter"))
    acc.unwrap_model(model).save_pretrained(os.path.join(out, "all", "accelerate"), is_main_process=acc.is_main_process)
    export_merged(model, os.path.join(out, "all", "merged"), tokenizer=tok)
    path = acc.save_state()
    trained = full_trainable(model)
    # The resume: a new run of the same setup restores the checkpoint.
    acc2 = accelerator(ckpt)
    model2 = get_peft_model(load_pretrained(base, accelerator=acc2), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                                              bias="all"))
    optimizer2 = torch.optim.AdamW([p for p in model2.parameters() if p.requires_grad], lr=2e-2)
    model2, optimizer2 = acc2.prepare(model2, optimizer2)
    before = full_trainable(model2)
    acc2.load_state(path)
    restored = full_trainable(model2)
    biases = sorted(n for n in trained if n.endswith(".bias"))
    record["all"] = {
        "checkpoint": path, "biases": biases, "trainable": sorted(trained),
        "bitwise": sorted(n for n in trained if torch.equal(trained[n], restored.get(n, torch.empty(0)))),
        "biases_moved": sorted(n for n in biases if not torch.equal(before[n], trained[n])),
    }


def run_lora_only(base, out, vocab, record):
    acc = accelerator()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, bias="lora_only", modules_to_save=["lm_head"])
    model, _ = train(acc, get_peft_model(load_pretrained(base, accelerator=acc), lora), vocab)
    save(os.path.join(out, "lora_only", "logits.pt"), logits(model, vocab))
    export_adapter(model, os.path.join(out, "lora_only", "adapter"))
    record["lora_only"] = {"trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad)}


def run_dora(base, out, vocab, record):
    acc = accelerator()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, use_dora=True)
    model, _ = train(acc, get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora), vocab)
    save(os.path.join(out, "dora", "logits.pt"), logits(model, vocab))
    acc.save_model(model, os.path.join(out, "dora", "adapter"))
    acc_meta = accelerator()
    meta = get_peft_model(load_pretrained(base, accelerator=acc_meta), lora)
    record.setdefault("refusals", {})["dora_meta"] = caught(lambda: acc_meta.prepare(meta))


def run_vblora(base, out, record):
    config = VBLoRAConfig(r=4, target_modules=["q_proj", "v_proj"], num_vectors=16, vector_length=8,
                          save_only_topk_weights=True)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
    target = os.path.join(out, "vblora")
    record.setdefault("refusals", {})["vblora_topk"] = caught(lambda: export_adapter(model, target))
    record["refusals"]["vblora_written"] = os.path.exists(target) or os.path.exists(target + ".tmp-hyperacc-export")


def run_trainer(base, out, tok, vocab, record):
    from datasets import Dataset
    from transformers import TrainingArguments

    from hyperacc.integrations.transformers import Trainer

    data = rows(vocab)
    dataset = Dataset.from_list([{"input_ids": r.tolist(), "labels": r.tolist()} for r in data])
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, bias="all", modules_to_save=["lm_head"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)
    args = TrainingArguments(output_dir=os.path.join(out, "trainer", "run"), per_device_train_batch_size=ROWS // 2,
                             max_steps=STEPS, save_strategy="no", use_cpu=True, report_to=[], learning_rate=2e-2,
                             logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, processing_class=tok)
    trainer.train()
    trainer.model.eval()
    save(os.path.join(out, "trainer", "logits.pt"), logits(trainer.model, vocab))
    trainer.save_model(os.path.join(out, "trainer", "save_model"))
    record["trainer"] = {"steps": trainer.state.global_step}


def main():
    base, out = sys.argv[1], sys.argv[2]
    tok = AutoTokenizer.from_pretrained(base)
    vocab = len(tok)
    record, seconds = {}, {}
    for name, fn in (("all", lambda: run_all(base, out, tok, vocab, record)),
                     ("lora_only", lambda: run_lora_only(base, out, vocab, record)),
                     ("dora", lambda: run_dora(base, out, vocab, record)),
                     ("vblora", lambda: run_vblora(base, out, record)),
                     ("trainer", lambda: run_trainer(base, out, tok, vocab, record))):
        start = time.perf_counter()
        fn()
        seconds[name] = round(time.perf_counter() - start, 2)
    record["seconds"] = seconds
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, record.get("refusals"))
    record["refusals_every_rank"] = every
    if dist.get_rank() == 0:
        with open(os.path.join(out, "record.json"), "w") as handle:
            json.dump(record, handle, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
