"""Step metrics (hyperacc.training.metrics): JSONL sink (one record per optimizer step), log cadence, resume,
custom and TensorBoard sinks, and a 2-rank gloo run (one collective per logging step, none on the
others)."""
import gc
import io
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch
from accelerate.tracking import GeneralTracker

import hyperacc
from dist_utils import run_torchrun
from hyperacc.training.metrics import (JsonlSink, MetricsLogger, MetricsSink, PeriodicCleanup, StepTimer,
                                       device_memory_gib)

SCRIPTS = Path(__file__).resolve().parent / "scripts"
REQUIRED = {"step", "epoch", "loss", "grad_norm", "lr", "step_time", "tokens_per_second"}


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def run_steps(logger, steps, tokens=64, step_time=0.5):
    return [logger.log_step(step=s, epoch=s // 3, loss=torch.tensor(1.0 / s), grad_norm=torch.tensor(2.0),
                            lr=[1e-4], step_time=step_time, tokens=tokens, samples=2) for s in steps]


def test_single_process_jsonl_keys_and_values(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    with MetricsLogger(metrics_file=str(path), progress_bar=False, log_fn=lambda line: None) as logger:
        returned = run_steps(logger, range(1, 4))
    lines = read_jsonl(path)
    assert [rec["step"] for rec in lines] == [1, 2, 3]
    for rec in lines:
        assert REQUIRED <= rec.keys()
    assert lines == [records[0] for records in returned]
    last = lines[-1]
    assert last["loss"] == pytest.approx(1 / 3) and last["grad_norm"] == 2.0 and last["lr"] == 1e-4
    assert last["epoch"] == 1 and last["step_time"] == 0.5 and last["tokens_per_second"] == 128.0
    assert last["tokens"] == 64  # the step's global count; consumed_tokens is their running sum
    assert last["consumed_tokens"] == 192 and last["consumed_samples"] == 6
    assert "memory_rss_gib" in last  # CPU reports the resident set size


def test_resume_sets_replayed_steps_and_partial_lines_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsLogger(metrics_file=str(path), progress_bar=False, log_fn=lambda line: None) as logger:
        run_steps(logger, [1, 2, 3, 4])
    with open(path, "a") as handle:  # a process killed mid-write
        handle.write('{"step": 5, "lo')
    # resumed from the checkpoint of step 2: steps 3-4 (and the torn line) belong to the replaced branch
    with pytest.warns(UserWarning, match=r"3 record\(s\) after step 2 .* moved to .*superseded-"):
        logger = MetricsLogger(metrics_file=str(path), progress_bar=False, initial_step=2, consumed_tokens=128,
                               consumed_samples=4, log_fn=lambda line: None)
    with logger:
        run_steps(logger, [3, 4, 5])
    good = [json.loads(line) for line in path.read_text().splitlines()]      # every line parses
    assert [rec["step"] for rec in good] == [1, 2, 3, 4, 5]                  # each step once, in order
    assert good[-1]["consumed_tokens"] == 320  # continued from the restored count
    aside = [p for p in tmp_path.iterdir() if ".superseded-" in p.name]
    assert len(aside) == 1 and aside[0].read_text().splitlines()[-1] == '{"step": 5, "lo'   # kept, not lost
    with MetricsLogger(metrics_file=str(path), progress_bar=False, initial_step=5,
                       log_fn=lambda line: None) as logger:
        logger.log_step(step=6, loss=1.0, step_time=1.0, consumed_tokens=1000)
    assert read_jsonl_last(path)["consumed_tokens"] == 1000


def read_jsonl_last(path):
    return json.loads(Path(path).read_text().splitlines()[-1])


def test_log_line_cadence_and_format(tmp_path):
    lines, path = [], tmp_path / "m.jsonl"
    with MetricsLogger(metrics_file=str(path), logging_steps=3, max_steps=7, progress_bar=False,
                       log_fn=lines.append) as logger:
        returned = [logger.log_step(step=s, rank_shares={"loss": torch.tensor(1.0 / s)}, step_time=0.5 * s,
                                    tokens=64, samples=2, lr=[1e-4], grad_norm=torch.tensor(2.0)) for s in range(1, 8)]
    assert [line.split()[0] for line in lines] == ["step=3", "step=6", "step=7"]  # + the last step
    assert [r and [rec["step"] for rec in r] for r in returned] == [None, None, [1, 2, 3], None, None, [4, 5, 6], [7]]
    written = read_jsonl(path)       # one record per optimizer step, each with its own values
    assert [r["step"] for r in written] == list(range(1, 8)) and written[-1]["consumed_tokens"] == 7 * 64
    assert [r["loss"] for r in written] == pytest.approx([1.0 / s for s in range(1, 8)])
    assert [r["step_time"] for r in written] == [0.5 * s for s in range(1, 8)]
    assert [r["tokens_per_second"] for r in written] == pytest.approx([128.0 / s for s in range(1, 8)])
    assert ["memory_rss_gib" in r for r in written] == [False, False, True, False, False, True, True]
    assert lines[0].startswith("step=3 loss=0.3333 lr=1.000e-04 grad_norm=2.0000 tokens/s=42.7 step_time=1.500s")


def test_progress_bar_and_eval_on_main_process_only(tmp_path):
    bar, lines = io.StringIO(), []
    path = tmp_path / "m.jsonl"
    logger = MetricsLogger(metrics_file=str(path), max_steps=10, initial_step=4, progress_file=bar,
                           log_fn=lines.append)
    run_steps(logger, [5, 6])
    record = logger.log_eval(step=6, loss=math.log(8.0))
    logger.close()
    assert record["eval_ppl"] == pytest.approx(8.0)
    text = bar.getvalue()
    assert "6/10" in text and "loss=" in text and "tok_s=" in text
    assert read_jsonl(path)[-1] == {**record}
    assert lines[-1].startswith("eval step=6 eval_loss=2.0794 eval_ppl=8.0000")

    other_bar, other_lines = io.StringIO(), []
    other = MetricsLogger(metrics_file=str(tmp_path / "other.jsonl"), is_main_process=False,
                          progress_file=other_bar, log_fn=other_lines.append, tensorboard_dir=str(tmp_path))
    rec, = other.log_step(step=1, loss=1.0, step_time=1.0, tokens=10)
    other.log_eval(step=1, loss=1.0)
    other.close()
    assert rec["tokens_per_second"] == 10.0  # the record is still computed and returned
    assert other_bar.getvalue() == "" and other_lines == []
    assert not (tmp_path / "other.jsonl").exists()


def test_tensorboard_missing_warns(tmp_path):
    try:
        import tensorboard  # noqa: F401
        pytest.skip("tensorboard installed")
    except ImportError:
        pass
    import hyperacc.training.metrics_sinks as metrics_sinks
    metrics_sinks._TB_WARNED = False
    with pytest.warns(UserWarning, match="tensorboard is not installed"):
        MetricsLogger(tensorboard_dir=str(tmp_path / "tb"), progress_bar=False).close()


class RecordingSink(MetricsSink):
    def __init__(self):
        self.writes, self.progressed, self.closed = [], [], 0

    def write(self, records, kind):
        self.writes.append((kind, [dict(record) for record in records]))

    def progress(self, step):
        self.progressed.append(step)

    def close(self):
        self.closed += 1


def test_custom_sink_gets_what_the_jsonl_file_gets(tmp_path):
    path, sink, lines = tmp_path / "m.jsonl", RecordingSink(), []
    with MetricsLogger(metrics_file=str(path), logging_steps=2, max_steps=5, progress_bar=False,
                       log_fn=lines.append, sinks=[sink]) as logger:
        run_steps(logger, range(1, 4))
        logger.log_eval(step=3, loss=1.0)
        run_steps(logger, [4, 5])
    assert sink.closed == 1
    logger.close()                   # a second close closes nothing again
    assert sink.closed == 1
    assert [kind for kind, _ in sink.writes] == ["step", "step", "eval", "step", "step"]
    assert [[r["step"] for r in records] for _, records in sink.writes] == [[1, 2], [3], [3], [4], [5]]
    assert [r for _, records in sink.writes for r in records] == read_jsonl(path)  # same steps, same values
    assert sink.progressed == [1, 3]  # the steps that flush nothing
    assert [line.split()[0] for line in lines] == ["step=2", "step=3", "eval", "step=4", "step=5"]


def test_sinks_only_write_on_the_main_process_and_need_only_write(tmp_path):
    class WriteOnly:                 # no progress(), no close(): still a sink
        def __init__(self):
            self.records = []

        def write(self, records, kind):
            self.records += records

    plain, other = WriteOnly(), RecordingSink()
    with MetricsLogger(progress_bar=False, log_fn=lambda line: None, sinks=[plain]) as logger:
        run_steps(logger, [1, 2])
    assert [r["step"] for r in plain.records] == [1, 2]
    with MetricsLogger(is_main_process=False, progress_bar=False, sinks=[other]) as logger:
        run_steps(logger, [1, 2])
        logger.log_eval(step=2, loss=1.0)
    assert other.writes == [] and other.progressed == [] and other.closed == 1


def test_tensorboard_sink_scalars(tmp_path, monkeypatch):
    scalars = []

    class FakeWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, global_step=None):     # torch's SummaryWriter signature
            scalars.append((tag, value, global_step))

        def flush(self):
            scalars.append("flush")

        def close(self):
            scalars.append("close")

    monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        types.SimpleNamespace(SummaryWriter=FakeWriter))
    with MetricsLogger(tensorboard_dir=str(tmp_path / "tb"), progress_bar=False, log_fn=lambda line: None) as logger:
        run_steps(logger, [1])
        logger.log_eval(step=1, loss=math.log(8.0))
    tags = [s[0] for s in scalars if isinstance(s, tuple)]
    assert tags[:5] == ["train/loss", "train/grad_norm", "train/lr", "train/step_time", "train/tokens_per_second"]
    assert "train/memory_rss_gib" in tags and scalars[-2:] == ["flush", "close"]
    assert scalars[-4:-2] == [("eval/loss", math.log(8.0), 1), ("eval/ppl", pytest.approx(8.0), 1)]


