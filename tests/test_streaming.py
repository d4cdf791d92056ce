"""StreamingDataLoader: step batches from a stream, resumed from the stream's own position (no replay).

In-process: the same samples as the map-style pipelines where the order is defined to match (no shuffle),
resumes at every kind of position (mid-window, mid-record, an epoch's end) equal to the uninterrupted
order, at another number of ranks too; bad rows named or skipped; refusals. On 2 processes (one launch
trains, saves and is killed; one resumes, and beside it 1 process resumes the same checkpoint): a streamed
text run and a streamed chat run with packing continue bitwise, and on 1 process on the same samples.
"""
import json
import random
import shutil
import warnings

import pytest
import torch

from conftest import SLOW
from dist_utils import REPO, run_python, run_together, run_torchrun

SCRIPT = REPO / "tests" / "scripts" / "stream_run.py"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_text(path, n=40, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(n):
            handle.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))}) + "\n")


def write_chat(path, n=48, seed=1):
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for i in range(n):
            q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 15)))
            r = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 25)))
            if i % 3 == 0:        # the two record forms in one file
                row = {"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": r}]}
            else:
                row = {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": r}]}
            handle.write(json.dumps(row) + "\n")


@pytest.fixture(scope="module")
def tok(hyperacc_cache):
    from hyperacc.data.text import load_tokenizer

    return load_tokenizer("default")


def stream(path):
    import datasets

    return datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)


def loader(path, tok, kind="text", **kw):
    from hyperacc.data import ChatRecords, StreamingDataLoader, TextWindows, prepare_chat_tokenizer

    transform = TextWindows(tok, 16) if kind == "text" else ChatRecords(prepare_chat_tokenizer(tok, "chatml"), 64)
    kw = {"global_batch_size": 4, "micro_batch_size": 1, "window": 8, **kw}
    return StreamingDataLoader(stream(path), transform=transform, **kw)


def ids_of(items):
    return [[mb["input_ids"].tolist() for mb in item] for item in items]


