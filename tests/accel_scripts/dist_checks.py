import os
if os.environ.get("ACCEL_IMPL") == "hyperacc":
    from hyperacc import Accelerator
else:
    from accelerate import Accelerator

# Several multi-process checks in one launch (a launch costs seconds, the checks milliseconds):
#   1. save_model: train a tiny Qwen3 a few steps, then `save_model` (safetensors, HF layout) into
#      <output_dir>/saved with the config beside it, and the full `get_state_dict` into
#      <output_dir>/state_dict.pt (main process); the test loads the folder with from_pretrained.
#   2. gather_for_metrics on uneven eval sets (sizes that do not divide by processes x batch size):
#      every sample exactly once, tensors, nested structures and use_gather_object.
import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup, set_seed

from tiny_stubs import TinyTokenizer, load_wikitext_like, report, tiny_qwen_config

BLOCK = 24


def lm_blocks():
    """Fixed-length blocks of tokens from the wikitext-like lines."""
    tokenizer = TinyTokenizer("gpt")
    ids = [t for line in load_wikitext_like(n_train=80, n_validation=0)["train"]["text"]
           for t in tokenizer(line)["input_ids"]]
    n = len(ids) // BLOCK
    return torch.tensor(ids[: n * BLOCK]).view(n, BLOCK)


def train_and_save(accelerator, output_dir, steps):
    set_seed(42)
    blocks = lm_blocks()
    loader = DataLoader(TensorDataset(blocks), batch_size=4, shuffle=True)
    model = AutoModelForCausalLM.from_config(tiny_qwen_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, steps * accelerator.num_processes)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    step = 0
    while step < steps:
        for (input_ids,) in loader:
            loss = model(input_ids=input_ids, labels=input_ids).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            report(accelerator, kind="train", step=step, loss=loss.item())
            step += 1
            if step == steps:
                break

    accelerator.wait_for_everyone()
    saved = os.path.join(output_dir, "saved")
    accelerator.save_model(model, saved)
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).config.save_pretrained(saved)
        torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, os.path.join(output_dir, "state_dict.pt"))
    accelerator.wait_for_everyone()
    report(accelerator, kind="saved", path=saved, num_tensors=len(state))


def gather_checks(accelerator):
    for size, batch_size in [(83, 8), (7, 2), (1, 4), (64, 8), (13, 3)]:
        loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(size)), batch_size=batch_size))
        tensors, nested_a, nested_b, objects = [], [], [], []
        for (x,) in loader:
            tensors.append(accelerator.gather_for_metrics(x))
            nested = accelerator.gather_for_metrics({"x": x, "pair": (x * 2, x.float())})
            nested_a.append(nested["x"])
            nested_b.append(nested["pair"][0])
            objects += accelerator.gather_for_metrics([f"s{int(v)}" for v in x], use_gather_object=True)
        values = torch.cat(tensors).tolist()
        report(accelerator, kind="gather", size=size, batch_size=batch_size,
               count=len(values), exact=sorted(values) == list(range(size)),
               nested_count=len(torch.cat(nested_a)),
               nested_exact=sorted(torch.cat(nested_b).tolist()) == [2 * i for i in range(size)],
               object_count=len(objects), object_exact=sorted(objects) == sorted(f"s{i}" for i in range(size)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    accelerator = Accelerator()
    report(accelerator, kind="setup", distributed_type=str(accelerator.distributed_type),
           num_processes=accelerator.num_processes)
    train_and_save(accelerator, args.output_dir, args.steps)
    gather_checks(accelerator)
    report(accelerator, kind="done")
    accelerator.end_training()


if __name__ == "__main__":
    main()
