import os
if os.environ.get("ACCEL_IMPL") == "hyperacc":
    from hyperacc import Accelerator
else:
    from accelerate import Accelerator

# accelerate's examples/by_feature/gradient_accumulation.py with local stand-ins for the hub.
# Accelerator features: Accelerator(gradient_accumulation_steps=k), accumulate(model) around
# forward/backward/step (the optimizer and a prepared scheduler only act on sync steps),
# sync_gradients, gather_for_metrics.
import argparse

import torch
from torch.optim import AdamW
from transformers import AutoModelForSequenceClassification, get_linear_schedule_with_warmup, set_seed

from accelerate import DistributedType
from tiny_stubs import PairClassificationMetric, get_mrpc_dataloaders, report, tiny_bert_config

get_dataloaders = get_mrpc_dataloaders


def training_function(config, args):
    gradient_accumulation_steps = int(args.gradient_accumulation_steps)
    accelerator = Accelerator(
        cpu=args.cpu, mixed_precision=args.mixed_precision, gradient_accumulation_steps=gradient_accumulation_steps
    )
    report(accelerator, kind="setup", distributed_type=str(accelerator.distributed_type),
           num_processes=accelerator.num_processes, gradient_accumulation_steps=accelerator.gradient_accumulation_steps)
    if accelerator.distributed_type == DistributedType.XLA and gradient_accumulation_steps > 1:
        raise NotImplementedError("Gradient accumulation on TPUs is not supported. Pass `gradient_accumulation_steps=1`")
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    metric = PairClassificationMetric()

    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    model = AutoModelForSequenceClassification.from_config(tiny_bert_config())
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    # The schedule counts every batch: the prepared scheduler only steps when gradients sync.
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
            batch.to(accelerator.device)
            # Gradients accumulate for k batches; the step and zero_grad are no-ops in between.
            with accelerator.accumulate(model):
                output = model(**batch)
                loss = output.loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            report(accelerator, kind="train", step=global_step, epoch=epoch, loss=loss.item(),
                   sync=bool(accelerator.sync_gradients), lr=lr_scheduler.get_last_lr()[0])
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
        report(accelerator, kind="eval", epoch=epoch, eval_dataset_len=len(eval_dataloader.dataset), **eval_metric)
    report(accelerator, kind="done")
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2,
                        help="The number of minibatches to be ran before gradients are accumulated.")
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--output_dir", type=str, default=None, help="Unused (nothing is written).")
    args = parser.parse_args()
    config = {"lr": 5e-3, "num_epochs": 3, "seed": 42, "batch_size": 8, "warmup_steps": 6}
    training_function(config, args)


if __name__ == "__main__":
    main()