def test_same_samples_as_the_map_style_pipeline(tmp_path, tok):
    """No shuffle: the stream's text windows are build_text_dataset's windows in order; chat samples are
    build_chat_dataset's (same rendering, labels and truncation)."""
    from hyperacc.data import build_chat_dataset, prepare_chat_tokenizer
    from hyperacc.data.text import build_text_dataset

    write_text(tmp_path / "t.jsonl")
    steps = ids_of(loader(tmp_path / "t.jsonl", tok))
    windows = build_text_dataset(str(tmp_path / "t.jsonl"), tok, 16, holdout_fraction=0.0)
    flat = [mb[0] for item in steps for mb in item]
    assert len(flat) == 4 * (len(windows) // 4) and len(flat) > 20
    assert flat == [windows[i]["input_ids"].tolist() for i in range(len(flat))]
    write_chat(tmp_path / "c.jsonl")
    chat = loader(tmp_path / "c.jsonl", tok, kind="chat")
    got = [(mb["input_ids"][0].tolist(), mb["labels"][0].tolist()) for item in chat for mb in item]
    mapped = build_chat_dataset(str(tmp_path / "c.jsonl"), prepare_chat_tokenizer(tok, "chatml"), seq_len=64,
                                holdout_fraction=0.0)
    assert got == [(mapped[i]["input_ids"].tolist(), mapped[i]["labels"].tolist()) for i in range(len(got))]


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_resume_anywhere_continues_the_order_at_any_rank_count(tmp_path, tok, kind):
    """A state taken after k steps (mid-window, mid-record for text, the epoch's last step, the next epoch's
    start) resumes with exactly the steps that followed, as rank 1 of 2 (the second half of each step)."""
    (write_text if kind == "text" else write_chat)(tmp_path / "d.jsonl")
    make = lambda: loader(tmp_path / "d.jsonl", tok, kind, shuffle=True, seed=3)  # noqa: E731
    full = make()
    epoch0 = ids_of(full)
    epoch1 = ids_of(full)
    assert full.epoch == 2 and epoch0 != epoch1 and sorted(map(str, epoch0)) != sorted(map(str, epoch1))[:0]
    order = epoch0 + epoch1
    n = len(epoch0)
    for k in sorted({0, 1, 3, 5, n - 1, n, n + 2}):
        first = make()
        taken = []
        while len(taken) < k:
            it = iter(first)
            for item in it:
                taken.append(item)
                if len(taken) == k:
                    break
        state = json.loads(json.dumps(first.state_dict()))          # what a checkpoint stores
        again = make().bind(1, 2)
        again.load_state_dict(state)
        rest = []
        while len(rest) < len(order) - k and again.epoch < 2:
            rest += ids_of(again)
        assert rest == [item[2:] for item in order[k:]], k


def test_bad_rows_named_or_skipped(tmp_path, tok):
    from hyperacc.data import StreamingDataLoader, TextWindows
    from hyperacc.errors import StreamRowError

    write_text(tmp_path / "t.jsonl", n=20)
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    lines[13] = json.dumps({"text": 7})
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(StreamRowError, match=r"record 13 of epoch 0 of the stream \(\{'text': 7\}\).*"
                                             r"'text' is int, not a string.*bad_rows='skip'"):
        list(loader(tmp_path / "t.jsonl", tok))
    skipping = loader(tmp_path / "t.jsonl", tok, bad_rows="skip")
    with pytest.warns(UserWarning, match="skipped 1 bad row"):
        got = ids_of(skipping)
    assert skipping.skipped_rows == 1 and got
    del lines[13]
    (tmp_path / "clean.jsonl").write_text("\n".join(lines) + "\n")
    assert got == ids_of(loader(tmp_path / "clean.jsonl", tok))
    with pytest.raises(ValueError, match="bad_rows must be"):
        StreamingDataLoader(stream(tmp_path / "clean.jsonl"), global_batch_size=4, micro_batch_size=1,
                            transform=TextWindows(tok, 16), bad_rows="ignore")


def test_refusals(tmp_path, tok):
    from hyperacc.data import MicroBatchDataLoader, StreamingDataLoader, TextWindows
    from hyperacc.errors import DataResumeMismatch

    write_text(tmp_path / "t.jsonl")
    first = loader(tmp_path / "t.jsonl", tok)
    next(iter(first))
    state = first.state_dict()
    for change, words in (({"global_batch_size": 8}, "global_batch_size: saved 4, current 8"),
                          ({"seed": 1}, "seed: saved 0, current 1"), ({"window": 4}, "window")):
        with pytest.raises(DataResumeMismatch, match=words):
            loader(tmp_path / "t.jsonl", tok, **change).load_state_dict(state)
    with pytest.raises(DataResumeMismatch, match="dataset_fingerprint"):       # another seq_len
        StreamingDataLoader(stream(tmp_path / "t.jsonl"), global_batch_size=4, micro_batch_size=1, window=8,
                            transform=TextWindows(tok, 24)).load_state_dict(state)
    restart = loader(tmp_path / "t.jsonl", tok, global_batch_size=8, resume_mismatch="restart")
    with pytest.warns(UserWarning, match="restarting epoch 0"):
        restart.load_state_dict(state)
    mapped = MicroBatchDataLoader(list(range(8)), global_batch_size=4, micro_batch_size=1)
    with pytest.raises(DataResumeMismatch, match="map-style"):
        first.load_state_dict(dict(mapped.state_dict()))
    with pytest.raises(TypeError, match="one-pass iterator"):
        StreamingDataLoader(iter([{"text": "a"}]), global_batch_size=4, micro_batch_size=1)
    with pytest.raises(TypeError, match="no length"):
        len(first)
    with pytest.raises(ValueError, match="not divisible"):
        first.bind(0, 3)


def test_a_source_without_a_position_is_read_again_once_with_a_warning():
    from hyperacc.data import StreamingDataLoader

    class Plain(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter({"input_ids": torch.tensor([i, i + 1])} for i in range(20))

    first = StreamingDataLoader(Plain(), global_batch_size=2, micro_batch_size=1, window=4, shuffle=True)
    order = ids_of(first)
    again = StreamingDataLoader(Plain(), global_batch_size=2, micro_batch_size=1, window=4, shuffle=True)
    it = iter(again)
    for _ in range(5):
        next(it)
    state = again.state_dict()
    resumed = StreamingDataLoader(Plain(), global_batch_size=2, micro_batch_size=1, window=4, shuffle=True)
    resumed.load_state_dict(state)
    with pytest.warns(UserWarning, match="reads its first 8 records again"):
        assert ids_of(resumed) == order[5:]


# ---------------------------------------------------------------------------------------- 2 processes
STEPS, SAVE, KILL = 10, 4, 6


def then(*runs):
    """One job's arguments for several runs of the script (tests/scripts/run_sequence.py)."""
    out = []
    for args in runs:
        out += [*(["--then"] if out else []), *map(str, args)]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, hyperacc_cache):
    """{name: record} of: uninterrupted text and chat runs, the same killed after a save (text: ended without
    saving more; chat: SIGKILL), resumed on 2 processes, and (slow set) resumed on 1 process from copies."""
    tmp = tmp_path_factory.mktemp("streaming")
    write_text(tmp / "text.jsonl", n=10)        # 7 steps an epoch (chat too): 10 steps cross into the next
    write_chat(tmp / "chat.jsonl", n=28)

    def args(kind, name, ckpt, *extra):
        return ["--kind", kind, "--data", tmp / f"{kind}.jsonl", "--out", tmp / f"{name}.json", "--ckpt", ckpt,
                "--steps", STEPS, *extra]

    killed = run_torchrun(SCRIPT, 2, then(args("text", "text_full", tmp / "unused_t"),
                                          args("chat", "chat_full", tmp / "unused_c"),
                                          args("text", "text_part", tmp / "ck_text", "--save-at", SAVE,
                                               "--end-after", KILL),
                                          args("chat", "chat_part", tmp / "ck_chat", "--save-at", SAVE,
                                               "--kill-after", KILL)), timeout=300, check=False)
    assert killed.returncode != 0, "the chat run was to be killed"
    for kind in ("text", "chat"):
        shutil.copytree(tmp / f"ck_{kind}", tmp / f"ck1_{kind}")
    def resumed():
        return run_torchrun(SCRIPT, 2, then(args("text", "text_resumed", tmp / "ck_text", "--resume"),
                                            args("chat", "chat_resumed", tmp / "ck_chat", "--resume")), timeout=300)

    def one():
        return run_python(SCRIPT, then(args("text", "text_one", tmp / "ck1_text", "--resume"),
                                       args("chat", "chat_one", tmp / "ck1_chat", "--resume")), timeout=300)

    run_together(resumed, one) if SLOW else resumed()       # 2 -> 1: the slow set (see its test)
    return {path.stem: json.loads(path.read_text()) for path in tmp.glob("*.json")}


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_killed_after_a_save_resumes_bitwise(runs, kind):
    full, part, resumed = runs[f"{kind}_full"], runs[f"{kind}_part"], runs[f"{kind}_resumed"]
    assert sorted(map(int, part["steps"])) == list(range(1, KILL + 1))
    assert {s: part["steps"][s] for s in map(str, range(1, KILL + 1))} == \
        {s: full["steps"][s] for s in map(str, range(1, KILL + 1))}
    assert sorted(map(int, resumed["steps"])) == list(range(SAVE + 1, STEPS + 1))
    assert resumed["steps"] == {s: full["steps"][s] for s in map(str, range(SAVE + 1, STEPS + 1))}
    assert resumed["params"] == full["params"]
    assert full["epoch"] == resumed["epoch"] == 1           # the stream ended and restarted within the 10 steps


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["text", "chat"])
def test_resumed_on_one_process_trains_the_same_samples(runs, kind):
    """The 2-process checkpoint on 1 process (the default run keeps the same-order guarantee across rank counts
    in test_resume_anywhere_continues_the_order_at_any_rank_count, and tests/test_stream_resume.py's 2 -> 1)."""
    full, one = runs[f"{kind}_full"], runs[f"{kind}_one"]
    for step in map(str, range(SAVE + 1, STEPS + 1)):
        assert one["steps"][step][1] == full["steps"][step][1], step          # the same samples, in order
        assert one["steps"][step][0] == pytest.approx(full["steps"][step][0], rel=1e-5), step
