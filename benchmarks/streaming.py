"""StreamingDataLoader (issue 41): resume cost, training throughput and memory, each against its natural baseline.

    .venv/bin/python benchmarks/streaming.py [--far 10000000] [--rounds 5] [--steps 8] [--rss-text-records 100000]

1. Resume time flat in the position. ``load_state_dict(state)`` + the first step item of a fresh loader, for a
   state at sample ~10^3 and one at sample ~10^7 of a generated stream (1 record = 1 sample, global batch 8,
   window 1024, shuffled windows), over (a) a torch ``IterableDataset`` with its own ``state_dict()`` (record i
   is computed from i: O(1) seek) and (b) a ``datasets`` stream of ~10^4 generator shards of 1000 records
   (``IterableDataset.from_generator``: datasets resumes at shard + offset in the shard). A stored position is
   what makes a resume cheap, so the baseline is the same resume at the small position (goal: ratio <= 1.5);
   for contrast, what a source without a position costs (the loader replays the records before the window),
   measured at ~10^5 and extrapolated. The state at ~10^7 is not trained to: it is the loader's state formula
   (window, record in the window, the source's own position at the window start), which is checked to equal the
   loader's own ``state_dict()`` at ~10^3 after training there, and the first item after loading it is checked
   to come from the records of that window.
2. Tokens/s of a training step, streaming vs map-style on the same text. 2 processes (torchrun, gloo, FSDP2),
   a tiny dense Qwen3 (fp32, seeded), one generated JSONL corpus: ``MicroBatchDataLoader`` over
   ``build_text_dataset`` (tokenized before the timed loop) vs ``StreamingDataLoader`` over
   ``load_dataset("json", streaming=True)`` + ``TextWindows`` (tokenized on the fly, every rank tokenizing
   every record). Both unshuffled, so both train on the very same samples (checked). The map-style loader is
   the baseline a stream has to keep up with (goal: streaming/map >= 0.9); rounds alternate (ABBA), the first
   round is warm-up; step time = data fetch + step, the slowest rank's. A one-process breakdown of the
   streaming fetch (reading records, tokenizing, the rest) says where its time goes.
3. Peak RSS flat in dataset size: a fresh process per size iterates (no model) the whole stream through
   StreamingDataLoader: a JSONL stream through TextWindows (10^4 vs --rss-text-records) and a generated
   torch stream (10^4 vs --rss-gen-records); peak RSS (VmHWM, reset once the loader is built) above the RSS
   at that point. The small stream is the baseline: memory must not grow with the data (goal ~1).
The ratios come last. Not a test: timings are noisy on a shared machine (medians, alternated sides).
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

RESUME_G, WINDOW, SHARD, ROW = 8, 1024, 1000, 16          # part 1: global batch, window, datasets shard, tokens
SEQ, G, MB = 256, 8, 2                                       # part 2: tokens per sample, global batch, micro-batch
WORDS = ("the of and to in is was for on that with as by at from his an were are which this be has or he had not "
         "first one their its new after but who they have her she two been other when there all during into school "
         "time may years more most only over city some world would where later up such used many can state about "
         "national out known university united then made river house music team season film album game line "
         "church village population family war party government north south east west").split()


# ---------------------------------------------------------------------------------------------- data
def record(i: int) -> dict:
    """Record i of the generated streams of parts 1 and 3: its index and ROW tokens, computed from i."""
    return {"index": i, "input_ids": [(i + k) % 50000 for k in range(ROW)]}


def document(i: int, words: int) -> str:
    """Document i of the generated text corpus (deterministic, about ``words`` words)."""
    n = words // 2 + (i * 7919) % max(1, words)
    return " ".join(WORDS[(i * 31 + k * 17 + k * k * (i % 5 + 1)) % len(WORDS)] for k in range(n))


def write_corpus(path: str, docs: int, words: int) -> None:
    with open(path, "w") as handle:
        handle.writelines(json.dumps({"text": document(i, words)}) + "\n" for i in range(docs))


def index_stream(n: int):
    """A torch IterableDataset of ``n`` records (``record(i)`` as tensors) with its own position (O(1) seek:
    record i computed from i)."""
    from torch.utils.data import IterableDataset

    class IndexStream(IterableDataset):
        def __init__(self):
            self._next = 0

        def __iter__(self):
            import torch

            while self._next < n:
                i = self._next
                self._next = i + 1          # before the yield: state_dict() is the position after this record
                yield {"index": torch.tensor(i), "input_ids": torch.arange(i, i + ROW) % 50000}

        def state_dict(self):
            return {"index": self._next}

        def load_state_dict(self, state):
            self._next = int(state["index"])

    return IndexStream()


def shard_gen(shard):
    for s in shard:
        for j in range(SHARD):
            yield record(s * SHARD + j)


def shard_stream(shards: int):
    """A datasets stream of ``shards`` generator shards of SHARD records (record i at shard i // SHARD)."""
    import datasets

    datasets.disable_progress_bars()
    return datasets.IterableDataset.from_generator(shard_gen, gen_kwargs={"shard": list(range(shards))})


class Unpositioned:
    """The same records without state_dict()/load_state_dict(): what a resume costs without a position."""

    def __init__(self, source, start):
        self.source, self.start = source, copy.deepcopy(start)

    def __iter__(self):
        self.source.load_state_dict(copy.deepcopy(self.start))
        return iter(self.source)


# ---------------------------------------------------------------------------------------------- 1. resume
def resume_positions(far: int) -> tuple:
    """Two sample positions with the same offset in their window and the same window-start offset in a
    datasets shard (so the work after the seek is alike): ~2*10^3 and ~``far``."""
    period = math.lcm(WINDOW, SHARD) // WINDOW
    offset = min(WINDOW - RESUME_G, max(0, (2000 - WINDOW) // RESUME_G * RESUME_G))
    far_w = 1 + period * max(1, round((far / WINDOW - 1) / period))
    return (1, offset), (far_w, offset)


def source_position(kind: str, template, start_record: int):
    if kind == "torch":
        return {"index": start_record}
    state = copy.deepcopy(template)
    state["examples_iterable"]["shard_idx"] = start_record // SHARD
    state["examples_iterable"]["shard_example_idx"] = start_record % SHARD
    return state


def built_state(loader, kind, template, window: int, offset: int, positioned: bool = True) -> dict:
    """The loader's state after ``window * WINDOW + offset`` samples (1 record = 1 sample, no transform):
    window, record in the window, the source's position at the window's start, records before the window."""
    state = loader.state_dict()
    state["position"] = {"epoch": 0, "window": window,
                         "source": source_position(kind, template, window * WINDOW) if positioned else None,
                         "record": offset, "used": 0, "carry": None, "records_before": window * WINDOW}
    return state


def make_loader(source):
    from hyperacc.data import StreamingDataLoader

    return StreamingDataLoader(source, global_batch_size=RESUME_G, micro_batch_size=RESUME_G, shuffle=True,
                               seed=7, window=WINDOW)


def resume_seconds(source, state) -> tuple:
    loader = make_loader(source)
    start = time.perf_counter()
    loader.load_state_dict(state)
    item = next(iter(loader))
    return time.perf_counter() - start, item


def first_indices(item) -> list:
    return sorted(int(i) for mb in item for i in mb["index"])


def part_resume(args) -> dict:
    import torch

    torch.set_num_threads(1)
    (near_w, off), (far_w, _) = resume_positions(args.far)
    near, far = near_w * WINDOW + off, far_w * WINDOW + off
    total = far_w * WINDOW + 2 * WINDOW
    shards = -(-total // SHARD) + 1
    replay_w = max(2, round(args.replay / WINDOW))
    replay = replay_w * WINDOW + off
    out = {"near": near, "far": far, "replay": replay, "shards": shards}
    t0 = time.perf_counter()
    sources = {"torch": index_stream(shards * SHARD), "datasets": shard_stream(shards)}
    out["datasets_build_s"] = time.perf_counter() - t0
    for kind, source in sources.items():
        template = copy.deepcopy(source.state_dict())
        # the state at `near`, really produced: train (iterate) there, take state_dict() and the next item
        trained = make_loader(source)
        steps = iter(trained)
        for _ in range(near // RESUME_G):
            next(steps)
        real = trained.state_dict()
        expected_next = first_indices(next(steps))
        del steps
        built = built_state(trained, kind, template, near_w, off)
        if built != real:
            raise SystemExit(f"{kind}: the built state at {near} differs from the loader's own:\n{built}\n{real}")
        states = {near: built, far: built_state(trained, kind, template, far_w, off)}
        times = {near: [], far: []}
        for rep in range(args.repeats + 1):               # first round: warm-up
            for position in (near, far) if rep % 2 else (far, near):
                seconds, item = resume_seconds(source, states[position])
                got = first_indices(item)
                window_start = (position // WINDOW) * WINDOW
                if position == near and got != expected_next:
                    raise SystemExit(f"{kind}: resumed at {near}: {got}, the trained loader went on with "
                                     f"{expected_next}")
                if len(set(got)) != RESUME_G or not all(window_start <= i < window_start + WINDOW for i in got):
                    raise SystemExit(f"{kind}: resumed at {position}: records {got} are not of its window")
                if rep:
                    times[position].append(seconds)
        # contrast: a source without a position (the loader replays the records before the window)
        plain = Unpositioned(source, template)
        replay_state = built_state(make_loader(plain), kind, template, replay_w, off, positioned=False)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            replay_s = statistics.median(resume_seconds(plain, replay_state)[0] for _ in range(3))
        source.load_state_dict(copy.deepcopy(template))
        start = time.perf_counter()
        count = sum(1 for _ in itertools.islice(iter(source), args.replay))
        raw_s = (time.perf_counter() - start) / count
        out[kind] = {"near_s": statistics.median(times[near]), "far_s": statistics.median(times[far]),
                     "replay_s": replay_s, "raw_record_s": raw_s}
    return out


def print_resume(r: dict, repeats: int) -> None:
    print(f"1. resume: load_state_dict(state) + first step item (global batch {RESUME_G}, window {WINDOW}, "
          f"shuffled windows), median of {repeats}, positions alternated, after one warm-up round:")
    print(f"   states: sample {r['near']:,} = the loader's own state_dict() after iterating there; sample "
          f"{r['far']:,} = the same formula (window, record in it, source position at the window start),")
    print("   which equals the loader's own state at the near sample (checked); the loader accepts both and the "
          "first item after each holds records of its window (checked; at the near sample, exactly the trained "
          "loader's next item)")
    labels = {"torch": "torch IterableDataset (O(1) seek)",
              "datasets": f"datasets stream, {r['shards']:,} shards x {SHARD}"}
    for kind in ("torch", "datasets"):
        k = r[kind]
        print(f"   {labels[kind]:38s} sample {r['near']:>10,}: {1e3 * k['near_s']:8.2f} ms   sample "
              f"{r['far']:,}: {1e3 * k['far_s']:8.2f} ms")
    print(f"   for contrast, without a stored position (the same sources without state_dict(); the loader replays "
          f"the records before the window):")
    for kind in ("torch", "datasets"):
        k = r[kind]
        before = (r["replay"] // WINDOW) * WINDOW
        scale = ((r["far"] // WINDOW) * WINDOW) / before
        print(f"   {labels[kind]:38s} resume at {r['replay']:,}: {k['replay_s']:6.2f} s measured -> at {r['far']:,}: "
              f"~{k['replay_s'] * scale:7.1f} s EXTRAPOLATED (x{scale:.0f}); raw read "
              f"{1e6 * k['raw_record_s']:.1f} us/record -> 10^7 records ~{1e7 * k['raw_record_s']:.0f} s EXTRAPOLATED")
    print(f"   (building the datasets stream of {r['shards']:,} generator shards took {r['datasets_build_s']:.1f} s, "
          "not timed above)", flush=True)


# ---------------------------------------------------------------------------------------------- 2. tokens/s
def train_worker(out: str, data: str, rounds: int, steps: int) -> None:
    import datasets
    import torch
    import torch.distributed as dist
    from transformers import Qwen3Config

    import hyperacc
    from hyperacc.data import MicroBatchDataLoader, StreamingDataLoader, TextWindows
    from hyperacc.data.text import build_text_dataset, load_tokenizer
    from hyperacc.models import build_causal_lm

    datasets.disable_progress_bars()
    acc = hyperacc.Accelerator(seed=0, checkpoint=hyperacc.CheckpointConfig(save_ckpt=False))
    rank = dist.get_rank()
    tok = load_tokenizer("default")
    for turn in (0, 1):          # rank 0 tokenizes into datasets' cache first, rank 1 then reads it
        if rank == turn:
            mapped = build_text_dataset(data, tok, SEQ, holdout_fraction=0.0)
        dist.barrier()
    stream = datasets.load_dataset("json", data_files=data, split="train", streaming=True)
    loaders = {"map": MicroBatchDataLoader(mapped, global_batch_size=G, micro_batch_size=MB, shuffle=False),
               "stream": StreamingDataLoader(stream, global_batch_size=G, micro_batch_size=MB,
                                             transform=TextWindows(tok, SEQ), shuffle=False)}
    config = Qwen3Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=SEQ,
                         tie_word_embeddings=False, use_cache=False)
    model = build_causal_lm(config, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loaders["map"], loaders["stream"] = acc.prepare(model, optimizer, loaders["map"],
                                                                      loaders["stream"])
    model.train()
    iters = {side: iter(loader) for side, loader in loaders.items()}
    firsts = {side: next(it) for side, it in iters.items()}       # the same samples on both sides?
    same = all(torch.equal(a[k], b[k]) for a, b in zip(firsts["map"], firsts["stream"]) for k in a)
    flags = torch.tensor([float(same)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    results = {"same_samples": bool(flags.item()), "map": [], "stream": [], "map_fetch": [], "stream_fetch": []}
    for rnd in range(rounds + 1):
        order = ("map", "stream") if rnd % 2 == 0 else ("stream", "map")
        for side in order:
            fetch, total = [], []
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                batch = next(iters[side])
                got = time.perf_counter()
                with acc.accumulate(model, batch) as micro_batches:
                    for mb in micro_batches:
                        acc.backward(model(**mb).loss)
                optimizer.step()
                optimizer.zero_grad()
                end = time.perf_counter()
                fetch.append(got - start)
                total.append(end - start)
            times = torch.tensor([fetch, total], dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)          # per step, the slowest rank
            if rnd:                                               # round 0: warm-up
                results[side].append(steps * G * SEQ / float(times[1].sum()))
                results[side + "_fetch"].append(float(times[0].median()))
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(results, handle)
    dist.barrier()
    acc.end_training()


def fetch_breakdown(data: str, steps: int) -> dict:
    """One process, no model: per step of G samples, the streaming loader's fetch split into reading the
    records, tokenizing them and the rest; and the map-style loader's fetch."""
    import datasets
    import torch

    from hyperacc.data import MicroBatchDataLoader, StreamingDataLoader, TextWindows
    from hyperacc.data.text import build_text_dataset, load_tokenizer

    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    tok = load_tokenizer("default")
    mapped = build_text_dataset(data, tok, SEQ, holdout_fraction=0.0)
    out = {}
    for _ in range(2):                  # second pass counts (first: file caches, imports)
        windows = TextWindows(tok, SEQ)
        loader = StreamingDataLoader(datasets.load_dataset("json", data_files=data, split="train", streaming=True),
                                     global_batch_size=G, micro_batch_size=MB, transform=windows)
        it, start = iter(loader), time.perf_counter()
        for _ in range(steps):
            next(it)
        stream_s = time.perf_counter() - start
        docs = windows.documents
        rows = list(itertools.islice(datasets.load_dataset("json", data_files=data, split="train", streaming=True),
                                     docs))
        start = time.perf_counter()
        for _ in itertools.islice(datasets.load_dataset("json", data_files=data, split="train", streaming=True),
                                  docs):
            pass
        read_s = time.perf_counter() - start
        start = time.perf_counter()
        for row in rows:
            tok(row["text"], add_special_tokens=False)
        tokenize_s = time.perf_counter() - start
        it = iter(MicroBatchDataLoader(mapped, global_batch_size=G, micro_batch_size=MB, shuffle=False))
        start = time.perf_counter()
        for _ in range(steps):
            next(it)
        map_s = time.perf_counter() - start
        out = {"stream_ms": 1e3 * stream_s / steps, "read_ms": 1e3 * read_s / steps,
               "tokenize_ms": 1e3 * tokenize_s / steps, "map_ms": 1e3 * map_s / steps, "docs_per_step": docs / steps}
    return out


# ---------------------------------------------------------------------------------------------- 3. RSS
def rss_worker(kind: str, n: int, data: str) -> None:
    import gc
    import threading

    import torch

    import rss
    from hyperacc.data import StreamingDataLoader, TextWindows

    torch.set_num_threads(1)
    if kind == "text":
        import datasets

        from hyperacc.data.text import load_tokenizer

        source = datasets.load_dataset("json", data_files=data, split="train", streaming=True)
        loader = StreamingDataLoader(source, global_batch_size=G, micro_batch_size=MB,
                                     transform=TextWindows(load_tokenizer("default"), 64))
    elif kind == "read":
        import datasets

        loader = datasets.load_dataset("json", data_files=data, split="train", streaming=True)
    else:
        loader = StreamingDataLoader(index_stream(n), global_batch_size=64, micro_batch_size=64, window=WINDOW)
    gc.collect()
    start_rss = rss.status("VmRSS")
    exact = rss.reset_peak()
    sampled, done = [start_rss], threading.Event()

    def sample():                       # where VmHWM cannot be reset: the highest RSS seen every 5 ms
        while not done.wait(0.005):
            sampled.append(rss.status("VmRSS"))

    sampler = threading.Thread(target=sample, daemon=True)
    if not exact:
        sampler.start()
    t0, steps = time.perf_counter(), 0
    for _ in loader:
        steps += 1
    seconds = time.perf_counter() - t0
    done.set()
    if not exact:
        sampler.join()
    peak = rss.peak() if exact else max(sampled)
    print(json.dumps({"start": start_rss, "peak": peak, "exact": exact, "steps": steps, "seconds": seconds}))


def run_rss(kind: str, n: int, data: str, env: dict) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss-worker", kind, str(n), data],
                          env=env, cwd=REPO, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-3000:])
        raise SystemExit(f"RSS worker {kind} {n} failed (exit {proc.returncode})")
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--far", type=int, default=10_000_000, help="part 1: the far resume position (samples)")
    parser.add_argument("--replay", type=int, default=100_000, help="part 1: where the replay contrast is measured")
    parser.add_argument("--repeats", type=int, default=5, help="part 1: resumes per position")
    parser.add_argument("--rounds", type=int, default=5, help="part 2: timed rounds per side (after a warm-up one)")
    parser.add_argument("--steps", type=int, default=8, help="part 2: steps per round")
    parser.add_argument("--words", type=int, default=200, help="part 2: words per document (mean)")
    parser.add_argument("--rss-small", type=int, default=10_000, help="part 3: records of the small streams")
    parser.add_argument("--rss-text-records", type=int, default=100_000, help="part 3: JSONL+TextWindows, big")
    parser.add_argument("--rss-read-records", type=int, default=1_000_000, help="part 3: JSONL read alone, big")
    parser.add_argument("--rss-gen-records", type=int, default=1_000_000, help="part 3: generated stream, big")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip (1,2,3)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rss-worker", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return train_worker(args.worker, args.data, args.rounds, args.steps)
    if args.rss_worker:
        kind, n, data = args.rss_worker
        return rss_worker(kind, int(n), data)
    from hyperacc.config.launch_env import free_port
    from step_timing import threads

    skip = set(filter(None, args.skip.split(",")))
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hyperacc_stream_bench_") as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads()), "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_CACHE": os.path.join(tmp, "cache"),
               "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
        os.environ.update({k: env[k] for k in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "HF_DATASETS_CACHE")})
        ratios = []
        if "1" not in skip:
            resume = part_resume(args)
            print_resume(resume, args.repeats)
            for kind, label in (("torch", "torch IterableDataset"), ("datasets", "datasets stream")):
                k = resume[kind]
                ratios.append(f"resume {label:22s} sample {resume['far']:.1e} / {resume['near']:.0e}  = "
                              f"{k['far_s'] / k['near_s']:.3f}   (goal <= 1.5)")
        if "2" not in skip:
            corpus = os.path.join(tmp, "corpus.jsonl")
            docs_needed = int((args.rounds + 2) * 2 * args.steps * G * SEQ / (args.words * 1.5) * 3) + 200
            write_corpus(corpus, docs_needed, args.words)
            out = os.path.join(tmp, "train.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                   f"--master_port={free_port()}", os.path.abspath(__file__), "--worker", out, "--data", corpus,
                   f"--rounds={args.rounds}", f"--steps={args.steps}"]
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, env=env, cwd=REPO)
            launch_s = time.perf_counter() - t0
            with open(out) as handle:
                tr = json.load(handle)
            brk = fetch_breakdown(corpus, 40)
            m, s = statistics.median(tr["map"]), statistics.median(tr["stream"])
            runs = lambda key: ", ".join(f"{v:.0f}" for v in tr[key])  # noqa: E731
            print(f"2. training, 2 processes (gloo, FSDP2, {env['OMP_NUM_THREADS']} thread each), tiny Qwen3 "
                  f"(hidden 128, 2 layers), {G} x {SEQ} tokens/step, micro-batch {MB}; {docs_needed} generated "
                  f"documents (~{args.words} words); {args.rounds} timed rounds of {args.steps} steps per side "
                  f"after a warm-up round, ABBA; step = fetch + train, slowest rank ({launch_s:.0f} s launch):")
            print(f"   both sides train on the same samples (first step compared): {tr['same_samples']}")
            print(f"   map-style  MicroBatchDataLoader(build_text_dataset)   {m:8.0f} tokens/s  (rounds {runs('map')});"
                  " "
                  f"fetch {1e3 * statistics.median(tr['map_fetch']):.2f} ms/step")
            print(f"   streaming  StreamingDataLoader(json stream, TextWindows) {s:6.0f} tokens/s  "
                  f"(rounds {runs('stream')}); fetch {1e3 * statistics.median(tr['stream_fetch']):.2f} ms/step")
            print(f"   the streaming fetch, one process, no model, per step ({brk['docs_per_step']:.1f} records): "
                  f"{brk['stream_ms']:.2f} ms = read records {brk['read_ms']:.2f} ms + tokenize "
                  f"{brk['tokenize_ms']:.2f} ms + windows/state/collate "
                  f"{brk['stream_ms'] - brk['read_ms'] - brk['tokenize_ms']:.2f} ms; map-style fetch "
                  f"{brk['map_ms']:.2f} ms", flush=True)
            ratios.append(f"tokens/s streaming / map-style                    = {s / m:.3f}   (goal >= 0.9)")
        if "3" not in skip:
            results, files = {}, {}
            cases = (("text", args.rss_text_records), ("read", args.rss_read_records), ("gen", args.rss_gen_records))
            for n in sorted({args.rss_small, args.rss_text_records, args.rss_read_records}):
                files[n] = os.path.join(tmp, f"rss_{n}.jsonl")
                write_corpus(files[n], n, 12)
            mid = args.rss_read_records // 3                 # a file above datasets' 10 MiB JSON block
            files[mid] = os.path.join(tmp, f"rss_{mid}.jsonl")
            write_corpus(files[mid], mid, 12)
            results["read", mid] = run_rss("read", mid, files[mid], env)
            for kind, big in cases:
                for n in (args.rss_small, big):
                    results[kind, n] = run_rss(kind, n, files.get(n, ""), env)
            exact = results["gen", args.rss_small]["exact"]
            print("3. peak RSS above the RSS once the stream is built (fresh process each, whole stream iterated, "
                  f"no model; {'VmHWM reset there' if exact else 'RSS sampled every 5 ms'}):")
            labels = {"text": "StreamingDataLoader: JSONL + TextWindows(64)",
                      "read": "(datasets JSONL stream alone, no loader)",
                      "gen": "StreamingDataLoader: generated torch stream"}
            grow = lambda r: (r["peak"] - r["start"]) / 2 ** 20  # noqa: E731
            for kind, big in cases:
                a, b = results[kind, args.rss_small], results[kind, big]
                print(f"   {labels[kind]:45s} {args.rss_small:>9,} records: +{grow(a):6.1f} MiB ({a['seconds']:4.1f} s)"
                      f"   {big:>9,}: +{grow(b):6.1f} MiB ({b['seconds']:4.1f} s)")
                ratios.append(f"peak RSS growth {kind:4s} {big:.0e} / {args.rss_small:.0e} records     = "
                              f"{grow(b) / max(grow(a), 1e-9):.3f}   (goal ~1)")
            a, b = results["read", mid], results["read", args.rss_read_records]
            print(f"   {labels['read']:45s} {mid:>9,} records: +{grow(a):6.1f} MiB ({a['seconds']:4.1f} s)"
                  f"   {args.rss_read_records:>9,}: +{grow(b):6.1f} MiB ({b['seconds']:4.1f} s)")
            ratios.append(f"peak RSS growth read {args.rss_read_records:.0e} / {mid:.0e} records     = "
                          f"{grow(b) / max(grow(a), 1e-9):.3f}   (both files above one 10 MiB JSON block)")
            sizes = {n: os.path.getsize(f) / 2 ** 20 for n, f in files.items()}
            listing = ", ".join(f"{n:,} records {mib:.1f} MiB" for n, mib in sorted(sizes.items()))
            print("   JSONL file sizes: " + listing
                  + "; datasets' JSON reader parses one block of up to 10 MiB (its chunksize) at a time: its peak "
                  "grows with a file up to that block, then stays")
        print(f"ratios (whole run {time.perf_counter() - began:.0f} s):")
        for line in ratios:
            print("  " + line)


if __name__ == "__main__":
    main()
