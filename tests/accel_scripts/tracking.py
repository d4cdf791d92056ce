import os
if os.environ.get("ACCEL_IMPL") == "hyperacc":
    from hyperacc import Accelerator
else:
    from accelerate import Accelerator

# accelerate's examples/by_feature/tracking.py with local stand-ins for the hub.
# Accelerator features: log_with ("all" plus a custom GeneralTracker that writes JSON lines, so the
# logged values can be checked), project_dir, init_trackers (after prepare), log(step=),
# get_tracker, end_training (finishes the trackers).
import argparse

import torch
from torch.optim import AdamW
from transformers import AutoModelForSequenceClassification, get_linear_schedule_with_warmup, set_seed

from accelerate import DistributedType
from tiny_stubs import JsonlTracker, PairClassificationMetric, get_mrpc_dataloaders, report, tiny_bert_config

MAX_GPU_BATCH_SIZE = 16
get_dataloaders = get_mrpc_dataloaders


def training_function(config, args):
    if args.with_tracking:
        run = os.path.split(__file__)[-1].split(".")[0]
        trackers = ["all", JsonlTracker(run, os.path.join(args.project_dir, "jsonl"))]
        accelerator = Accelerator(
            cpu=args.cpu, mixed_precision=args.mixed_precision, log_with=trackers, project_dir=args.project_dir
        )
    else:
        accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    report(accelerator, kind="setup", distributed_type=str(accelerator.distributed_type),
           num_processes=accelerator.num_processes)
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])
    set_seed(seed)

    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    metric = PairClassificationMetric()

    gradient_accumulation_steps = 1
    if batch_size > MAX_GPU_BATCH_SIZE and accelerator.distributed_type != DistributedType.XLA:
        gradient_accumulation_steps = batch_size // MAX_GPU_BATCH_SIZE
        batch_size = MAX_GPU_BATCH_SIZE

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

    # Trackers are initialized on the main process with the run name and its configuration.
    if args.with_tracking:
        run = os.path.split(__file__)[-1].split(".")[0]
        accelerator.init_trackers(run, config)
        if accelerator.is_main_process:
            jsonl = accelerator.get_tracker("jsonl", unwrap=False)
            report(accelerator, kind="tracker", name=jsonl.name, path=jsonl.path)

    global_step = 0
    for epoch in range(num_epochs):
        model.train()
        if args.with_tracking:
            total_loss = 0
        for step, batch in enumerate(train_dataloader):
            batch.to(accelerator.device)
            outputs = model(**batch)
            loss = outputs.loss
            if args.with_tracking:
                total_loss += loss.detach().float()
            loss = loss / gradient_accumulation_steps
            accelerator.backward(loss)
            if step % gradient_accumulation_steps == 0:
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
        report(accelerator, kind="eval", epoch=epoch, eval_dataset_len=len(eval_dataloader.dataset), **eval_metric)

        if args.with_tracking:
            accelerator.log(
                {
                    "accuracy": eval_metric["accuracy"],
                    "f1": eval_metric["f1"],
                    "train_loss": total_loss.item() / len(train_dataloader),
                    "epoch": epoch,
                },
                step=epoch,
            )

    report(accelerator, kind="done")
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default=None, choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--with_tracking", action="store_true", help="Log to the trackers.")
    parser.add_argument("--project_dir", type=str, default="logs", help="Where tracking logs go.")
    parser.add_argument("--output_dir", type=str, default=None,
                        help="When given and --project_dir is not, tracking logs go to <output_dir>/logs.")
    args = parser.parse_args()
    if args.output_dir is not None and args.project_dir == "logs":
        args.project_dir = os.path.join(args.output_dir, "logs")
    config = {"lr": 5e-3, "num_epochs": 3, "seed": 42, "batch_size": 16, "warmup_steps": 3}
    training_function(config, args)


if __name__ == "__main__":
    main()
