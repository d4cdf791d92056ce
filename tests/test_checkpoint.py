"""Checkpointer in one process (no process group): cadence, bucket round trips, fail-closed cases.

Real DCP files in tmp dirs; plain (unsharded) modules, which DCP and the state-dict helpers accept
as well. The multi-process, FSDP2-sharded cases are in test_checkpoint_dist.py.
"""
import os
import random
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from hyperacc.checkpoint.lifecycle import CheckpointDirInUse
from hyperacc.checkpoint import Checkpointer, TrainState
from hyperacc.checkpoint import discovery, storage
from hyperacc.checkpoint.integrity import IntegrityError
from hyperacc.config import CheckpointConfig
from hyperacc.data import MicroBatchDataLoader
from hyperacc.runtime.progress import Progress


class Data:
    def __init__(self, n=6):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.full((4,), float(i)), "y": torch.tensor(float(i % 3))}


def make_state(seed=0, *, n=6, gbs=2, frozen=False, loader=True):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    if frozen:
        model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    dl = MicroBatchDataLoader(Data(n), global_batch_size=gbs, micro_batch_size=gbs, shuffle=True,
                              seed=3).bind(0, 1) if loader else None
    return TrainState(models=[model], optimizers=[opt], schedulers=[sched], loader=dl,
                      progress=Progress(), dp_rank=0, dp_size=1, seed=11)


def train(state, ckpt, steps, *, saves=None):
    """``steps`` optimizer steps; returns the per-step losses. Iterates epochs like a user loop."""
    losses, done = [], 0
    model, opt, sched = state.models[0], state.optimizers[0], state.schedulers[0]
    while done < steps:
        for batch in state.loader:
            mb = batch[0]
            loss = ((model(mb["x"]).squeeze(-1) - mb["y"]) ** 2).mean() + 0.01 * torch.rand(()).item()
            loss.backward()
            opt.step(); sched.step(); opt.zero_grad()
            state.progress.global_step += 1
            state.progress.consumed_samples += len(mb["x"])
            state.progress.epoch = state.loader.epoch
            losses.append(float(loss))
            saved = ckpt.on_step_end(state)
            if saves is not None and saved:
                saves.append(state.progress.global_step)
            done += 1
            if done == steps:
                break
    return losses


def step_dirs(root):
    return sorted(s for s, _ in discovery.scan(root))


def cfg(tmp_path, **kw):
    return CheckpointConfig(checkpoint_dir=str(tmp_path / "ckpt"), **kw)


