import os
if os.environ.get("ACCEL_IMPL") == "hyperacc":
    from hyperacc import Accelerator
else:
    from accelerate import Accelerator

# accelerate's examples/by_feature/gradient_accumulation_for_autoregressive_models.py with local
# stand-ins for the hub: a tiny Llama (the architecture of SmolLM) built from a config, wikitext-like
# lines from a seeded Markov chain, a word-level tokenizer.
# Accelerator features: gradient_accumulation_steps=k with a hand-written accumulation loop,
# local_main_process_first, gather of a 0-d tensor (label tokens of the step on all processes),
# model.no_sync on the non-final micro-batches, backward (which divides by k), clip_grad_norm_,
# num_processes, gather_for_metrics of repeated eval losses.
import argparse
import contextlib
import math

import torch
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, get_constant_schedule, set_seed

from accelerate import DistributedType
from tiny_stubs import TinyTokenizer, load_wikitext_like, report, tiny_llama_config

EVAL_BATCH_SIZE = 8


def get_dataloaders(accelerator: Accelerator, batch_size: int = 16, max_training_samples=120):
    """Loaders of padded lines, labels = input ids with padding masked to -100 (the model shifts)."""
    tokenizer = TinyTokenizer("gpt")
    tokenizer.pad_token = tokenizer.eos_token
    with accelerator.local_main_process_first():
        datasets = load_wikitext_like()
        datasets["train"] = datasets["train"].select(range(max_training_samples))

    def tokenize_function(examples):
        return tokenizer(examples["text"], truncation=True, max_length=None, return_attention_mask=False)

    with accelerator.main_process_first():
        datasets = datasets.filter(lambda x: len(x) > 0, input_columns="text")
    with accelerator.main_process_first():
        tokenized_datasets = datasets.map(tokenize_function, batched=True, remove_columns=["text"])

    def collate_fn(examples):
        max_length = (
            128 if accelerator.distributed_type == DistributedType.XLA else max(len(e["input_ids"]) for e in examples)
        )
        if accelerator.mixed_precision == "fp8":
            pad_to_multiple_of = 16
        elif accelerator.mixed_precision != "no":
            pad_to_multiple_of = 8
        else:
            pad_to_multiple_of = None
        batch = tokenizer.pad(examples, padding="max_length", max_length=max_length,
                              pad_to_multiple_of=pad_to_multiple_of, return_tensors="pt")
        lengths = torch.tensor([len(e["input_ids"]) for e in examples])
        positions = torch.arange(batch["input_ids"].shape[1])[None, :]
        batch["attention_mask"] = (positions < lengths[:, None]).long()
        batch["labels"] = torch.where(batch["attention_mask"].bool(), batch["input_ids"], -100)
        return batch

    train_dataloader = DataLoader(tokenized_datasets["train"], shuffle=False, collate_fn=collate_fn,
                                  batch_size=batch_size)
    eval_dataloader = DataLoader(tokenized_datasets["validation"], shuffle=False, collate_fn=collate_fn,
                                 batch_size=EVAL_BATCH_SIZE)
    return train_dataloader, eval_dataloader


def training_function(config, args):
    gradient_accumulation_steps = int(args.gradient_accumulation_steps)
    accelerator = Accelerator(
        cpu=args.cpu, mixed_precision=args.mixed_precision, gradient_accumulation_steps=gradient_accumulation_steps
    )
    report(accelerator, kind="setup", distributed_type=str(accelerator.distributed_type),
           num_processes=accelerator.num_processes)
    if accelerator.distributed_type == DistributedType.XLA and gradient_accumulation_steps > 1:
        raise NotImplementedError("Gradient accumulation on TPUs is not supported. Pass `gradient_accumulation_steps=1`")
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])
    max_grad_norm = config["max_grad_norm"]

    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_constant_schedule(optimizer=optimizer)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    # The last update of an epoch may have fewer micro-batches than k.
    num_samples_in_epoch = len(train_dataloader)
    remainder = num_samples_in_epoch % gradient_accumulation_steps
    remainder = remainder if remainder != 0 else gradient_accumulation_steps
    total_gradient_updates = math.ceil(num_samples_in_epoch / gradient_accumulation_steps)

    total_batched_samples = 0
    for epoch in range(num_epochs):
        model.train()
        training_iterator = iter(train_dataloader)
        for update_step in range(total_gradient_updates):
            batch_samples = []
            num_batches_in_step = (
                gradient_accumulation_steps if update_step != (total_gradient_updates - 1) else remainder
            )
            for _ in range(num_batches_in_step):
                batch_samples += [next(training_iterator)]
            # Normalize by the label tokens of the whole step on all processes, not per micro-batch.
            local_num_items_in_batch = sum([(batch["labels"][:, 1:].ne(-100)).sum() for batch in batch_samples])
            num_items_in_batch = accelerator.gather(local_num_items_in_batch).sum().item()
            losses = []
            for i, batch in enumerate(batch_samples):
                ctx = (
                    model.no_sync
                    if (i < len(batch_samples) - 1 and accelerator.num_processes > 1)
                    else contextlib.nullcontext
                )
                with ctx():
                    total_batched_samples += 1
                    outputs = model(**batch, use_cache=False, num_items_in_batch=num_items_in_batch)
                    loss = outputs.loss
                    # backward divides by k and DDP averages over processes: undo both.
                    loss = loss * gradient_accumulation_steps * accelerator.num_processes
                    accelerator.backward(loss)
                    losses.append(loss.detach())

            grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()

            losses = accelerator.gather(sum(losses)).sum().item() / (
                accelerator.num_processes * gradient_accumulation_steps
            )
            grad_norm = grad_norm.detach().item() if isinstance(grad_norm, torch.Tensor) else grad_norm
            accelerator.print(f"epoch {epoch} - update step {update_step}:: grad norm: {grad_norm} ::train loss: {losses}")
            report(accelerator, kind="train", step=update_step + total_gradient_updates * epoch, epoch=epoch,
                   loss=losses, grad_norm=grad_norm, num_items_in_batch=num_items_in_batch)

        model.eval()
        losses = []
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch, use_cache=False)
            eval_loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(eval_loss.repeat(EVAL_BATCH_SIZE)))

        losses = torch.cat(losses)
        try:
            eval_loss = torch.mean(losses)
            perplexity = math.exp(eval_loss)
        except OverflowError:
            perplexity = float("inf")
        accelerator.print(f"epoch {epoch}:: eval perplexity: {perplexity} eval_loss: {eval_loss}")
        report(accelerator, kind="eval", epoch=epoch, perplexity=perplexity, eval_loss=eval_loss.item(),
               num_samples=len(losses))
    report(accelerator, kind="done")
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2,
                        help="The number of minibatches to be ran before gradients are accumulated.")
    parser.add_argument("--per_device_batch_size", type=int, default=4, help="The size of each minibatch")
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--output_dir", type=str, default=None, help="Unused (nothing is written).")
    args = parser.parse_args()
    config = {"lr": 3e-3, "num_epochs": 2, "seed": 42, "batch_size": args.per_device_batch_size, "max_grad_norm": 1.0}
    training_function(config, args)


if __name__ == "__main__":
    main()
