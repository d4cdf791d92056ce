"""`Accelerator.save_model` into the same directory again and again, as `Trainer.save_model` does, on
however many processes launched it (torchrun, gloo).

    torchrun --nproc_per_node=2 save_model_replace.py OUT.json DIR [--peft]

A tiny dense Qwen3 is prepared and saved into DIR (which also holds a tokenizer file, a checkpoint
sub-directory, the checkpoint pointer and training_args.bin) three times with one SGD step between
saves: sharded, sharded again, one file. With ``--peft`` a LoRA model is saved twice into DIR/adapter.
After each save rank 0 loads DIR with `from_pretrained` (`PeftModel.from_pretrained`) and compares it
with the prepared model's gathered weights; it writes one record per save to OUT.json.
"""
import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

import hyperacc
from hyperacc.models import build_causal_lm

OTHERS = {"tokenizer.json": "{}", "latest_checkpoint_iteration.txt": "1", "training_args.bin": "args"}


def tiny_config():
    return Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False)


def gathered(model, only=None):
    """Full copies of the parameters (collective: every rank, same order)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for n, p in model.named_parameters() if only is None or only(n)}


def sgd_step(acc, model, optimizer):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    optimizer.zero_grad()


def others_intact(directory):
    return all(open(os.path.join(directory, n)).read() == text for n, text in OTHERS.items()) and \
        os.listdir(os.path.join(directory, "global_step_1")) == ["keep.txt"]


def full_model_rounds(acc, directory):
    model = build_causal_lm(tiny_config(), seed=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = acc.prepare(model, optimizer)
    records = []
    for max_shard_size in ("100KB", "100KB", "10GB"):
        acc.save_model(model, directory, max_shard_size=max_shard_size)
        expected = gathered(model)
        if acc.is_main_process:
            loaded = dict(AutoModelForCausalLM.from_pretrained(directory).named_parameters())
            records.append({"files": sorted(os.listdir(directory)), "others_intact": others_intact(directory),
                            "equal": sorted(loaded) == sorted(expected)
                            and all(torch.equal(loaded[n], expected[n]) for n in expected)})
        sgd_step(acc, model, optimizer)
    return records


def adapter_rounds(acc, directory):
    from peft import LoraConfig, PeftModel, get_peft_model

    base = build_causal_lm(tiny_config(), seed=4)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model, optimizer = acc.prepare(model, optimizer)
    records = []
    for _ in range(2):
        sgd_step(acc, model, optimizer)         # lora_B leaves zero: each save holds other values
        acc.save_model(model, directory)
        expected = gathered(model, only=lambda n: "lora_" in n)
        if acc.is_main_process:
            loaded = PeftModel.from_pretrained(build_causal_lm(tiny_config(), seed=4), directory)
            got = {n: p.detach() for n, p in loaded.named_parameters() if "lora_" in n}
            records.append({"files": sorted(os.listdir(directory)), "readme_kept": open(
                os.path.join(directory, "README.md")).read() == "mine",
                "equal": sorted(got) == sorted(expected) and all(torch.equal(got[n], expected[n]) for n in expected)})
    return records


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("directory")
    parser.add_argument("--peft", action="store_true")
    args = parser.parse_args()
    acc = hyperacc.Accelerator(checkpoint=hyperacc.CheckpointConfig(save_ckpt=False))
    if acc.is_main_process:
        os.makedirs(os.path.join(args.directory, "global_step_1"))
        open(os.path.join(args.directory, "global_step_1", "keep.txt"), "w").write("checkpoint")
        for name, text in OTHERS.items():
            open(os.path.join(args.directory, name), "w").write(text)
        os.makedirs(os.path.join(args.directory, "adapter"))
        open(os.path.join(args.directory, "adapter", "README.md"), "w").write("mine")
    acc.wait_for_everyone()
    result = {"model": full_model_rounds(acc, args.directory)}
    if args.peft:
        result["adapter"] = adapter_rounds(acc, os.path.join(args.directory, "adapter"))
    if acc.is_main_process:
        with open(args.out, "w") as handle:
            json.dump(result, handle)
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
