"""A stream resumed from its own position, not replayed: the accelerate path and hyperacc's SFTTrainer.

    stream_resume_run.py --out DIR [--parts accelerate,trainer] [--resume-from DIR2 --records 24]

Every record read from the source is counted: the stream is ``load_dataset("json", streaming=True)``
(no shuffle buffer) followed by ``.map(count)``, which appends the record's id to this process's list
while counting is on (only inside the training loops; rank 0 alone reads under accelerate's default
dispatching). What each part records (rank 0 writes ``DIR/result.json``):

accelerate  ``prepare()`` of a DataLoader (per-rank batch 3) over a 36-record stream, 2 epochs, SGD on a
            2-layer MLP, fp32. "full": uninterrupted; "head": 4 steps then ``save_state``; "resumed": a
            fresh Accelerator, ``load_state``, the rest. Per step: global mean loss, sample ids of every
            rank; per rank: ids read. Cases: "default" (accelerate's dispatching), "stateful"
            (``use_stateful_dataloader=True``, torchdata), "buffer" (``shuffle(buffer_size=4)``: the
            replay fallback; its warnings are recorded).
trainer     hyperacc's ``SFTTrainer`` (tiny Qwen3 of trainer_run.py), per-device 2 x GA 2, ``max_steps=6``
            over a 40-record stream (a pass is 5 steps at 2 processes), a checkpoint at step 3: "full"
            uninterrupted (saving), "resumed" a fresh trainer with ``resume_from_checkpoint=global_step_3``.
            Per step: loss; per rank: ids read during ``train()``, sha256 of its local weight shards.

With ``--resume-from DIR2`` (another world size) the checkpoints of DIR2's run are resumed with the
per-rank batch scaled to keep the global batch ("cross" in the result), to compare with DIR2's record.
"""
import argparse
import hashlib
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import iterable_run  # noqa: E402
from iterable_run import barrier, build_model, collate, gather, global_mean, rank, reset_accelerate_state, world  # noqa: E402,E501

READS: list = []
COUNTING = [False]
RECORDS, EPOCHS, PER_RANK, SAVE_AT = 36, 2, 3, 4
CASES = {"default": {}, "stateful": {"stateful": True}, "buffer": {"buffer": True}}


def count(row):
    if COUNTING[0]:
        READS.append(int(row["id"]))
    return row


class counting:
    def __enter__(self):
        READS.clear()
        COUNTING[0] = True

    def __exit__(self, *exc):
        COUNTING[0] = False


def write_jsonl(path: str, rows) -> str:
    if rank() == 0:
        with open(path, "w") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
    barrier()
    return path


def stream(path: str, buffer: bool = False):
    from datasets import load_dataset

    data = load_dataset("json", data_files=path, split="train", streaming=True)
    if buffer:
        data = data.shuffle(seed=5, buffer_size=4)
    return data.map(count)


# ----------------------------------------------------------------------------- accelerate path
def fresh(path: str, case: dict, per_rank: int):
    import hyperacc
    from accelerate.utils import DataLoaderConfiguration

    acc = hyperacc.Accelerator(dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=case.get("stateful", False)))
    model = build_model()
    loader = DataLoader(stream(path, case.get("buffer", False)), batch_size=per_rank, collate_fn=collate)
    model, optimizer, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    return acc, model, optimizer, loader


def loop(acc, model, optimizer, loader, steps=None, start_epoch: int = 0) -> dict:
    record = {"steps": [], "epochs": []}
    with counting():
        for epoch in range(start_epoch, EPOCHS):
            for batch in loader:
                loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                record["steps"].append({"loss": global_mean(loss), "ids": gather([int(i) for i in batch["id"]])})
                record["epochs"].append(epoch)
                if steps is not None and len(record["steps"]) == steps:
                    break
            else:
                continue
            break
    record["reads"] = gather(list(READS))
    return record


