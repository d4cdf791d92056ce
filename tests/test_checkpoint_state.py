"""The checkpoint's state as a dict of Stateful buckets (hyperacc.checkpoint.state), in one process.

The dict is the on-disk layout: its keys are the DCP keys and extra-state keys written, in order; each
built-in bucket and each registered object follows torch's `Stateful` protocol. A user's object joins the
same dict and is saved, verified and restored with the rest -- its count checked before anything loads.
Byte compatibility with checkpoints of the previous main is tests/test_checkpoint_v0.py's.
"""
import json
import os

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from hyperacc.checkpoint import Checkpointer, TrainState, storage
from hyperacc.checkpoint.state import DCP, FILE, PER_RANK, SHARED, storage_of
from hyperacc.config import CheckpointConfig
from hyperacc.runtime.progress import Progress


class Counter:
    """A user's object with accelerate's register_for_checkpointing protocol (no hyperacc base class)."""

    def __init__(self, n=0):
        self.n = n

    def state_dict(self):
        return {"n": torch.tensor(self.n)}

    def load_state_dict(self, state):
        self.n = int(state["n"])


def make_state(*, seed=0, objects=()):
    torch.manual_seed(seed)
    models = [nn.Linear(3, 2), nn.Linear(2, 2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in models]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in opts]
    for m, o, sch in zip(models, opts, scheds):
        m(torch.ones(1, m.in_features)).sum().backward()
        o.step(); sch.step(); o.zero_grad()
    return TrainState(models=models, optimizers=opts, schedulers=scheds, progress=Progress(global_step=1 + seed),
                      seed=5, custom_objects=list(objects))


def test_the_dict_is_the_layout_and_every_entry_is_stateful(tmp_path):
    counter = Counter(3)
    state = make_state(objects=[counter])
    states = state.states()
    assert list(states) == ["model", "model_1", "optimizer", "optimizer_1", "progress", "schedulers", "loader", "rng",
                            "custom_checkpoint_0"]
    assert all(isinstance(v, Stateful) for v in states.values())
    assert [storage_of(v) for v in states.values()] == [DCP] * 4 + [SHARED] * 3 + [PER_RANK, FILE]
    assert states["custom_checkpoint_0"] is counter          # the user's own object, not a copy
    assert "optimizer" not in state.states(optimizers=False)

    path = Checkpointer(CheckpointConfig(checkpoint_dir=str(tmp_path))).save(state)
    dcp_keys = {k.split(".")[0] for k in storage.read_dcp_metadata(path).state_dict_metadata}
    assert dcp_keys == {"model", "model_1", "optimizer", "optimizer_1"}
    extra = storage.load_weights_only(storage.extra_state_path(path, 0), "extra state")
    assert list(extra) == ["progress", "schedulers", "loader", "rng", "rank", "world_size", "dp_rank", "dp_size"]
    assert extra["progress"] == state.progress.state_dict()
    with open(os.path.join(path, "hyperacc_manifest.json")) as f:
        assert "custom_checkpoint_0.pkl" in json.load(f)["files"]      # under the integrity manifest


@pytest.mark.parametrize("restore_train_state", [True, False])
def test_a_registered_object_round_trips_with_the_buckets(tmp_path, restore_train_state):
    saved = make_state(objects=[Counter(7)])
    path = Checkpointer(CheckpointConfig(checkpoint_dir=str(tmp_path))).save(saved)

    fresh = make_state(seed=1, objects=[Counter(0)])
    loader = Checkpointer(CheckpointConfig(checkpoint_dir=str(tmp_path), save_ckpt=False,
                                           restore_train_state=restore_train_state))
    assert loader.load(fresh, path) == path
    assert fresh.custom_objects[0].n == 7                   # restored with or without the train state
    for a, b in zip(fresh.models, saved.models):
        torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)
    assert fresh.progress.global_step == (1 if restore_train_state else 2)
    if restore_train_state:
        assert fresh.schedulers[1].state_dict() == saved.schedulers[1].state_dict()


def test_another_count_of_registered_objects_is_refused_before_anything_loads(tmp_path):
    path = Checkpointer(CheckpointConfig(checkpoint_dir=str(tmp_path))).save(make_state(objects=[Counter(7)]))
    fresh = make_state(seed=1)                      # nothing registered
    before = [m.weight.detach().clone() for m in fresh.models]
    loader = Checkpointer(CheckpointConfig(checkpoint_dir=str(tmp_path), save_ckpt=False))
    with pytest.raises(RuntimeError, match=r"holds 1 custom checkpoint\(s\) but 0 object\(s\) are registered "
                                           r"with register_for_checkpointing"):
        loader.load(fresh, path)
    for m, w in zip(fresh.models, before):          # refused in the load plan: the model is untouched
        assert torch.equal(m.weight, w)
    assert fresh.progress.global_step == 2
