"""The checkpoint directory under generated sequences of runs, kills, damaged files and config changes.

Each sequence drives one ``checkpoint_dir`` through real Checkpointers (real DCP, one process): runs
that start fresh or resume (LATEST, an explicit older step, a path elsewhere), with or without
retention, that finish or are killed between saves; checkpoints damaged on disk; interrupted saves.
After every operation the invariants of hyperacc/checkpoint/lifecycle.py must hold:

* LATEST names the newest complete step directory, and it is this history's newest save;
* every step directory belongs to one history: the last run that saved and the runs it resumed from;
* a refused run changes nothing on disk; a damaged or abandoned step is renamed, never deleted;
* a resume restores exactly the state saved at its step (weights compared bitwise).
"""
import hashlib
import os
import random
import warnings

import pytest
import torch
import yaml

from hyperacc.checkpoint import Checkpointer, discovery
from hyperacc.checkpoint.integrity import IntegrityError
from hyperacc.checkpoint.lifecycle import CheckpointDirInUse
from hyperacc.config import CheckpointConfig
from test_checkpoint import make_state, train


def weights_digest(state) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in state.models[0].parameters())).hexdigest()


def snapshot(root):
    """Every path under ``root`` with its size and mtime: what "nothing changed" compares (the lock
    file is rewritten by each job that takes the lock: it is not data)."""
    out = {}
    for base, dirs, files in os.walk(root):
        for name in dirs + [f for f in files if f != ".hyperacc.lock"]:
            path = os.path.join(base, name)
            stat = os.lstat(path)
            out[os.path.relpath(path, root)] = (stat.st_size, stat.st_mtime_ns)
    return out


class World:
    """The model of what the directory should hold, checked against the real one."""

    def __init__(self, root, other):
        self.root, self.other = root, other
        self.saved = {}          # (run id, step) -> weights digest at that save
        self.lineage = {}        # run id -> the run ids of its history (itself included)
        self.head = None         # the run whose history the directory holds
        self.runs = 0

    def writer(self, path):
        with open(os.path.join(path, "config.yaml")) as handle:
            return yaml.safe_load(handle)["run"]

    def check(self):
        complete = discovery.scan(self.root)
        names = set(os.listdir(self.root)) if os.path.isdir(self.root) else set()
        assert not any(".tmp." in n for n in names), names
        if not complete:
            return
        newest = complete[-1][0]
        assert discovery.read_pointer(self.root) == newest, (discovery.read_pointer(self.root), complete)
        history = self.lineage[self.head]
        for step, path in complete:
            run = self.writer(path)
            assert run in history, (step, run, history)            # one history, never a mix
            assert (run, step) in self.saved

    # ------------------------------------------------------------------ operations
    def run(self, rng):
        self.runs += 1
        run_id = f"r{self.runs}"
        complete = discovery.scan(self.root)
        choice = rng.choice(["fresh", "latest", "latest", "older", "elsewhere"])
        restore = None
        if choice == "latest":
            restore = "LATEST"
        elif choice == "older" and complete:
            restore = rng.choice(complete)[1]
        elif choice == "elsewhere":
            restore = "ELSEWHERE"
        config = CheckpointConfig(checkpoint_dir=self.root, save_steps=rng.choice([1, 2, 3]), save_epochs=0,
                                  keep_last_n=rng.choice([0, 0, 2]),
                                  restore_from=None if restore == "ELSEWHERE" else restore)
        ckpt = Checkpointer(config, run_config=yaml.safe_dump({"run": run_id}))
        state = make_state(seed=self.runs)
        before = snapshot(self.root) if os.path.isdir(self.root) else {}
        parent = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if restore == "ELSEWHERE":
                    loaded = ckpt.load(state, self.other)
                else:
                    loaded = ckpt.load(state) if restore else None
                if loaded is not None:
                    parent = self.writer(loaded)
                    step = discovery.step_of(loaded)
                    assert state.progress.global_step == step
                    assert weights_digest(state) == self.saved[(parent, step)]     # exact resume
                steps = rng.randint(1, 5)
                train(state, ckpt, steps, saves=None)
                killed = rng.random() < 0.3
                if not killed:
                    ckpt.finish(state)
        except CheckpointDirInUse:
            fresh_like = restore in (None, "ELSEWHERE")
            assert fresh_like and complete, (restore, complete)     # refused only when mixing histories
            assert snapshot(self.root) == before                    # and nothing on disk changed
            ckpt._lock.release()
            return
        except IntegrityError:
            assert restore not in (None, "LATEST"), restore         # LATEST falls back; a path fails
            assert snapshot(self.root) == before
            ckpt._lock.release()
            return
        ckpt._lock.release()
        if restore in (None, "ELSEWHERE"):
            assert not complete          # a run not resuming from this directory saves only into an empty one
        self.lineage[run_id] = {run_id} | self.lineage.get(parent, set())
        for step, path in discovery.scan(self.root):
            if self.writer(path) == run_id:
                self.saved.setdefault((run_id, step), None)
        self._record_saves(run_id)
        if discovery.scan(self.root):
            self.head = run_id

    def _record_saves(self, run_id):
        """Digest of every checkpoint this run wrote (read back from disk with a fresh reader)."""
        reader = CheckpointConfig(checkpoint_dir=self.root, save_ckpt=False)
        for step, path in discovery.scan(self.root):
            if self.writer(path) == run_id and self.saved.get((run_id, step)) is None:
                probe = make_state(seed=999)
                Checkpointer(reader).load(probe, path)
                self.saved[(run_id, step)] = weights_digest(probe)

    def damage(self, rng):
        complete = discovery.scan(self.root)
        if not complete:
            return
        _, path = rng.choice(complete)
        shard = os.path.join(path, "__0_0.distcp")
        with open(shard, "r+b") as handle:
            handle.seek(os.path.getsize(shard) // 2)
            handle.write(b"\xff" * 16)

    def interrupted_save(self, rng):
        complete = discovery.scan(self.root)
        step = (complete[-1][0] if complete else 0) + rng.randint(1, 3)
        path = discovery.step_dir(self.root, step)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "__0_0.distcp"), "wb") as handle:
            handle.write(b"partial")


