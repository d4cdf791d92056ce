"""Iterable datasets through `prepare()`: hyperacc.Accelerator against accelerate.Accelerator, one launch.

    iterable_run.py --out DIR [--resume-from CKPT --expect JSON]

In one process (plain python for 1 rank, torchrun for 2) every case below first trains under plain
``accelerate.Accelerator(cpu=True)`` (DDP over gloo at 2 ranks: accelerate alone does not shard on a
CPU-only machine), then — accelerate's state reset, the same process group reused — under
``hyperacc.Accelerator`` (FSDP2). Same seed, same model, same stream, same loop; what is recorded per
optimizer step: the global mean loss (all-reduced) and the sample ids each rank trained on.

Cases (a stream of 22 samples, 2 epochs, a 2-layer MLP, fp32, SGD):
  torch_dispatch    torch IterableDataset without __len__, accelerate's default (DataLoaderDispatcher),
                    drop_last=False, gradient_accumulation_steps=2 through `accumulate`
  torch_shard       dispatch_batches=False (IterableDatasetShard)
  torch_split       split_batches=True
  torch_drop_last   drop_last=True, dispatch_batches=False
  hf_stream         `load_dataset("json", data_files=[2 files], streaming=True).shuffle(seed, buffer)`
  hf_shards         the same, dispatch_batches=False (each rank reads its file: datasets' `shard()`)

Then hyperacc alone, save_state/load_state (RESUME_CASES): an uninterrupted run records every step; a
fresh run trains K steps, `save_state`s, and a third fresh Accelerator `load_state`s it and trains on.
With ``--resume-from`` the checkpoint of another world size is loaded instead (per-rank batch scaled to
keep the global batch) and the steps after it are compared with ``--expect`` (that run's own record).

Rank 0 writes ``DIR/result.json``: {"world", "compare": {case: {"plain": rec, "hyperacc": rec}},
"resume": {case: {"full": rec, "resumed": rec, "k": K, "checkpoint": path}}, "cross": rec, "refusal": str}.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

N_SAMPLES, EPOCHS, FEATURES = 22, 2, 6


class Stream(IterableDataset):
    """Samples 0..n-1 in order (no __len__); the features are a fixed function of the id."""

    def __init__(self, n: int = N_SAMPLES):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield sample(i)


def sample(i: int) -> dict:
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(FEATURES, generator=g)
    return {"id": i, "x": x.tolist(), "y": float(x.sum().sin())}


def write_jsonl(folder: str) -> list:
    """Two shard files of the stream (even ids, odd ids), written by rank 0."""
    paths = [os.path.join(folder, f"part{k}.jsonl") for k in range(2)]
    if rank() == 0:
        for k, path in enumerate(paths):
            with open(path, "w") as handle:
                for i in range(k, N_SAMPLES, 2):
                    handle.write(json.dumps(sample(i)) + "\n")
    barrier()
    return paths


CASES = {
    "torch_dispatch": dict(data="torch", batch=3, accum=2),
    "torch_shard": dict(data="torch", batch=3, dispatch=False),
    "torch_split": dict(data="torch", batch=4, split=True),
    "torch_drop_last": dict(data="torch", batch=3, dispatch=False, drop_last=True),
    "hf_stream": dict(data="hf", batch=2),
    "hf_shards": dict(data="hf", batch=2, dispatch=False),
}
# case -> where the save happens, in optimizer steps: "mid2" one step into the second epoch, "end" at the
# end of the first epoch (the stream's last batch was read: accelerate flagged it), or a step count.
RESUME_CASES = {"torch_drop_last": "mid2", "torch_dispatch": "end", "hf_stream": 3}
CROSS_CASE = "torch_drop_last"      # saved on 2 ranks, resumed on 1 with the same global batch


# ----------------------------------------------------------------------------- processes
def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def gather(obj) -> list:
    if dist.is_initialized() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def reset_accelerate_state() -> None:
    """Forget accelerate's singletons (the process group stays) so that the next Accelerator builds its own."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# ----------------------------------------------------------------------------- one training run
def make_loader(case: dict, files, batch_scale: float = 1.0) -> DataLoader:
    batch = int(case["batch"] * batch_scale)
    if case["data"] == "torch":
        dataset = Stream()
    else:
        from datasets import load_dataset

        dataset = load_dataset("json", data_files=files, split="train", streaming=True).shuffle(seed=5, buffer_size=6)
    return DataLoader(dataset, batch_size=batch, drop_last=case.get("drop_last", False), collate_fn=collate)


def collate(rows: list) -> dict:
    return {"id": torch.tensor([r["id"] for r in rows]), "x": torch.tensor([r["x"] for r in rows]),
            "y": torch.tensor([r["y"] for r in rows])}


def make_accelerator(engine: str, case: dict):
    from accelerate.utils import DataLoaderConfiguration

    config = DataLoaderConfiguration(split_batches=case.get("split", False), dispatch_batches=case.get("dispatch"))
    kwargs = dict(dataloader_config=config, gradient_accumulation_steps=case.get("accum", 1))
    if engine == "plain":
        import accelerate

        return accelerate.Accelerator(cpu=True, **kwargs)
    import hyperacc

    return hyperacc.Accelerator(**kwargs)


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def global_mean(value: torch.Tensor) -> float:
    value = value.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def train(acc, model, optimizer, loader, steps: int = None, start_epoch: int = 0) -> dict:
    """The loop of an accelerate script; returns {"steps": [{"loss", "ids"}, ...], "epochs": [...]}.
    ``steps``: stop after that many optimizer steps (None: all epochs)."""
    record = {"steps": [], "epochs": []}
    ids, losses = [], []
    for epoch in range(start_epoch, EPOCHS):
        for batch in loader:
            with acc.accumulate(model):
                pred = model(batch["x"]).squeeze(-1)
                loss = torch.nn.functional.mse_loss(pred, batch["y"])
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            ids.append([int(i) for i in batch["id"]])
            losses.append(loss)
            if acc.sync_gradients:
                record["steps"].append({"loss": sum(global_mean(x) for x in losses) / len(losses),
                                        "ids": gather(ids)})
                record["epochs"].append(epoch)
                ids, losses = [], []
                if steps is not None and len(record["steps"]) == steps:
                    return record
    return record


