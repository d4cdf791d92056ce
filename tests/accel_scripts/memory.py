import os
if os.environ.get("ACCEL_IMPL") == "hyperacc":
    from hyperacc import Accelerator
else:
    from accelerate import Accelerator

# accelerate's examples/by_feature/memory.py with local stand-ins for the hub.
# Accelerator features: find_executable_batch_size around the whole training function,
# free_memory() at the start of each attempt (drops what the failed attempt prepared), a second
# prepare() of fresh objects on the same Accelerator. With --simulate_oom_above N an attempt with a
# batch size above N raises an out-of-memory error at its first training step (on every process),
# so the retry path really runs on a CPU.
import argparse

import torch
from torch.optim import AdamW
from transformers import AutoModelForSequenceClassification, get_linear_schedule_with_warmup, set_seed

from accelerate.utils import find_executable_batch_size
from tiny_stubs import PairClassificationMetric, get_mrpc_dataloaders, report, tiny_bert_config

get_dataloaders = get_mrpc_dataloaders


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    report(accelerator, kind="setup", distributed_type=str(accelerator.distributed_type),
           num_processes=accelerator.num_processes)
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    metric = PairClassificationMetric()

    # The decorated function gets the batch size as its first argument; when it fails with an
    # out-of-memory error it is called again with a smaller one (90 % of the last).
    @find_executable_batch_size(starting_batch_size=batch_size)
    def inner_training_loop(batch_size):
        nonlocal accelerator
        accelerator.free_memory()
        report(accelerator, kind="attempt", batch_size=batch_size)

        set_seed(seed)
        model = AutoModelForSequenceClassification.from_config(tiny_bert_config())
        model = model.to(accelerator.device)
        optimizer = AdamW(params=model.parameters(), lr=lr)
        train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
        lr_scheduler = get_linear_schedule_with_warmup(
            optimizer=optimizer,
            num_warmup_steps=config["warmup_steps"],
            num_training_steps=(len(train_dataloader) * num_epochs),
        )

        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
            model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
        )

        global_step = 0
        for epoch in range(num_epochs):
            model.train()
            for step, batch in enumerate(train_dataloader):
                if args.simulate_oom_above and batch_size > args.simulate_oom_above:
                    raise RuntimeError("CUDA out of memory. (simulated by the test script)")
                batch.to(accelerator.device)
                outputs = model(**batch)
                loss = outputs.loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                report(accelerator, kind="train", step=global_step, epoch=epoch, loss=loss.item())
                global_step += 1

            model.eval()
            for step, batch in enumerate(eval_dataloader):
                batch.to(accelerator.device)
                with torch.no_grad():
                    outputs = model(**batch)
                predictions = outputs.logits.argmax(dim=-1)
                predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
                metric.add_batch(predictions=predictions, references=references)

            eval_metric = metric.compute()
            accelerator.print(f"epoch {epoch}:", eval_metric)
            report(accelerator, kind="eval", epoch=epoch, batch_size=batch_size,
                   eval_dataset_len=len(eval_dataloader.dataset), **eval_metric)

    inner_training_loop()
    report(accelerator, kind="done")
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--simulate_oom_above", type=int, default=24,
                        help="Raise an out-of-memory error for batch sizes above this (0: never).")
    parser.add_argument("--output_dir", type=str, default=None, help="Unused (nothing is written).")
    args = parser.parse_args()
    config = {"lr": 5e-3, "num_epochs": 3, "seed": 42, "batch_size": 32, "warmup_steps": 3}
    training_function(config, args)


if __name__ == "__main__":
    main()
