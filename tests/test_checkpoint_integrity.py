"""Fail closed: containment, integrity, single writer, exact optimizer resume (issue 10).

Each test plants the fault the way a user or a failing disk would, on real DCP files. One process
here (plain modules); the 2-process FSDP2 versions (error on every rank, no hang) are in
tests/scripts/ckpt_integrity.py, launched by test_integrity_on_two_processes.
"""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from dist_utils import REPO, _env, run_torchrun
from hyperacc.checkpoint import Checkpointer, TrainState, discovery, integrity, storage
from hyperacc.checkpoint.lock import CheckpointDirLocked
from hyperacc.config import CheckpointConfig
from hyperacc.runtime.progress import Progress


class Net(nn.Module):
    """``late`` joins the forward only from step 6 on: until then it has no optimizer state."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.late = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x, step):
        h = torch.tanh(self.first(x))
        if step >= 6:
            h = h + torch.tanh(self.late(h))
        return self.head(h)


def make_state(seed=0, groups=1):
    torch.manual_seed(seed)
    model = Net()
    params = list(model.parameters())
    if groups == 2:
        params = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.5}]
    opt = torch.optim.AdamW(params, lr=0.05)
    return TrainState(models=[model], optimizers=[opt], schedulers=[], loader=None, progress=Progress(),
                      dp_rank=0, dp_size=1, seed=1)


def train(state, steps):
    model, opt = state.models[0], state.optimizers[0]
    for _ in range(steps):
        step = state.progress.global_step + 1
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)
        ((model(x, step) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        state.progress.global_step = step


def saved_run(root, steps=(2, 4), **kw):
    config = CheckpointConfig(checkpoint_dir=str(root), **kw)
    state, ckpt = make_state(), Checkpointer(CheckpointConfig(checkpoint_dir=str(root), **kw))
    if config.restore_from:
        ckpt.load(state)
    for target in steps:
        train(state, target - state.progress.global_step)
        ckpt.save(state)
    ckpt.finish(state)
    return config, state


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def flip_bytes(file, offset=None, n=64):
    size = os.path.getsize(file)
    offset = size // 2 if offset is None else offset
    with open(file, "r+b") as handle:
        handle.seek(offset)
        data = handle.read(n)
        handle.seek(offset)
        handle.write(bytes(b ^ 0xFF for b in data))


# ----------------------------------------------------------------------------- containment
def test_retention_never_deletes_through_a_symlinked_step_dir(tmp_path):
    outside = tmp_path / "other_run"
    saved_run(outside, steps=(1,))                       # someone else's complete checkpoint
    before = sorted(os.listdir(outside / "global_step_1"))
    root = tmp_path / "ckpt"
    os.makedirs(root)
    os.symlink(outside / "global_step_1", root / "global_step_1")
    with pytest.warns(UserWarning, match="global_step_1 is a symlink.*left alone"):    # a run resumed from it
        saved_run(root, steps=(2, 3, 4), keep_last_n=1, restore_from="LATEST")
    assert sorted(os.listdir(outside / "global_step_1")) == before      # .metadata and all kept
    assert os.path.islink(root / "global_step_1")
    assert [s for s, _ in discovery.scan(str(root))] == [1, 4]          # own old steps were pruned


def test_save_never_writes_into_a_symlinked_step_dir(tmp_path):
    target = tmp_path / "elsewhere"
    os.makedirs(target)
    root = tmp_path / "ckpt"
    os.makedirs(root)
    os.symlink(target, root / "global_step_2")           # empty, so "incomplete": still foreign
    state = make_state()
    train(state, 2)
    with pytest.warns(UserWarning, match="is a symlink"):
        assert Checkpointer(CheckpointConfig(checkpoint_dir=str(root))).save(state) is None
    assert os.listdir(target) == []


def test_config_yaml_atomic_only_after_an_accepted_resume(tmp_path):
    root = tmp_path / "ckpt"
    state = make_state()
    train(state, 2)
    ckpt = Checkpointer(CheckpointConfig(checkpoint_dir=str(root)), run_config="run: first\n")
    ckpt.save(state)
    ckpt.finish(state)
    assert (root / "config.yaml").read_text() == "run: first\n"
    assert (root / "global_step_2" / "config.yaml").read_text() == "run: first\n"   # verified like the rest
    assert "config.yaml" in json.load(open(root / "global_step_2" / integrity.MANIFEST_FILE))["files"]
    # a rejected resume (another model) leaves the config that produced the checkpoints in place
    bad = make_state()
    bad.models[0].extra = nn.Linear(2, 2)
    rejected = Checkpointer(CheckpointConfig(checkpoint_dir=str(root), restore_from="LATEST"),
                            run_config="run: rejected\n")
    with pytest.raises(RuntimeError, match="missing model key"):
        rejected.load(bad)
    rejected.finish(bad)
    assert (root / "config.yaml").read_text() == "run: first\n"
    # a symlinked config.yaml is replaced, never written through
    victim = tmp_path / "victim.yaml"
    victim.write_text("keep me\n")
    os.remove(root / "config.yaml")
    os.symlink(victim, root / "config.yaml")
    accepted = Checkpointer(CheckpointConfig(checkpoint_dir=str(root), restore_from="LATEST"),
                            run_config="run: second\n")
    accepted.load(make_state())
    accepted.finish(make_state())
    assert victim.read_text() == "keep me\n"
    assert not os.path.islink(root / "config.yaml") and (root / "config.yaml").read_text() == "run: second\n"


# ----------------------------------------------------------------------------- integrity
def test_flipped_bytes_are_named_and_latest_falls_back(tmp_path):
    root = tmp_path / "ckpt"
    config, _ = saved_run(root, steps=(2, 4))
    reader = CheckpointConfig(checkpoint_dir=str(root), save_ckpt=False)    # reads only: sets nothing aside
    probe = make_state()
    Checkpointer(reader).load(probe, str(root / "global_step_2"))
    at_2 = weights(probe.models[0])
    shard = root / "global_step_4" / "__0_0.distcp"
    flip_bytes(shard)
    with pytest.raises(integrity.IntegrityError) as err:
        Checkpointer(reader).load(make_state(), str(root / "global_step_4"))
    message = str(err.value)
    assert "\n" not in message and str(root / "global_step_4") in message
    assert "__0_0.distcp" in message and "contents changed" in message
    fresh = make_state()
    with pytest.warns(UserWarning, match="falling back to .*global_step_2"):
        loaded = Checkpointer(CheckpointConfig(checkpoint_dir=str(root), restore_from="LATEST")).load(fresh)
    assert loaded.endswith("global_step_2") and fresh.progress.global_step == 2
    assert all(torch.equal(a, at_2[k]) for k, a in weights(fresh.models[0]).items())


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_truncated_or_empty_shard_in_latest(tmp_path, damage):
    root = tmp_path / "ckpt"
    config, _ = saved_run(root, steps=(2, 4))
    shard = root / "global_step_4" / "__0_0.distcp"
    size = os.path.getsize(shard)
    with open(shard, "r+b") as handle:
        handle.truncate(0 if damage == "empty" else size // 3)
    with pytest.raises(integrity.IntegrityError, match=rf"global_step_4 is damaged: file __0_0.distcp: {damage}"):
        Checkpointer(config).load(make_state(), str(root / "global_step_4"))
    reader = CheckpointConfig(checkpoint_dir=str(root), save_ckpt=False)
    # no older checkpoint to fall back to: one clear error, not DCP's tracebacks
    os.rename(root / "global_step_2" / "__0_0.distcp", tmp_path / "kept")
    with pytest.raises(integrity.IntegrityError, match="__0_0.distcp: missing.*No older checkpoint"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Checkpointer(reader).load(make_state(), "LATEST")
    os.rename(tmp_path / "kept", root / "global_step_2" / "__0_0.distcp")
    with pytest.warns(UserWarning, match=f"{damage}.*falling back"):
        assert Checkpointer(reader).load(make_state(), "LATEST").endswith("global_step_2")
    assert (root / "global_step_4").is_dir()                  # a run that only reads moves nothing
    # a run that saves sets the damaged step aside (renamed, kept) and LATEST names the step it resumed
    with pytest.warns(UserWarning, match="global_step_4 -> global_step_4.damaged-"):
        assert Checkpointer(config).load(make_state(), "LATEST").endswith("global_step_2")
    assert not (root / "global_step_4").exists() and discovery.read_pointer(str(root)) == 2
    assert [n for n in os.listdir(root) if n.startswith("global_step_4.damaged-")]


def test_checkpoint_without_manifest_loads_with_warning(tmp_path):
    # (a) a hyperacc checkpoint from before checksums: sentinel format 1, no manifest
    root = tmp_path / "ckpt"
    config, trained = saved_run(root, steps=(2,))
    path = root / "global_step_2"
    os.remove(path / integrity.MANIFEST_FILE)
    info = storage.read_sentinel(str(path))
    info.pop("integrity")
    info["format_version"] = 1
    (path / storage.SENTINEL_FILE).write_text(json.dumps(info))
    fresh = make_state()
    with pytest.warns(UserWarning, match="has no hyperacc_manifest.json"):
        Checkpointer(config).load(fresh, str(path))
    assert all(torch.equal(a, b) for a, b in zip(fresh.models[0].parameters(), trained.models[0].parameters()))
    assert fresh.optimizers[0].state_dict()["state"].keys() == trained.optimizers[0].state_dict()["state"].keys()
    # (b) a raw DCP checkpoint in torch's own optimizer layout (get_optimizer_state_dict)
    raw = tmp_path / "raw"
    dcp.save({"model": get_model_state_dict(trained.models[0]),
              "optimizer": get_optimizer_state_dict(trained.models[0], trained.optimizers[0])},
             checkpoint_id=str(raw), no_dist=True)
    fresh = make_state()
    with pytest.warns(UserWarning, match="no hyperacc_manifest.json"):
        Checkpointer(CheckpointConfig(checkpoint_dir=str(root), restore_train_state=False)).load(fresh, str(raw))
    want = trained.optimizers[0].state[trained.models[0].head.weight]["exp_avg"]
    assert torch.equal(fresh.optimizers[0].state[fresh.models[0].head.weight]["exp_avg"], want)
    # (c) a current checkpoint whose manifest was removed is refused (it is written before .metadata)
    config2, _ = saved_run(tmp_path / "c2", steps=(2,))
    os.remove(tmp_path / "c2" / "global_step_2" / integrity.MANIFEST_FILE)
    with pytest.raises(integrity.IntegrityError, match="hyperacc_manifest.json is missing"):
        Checkpointer(config2).load(make_state(), str(tmp_path / "c2" / "global_step_2"))


# ----------------------------------------------------------------------------- single writer
def test_second_job_fails_naming_the_holder(tmp_path):
    root = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom hyperacc.checkpoint import Checkpointer\n"
         "from hyperacc.config import CheckpointConfig\n"
         f"c = Checkpointer(CheckpointConfig(checkpoint_dir={str(root)!r})); c.lock()\n"
         "print('locked', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, env=_env(), cwd=str(REPO))
    try:
        assert holder.stdout.readline().strip() == "locked"
        state = make_state()
        train(state, 1)
        with pytest.raises(CheckpointDirLocked, match=rf"in use by another job \(host .*, pid {holder.pid}, since"):
            Checkpointer(CheckpointConfig(checkpoint_dir=str(root))).save(state)
        with pytest.raises(CheckpointDirLocked, match=f"pid {holder.pid}"):   # a resume that would save, too
            Checkpointer(CheckpointConfig(checkpoint_dir=str(root), restore_from="LATEST")).load(state)
        assert not os.path.exists(root / "global_step_1")
        # restore-only jobs may read while the holder writes
        assert Checkpointer(CheckpointConfig(checkpoint_dir=str(root), save_ckpt=False)).load(state, "LATEST") is None
    finally:
        holder.kill()
        holder.wait()
    ckpt = Checkpointer(CheckpointConfig(checkpoint_dir=str(root)))   # the dead holder's lock is gone
    assert ckpt.save(state).endswith("global_step_1")
    ckpt.finish(state)


# ----------------------------------------------------------------------------- optimizer
def _saved_for_optim(tmp_path, state):
    train(state, 2)
    ckpt = Checkpointer(CheckpointConfig(checkpoint_dir=str(tmp_path / "ckpt")))
    path = ckpt.save(state)
    ckpt.finish(state)
    return path


def test_optimizer_structure_mismatch_fails_closed(tmp_path):
    config = CheckpointConfig(checkpoint_dir=str(tmp_path / "ckpt"), restore_train_state=False)
    # two optimizers saved, loaded in swapped order
    state = make_state()
    model = state.models[0]
    state.optimizers = [torch.optim.AdamW(model.first.parameters(), lr=0.1),
                        torch.optim.AdamW(list(model.late.parameters()) + list(model.head.parameters()), lr=0.2)]
    path = _saved_for_optim(tmp_path, state)
    swapped = make_state()
    m = swapped.models[0]
    swapped.optimizers = [torch.optim.AdamW(list(m.late.parameters()) + list(m.head.parameters()), lr=0.2),
                          torch.optim.AdamW(m.first.parameters(), lr=0.1)]
    with pytest.raises(ValueError, match=r"optimizer 0: parameter 'late.weight' is in training's group 0 but not "
                                         r"in the checkpoint's"):
        Checkpointer(config).load(swapped, path)
    assert not swapped.optimizers[0].state                 # nothing was half-restored
    # one param group saved, two loaded
    path = _saved_for_optim(tmp_path / "g", make_state(groups=1))
    with pytest.raises(ValueError, match=r"the checkpoint has 1 param group\(s\), training has 2"):
        Checkpointer(config).load(make_state(groups=2), path)
    # a parameter missing from training's optimizer
    fewer = make_state()
    fewer.optimizers = [torch.optim.AdamW(list(fewer.models[0].parameters())[:-1], lr=0.05)]
    with pytest.raises(ValueError, match=r"parameter 'head.bias' is in the checkpoint's group 0 but not in "
                                         r"training's \(6 saved vs 5 now\)"):
        Checkpointer(config).load(fewer, path)


def test_parameter_unused_until_step_6_resumes_exactly(tmp_path):
    reference = make_state()
    train(reference, 8)
    first = make_state()
    train(first, 4)
    ckpt = Checkpointer(CheckpointConfig(checkpoint_dir=str(tmp_path / "ckpt")))
    path = ckpt.save(first)
    ckpt.finish(first)
    resumed = make_state(seed=123)                         # other initial weights: all must come back
    Checkpointer(CheckpointConfig(checkpoint_dir=str(tmp_path / "ckpt"))).load(resumed, path)
    late = resumed.models[0].late
    assert late.weight not in resumed.optimizers[0].state   # no state at save -> none after load
    assert int(resumed.optimizers[0].state[resumed.models[0].head.weight]["step"]) == 4
    train(resumed, 4)
    for (name, a), b in zip(reference.models[0].named_parameters(), resumed.models[0].parameters()):
        assert torch.equal(a, b), name                    # bitwise, the late layer included


def test_save_before_first_step_does_not_change_training(tmp_path):
    plain, saved = make_state(), make_state()
    ckpt = Checkpointer(CheckpointConfig(checkpoint_dir=str(tmp_path / "ckpt")))
    ckpt.save(saved)                                        # step 0: the optimizer has no state yet
    ckpt.finish(saved)
    assert not saved.optimizers[0].state
    train(plain, 4)
    train(saved, 4)
    for a, b in zip(plain.models[0].parameters(), saved.models[0].parameters()):
        assert torch.equal(a, b)
    assert int(saved.optimizers[0].state[saved.models[0].head.weight]["step"]) == 4


# ----------------------------------------------------------------------------- 2 processes
def test_integrity_on_two_processes(tmp_path):
    """Every rank raises the same one-line error (no hang); LATEST falls back on both ranks; a
    second job is refused on both ranks naming the holder; unused-layer resume exact on FSDP2."""
    run_torchrun(REPO / "tests" / "scripts" / "ckpt_integrity.py", 2, [tmp_path / "r", tmp_path],
                 timeout=240)
    r0, r1 = (json.load(open(f"{tmp_path / 'r'}.rank{r}.json")) for r in range(2))
    assert r0 == r1
    assert r0["locked"][0] in ("CheckpointDirLocked", "RuntimeError") and "in use by another job" in r0["locked"][1]
    assert f"pid {r0['holder_pid']}" in r0["locked"][1]
    assert r0["flipped_rank1"][0] == "IntegrityError"
    assert "__1_0.distcp: contents changed" in r0["flipped_rank1"][1] and "global_step_4" in r0["flipped_rank1"][1]
    assert r0["latest_fallback"] == ["ok", "global_step_2"]
    assert r0["truncated_explicit"][0] == "IntegrityError" and "__0_0.distcp: truncated" in r0["truncated_explicit"][1]
    assert r0["optimizer_mismatch"][0] == "ValueError" and "param group" in r0["optimizer_mismatch"][1]
    assert r0["late_layer_exact"] is True and r0["late_layer_no_state"] is True


class Counter:
    """An object registered with accelerate's `register_for_checkpointing` (state_dict protocol)."""

    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": torch.tensor(self.value)}

    def load_state_dict(self, state):
        self.value = int(state["value"])


def test_registered_objects_are_in_the_manifest_and_verified(tmp_path):
    import hyperacc

    acc = hyperacc.Accelerator(checkpoint=CheckpointConfig(save_ckpt=False))
    try:
        model = nn.Linear(4, 4)
        model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters()))
        counter = Counter(7)
        acc.register_for_checkpointing(counter)
        saved = acc.save_state(str(tmp_path / "ck"))
        manifest = json.loads((tmp_path / "ck" / integrity.MANIFEST_FILE).read_text())
        assert "custom_checkpoint_0.pkl" in json.dumps(manifest)    # written before the checkpoint completed
        counter.value = 0
        acc.load_state(saved)
        assert counter.value == 7
        flip_bytes(tmp_path / "ck" / "custom_checkpoint_0.pkl")
        with pytest.raises(integrity.IntegrityError, match="custom_checkpoint_0.pkl"):
            acc.load_state(saved)
    finally:
        acc.end_training()
