"""Checkpoints written by the code before issue 39 (commit f56f13a) load and resume bit for bit.

tests/data/v0_checkpoints/ holds three tiny checkpoints that f56f13a wrote on 2 processes (FSDP2, gloo)
with `Accelerator.save_state()` after two optimizer steps, and what that run produced in its next two steps
(`expected.json`; how and from which commit: tests/data/make_v0_checkpoints.py). One launch of that script
with the current code (a copy of the fixtures in tmp: nothing is written into tests/data) rebuilds each
model, optimizer, scheduler and loader, `load_state`s the stored checkpoint, trains the same two steps and
saves once more. The loaded state, saved again before the steps, must hold the stored tensors bit for bit;
the steps must give the stored draws, learning rates and epochs exactly and the stored losses to float rounding
(on another kind of CPU, e.g. this project's AVX-512 machines, the same code sums in another order: 1.2e-7
apart, so the final parameters' hashes are not compared). The fixtures cover the six buckets (the losses
need the model, optimizer, scheduler, loader position and the rng behind attention dropout; the draws read the rng bucket directly, the steps the
progress bucket), an object registered with `register_for_checkpointing`, a tie stored once, LATEST and a
LoRA adapters-only checkpoint with its frozen-base fingerprint.

A format change that old checkpoints cannot follow fails `test_v0_checkpoint_resumes_bitwise` (a load error
in the launch, or different losses / parameters); a change in what the current code writes for the same
state (files, DCP keys, sentinel) fails `test_current_save_writes_the_v0_layout` (checkpoints must stay
byte-compatible both ways: a checkpoint written now must load in the code before).
"""
import json
import shutil

import pytest
import torch

from dist_utils import REPO, run_torchrun

DATA = REPO / "tests" / "data"
SCRIPT = DATA / "make_v0_checkpoints.py"
FIXTURES = DATA / "v0_checkpoints"
KINDS = ("full", "tied", "lora")
WRITER = "f56f13a"


def expected(kind):
    return json.loads((FIXTURES / kind / "expected.json").read_text())


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """{kind: what the current code did with the stored checkpoint of ``kind``} (one 2-process launch)."""
    tmp = tmp_path_factory.mktemp("v0_checkpoints")
    shutil.copytree(FIXTURES, tmp / "fixtures")
    result = tmp / "result.json"
    run_torchrun(SCRIPT, 2, ["resume", "--fixtures", tmp / "fixtures", "--result", result], timeout=300)
    record = json.loads(result.read_text())
    assert record["hyperacc"].startswith(str(REPO / "hyperacc")), record["hyperacc"]    # the code under test
    return record["records"]


def test_fixtures_come_from_the_code_before():
    """The stored checkpoints are the old code's (regenerated with newer code they would prove nothing)."""
    for kind in KINDS:
        written = expected(kind)["written_by"]
        assert written["hyperacc_commit"].startswith(WRITER), (kind, written)
        assert (FIXTURES / kind / expected(kind)["checkpoint"] / ".metadata").is_file()
        assert not (FIXTURES / kind / "ckpt" / ".hyperacc.lock").exists()
    size = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    assert size < 3 * 2**20, size


def dcp_contents(path, out):
    """{key: value} of a DCP checkpoint, read by torch's own converter (one process, no group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


@pytest.mark.parametrize("kind", KINDS)
def test_v0_checkpoint_loads_bitwise(resumed, kind, tmp_path):
    """The state the current code loads from the stored checkpoint, saved again, holds the same tensors bit
    for bit (model, optimizer moments and steps; no kernel runs between, so this holds on any CPU)."""
    got = resumed[kind]
    assert "error" not in got, f"the current code could not resume the stored {kind} checkpoint:\n{got['error']}"
    stored = flat(dcp_contents(got["stored_path"], tmp_path / "stored.pt"))
    again = flat(dcp_contents(got["reloaded_path"], tmp_path / "again.pt"))
    assert sorted(stored) == sorted(again)
    tensors = [k for k, v in stored.items() if isinstance(v, torch.Tensor)]
    assert any(k.startswith("model.") for k in tensors) and any(k.startswith("optimizer.state.") for k in tensors)
    differ = [k for k in tensors if not (stored[k].dtype == again[k].dtype and torch.equal(stored[k], again[k]))]
    assert not differ, f"loaded state differs from the stored checkpoint: {differ}"
    assert {k: v for k, v in stored.items() if k not in tensors} == {k: v for k, v in again.items()
                                                                      if k not in tensors}


@pytest.mark.parametrize("kind", KINDS)
def test_v0_checkpoint_resumes_bitwise(resumed, kind):
    """The two steps after the load: draws, learning rates and epochs exactly; losses to float rounding (bit
    for bit on the writer's CPU; an AVX-512 machine's kernels may sum in another order: seen 1.2e-7 apart)."""
    want, got = expected(kind), resumed[kind]
    assert "error" not in got, f"the current code could not resume the stored {kind} checkpoint:\n{got['error']}"
    assert got["loaded"] == want["checkpoint"]
    assert got["global_step"] == want["saved_at"] == 2          # progress bucket
    assert got["epoch"] == want["epoch"]
    assert got["draws"] == want["draws"], "rng bucket: torch/python/numpy draws after the load differ (per rank)"
    assert sorted(got["steps"]) == sorted(want["steps"])
    for step, now in got["steps"].items():
        then = want["steps"][step]
        assert (now["lr"], now["epoch"]) == (then["lr"], then["epoch"]), step
        assert now["loss"] == pytest.approx(then["loss"], rel=1e-6), ("the two steps after the load differ: "
                                                                      f"now {got['steps']}, stored {want['steps']}")
    assert set(got["param_sha256"]) == set(want["param_sha256"])
    assert got["final_global_step"] == 4
    if kind == "full":
        assert got["counter"]["steps"] == want["counter"]["steps"]      # register_for_checkpointing's object
        assert got["counter"]["trace"] == pytest.approx(want["counter"]["trace"], rel=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_current_save_writes_the_v0_layout(resumed, kind):
    """The same state saved by the current code: the same files, DCP keys and sentinel as the stored one."""
    assert "error" not in resumed[kind], f"the stored {kind} checkpoint did not resume (see the test above)"
    want, got = expected(kind)["layout"], resumed[kind]["layout"]
    assert got["files"] == want["files"]
    missing = sorted(set(want["dcp_keys"]) - set(got["dcp_keys"]))
    extra = sorted(set(got["dcp_keys"]) - set(want["dcp_keys"]))
    assert not missing and not extra, f"DCP keys: no longer written {missing}, new {extra}"
    assert got["sentinel"] == want["sentinel"]
