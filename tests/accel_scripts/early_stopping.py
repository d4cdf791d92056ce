import os
if os.environ.get("ACCEL_IMPL") == "hyperacc":
    from hyperacc import Accelerator
else:
    from accelerate import Accelerator

# accelerate's examples/by_feature/early_stopping.py with local stand-ins for the hub.
# Accelerator features: set_trigger() on whichever process decides to stop, check_trigger()
# (a collective: every process breaks out of the loop at the same step).
import argparse

import torch
from torch.optim import AdamW
from transformers import AutoModelForSequenceClassification, get_linear_schedule_with_warmup, set_seed

from accelerate import DistributedType
from tiny_stubs import PairClassificationMetric, get_mrpc_dataloaders, report, tiny_bert_config

MAX_GPU_BATCH_SIZE = 16
get_dataloaders = get_mrpc_dataloaders


class EarlyStopping:
    """Stop when the loss has not improved by ``min_delta`` for ``patience`` checks in a row."""

    def __init__(self, min_delta=0.0, patience=5):
        self.min_delta, self.patience = min_delta, patience
        self.best = float("inf")
        self.bad_checks = 0

    def check_early_stopping(self, loss_value):
        if self.best - loss_value >= self.min_delta:
            self.best, self.bad_checks = loss_value, 0
            return False
        self.bad_checks += 1
        return self.bad_checks >= self.patience


callback = EarlyStopping(patience=4)


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    report(accelerator, kind="setup", distributed_type=str(accelerator.distributed_type),
           num_processes=accelerator.num_processes)
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    metric = PairClassificationMetric()

    gradient_accumulation_steps = 1
    if batch_size > MAX_GPU_BATCH_SIZE and accelerator.distributed_type != DistributedType.XLA:
        gradient_accumulation_steps = batch_size // MAX_GPU_BATCH_SIZE
        batch_size = MAX_GPU_BATCH_SIZE

    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    model = AutoModelForSequenceClassification.from_config(tiny_bert_config())
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer,
        num_warmup_steps=config["warmup_steps"],
        num_training_steps=(len(train_dataloader) * num_epochs) // gradient_accumulation_steps,
    )

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    global_step = 0
    for epoch in range(num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            batch.to(accelerator.device)
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / gradient_accumulation_steps
            accelerator.backward(loss)
            if step % gradient_accumulation_steps == 0:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            report(accelerator, kind="train", step=global_step, epoch=epoch, loss=loss.item())
            global_step += 1

            # Any process may ask to stop; check_trigger() tells all of them.
            if callback.check_early_stopping(loss.item()):
                accelerator.set_trigger()

            if accelerator.check_trigger():
                report(accelerator, kind="early_stop", epoch=epoch, step=global_step - 1)
                break

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
        report(accelerator, kind="eval", epoch=epoch, eval_dataset_len=len(eval_dataloader.dataset), **eval_metric)
    report(accelerator, kind="done")
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--output_dir", type=str, default=None, help="Unused (nothing is written).")
    args = parser.parse_args()
    config = {"lr": 5e-3, "num_epochs": 3, "seed": 42, "batch_size": 16, "warmup_steps": 3}
    training_function(config, args)


if __name__ == "__main__":
    main()