class RecordingTracker(GeneralTracker):
    """An accelerate tracker as a user would pass in log_with (wandb, mlflow, ... are the same shape)."""
    name, requires_logging_directory = "recording", False

    def __init__(self):
        super().__init__()
        self.logged, self.finished = [], 0

    @property
    def tracker(self):
        return self.logged

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, dict(values)))

    def finish(self):
        self.finished += 1


def test_one_logging_system_with_accelerate_trackers(tmp_path):
    """MetricsLogger(accelerator=acc) writes its records to the Accelerator's trackers (log_with), and
    its own JSONL sink joins them, so accelerator.log reaches the same file; a JsonlSink passed in
    log_with is written by both too (full records through write, accelerate's values through log)."""
    recording, path, other = RecordingTracker(), tmp_path / "m.jsonl", tmp_path / "other.jsonl"
    acc = hyperacc.Accelerator(log_with=[recording, JsonlSink(str(other))],
                               checkpoint=hyperacc.CheckpointConfig(save_ckpt=False))
    acc.init_trackers("run")
    with MetricsLogger(metrics_file=str(path), logging_steps=2, progress_bar=False, log_fn=lambda line: None,
                       accelerator=acc) as logger:
        assert len(acc.trackers) == 3                        # log_with's two + the logger's JSONL sink
        run_steps(logger, [1, 2])
        acc.log({"custom": 7.0}, step=2)
        logger.log_eval(step=2, loss=math.log(4.0))
    assert acc.trackers[:2] == [recording, acc.get_tracker("jsonl")] and len(acc.trackers) == 2   # ours left
    ours, theirs = read_jsonl(path), read_jsonl(other)
    assert [r["step"] for r in ours] == [1, 2, 2, 2] and ours[2] == {"step": 2, "custom": 7.0}
    assert ours == theirs and ours[3]["eval_ppl"] == pytest.approx(4.0)
    assert [step for step, _ in recording.logged] == [1, 2, 2, 2]
    assert recording.logged[0][1] == {"train/loss": 1.0, "train/grad_norm": 2.0, "train/lr": 1e-4,
                                      "train/step_time": 0.5, "train/tokens_per_second": 128.0}
    assert "train/memory_rss_gib" in recording.logged[1][1] and recording.logged[2][1] == {"custom": 7.0}
    assert recording.logged[3][1] == {"eval/loss": math.log(4.0), "eval/ppl": pytest.approx(4.0)}
    acc.end_training()
    assert recording.finished == 1
    acc.log({"late": 1.0}, step=3)                            # finished: the file is closed, nothing appended
    assert read_jsonl(other) == theirs


