"""TRL's `SFTTrainer` on a streaming `datasets` dataset: plain TRL, then hyperacc's, then hyperacc's resumed.

    stream_trainer_run.py --out DIR [--docs 12] [--max-steps 8] [--save-steps 2] [--per-device 2]
        [--grad-accum 2] [--resume-steps 2,4,6] [--no-plain]

The data is ``load_dataset("json", data_files=<local jsonl>, streaming=True)`` (an ``IterableDataset``,
no length) shuffled with a seed and a buffer, so each pass (``set_epoch``) has its own order. With 12
documents, per-device 2 x GA 2 an epoch of the stream is 3 optimizer steps: 8 steps read it 2.67 times,
and `Trainer` (which cannot know that) counts all of ``max_steps`` as one epoch.

In one process, in turn: plain ``trl.SFTTrainer`` (accelerate's engine, no saves); hyperacc's
``SFTTrainer`` with a checkpoint every ``--save-steps``; for each of ``--resume-steps`` a fresh hyperacc
``SFTTrainer`` in another output_dir with ``train(resume_from_checkpoint=<the run's global_step_K>)``.
The model is the tiny Qwen3 of trainer_run.py (built from its config after ``torch.manual_seed(0)``),
the offline tokenizer, fp32. Rank 0 writes ``DIR/result.json``: {"plain": steps, "hyperacc": steps,
"resumed": {K: steps}} with steps = {step: [loss, epoch]} from ``state.log_history``.
"""
import argparse
import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trainer_run  # noqa: E402


def write_docs(path: str, n: int) -> None:
    with open(path, "w") as handle:
        for doc in trainer_run.sft_documents(n):
            handle.write(json.dumps({"text": doc}) + "\n")


def reset_accelerate_state() -> None:
    """Forget accelerate's singletons between trainers of different engines in this process."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def run(a, data: str, engine: str, out: str, save_steps: int, resume=None) -> dict:
    from datasets import load_dataset
    from trl import SFTConfig

    _, SFTTrainer = trainer_run.trainer_classes(engine)
    stream = load_dataset("json", data_files=data, split="train", streaming=True).shuffle(seed=3, buffer_size=4)
    tokenizer = trainer_run.sft_tokenizer()
    model = trainer_run.build_model("dense", vocab=len(tokenizer))
    config = SFTConfig(output_dir=out, per_device_train_batch_size=a.per_device,
                       gradient_accumulation_steps=a.grad_accum, max_steps=a.max_steps, logging_steps=1,
                       save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, use_cpu=True,
                       report_to=[], learning_rate=1e-2, seed=0, disable_tqdm=True, bf16=False, max_length=64,
                       dataset_num_proc=None)
    trainer = SFTTrainer(model=model, args=config, train_dataset=stream, processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=resume)
    steps = {str(e["step"]): [e["loss"], e["epoch"]] for e in trainer.state.log_history if "loss" in e}
    del trainer, model            # the process group stays for the next run (re-creating one under torchrun hangs)
    reset_accelerate_state()
    return steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--docs", type=int, default=12)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--per-device", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--resume-steps", default="2,4,6")
    parser.add_argument("--no-plain", action="store_true")
    a = parser.parse_args()
    os.makedirs(a.out, exist_ok=True)
    data = os.path.join(a.out, "train.jsonl")
    write_docs(data, a.docs)
    result = {"plain": None if a.no_plain else run(a, data, "plain", os.path.join(a.out, "plain"), 0)}
    result["hyperacc"] = run(a, data, "hyperacc", os.path.join(a.out, "hyperacc"), a.save_steps)
    result["resumed"] = {}
    for k in [int(s) for s in a.resume_steps.split(",") if s]:
        checkpoint = os.path.join(a.out, "hyperacc", f"global_step_{k}")
        result["resumed"][str(k)] = run(a, data, "hyperacc", os.path.join(a.out, f"resumed_{k}"), 0, checkpoint)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(os.path.join(a.out, "result.json"), "w") as handle:
            json.dump(result, handle)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
