"""Depend, don't rewrite (issue 39): the maintained libraries against hyperacc's own code for weight
files, sharded Hugging Face load/export and bf16 stochastic-rounding AdamW, in one run.

    python benchmarks/libraries_weights.py [--layers 16] [--rounds 2]
    # builds a Qwen3 (16 layers: 254 M parameters, 1.0 GB fp32, one model.safetensors), then
    # re-launches itself with torchrun on 2 processes; ~1.5 min on 2 cores

Per rank, each variant between barriers, the page cache warm (the file was just written), the order
alternating between rounds: wall time and peak RSS above the RSS just before (VmHWM reset with
clear_refs; "file" is the part of it that is mapped file pages, sampled every 2 ms).

  files: read rows     hyperacc's preadv of a rank's rows straight into its FSDP2 shard (`WeightFiles`)
                       vs safetensors' ``safe_open(...).get_slice(key)[rows]`` (mmap and pread backends)
  files: header table  safetensors' header parser (what `WeightFiles` uses now) vs the 8-byte-length +
                       JSON parser it replaced (rank 0, one process)
  HF load              `fill_shards` vs ``dcp.load(model.state_dict(), HuggingFaceStorageReader(dir))``
  HF export            `export_sharded` vs ``dcp.save(..., HuggingFaceStorageWriter(save_distributed=True,
                       enable_consolidation=True))`` with the same file plan; then what each wrote
  AdamW (bf16 SR)      `hyperacc.precision.adamw.AdamW` vs torchao's ``_AdamW(bf16_stochastic_round=True)``
                       (skipped when torchao, an optional extra, is not installed): do two replicas agree
                       after one of them drew a random number the other did not, does 1 process equal 2
                       (Shard(0)), and the step time on ~4 M bf16 parameters (both ranks at once)
Ratios (library / ours) print last.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rss import reset_peak, status  # noqa: E402

from hyperacc.config.launch_env import free_port  # noqa: E402

MiB = 2**20


class Phase:
    """Wall time and peak RSS above the start (all, and mapped file pages) of a ``with`` block. The
    heap's free memory goes back to the system first (malloc_trim), so that what one variant freed
    cannot hide the next one's peak."""

    def __enter__(self):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        reset_peak()
        self.rss0, self.file0 = status("VmRSS"), status("RssFile")
        self.file_peak, self._stop = self.file0, False
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self):
        while not self._stop:
            self.file_peak = max(self.file_peak, status("RssFile"))
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self._stop = True
        self._thread.join()
        self.peak = status("VmHWM") - self.rss0
        self.file = self.file_peak - self.file0


# --------------------------------------------------------------------------- the candidates
def slice_reads(backend):
    """`WeightFiles` whose reads go through safetensors' ``get_slice(key)[index]``."""
    from safetensors import safe_open

    from hyperacc.weights.files import WeightFiles

    class SliceReads(WeightFiles):
        def __init__(self, directory):
            super().__init__(directory)
            self._handles = {name: safe_open(os.path.join(directory, name), framework="pt", backend=backend)
                             for name in {entry[0] for entry in self.entries.values()}}

        def read(self, key, index):
            return self._handles[self.entries[key][0]].get_slice(key)[tuple(index)]

        def read_into(self, key, index, dest):
            dest.copy_(self.read(key, index).reshape(dest.shape))
            return True

        def close(self):
            self._handles.clear()
            super().close()

    return SliceReads


