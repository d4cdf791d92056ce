"""The model-kind seam (`hyperacc.kinds`) and the replaceable `parallelize` pipeline, from outside the package.

A toy kind defined and registered in THIS file (nothing under hyperacc/ knows it) serves a wrapper that
freezes half its blocks: prepare keeps the frozen half in its own dtype and lets the kind write values
after sharding, a checkpoint holds exactly the names the kind says (trainable + `always_saved`, the
frozen base fingerprinted under the kind's `base_names`), `load_state` restores them, and
`save_model` writes the kind's own export. Run on 1 process (in this process) and on 2 (this file as a
torchrun script, one launch). Also: `check_model` runs once per prepare, and `parallelize_fn` replaces
the default pipeline.
"""
from __future__ import annotations

import collections
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

import hyperacc
from hyperacc import kinds
from hyperacc.sharding import reshard

WIDTH, BLOCKS, SEED = 8, 4, 3
EXPORT_FILE = "toy_adapter.safetensors"
ALWAYS_SAVED = "blocks.1.lin.bias"       # frozen, yet in every checkpoint (the kind says so)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.lin(x.to(self.lin.weight.dtype))).float()


class HalfFrozen(nn.Module):
    """A wrapper that freezes its first half of blocks and stores them in bf16."""

    _no_split_modules = ["Block"]

    def __init__(self, width: int = WIDTH, blocks: int = BLOCKS):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 1)
        for block in self.blocks[: blocks // 2]:
            block.requires_grad_(False)
            block.to(torch.bfloat16)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x).squeeze(-1), y)


def _head_init(seed: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, WIDTH).reshape(1, WIDTH) * (seed + 1) / 10