def test_tensorboard_in_a_process_group_needs_the_accelerator_first(monkeypatch, tmp_path):
    from accelerate import PartialState

    monkeypatch.setattr(PartialState, "_shared_state", {})    # no accelerate state yet
    monkeypatch.setenv("WORLD_SIZE", "2")                     # launched as one of two processes
    with pytest.raises(ValueError, match=r"create the Accelerator .* before it"):
        MetricsLogger(tensorboard_dir=str(tmp_path / "tb"), is_main_process=False, progress_bar=False)


def test_periodic_cleanup_and_timer(monkeypatch):
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    cleanup = PeriodicCleanup(gc_steps=2, empty_cache_steps=3)
    for step in range(1, 7):
        cleanup.maybe_run(step)
    assert cleanup.gc_runs == 3 and len(collected) == 3 and cleanup.cache_runs == 2
    was_enabled = gc.isenabled()
    manual = PeriodicCleanup(gc_steps=1, disable_automatic_gc=True)
    assert not gc.isenabled()
    manual.close()
    assert gc.isenabled() == was_enabled
    with StepTimer() as timer:
        sum(range(1000))
    assert timer.elapsed > 0
    assert device_memory_gib("cpu").keys() <= {"memory_rss_gib"}


def test_two_ranks_one_collective_max_step_time_global_tokens(tmp_path):
    metrics_file = tmp_path / "metrics.jsonl"
    run_torchrun(SCRIPTS / "metrics_two_ranks.py", 2, args=[tmp_path, metrics_file], timeout=180)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for result in ranks:
        # one collective per logging step (2, 4 and the last, 5), none on the others
        assert result["calls"] == [[], ["all_gather"], [], ["all_gather"], ["all_gather"]]
    rec0, rec1 = ranks[0]["records"], ranks[1]["records"]
    assert [r and [rec["step"] for rec in r] for r in rec0] == [None, [1, 2], None, [3, 4], [5]]
    strip = lambda windows: [{k: v for k, v in r.items() if k != "time"} for w in windows if w for r in w]  # noqa: E731
    assert strip(rec0) == strip(rec1)  # every rank returns the same records
    for rec in strip(rec0):            # rank 1 (the slower) takes 0.2 * step seconds per step
        assert rec["step_time"] == pytest.approx(0.2 * rec["step"])
        assert rec["loss"] == pytest.approx(3.0 / rec["step"])   # rank shares 1/step and 2/step, summed
        assert rec["tokens"] == 300 and rec["samples"] == 3
        assert rec["tokens_per_second"] == pytest.approx(300 / (0.2 * rec["step"]))
        assert rec["consumed_tokens"] == 300 * rec["step"]
    written = read_jsonl(metrics_file)
    assert [r["step"] for r in written] == [1, 2, 3, 4, 5]  # one writer (rank 0), one record per step
    assert strip([written]) == strip(rec0)
    assert [line.split()[0] for line in ranks[0]["lines"]] == ["step=2", "step=4", "step=5"]
    assert ranks[1]["lines"] == [] and ranks[1]["bar"] == ""
    assert "5/5" in ranks[0]["bar"]