def fresh(case: dict, files, batch_scale: float = 1.0):
    """A hyperacc Accelerator with the case's model, optimizer and loader, prepared together."""
    acc = make_accelerator("hyperacc", case)
    model = build_model()
    model, optimizer, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                           make_loader(case, files, batch_scale))
    return acc, model, optimizer, loader


def plain(case: dict, files) -> dict:
    acc = make_accelerator("plain", case)
    model = build_model()
    model, optimizer, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), make_loader(case, files))
    record = train(acc, model, optimizer, loader)
    del model, optimizer, loader, acc
    return record


def resume_case(name: str, case: dict, files, out: str) -> dict:
    full = train(*fresh(case, files))
    per_epoch = full["epochs"].count(0)
    k = {"mid2": per_epoch + 1, "end": per_epoch}.get(RESUME_CASES[name], RESUME_CASES[name])
    acc, model, optimizer, loader = fresh(case, files)
    head = train(acc, model, optimizer, loader, steps=k)
    checkpoint = os.path.join(out, f"ckpt_{name}")
    acc.save_state(checkpoint)
    acc, model, optimizer, loader = fresh(case, files)
    acc.load_state(checkpoint)
    epoch, _ = loader.restored_position()
    tail = train(acc, model, optimizer, loader, start_epoch=epoch)
    return {"full": full, "head": head, "resumed": tail, "k": k, "checkpoint": checkpoint,
            "restored_epoch": epoch}


def refusal(files, out: str) -> str:
    """A map-style loader's checkpoint loaded into a stream's loader: the one-line refusal."""
    acc = make_accelerator("hyperacc", {})
    model = build_model()
    model, optimizer, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                           DataLoader([sample(i) for i in range(N_SAMPLES)], batch_size=3))
    next(iter(loader))
    checkpoint = os.path.join(out, "ckpt_map_style")
    acc.save_state(checkpoint)
    acc, model, optimizer, loader = fresh(CASES["torch_shard"], files)
    try:
        acc.load_state(checkpoint)
    except Exception as error:        # recorded, and checked by the test
        return f"{type(error).__name__}: {error}"
    return "no error"


def tensor_parallel_checks() -> dict:
    """2 ranks, tp_size=2 (one data-parallel rank): both read the same samples; an explicit
    dispatch_batches=True (which would slice batches over both) is refused."""
    import hyperacc
    from accelerate.utils import DataLoaderConfiguration

    parallel = hyperacc.ParallelConfig(dp_shard_size=1, tp_size=2)
    loader = hyperacc.Accelerator(parallel=parallel).prepare(DataLoader(Stream(), batch_size=3, collate_fn=collate))
    ids = [[int(i) for i in batch["id"]] for batch in loader]
    acc = hyperacc.Accelerator(parallel=parallel, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    try:
        acc.prepare(DataLoader(Stream(), batch_size=3, collate_fn=collate))
        refused = "no error"
    except ValueError as error:
        refused = f"{type(error).__name__}: {error}"
    return {"ids": gather(ids), "refused": refused}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume-from", default=None, help=f"another world size's checkpoint (case {CROSS_CASE})")
    parser.add_argument("--expect", default=None, help="that run's result.json")
    parser.add_argument("--cases", default=",".join(CASES))
    a = parser.parse_args()
    os.environ["ACCELERATE_USE_CPU"] = "true"       # plain accelerate: DDP over gloo (MULTI_CPU) on CPU
    if world() > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    os.makedirs(a.out, exist_ok=True)
    files = write_jsonl(a.out)
    result = {"world": world(), "compare": {}, "resume": {}}
    names = [n for n in a.cases.split(",") if n]
    plain_records = {name: plain(CASES[name], files) for name in names}
    reset_accelerate_state()
    for name in names:
        acc, model, optimizer, loader = fresh(CASES[name], files)
        result["compare"][name] = {"plain": plain_records[name], "hyperacc": train(acc, model, optimizer, loader)}
    for name in RESUME_CASES:
        if name in names:
            result["resume"][name] = resume_case(name, CASES[name], files, a.out)
    result["refusal"] = refusal(files, a.out)
    if world() == 2:
        result["tensor_parallel"] = tensor_parallel_checks()
    if a.resume_from:
        expect = json.loads(open(a.expect).read())
        saved_world = expect["world"]
        acc, model, optimizer, loader = fresh(CASES[CROSS_CASE], files, batch_scale=saved_world / world())
        acc.load_state(a.resume_from)
        epoch, batches = loader.restored_position()
        result["cross"] = {"position": [epoch, batches],
                           "record": train(acc, model, optimizer, loader, start_epoch=epoch)}
    if rank() == 0:
        with open(os.path.join(a.out, "result.json"), "w") as handle:
            json.dump(result, handle)
    barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