# ----------------------------------------------------------------------------- B: cadence
def test_cadence_steps_epochs_end_and_no_duplicate(tmp_path):
    config = cfg(tmp_path, save_steps=2, save_epochs=1)    # 3 steps per epoch
    state, saves = make_state(), []
    ckpt = Checkpointer(config, device_type="cpu")
    train(state, ckpt, 7, saves=saves)
    assert saves == [2, 3, 4, 6]                           # step 6: steps and epoch -> one save
    ckpt.finish(state)                                     # end of training: step 7
    assert step_dirs(config.checkpoint_dir) == [2, 3, 4, 6, 7]
    assert discovery.read_pointer(config.checkpoint_dir) == 7
    ckpt.finish(state)                                     # that step was just saved: nothing new
    # A resume that trains no further step does not save the restored step again (and no warning).
    again = make_state(seed=5)
    ckpt2 = Checkpointer(CheckpointConfig(checkpoint_dir=config.checkpoint_dir, restore_from="LATEST"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt2.load(again).endswith("global_step_7")
        ckpt2.finish(again)
    assert step_dirs(config.checkpoint_dir) == [2, 3, 4, 6, 7]
    # save_epochs=2 only: epoch 2 ends at step 6; the final save at step 6 is then skipped.
    config3 = CheckpointConfig(checkpoint_dir=str(tmp_path / "c3"), save_steps=0, save_epochs=2)
    state3, saves3 = make_state(), []
    ckpt3 = Checkpointer(config3)
    train(state3, ckpt3, 6, saves=saves3)
    ckpt3.finish(state3)
    assert saves3 == [6] and step_dirs(config3.checkpoint_dir) == [6]


def test_four_save_restore_combinations(tmp_path):
    root = tmp_path / "ckpt"
    # both off: no work at all, nothing created
    off = Checkpointer(CheckpointConfig(checkpoint_dir=str(root), save_ckpt=False, save_steps=1))
    state = make_state()
    assert off.load(state) is None
    train(state, off, 3)
    off.finish(state)
    assert not root.exists()
    # save only
    saver = Checkpointer(CheckpointConfig(checkpoint_dir=str(root), save_steps=2))
    state = make_state()
    train(state, saver, 3)
    saver.finish(state)
    assert step_dirs(root) == [2, 3]
    # restore only: resumes, never writes
    reader = Checkpointer(CheckpointConfig(checkpoint_dir=str(root), save_ckpt=False, save_steps=1,
                                           restore_from="LATEST"))
    state = make_state()
    assert reader.load(state).endswith("global_step_3") and state.progress.global_step == 3
    train(state, reader, 2)
    reader.finish(state)
    assert step_dirs(root) == [2, 3]
    # both: resumes and keeps saving
    both = Checkpointer(CheckpointConfig(checkpoint_dir=str(root), save_steps=2, restore_from="LATEST"))
    state = make_state()
    both.load(state)
    train(state, both, 2)
    both.finish(state)
    assert step_dirs(root) == [2, 3, 4, 5]


# ----------------------------------------------------------------------------- C: buckets
def _moments(opt):
    return [(s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in opt.state.values()]


@pytest.mark.parametrize("per_rank", [True, False])
def test_every_bucket_round_trips(tmp_path, per_rank):
    config = cfg(tmp_path, save_extra_state_per_rank=per_rank, is_async=per_rank)
    state = make_state()
    ckpt = Checkpointer(config)
    train(state, ckpt, 4)                                   # epoch 1, step 1 of 3
    random.seed(1234); np.random.seed(99)
    path = ckpt.save(state)
    ckpt.wait()
    weights = {k: v.clone() for k, v in state.models[0].state_dict().items()}
    moments = _moments(state.optimizers[0])
    lr = state.optimizers[0].param_groups[0]["lr"]
    reference = train(state, ckpt, 3)                       # the uninterrupted continuation
    ckpt.wait()     # its async save of step 6 lands before the resumed run sets newer steps aside (else a race)
    draws = (torch.rand(3), random.random(), np.random.rand())

    fresh = make_state(seed=77)
    resumer = Checkpointer(config)      # the resumed run: it loads, then trains and saves on
    assert resumer.load(fresh, path) == path
    for k, v in fresh.models[0].state_dict().items():
        torch.testing.assert_close(v, weights[k], rtol=0, atol=0)
    for (a, b), (c, d) in zip(_moments(fresh.optimizers[0]), moments):
        assert c.abs().sum() > 0 and d.abs().sum() > 0
        torch.testing.assert_close(a, c, rtol=0, atol=0)
        torch.testing.assert_close(b, d, rtol=0, atol=0)
    assert fresh.optimizers[0].param_groups[0]["lr"] == lr != 0.1           # not re-warmed
    assert fresh.progress.state_dict() == {"global_step": 4, "epoch": 1, "consumed_samples": 8,
                                           "consumed_tokens": 0}
    assert (fresh.loader.epoch, fresh.loader.step_in_epoch) == (1, 1)
    resumed = train(fresh, resumer, 3)
    if per_rank:    # RNG continues: the same losses (they include a torch.rand term) and draws
        assert resumed == reference
        assert torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1]
        assert np.random.rand() == draws[2]
    else:           # embedded layout: RNG is re-derived from (seed, step, rank), documented
        np.testing.assert_allclose(resumed, reference, rtol=0, atol=0.011)
    assert fresh.schedulers[0].last_epoch == 7


def test_restore_optimizer_false_keeps_schedule(tmp_path):
    config = cfg(tmp_path)
    state = make_state()
    ckpt = Checkpointer(config)
    train(state, ckpt, 3)
    path = ckpt.save(state) or discovery.step_dir(config.checkpoint_dir, 3)
    lr = state.optimizers[0].param_groups[0]["lr"]
    fresh = make_state()
    Checkpointer(cfg(tmp_path, restore_optimizer=False)).load(fresh, path)
    assert fresh.optimizers[0].state == {} or all(
        float(s["exp_avg"].abs().sum()) == 0 for s in fresh.optimizers[0].state.values())
    assert fresh.optimizers[0].param_groups[0]["lr"] == lr


def test_retention_keeps_newest_and_pointer(tmp_path):
    config = cfg(tmp_path, save_steps=1, keep_last_n=2)
    state = make_state()
    ckpt = Checkpointer(config)
    train(state, ckpt, 5)
    assert step_dirs(config.checkpoint_dir) == [4, 5]
    os.makedirs(discovery.step_dir(config.checkpoint_dir, 1))   # incomplete dirs are never deleted
    train(state, ckpt, 1)
    assert step_dirs(config.checkpoint_dir) == [5, 6]
    assert os.path.isdir(discovery.step_dir(config.checkpoint_dir, 1))


def test_existing_complete_dir_is_never_overwritten(tmp_path):
    config = cfg(tmp_path)
    state = make_state()
    ckpt = Checkpointer(config)
    train(state, ckpt, 2)
    path = ckpt.save(state)
    before = {f: os.path.getmtime(os.path.join(path, f)) for f in os.listdir(path)}
    assert ckpt.save(state) is None                         # the same step again: nothing to do
    other = make_state(seed=3)                              # another run, same directory: refused
    other.progress.global_step = 2
    with pytest.raises(CheckpointDirInUse, match="holds checkpoints of another run.*CheckpointConfig.restore_from='LATEST'"):
        Checkpointer(config).save(other)
    assert before == {f: os.path.getmtime(os.path.join(path, f)) for f in os.listdir(path)}


# ----------------------------------------------------------------------------- A: fail closed
def _saved(tmp_path, **kw):
    config = cfg(tmp_path, **kw)
    state = make_state()
    ckpt = Checkpointer(config)
    train(state, ckpt, 2)
    return config, ckpt.save(state)


def test_a1_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Checkpointer(cfg(tmp_path)).load(make_state(), str(tmp_path / "nope"))


def test_a2_latest_without_checkpoint_starts_fresh(tmp_path):
    state = make_state()
    with pytest.warns(UserWarning, match="starting from scratch"):
        assert Checkpointer(cfg(tmp_path, restore_from="LATEST")).load(state) is None
    assert state.progress.global_step == 0


def test_a3_pointer_to_incomplete_dir_uses_newest_complete(tmp_path):
    config, path = _saved(tmp_path)
    os.makedirs(discovery.step_dir(config.checkpoint_dir, 9))
    open(os.path.join(discovery.step_dir(config.checkpoint_dir, 9), "__0_0.distcp"), "w").close()
    discovery.write_pointer(config.checkpoint_dir, 9)
    # an explicit path to an incomplete directory is an error
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        Checkpointer(config).load(make_state(), discovery.step_dir(config.checkpoint_dir, 9))
    state = make_state()
    with pytest.warns(UserWarning, match="incomplete"):
        assert Checkpointer(config).load(state, "LATEST") == path
    assert state.progress.global_step == 2
    assert discovery.read_pointer(config.checkpoint_dir) == 2      # the resumed run (it saves) moved LATEST


def test_a4_weights_only_checkpoint(tmp_path):
    config, path = _saved(tmp_path, save_train_state=False, save_optimizer=False)
    with pytest.raises(FileNotFoundError, match="no training state"):
        Checkpointer(cfg(tmp_path, restore_optimizer=False)).load(make_state(), path)
    with pytest.raises(FileNotFoundError, match="no optimizer state"):
        Checkpointer(cfg(tmp_path, restore_train_state=False)).load(make_state(), path)
    state = make_state(seed=4)
    Checkpointer(cfg(tmp_path, restore_train_state=False, restore_optimizer=False)).load(state, path)
    assert state.progress.global_step == 0


def test_a5_missing_extra_state(tmp_path):
    config, path = _saved(tmp_path)
    os.remove(storage.extra_state_path(path, 0))
    with pytest.raises(IntegrityError, match="extra_state_rank_0.pt: missing"):   # the manifest lists it
        Checkpointer(config).load(make_state(), path)
    with pytest.raises(FileNotFoundError, match="extra_state"):   # without integrity: the plan's own check
        Checkpointer(config, integrity=False).load(make_state(), path)
    # embedded layout recorded, but the payload item is absent
    config, path = _saved(tmp_path / "b", save_train_state=False)
    info = storage.read_sentinel(path)
    info["train_state"] = "embedded"
    storage.write_sentinel(path, info)
    with pytest.raises(FileNotFoundError, match="extra_state"):
        Checkpointer(config, integrity=False).load(make_state(), path)


def test_a6_missing_model_key(tmp_path):
    config, path = _saved(tmp_path)
    state = make_state()
    state.models[0].append(nn.Linear(1, 1))
    with pytest.raises(RuntimeError, match="missing model key"):
        Checkpointer(config).load(state, path)


def test_a7_peft_restores_without_base_keys(tmp_path):
    config = cfg(tmp_path, is_peft=True)
    state = make_state(frozen=True)
    base_before = state.models[0][0].weight.clone()
    ckpt = Checkpointer(config)
    train(state, ckpt, 2)
    path = ckpt.save(state)
    saved_keys = storage.read_dcp_metadata(path).state_dict_metadata
    assert not any(k.startswith("model.0.") for k in saved_keys)       # the frozen base is not saved
    trained = state.models[0][2].weight.clone()
    fresh = make_state(frozen=True)          # the same base (same seed), untrained head
    assert not torch.equal(fresh.models[0][2].weight, trained)
    Checkpointer(config).load(fresh, path)
    torch.testing.assert_close(fresh.models[0][2].weight, trained, rtol=0, atol=0)
    torch.testing.assert_close(fresh.models[0][0].weight, base_before, rtol=0, atol=0)


def test_a7_peft_refuses_another_frozen_base(tmp_path):
    """An adapters-only checkpoint resumed onto another base would train on silently: refused, naming
    the first frozen parameter that differs; nothing is loaded."""
    config = cfg(tmp_path, is_peft=True)
    state = make_state(frozen=True)
    ckpt = Checkpointer(config)
    train(state, ckpt, 2)
    path = ckpt.save(state)
    other = make_state(seed=9, frozen=True)
    head = other.models[0][2].weight.clone()
    with pytest.raises(RuntimeError, match=r"another base model: frozen parameter 0\.(weight|bias) differs"):
        Checkpointer(config).load(other, path)
    assert torch.equal(other.models[0][2].weight, head)


def test_a9_count_mismatch_warns_and_pairs_shorter(tmp_path):
    config, path = _saved(tmp_path)
    state = make_state()
    extra_opt = torch.optim.SGD(state.models[0].parameters(), lr=0.5)
    state.optimizers.append(extra_opt)
    state.schedulers.append(torch.optim.lr_scheduler.StepLR(extra_opt, 1))
    with pytest.warns(UserWarning) as record:
        Checkpointer(config).load(state, path)
    text = " ".join(str(w.message) for w in record)
    assert "1 optimizer(s) but training has 2" in text and "1 lr_scheduler(s) but training has 2" in text
    assert state.schedulers[0].last_epoch == 2 and state.schedulers[1].last_epoch == 0


def test_a10_loader_batch_size_changed(tmp_path):
    config, path = _saved(tmp_path)
    with pytest.raises(ValueError, match="global_batch_size"):
        Checkpointer(config).load(make_state(gbs=3), path)


def test_pickle_payload_is_not_executed(tmp_path):
    config, path = _saved(tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"progress": Evil()}, storage.extra_state_path(path, 0))
    with pytest.raises(IntegrityError, match="extra_state_rank_0.pt"):   # caught before it is parsed
        Checkpointer(config).load(make_state(), path)
    with pytest.raises(storage.UnsafeCheckpointError, match="Refusing"):   # and without the manifest check
        Checkpointer(config, integrity=False).load(make_state(), path)
    assert not marker.exists()
    # the same for DCP's own .metadata
    with open(os.path.join(path, ".metadata"), "wb") as handle:
        import pickle
        pickle.dump(Evil(), handle)
    with pytest.raises(IntegrityError, match=".metadata is unreadable"):
        Checkpointer(config).load(make_state(), path)
    with pytest.raises(storage.UnsafeCheckpointError):
        Checkpointer(config, integrity=False).load(make_state(), path)
    assert not marker.exists()


def test_no_unsafe_load_in_package():
    root = os.path.join(os.path.dirname(__file__), "..", "hyperacc")
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name)) as handle:
                    assert "weights_only=False" not in handle.read(), name