def _other_run(tmp_path):
    """A complete checkpoint of an unrelated run, outside the directory under test."""
    other_root = str(tmp_path / "elsewhere")
    ckpt = Checkpointer(CheckpointConfig(checkpoint_dir=other_root, save_steps=0, save_epochs=0),
                        run_config=yaml.safe_dump({"run": "stranger"}))
    state = make_state(seed=123)
    train(state, ckpt, 2)
    path = ckpt.save(state)
    ckpt.finish(state)
    return path, weights_digest(state)


@pytest.mark.parametrize("seed", range(6))
def test_generated_sequences_keep_the_directory_invariants(tmp_path, seed):
    rng = random.Random(seed)
    other, digest = _other_run(tmp_path)
    world = World(str(tmp_path / "ckpt"), other)
    world.lineage["stranger"], world.saved[("stranger", 2)] = {"stranger"}, digest
    for _ in range(10):
        operation = rng.choices(["run", "damage", "interrupted_save"], weights=[6, 2, 1])[0]
        getattr(world, operation)(rng)
        if operation == "run":
            world.check()
    assert world.runs >= 3


def test_a_damaged_newest_checkpoint_is_set_aside_and_saved_anew(tmp_path):
    # The sequence: saves at 5 .. 20, step 20 damaged; the resume falls back to 15, retrains
    # 16-20 and must save step 20 again (before: skipped, LATEST stayed on the damaged 20 forever).
    root = str(tmp_path / "ckpt")
    config = CheckpointConfig(checkpoint_dir=root, save_steps=5, save_epochs=0)
    first = Checkpointer(config)
    state = make_state()
    train(state, first, 20)
    first.finish(state)
    shard = os.path.join(discovery.step_dir(root, 20), "__0_0.distcp")
    with open(shard, "r+b") as handle:
        handle.write(b"\xff" * 32)
    resume = CheckpointConfig(checkpoint_dir=root, save_steps=5, save_epochs=0, restore_from="LATEST")
    for attempt in range(2):             # an elastic launcher restarting again loses nothing more
        second = Checkpointer(resume)
        state = make_state(seed=5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = second.load(state)
        assert attempt or any("global_step_20 -> global_step_20.damaged-" in str(w.message) for w in caught)
        assert restored.endswith("global_step_20" if attempt else "global_step_15")
        train(state, second, 20 - state.progress.global_step)
        second.finish(state)
        assert discovery.read_pointer(root) == 20 and [s for s, _ in discovery.scan(root)] == [5, 10, 15, 20]
    aside = [n for n in os.listdir(root) if n.startswith("global_step_20.damaged-")]
    assert len(aside) == 1                                   # kept for inspection, not deleted


def test_a_fresh_run_in_a_used_directory_is_refused_and_changes_nothing(tmp_path):
    root = str(tmp_path / "ckpt")
    old = Checkpointer(CheckpointConfig(checkpoint_dir=root, save_steps=2, keep_last_n=1), run_config="run: old\n")
    state = make_state()
    train(state, old, 4)
    old.finish(state)
    before = snapshot(root)
    new = Checkpointer(CheckpointConfig(checkpoint_dir=root, save_steps=2, keep_last_n=1), run_config="run: new\n")
    state = make_state(seed=1)
    with pytest.raises(CheckpointDirInUse, match="holds checkpoints of another run.*CheckpointConfig.restore_from='LATEST'"):
        train(state, new, 2)
    assert state.progress.global_step == 1                   # told at its first step, not at its first save
    assert snapshot(root) == before and open(os.path.join(root, "config.yaml")).read() == "run: old\n"