def hand_parsed_header(file):
    """The parser `WeightFiles` had before issue 39: 8-byte length, JSON, offsets from the header."""
    from hyperacc.weights.files import _DTYPES

    with open(file, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
    return {key: (_DTYPES[info["dtype"]], tuple(info["shape"]), 8 + size + info["data_offsets"][0])
            for key, info in header.items() if key != "__metadata__"}


# --------------------------------------------------------------------------- the measurements
def measure_load(model, source, rounds, rows):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import hyperacc.weights.load as load

    ours = load.WeightFiles
    variants = {"ours": None, "get_slice mmap": slice_reads("mmap"), "get_slice pread": slice_reads("pread"),
                "DCP HF reader": "dcp"}
    reference = None
    for r in range(rounds):
        for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            for p in model.parameters():
                p.to_local().zero_()
            dist.barrier()
            with Phase() as phase:
                if variants[name] == "dcp":
                    dcp.load(model.state_dict(), storage_reader=dcp.HuggingFaceStorageReader(source.directory))
                else:
                    load.WeightFiles = variants[name] or ours
                    try:
                        load.fill_shards(model, source)
                    finally:
                        load.WeightFiles = ours
            dist.barrier()
            rows.setdefault(("load", name), []).append(phase)
            got = [p.to_local().clone() for p in model.parameters()]
            reference = reference or got
            assert all(a.equal(b) for a, b in zip(reference, got)), f"{name} loaded other values"


def measure_header(directory):
    import timeit

    from hyperacc.weights import files

    paths = [os.path.join(directory, n) for n in sorted(os.listdir(directory)) if n.endswith(".safetensors")]
    assert all(files._header(p) == hand_parsed_header(p) for p in paths)
    timing = {}
    for name, parse in (("ours", hand_parsed_header), ("safe_open", files._header)):
        timing[name] = min(timeit.repeat(lambda: [parse(p) for p in paths], number=50, repeat=5)) / 50
    return timing


def measure_export(model, out_root, rows, max_shard):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from hyperacc.weights.export import entry_groups, export_sharded, export_tensors
    from hyperacc.weights.writer import plan_files

    files = plan_files(entry_groups(export_tensors(model)), dist.get_world_size(), max_shard)
    mapping = {e.key: i + 1 for i, f in enumerate(files) for e in f.entries}
    for name in ("ours", "DCP HF writer"):
        out = os.path.join(out_root, name.split()[0].lower())
        dist.barrier()
        with Phase() as phase:
            if name == "ours":
                export_sharded(model, out, max_shard_bytes=max_shard)
            else:
                writer = dcp.HuggingFaceStorageWriter(out, fqn_to_index_mapping=mapping, save_distributed=True,
                                                      enable_consolidation=True)
                dcp.save(model.state_dict(), storage_writer=writer)
        dist.barrier()
        rows.setdefault(("export", name), []).append(phase)


def compare_exports(out_root):
    """What the DCP writer wrote, against hyperacc's export (same file plan)."""
    from safetensors import safe_open

    ours, theirs = os.path.join(out_root, "ours"), os.path.join(out_root, "dcp")
    index = [json.load(open(os.path.join(d, "model.safetensors.index.json"))) for d in (ours, theirs)]
    same_tensors, metadata = True, None
    for name in sorted(set(index[0]["weight_map"].values())):
        with safe_open(os.path.join(ours, name), "pt") as a, safe_open(os.path.join(theirs, name), "pt") as b:
            same_tensors &= sorted(a.keys()) == sorted(b.keys()) and all(
                a.get_tensor(k).equal(b.get_tensor(k)) and a.get_slice(k).get_dtype() == b.get_slice(k).get_dtype()
                for k in a.keys())
            metadata = (a.metadata(), b.metadata())
    extra = sorted(set(os.listdir(theirs)) - set(os.listdir(ours)))
    sharded = os.path.join(theirs, "sharded")
    return {"same weight_map": index[0]["weight_map"] == index[1]["weight_map"],
            "same keys, dtypes, values": bool(same_tensors),
            "header __metadata__ ours / DCP": metadata,
            "index metadata ours / DCP": (index[0]["metadata"], index[1]["metadata"]),
            "left in the DCP export": extra,
            "DCP sharded/ MiB": round(sum(os.path.getsize(os.path.join(sharded, n)) for n in os.listdir(sharded)) / MiB)
            if os.path.isdir(sharded) else 0}


def measure_adamw(mesh, rank):
    """(agreement dict, step-time dict), or None without torchao."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from hyperacc.precision.adamw import AdamW

    try:
        from torchao.optim import _AdamW
    except ImportError:
        return None
    shapes = [(64, 48), (30, 16), (7,)]         # (30, 16): rows split unevenly over 2 ranks

    def optimizer(kind, params):
        if kind == "torchao":
            return _AdamW(params, lr=1e-2, weight_decay=0.01, bf16_stochastic_round=True)
        opt = AdamW(params, lr=1e-2, weight_decay=0.01, state_dtype=torch.bfloat16, stochastic_rounding=True, seed=1)
        opt.param_names.update({id(p): f"p{i}" for i, p in enumerate(params)})
        return opt

    def run(kind, shard=False, extra_draws=0, steps=5):
        torch.manual_seed(0)                    # as the Accelerator's set_seed: the same on every rank
        torch.rand(extra_draws)                 # a rank that drew random numbers the other did not
        g = torch.Generator().manual_seed(7)
        start = [torch.randn(s, generator=g).bfloat16() for s in shapes]
        params = [torch.nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]) if shard else p) for p in start]
        opt = optimizer(kind, params)
        for step in range(steps):
            g = torch.Generator().manual_seed(100 + step)
            for p, s in zip(params, shapes):
                grad = (torch.randn(s, generator=g) * 1e-3).bfloat16()
                p.grad = distribute_tensor(grad, mesh, [Shard(0)]) if shard else grad
            opt.step()
        return [(p.full_tensor() if isinstance(p, DTensor) else p).detach() for p in params]

    agree = {}
    for kind in ("ours", "torchao"):
        whole, plain, skewed = run(kind), [None, None], [None, None]
        dist.all_gather_object(plain, whole)
        dist.all_gather_object(skewed, run(kind, extra_draws=rank))
        agree[kind] = {"replicas agree": all(a.equal(b) for a, b in zip(*plain)),
                       "replicas agree, one extra draw": all(a.equal(b) for a, b in zip(*skewed)),
                       "1 process == 2 (Shard(0))": all(a.equal(b) for a, b in zip(whole, run(kind, shard=True)))}
    # speed: 4 M bf16 parameters in 4 tensors of two shapes, each rank on its own
    sizes = [(1024, 1024)] * 3 + [(1000, 1024)]
    speed = {}
    for kind in ("ours", "torchao"):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in sizes]
        for p in params:
            p.grad = (torch.randn_like(p, dtype=torch.float32) * 1e-3).bfloat16()
        opt = optimizer(kind, params)
        t = time.perf_counter()
        opt.step()                              # torchao compiles here (once per shape)
        first = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(3):
            opt.step()
        speed[kind] = {"first step s": first, "step s": (time.perf_counter() - t) / 3}
    return agree, speed


# --------------------------------------------------------------------------- driver
def build(directory, layers):
    from transformers import Qwen3Config

    from hyperacc.models import build_causal_lm

    config = Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=128, tie_word_embeddings=False)
    build_causal_lm(config, seed=1).save_pretrained(directory, max_shard_size="50GB")


def relaunch(args):
    work = tempfile.mkdtemp(prefix="libraries_weights_")
    try:
        t = time.perf_counter()
        build(os.path.join(work, "model"), args.layers)
        print(f"built and saved the model in {time.perf_counter() - t:.1f} s", flush=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", os.path.abspath(__file__), "--layers", str(args.layers),
               "--rounds", str(args.rounds), "--work", work]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
        env.setdefault("OMP_NUM_THREADS", "1")
        return subprocess.call(cmd, env=env)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hyperacc.weights.load as load
    from hyperacc.models.build import build_for_sharded_load

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_grad_enabled(False)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_for_sharded_load(os.path.join(args.work, "model"))
    source = load.source_of(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    shard_mib = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / MiB
    rows = {}
    measure_load(model, source, args.rounds, rows)
    header = measure_header(source.directory) if rank == 0 else None
    measure_export(model, args.work, rows, max_shard=300 * MiB)
    files = compare_exports(args.work) if rank == 0 else None
    adamw = measure_adamw(mesh, rank)
    mine = {f"{k[0]}|{k[1]}": [(p.seconds, p.peak, p.file) for p in v] for k, v in rows.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        report(everyone, header, files, adamw, shard_mib)
    dist.destroy_process_group()


def report(everyone, header, files, adamw, shard_mib):
    print(f"\nper-rank shard {shard_mib:.0f} MiB; s = wall time, peak = peak RSS above the start (file: mapped "
          "file pages), per rank, every round")
    medians = {}
    for key in everyone[0]:
        runs = [run for rank_rows in everyone for run in rank_rows[key]]
        medians[key] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
        cells = "  ".join(f"{s:.2f}s/+{peak / MiB:.0f}(file {f / MiB:.0f})" for s, peak, f in runs)
        print(f"  {key:<28} {cells}")
    print(f"  header table, one file: safe_open {header['safe_open'] * 1e3:.3f} ms, hand-parsed "
          f"{header['ours'] * 1e3:.3f} ms")
    print("  DCP HF export vs ours: " + "; ".join(f"{k}: {v}" for k, v in files.items()))
    if adamw is None:
        print("  AdamW: torchao is not installed (an optional extra: pip install torchao) -- skipped")
    else:
        agree, speed = adamw
        for kind in ("ours", "torchao"):
            print(f"  AdamW {kind:<8} {agree[kind]}; first step {speed[kind]['first step s']:.2f} s, "
                  f"then {speed[kind]['step s']:.3f} s/step")
    print("\nratios, library / ours (median over ranks and rounds; peak RSS ratios of the peak above the start + "
          "the shard, i.e. of the rank's whole weight memory)")

    def ratio(kind, lib):
        (ts, tp), (os_, op) = medians[f"{kind}|{lib}"], medians[f"{kind}|ours"]
        held = shard_mib * MiB
        print(f"  {kind + ': ' + lib:<32} time {ts / os_:6.2f}   peak RSS {(tp + held) / (op + held):5.2f}   "
              f"(+{tp / MiB:.0f} vs +{op / MiB:.0f} MiB)")

    for lib in ("get_slice mmap", "get_slice pread", "DCP HF reader"):
        ratio("load", lib)
    ratio("export", "DCP HF writer")
    print(f"  {'files: header table (safe_open)':<32} time {header['safe_open'] / header['ours']:6.2f}   "
          "(adopted: the replaced hand parser is the baseline)")
    if adamw is not None:
        agree, speed = adamw
        print(f"  {'AdamW: torchao bf16 SR':<32} time {speed['torchao']['step s'] / speed['ours']['step s']:6.2f}   "
              f"first step {speed['torchao']['first step s'] / speed['ours']['first step s']:.2f}   "
              f"layout-independent: ours {agree['ours']['1 process == 2 (Shard(0))']}, torchao "
              f"{agree['torchao']['1 process == 2 (Shard(0))']}; replicas agree after one rank drew once more: "
              f"ours {agree['ours']['replicas agree, one extra draw']}, "
              f"torchao {agree['torchao']['replicas agree, one extra draw']}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16, help="16: 254 M parameters, 1.0 GB in fp32")
    parser.add_argument("--rounds", type=int, default=2, help="load rounds (the order alternates)")
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        sys.exit(relaunch(args))
    worker(args)


if __name__ == "__main__":
    main()
