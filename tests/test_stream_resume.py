"""A stream resumes from its own position, not by replaying it (issue 41: accelerate and Trainer/TRL).

Launches (module-scoped, tests/scripts/stream_resume_run.py; every record read from the source is counted):
  2 procs  the accelerate path (``prepare()`` of a DataLoader over ``load_dataset(json, streaming=True)``,
           accelerate's default dispatching; the same with ``use_stateful_dataloader=True``; a stream with a
           shuffle buffer, which falls back to replay) and hyperacc's SFTTrainer with ``max_steps=6`` saved at
           step 3 and resumed by a fresh trainer.
  1 proc   the 2-process accelerate checkpoint resumed on 1 process (same global batch).
  slow     (HYPERACC_SLOW_TESTS=1) the 2-process SFTTrainer checkpoint resumed on 1 process.
Measured (fp32, this CPU): same-world resumes bitwise (losses, sample ids, Trainer weights); the resumed
runs read exactly the records after the trained ones; 2 -> 1 process: the same samples, losses within 2e-7.
"""
import json

import pytest

from dist_utils import REPO, run_python, run_torchrun

SCRIPT = REPO / "tests" / "scripts" / "stream_resume_run.py"
TRAINED = 24        # records the checkpoints had trained on (accelerate: 4 steps x 3 x 2 ranks; Trainer: 3 x 8)
REL = 1e-6


def _result(out) -> dict:
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def two(tmp_path_factory, hyperacc_cache):
    pytest.importorskip("trl")
    pytest.importorskip("torchdata")
    out = tmp_path_factory.mktemp("stream_resume_two")
    run_torchrun(SCRIPT, 2, ["--out", out], env={"HYPERACC_CACHE": hyperacc_cache}, timeout=600)
    return out


@pytest.fixture(scope="module")
def runs(two):
    return _result(two)


def _flat(step: dict) -> list:
    return [i for rank in step["ids"] for i in rank]


def _max_rel(a, b) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _reads_only_what_follows(full_reads: list, resumed_reads: list) -> None:
    """Per rank: the resumed run read exactly the records the uninterrupted run read after the trained ones
    (a rank that reads nothing — not the main process under dispatching — reads nothing in both)."""
    assert any(full_reads), "no records were counted: the counter is broken"
    for full, resumed in zip(full_reads, resumed_reads):
        assert resumed == full[TRAINED:] if full else resumed == [], (full, resumed)


@pytest.mark.parametrize("case", ["default", "stateful"])
def test_accelerate_stream_resumes_without_reading_again(runs, case):
    """save_state/load_state mid-epoch over a datasets stream: bitwise the same next steps (losses and the
    samples of every rank), the epoch boundary after it included, and nothing trained is read again; with
    accelerate's use_stateful_dataloader (torchdata) the same: hyperacc's own position is used."""
    record = runs["accelerate"][case]
    full, k = record["full"]["steps"], record["k"]
    assert record["head"]["steps"] == full[:k]
    assert record["resumed"]["steps"] == full[k:]
    assert record["resumed"]["epochs"] == record["full"]["epochs"][k:] and 1 in record["resumed"]["epochs"]
    _reads_only_what_follows(record["full"]["reads"], record["resumed"]["reads"])
    assert record["warnings"] == []


def test_a_stream_without_a_position_is_replayed_with_one_warning(runs):
    """datasets' shuffle buffer is not in the stream's state: the resume replays (still exact) and one
    warning says how many batches are read again, why, and what to change."""
    record = runs["accelerate"]["buffer"]
    assert record["resumed"]["steps"] == record["full"]["steps"][record["k"]:]
    assert record["resumed"]["reads"][0][:3] == record["full"]["reads"][0][:3]       # read from the start
    (message,) = record["warnings"]
    assert message.startswith("Resuming the stream by reading again the 4 batches already trained in epoch 0")
    assert "shuffle(buffer_size=...)" in message and "shuffle the shards only" in message and "\n" not in message


def test_sft_trainer_stream_resumes_bitwise_without_reading_again(runs):
    """hyperacc's SFTTrainer, 2 processes, a streaming jsonl with max_steps crossing a pass of the stream:
    a fresh trainer resumed from global_step_3 logs the same losses bitwise, ends with bitwise the same
    weights on every rank, and reads only the records after the 24 trained."""
    full, resumed = runs["trainer"]["full"], runs["trainer"]["resumed"]
    assert list(full["losses"]) == [str(s) for s in range(1, 7)]
    assert resumed["losses"] == full["losses"]
    assert resumed["weights"] == full["weights"]
    _reads_only_what_follows(full["reads"], resumed["reads"])


def test_accelerate_stream_resumes_on_another_number_of_processes(two, tmp_path_factory):
    """The 2-process checkpoint on 1 process with the same global batch: the same samples in the same
    steps (losses to 1e-6: another reduction order), and only the records after the trained ones read."""
    out = tmp_path_factory.mktemp("stream_resume_one")
    run_python(SCRIPT, ["--out", out, "--parts", "accelerate", "--resume-from", two], timeout=600)
    cross, saved = _result(out)["accelerate"]["cross"], _result(two)["accelerate"]["default"]
    expected = saved["full"]["steps"][saved["k"]:]
    assert cross["position"] == [0, saved["k"]]
    assert [_flat(s) for s in cross["record"]["steps"]] == [_flat(s) for s in expected]
    assert _max_rel([s["loss"] for s in cross["record"]["steps"]], [s["loss"] for s in expected]) <= REL
    assert cross["record"]["reads"][0] == saved["full"]["reads"][0][TRAINED:]


@pytest.mark.slow
def test_sft_trainer_stream_resumes_on_another_number_of_processes(two, tmp_path_factory, hyperacc_cache):
    """The 2-process SFTTrainer checkpoint resumed on 1 process (per-device batch doubled: the same global
    batch). The default test_accelerate_stream_resumes_on_another_number_of_processes keeps the guarantee
    (the loader's position is the same code under the Trainer); this adds the Trainer's step bookkeeping."""
    out = tmp_path_factory.mktemp("stream_resume_trainer_one")
    run_python(SCRIPT, ["--out", out, "--parts", "trainer", "--resume-from", two],
               env={"HYPERACC_CACHE": hyperacc_cache}, timeout=600)
    cross, saved = _result(out)["trainer"]["cross"], _result(two)["trainer"]["full"]
    assert list(cross["losses"]) == list(saved["losses"])
    assert _max_rel(list(cross["losses"].values()), list(saved["losses"].values())) <= 1e-5
    assert cross["reads"][0] == saved["reads"][0][TRAINED:]