# ----------------------------------------------------------------------------- async
def test_async_staged_copy_and_background_error(tmp_path, monkeypatch):
    config = cfg(tmp_path, is_async=True)
    state = make_state()
    ckpt = Checkpointer(config)
    train(state, ckpt, 2)
    expected = {k: v.clone() for k, v in state.models[0].state_dict().items()}
    path = ckpt.save(state)
    with torch.no_grad():                                   # the loop mutates right after the call
        for p in state.models[0].parameters():
            p.add_(1.0)
    ckpt.wait()
    assert discovery.read_pointer(config.checkpoint_dir) == 2
    fresh = make_state(seed=8)
    Checkpointer(config).load(fresh, path)
    for k, v in fresh.models[0].state_dict().items():
        assert torch.equal(v, expected[k]), k

    import concurrent.futures
    failed = concurrent.futures.Future()
    failed.set_exception(OSError("disk full"))
    monkeypatch.setattr(storage, "dcp_async_save", lambda *a, **k: failed)
    state.progress.global_step = 3
    assert ckpt.save(state).endswith("global_step_3")        # returns: the error surfaces later
    ckpt._pending.exception(timeout=30)                      # the background step has finished
    with pytest.raises(OSError, match="disk full"):
        ckpt.on_step_end(state)                              # re-raised on the next call
    assert discovery.read_pointer(config.checkpoint_dir) == 2
    ckpt.wait()                                              # raised once, then cleared
    state.progress.global_step = 4
    ckpt.save(state)
    state.progress.global_step = 5
    with pytest.raises(OSError, match="disk full"):
        ckpt.save(state)                                     # a new save first waits for the last


def test_hf_export_sharded_with_index(tmp_path):
    import json as _json
    from transformers import AutoModelForCausalLM
    from hyperacc.checkpoint.export import export_hf
    from hyperacc.models import build_causal_lm, qwen3_moe_config
    model = build_causal_lm(qwen3_moe_config(), seed=0)
    out = export_hf(model, str(tmp_path / "hf"), max_shard_bytes=200_000)
    files = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in files and "config.json" in files
    index = _json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    loaded = AutoModelForCausalLM.from_pretrained(out)
    expected = dict(model.named_parameters())
    for name, tensor in loaded.named_parameters():
        assert torch.equal(tensor, expected[name]), name
