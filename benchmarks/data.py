"""Data pipeline benchmark (a script, not a test).

1. Conversion throughput (tokens/s) of ``hyperacc.data.convert`` with 1 and 2 workers, on the
   embedded default corpus replicated ``--repeat`` times as a jsonl file, default tokenizer.
   TOKENIZERS_PARALLELISM is off so that ``--workers`` is the only source of parallelism.
2. Random access (sequences/s) of ``hyperacc.data.megatron.IndexedDataset`` versus
   megatron-core's ``IndexedDataset`` on the same files, same random indices.

    python benchmarks/data.py [--repeat 4] [--accesses 200000]

The last line is the reader ratio (ours / megatron-core; the goal is >= 1.0).
"""
import argparse
import json
import os
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=4, help="copies of the default corpus in the input")
    ap.add_argument("--accesses", type=int, default=200_000, help="random reads per reader")
    args = ap.parse_args()

    from hyperacc.data import convert as cv
    from hyperacc.data.default_corpus import collect_documents, default_tokenizer_dir
    from hyperacc.data.megatron import IndexedDataset

    tok_dir = default_tokenizer_dir()
    docs = collect_documents()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "corpus.jsonl")
        with open(src, "w") as f:
            for r in range(args.repeat):
                for d in docs:
                    f.write(json.dumps({"text": d}) + "\n")
        n_chars = sum(map(len, docs)) * args.repeat
        print(f"input: {len(docs) * args.repeat} documents, {n_chars / 1e6:.1f} M characters")
        # warm-up: datasets parses the jsonl into its Arrow cache once
        cv.convert(src, os.path.join(tmp, "warm"), tokenizer=tok_dir, workers=1, progress=False, log=None)
        rates = {}
        for workers in (1, 2):
            s = cv.convert(src, os.path.join(tmp, f"w{workers}"), tokenizer=tok_dir, workers=workers,
                           progress=False, log=None)
            rates[workers] = s["tokens_per_second"]
            print(f"convert, {workers} worker(s): {s['tokens']} tokens in {s['seconds']:.2f} s = "
                  f"{s['tokens_per_second']:,.0f} tokens/s")
        print(f"convert speed-up 2 workers / 1 worker: {rates[2] / rates[1]:.2f}")

        prefix = os.path.join(tmp, "w1")
        warnings.filterwarnings("ignore")
        import logging

        logging.disable(logging.WARNING)
        from megatron.core.datasets.indexed_dataset import IndexedDataset as MCoreIndexedDataset

        ours, theirs = IndexedDataset(prefix), MCoreIndexedDataset(prefix)
        n = len(ours)
        idx = np.random.default_rng(0).integers(0, n, args.accesses).tolist()
        for i in idx[:1000]:  # same content, and warm the page cache for both
            assert np.array_equal(ours[i], theirs[i])
        best = {"hyperacc": float("inf"), "megatron-core": float("inf")}
        for _ in range(5):  # interleaved rounds, best of each: robust to a busy machine
            for name, ds in (("hyperacc", ours), ("megatron-core", theirs)):
                t = time.perf_counter()
                for i in idx:
                    ds[i]
                best[name] = min(best[name], time.perf_counter() - t)
        results = {name: len(idx) / sec for name, sec in best.items()}
        for name, rate in results.items():
            print(f"random access, {name} IndexedDataset: {rate:,.0f} sequences/s ({n} sequences)")
        print(f"reader ratio hyperacc / megatron-core: {results['hyperacc'] / results['megatron-core']:.2f}")


if __name__ == "__main__":
    main()