def accelerate_case(name: str, path: str, out: str) -> dict:
    case = CASES[name]
    full = loop(*fresh(path, case, PER_RANK))
    acc, model, optimizer, loader = fresh(path, case, PER_RANK)
    head = loop(acc, model, optimizer, loader, steps=SAVE_AT)
    checkpoint = os.path.join(out, f"ckpt_{name}")
    acc.save_state(checkpoint)
    acc, model, optimizer, loader = fresh(path, case, PER_RANK)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(checkpoint)
        epoch, _ = loader.restored_position()
        resumed = loop(acc, model, optimizer, loader, start_epoch=epoch)
    return {"full": full, "head": head, "resumed": resumed, "k": SAVE_AT,
            "warnings": [str(w.message) for w in caught if "stream" in str(w.message)]}


def accelerate_cross(path: str, source: str) -> dict:
    saved = json.loads(open(os.path.join(source, "result.json")).read())
    scale = saved["world"] // world()
    acc, model, optimizer, loader = fresh(path, {}, PER_RANK * scale)
    acc.load_state(os.path.join(source, "ckpt_default"))
    epoch, batches = loader.restored_position()
    return {"position": [epoch, batches], "record": loop(acc, model, optimizer, loader, start_epoch=epoch)}


# ----------------------------------------------------------------------------- Trainer path
def trainer_run(path: str, out: str, per_device: int, save: bool, resume=None) -> dict:
    import trainer_run as tr
    from trl import SFTConfig

    _, SFTTrainer = tr.trainer_classes("hyperacc")
    reset_accelerate_state()
    tokenizer = tr.sft_tokenizer()
    model = tr.build_model("dense", vocab=len(tokenizer))
    config = SFTConfig(output_dir=out, per_device_train_batch_size=per_device, gradient_accumulation_steps=2,
                       max_steps=6, logging_steps=1, save_strategy="steps" if save else "no", save_steps=3,
                       use_cpu=True, report_to=[], learning_rate=1e-2, seed=0, disable_tqdm=True, bf16=False,
                       max_length=64, dataset_num_proc=None)
    trainer = SFTTrainer(model=model, args=config, train_dataset=stream(path), processing_class=tokenizer)
    with counting():
        trainer.train(resume_from_checkpoint=resume)
    reads = gather(list(READS))
    losses = {str(e["step"]): e["loss"] for e in trainer.state.log_history if "loss" in e}
    weights = gather(local_digest(trainer.model))
    del trainer, model
    return {"losses": losses, "reads": reads, "weights": weights}


def local_digest(model) -> str:
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        t = (p.to_local() if isinstance(p, DTensor) else p).detach().cpu().contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def trainer_part(path: str, out: str, source=None) -> dict:
    if source is None:
        full = trainer_run(path, os.path.join(out, "trainer_full"), 2, save=True)
        resumed = trainer_run(path, os.path.join(out, "trainer_resumed"), 2, save=False,
                              resume=os.path.join(out, "trainer_full", "global_step_3"))
        return {"full": full, "resumed": resumed}
    saved = json.loads(open(os.path.join(source, "result.json")).read())
    scale = saved["world"] // world()
    return {"cross": trainer_run(path, os.path.join(out, "trainer_cross"), 2 * scale, save=False,
                                 resume=os.path.join(source, "trainer_full", "global_step_3"))}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="accelerate,trainer")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--resume-from", default=None)
    a = parser.parse_args()
    if world() > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    os.makedirs(a.out, exist_ok=True)
    records = write_jsonl(os.path.join(a.out, "records.jsonl"),
                          [iterable_run.sample(i) for i in range(RECORDS)])
    texts = write_jsonl(os.path.join(a.out, "texts.jsonl"),
                        [{"id": i, "text": doc} for i, doc in enumerate(_documents(40))])
    parts = a.parts.split(",")
    result = {"world": world(), "accelerate": {}}
    if "accelerate" in parts:
        if a.resume_from:
            result["accelerate"]["cross"] = accelerate_cross(records, a.resume_from)
        else:
            for name in [n for n in a.cases.split(",") if n]:
                result["accelerate"][name] = accelerate_case(name, records, a.out)
    if "trainer" in parts:
        result["trainer"] = trainer_part(texts, a.out, a.resume_from)
    if rank() == 0:
        with open(os.path.join(a.out, "result.json"), "w") as handle:
            json.dump(result, handle)
    barrier()
    if dist.is_initialized():
        dist.destroy_process_group()


def _documents(n: int):
    import trainer_run as tr

    return tr.sft_documents(n)


if __name__ == "__main__":
    main()