def _full(tensor) -> torch.Tensor:
    """Collective for a DTensor: every rank, same order."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


class ToyKind(kinds.ModelKind):
    """What a `HalfFrozen` answers; it counts the calls so that the tests see the seam was used."""

    name = "toy"

    def __init__(self):
        self.calls = collections.Counter()

    def matches(self, model):
        return isinstance(model, HalfFrozen)

    def check_layout(self, model, parallel):
        self.calls["check_layout"] += 1
        if parallel.tp_size > 1:
            raise NotImplementedError("HalfFrozen with tp_size > 1 is not supported. Fix: tp_size=1.")

    def keeps_dtype(self, model):
        self.calls["keeps_dtype"] += 1
        return {n for n, p in model.named_parameters() if not p.requires_grad}

    def before_sharding(self, model, *, device, seed):
        self.calls["before_sharding"] += 1
        assert not isinstance(model.head.weight, DTensor)       # full shapes still
        return {"head.weight": _head_init(seed)}

    def after_sharding(self, model, before, *, initialised):
        self.calls["after_sharding"] += 1
        assert isinstance(model.head.weight, DTensor)
        with torch.no_grad():
            for name, full in before.items():
                param = model.get_parameter(name)
                local = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())

    def saves_trainable_only(self, model):
        return True

    def always_saved(self, model):
        self.calls["always_saved"] += 1
        return {ALWAYS_SAVED}

    def base_names(self, model):
        self.calls["base_names"] += 1
        return {n: None if p.requires_grad else f"base.{n}" for n, p in model.named_parameters()}

    def export(self, model, out_dir, *, group=None, into_existing=False, tokenizer=None, max_shard_bytes=None):
        from safetensors.torch import save_file

        self.calls["export"] += 1
        reshard(model)
        tensors = {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}
        if not dist.is_initialized() or dist.get_rank(group) == 0:
            os.makedirs(out_dir, exist_ok=True)
            save_file(tensors, os.path.join(out_dir, EXPORT_FILE), metadata={"kind": self.name})
        if dist.is_initialized():
            dist.barrier(group)
        return out_dir


def _step(acc, model, optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(4, WIDTH, generator=generator), torch.randn(4, generator=generator)
    loss = model(x.to(acc.device), y.to(acc.device))
    acc.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def toy_run(out: str) -> dict:
    """prepare -> 2 steps -> save_state -> 1 step -> load_state -> save_model, with the toy kind registered;
    returns what a test checks (rank 0's view; values are gathered)."""
    kind = kinds.register(ToyKind())
    try:
        torch.manual_seed(0)        # the same model on every rank
        model = HalfFrozen()
        acc = hyperacc.Accelerator(seed=SEED, checkpoint=hyperacc.CheckpointConfig(
            checkpoint_dir=os.path.join(out, "ckpt")))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model, optimizer = acc.prepare(model, optimizer)
        seen = {"kind": kinds.for_model(model).name, "world": acc.num_processes,
                "dtypes": {n: str(p.dtype) for n, p in model.named_parameters()},
                "head_after_prepare": _full(model.head.weight).tolist(),
                "expected_head": _head_init(SEED).tolist()}
        for step in range(2):
            _step(acc, model, optimizer, step)
        path = acc.save_state()
        saved = {n: _full(p) for n, p in model.named_parameters()}
        _step(acc, model, optimizer, 2)
        moved = {n: _full(p) for n, p in model.named_parameters()}
        acc.load_state(path)
        loaded = {n: _full(p) for n, p in model.named_parameters()}
        export_dir = os.path.join(out, "export")
        acc.save_model(model, export_dir)
        seen["calls"] = dict(kind.calls)
        if acc.is_main_process:
            import torch.distributed.checkpoint as dcp
            from safetensors import safe_open

            from hyperacc.checkpoint import storage

            meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
            seen["checkpoint_model_keys"] = sorted(k[len("model."):] for k in meta if k.startswith("model."))
            seen["frozen_base_keys"] = sorted((storage.read_sentinel(path) or {}).get("frozen_base")[0])
            with safe_open(os.path.join(export_dir, EXPORT_FILE), framework="pt") as handle:
                seen["export_metadata"] = handle.metadata()
                seen["export_equal_loaded"] = sorted(k for k in handle.keys()
                                                     if torch.equal(handle.get_tensor(k), loaded[k]))
                seen["export_keys"] = sorted(handle.keys())
            seen["export_files"] = sorted(os.listdir(export_dir))
        trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        seen["trainable"] = trainable
        seen["frozen"] = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
        seen["moved_by_step"] = sorted(n for n in trainable if not torch.equal(saved[n], moved[n]))
        seen["restored"] = sorted(n for n in saved if torch.equal(saved[n], loaded[n]))
        acc.end_training()
        return seen
    finally:
        kinds.unregister(kind)


def _check(seen: dict, world: int) -> None:
    assert seen["kind"] == "toy" and seen["world"] == world
    frozen, trainable = seen["frozen"], seen["trainable"]
    assert frozen == [f"blocks.{i}.lin.{w}" for i in range(BLOCKS // 2) for w in ("bias", "weight")]
    # keeps_dtype: the frozen half stays bf16 where the fp32_master recipe stores the rest in fp32
    assert {seen["dtypes"][n] for n in frozen} == {"torch.bfloat16"}
    assert {seen["dtypes"][n] for n in trainable} == {"torch.float32"}
    # before_sharding / after_sharding: the kind's full-size value, written into the shards
    assert seen["head_after_prepare"] == seen["expected_head"]
    # the checkpoint holds exactly the trainable tensors and what the kind always saves
    assert seen["checkpoint_model_keys"] == sorted(trainable + [ALWAYS_SAVED])
    # the frozen base is fingerprinted under the kind's base names
    assert seen["frozen_base_keys"] == sorted(f"base.{n}" for n in frozen)
    # load_state brought back what save_state saved, after a step had moved it
    assert seen["moved_by_step"] == trainable
    assert seen["restored"] == sorted(trainable + frozen)
    # save_model wrote the kind's export (and nothing of hyperacc's own Hugging Face export)
    assert seen["export_files"] == [EXPORT_FILE]
    assert seen["export_metadata"] == {"kind": "toy"}
    assert seen["export_keys"] == seen["export_equal_loaded"] == trainable
    calls = seen["calls"]
    assert calls["check_layout"] == 1 and calls["before_sharding"] == 1 and calls["after_sharding"] == 1
    assert calls["export"] == 1 and calls["always_saved"] >= 2 and calls["base_names"] >= 2


def test_toy_kind_one_process(tmp_path):
    _check(toy_run(str(tmp_path)), world=1)


def test_toy_kind_two_processes(tmp_path):
    from dist_utils import run_torchrun

    run_torchrun(__file__, 2, [tmp_path])
    _check(json.loads((tmp_path / "seen.json").read_text()), world=2)


def test_toy_kind_refuses_its_layout_before_any_collective():
    from hyperacc.config import ParallelConfig
    from hyperacc.runtime.mesh import MeshInfo
    from hyperacc.sharding.parallelize import check_model

    kind = kinds.register(ToyKind())
    try:
        mesh = MeshInfo(mesh=None, parallel=ParallelConfig(dp_shard_size=1, tp_size=2))
        with pytest.raises(NotImplementedError, match="tp_size > 1"):
            check_model(HalfFrozen(), mesh, hyperacc.FSDPConfig(), "cpu")
        assert kinds.for_model(nn.Linear(2, 2)) is kinds.PLAIN
    finally:
        kinds.unregister(kind)


@pytest.mark.filterwarnings("ignore:No module of class")
def test_check_model_runs_once_per_prepare(monkeypatch):
    """Once per prepare, whatever path the model takes (it ran three times before)."""
    from hyperacc import parallel
    from hyperacc.sharding import compile as compilation

    counts = collections.Counter()

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(parallel, "check_model", counting("parallel", parallel.check_model))
    monkeypatch.setattr(compilation, "check_model", counting("compile", compilation.check_model))
    kind = kinds.register(ToyKind())
    try:
        acc = hyperacc.Accelerator(seed=SEED)
        plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        toy = HalfFrozen()
        acc.prepare(plain, toy)
        assert counts == {"parallel": 2, "compile": 2}     # two models, one check each
        assert kind.calls["check_layout"] == 1
        acc.free_memory()
    finally:
        kinds.unregister(kind)


def test_parallelize_fn_replaces_the_pipeline():
    """A user's own pipeline: one FSDP unit for the whole model (no per-block units), and it trains."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from hyperacc.runtime.mesh import MeshInfo

    calls = []

    def whole_model_only(model, mesh, config):
        calls.append((type(mesh), type(config)))
        fully_shard(model, mesh=mesh.fsdp_mesh)

    acc = hyperacc.Accelerator(seed=SEED, parallelize_fn=whole_model_only)
    torch.manual_seed(0)
    model = HalfFrozen()
    for block in model.blocks:
        block.requires_grad_(True).float()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    assert calls == [(MeshInfo, hyperacc.FSDPConfig)]
    assert isinstance(model, FSDPModule) and not any(isinstance(b, FSDPModule) for b in model.blocks)
    before = _full(model.head.weight)
    _step(acc, model, optimizer, 0)
    assert not torch.equal(before, _full(model.head.weight))
    acc.free_memory()


def test_parallelize_fn_that_is_not_a_function_is_one_error():
    with pytest.raises(TypeError, match=r"parallelize_fn='fsdp'\): not a function. Fix: pass a function"):
        hyperacc.Accelerator(parallelize_fn="fsdp")


if __name__ == "__main__":        # the 2-process run: torchrun tests/test_model_kinds.py OUT_DIR
    result = toy_run(sys.argv[1])
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(sys.argv[1], "seen.json"), "w") as handle:
            json.dump(result, handle)
