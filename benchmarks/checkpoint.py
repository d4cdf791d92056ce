"""Checkpoint overhead: hyperacc's save/load against raw DCP on the same FSDP2 model + AdamW state.

    python benchmarks/checkpoint.py [--layers 8 --width 1024 --repeats 3]
    # re-launches itself with torchrun on 2 processes; or: torchrun --nproc_per_node 2 benchmarks/checkpoint.py

Measures (median of --repeats, fresh directories, sync unless stated):
  save_state / raw dcp.save   Checkpointer.save (what acc.save_state runs: six buckets, sentinel,
                              file digests + manifest, LATEST pointer, barriers) vs dcp.save of
                              get_state_dict(model, optim)
  load_state / raw dcp.load   Checkpointer.load (files verified first) vs dcp.load + set_state_dict
  integrity on / off          the same Checkpointer save / load with integrity=False (no digests)
  async blocked / sync save   time the loop is blocked by an async save vs a sync save
  tied model (--tied-*)       a Qwen3 with tied embedding/head (Qwen3-0.6B's vocabulary and width, fewer
                              layers): checkpoint bytes and save time of hyperacc's model bucket (the tied
                              weight once) vs raw dcp.save(model.state_dict()) (both names, so twice)
Ratios are printed last. ``--tied-only`` runs just the tied-model comparison.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def relaunch(argv):
    sys.path.insert(0, REPO)
    from hyperacc.config.launch_env import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", os.path.abspath(__file__), *argv]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(subprocess.call(cmd, env=env))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--tied-vocab", type=int, default=151936, help="Qwen3-0.6B's vocabulary")
    parser.add_argument("--tied-width", type=int, default=1024, help="Qwen3-0.6B's hidden size")
    parser.add_argument("--tied-layers", type=int, default=2)
    parser.add_argument("--tied-repeats", type=int, default=3)
    parser.add_argument("--tied-only", action="store_true", help="only the tied-model comparison")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        relaunch(sys.argv[1:])

    sys.path.insert(0, REPO)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hyperacc.checkpoint import Checkpointer, TrainState
    from hyperacc.config import CheckpointConfig
    from hyperacc.runtime.progress import Progress

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if args.tied_only:
        tied_model(args, mesh)
        dist.destroy_process_group()
        return
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    def train_step():
        model(torch.randn(8, args.width)).pow(2).mean().backward()
        optimizer.step(); scheduler.step(); optimizer.zero_grad()

    train_step()
    progress = Progress(global_step=1)
    state = TrainState(models=[model], optimizers=[optimizer], schedulers=[scheduler], loader=None,
                       progress=progress, dp_rank=rank, dp_size=dist.get_world_size(), seed=0)
    root = args.dir or tempfile.mkdtemp(prefix="hyperacc_ckpt_bench_") if rank == 0 else None
    box = [root]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    payload_mb = sum(p.numel() * p.element_size() for p in model.parameters()) * 3 / 2**20
    counter = [0]

    def fresh_dir():
        counter[0] += 1
        return os.path.join(root, f"run_{counter[0]}")

    def timed(fn):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def raw_save(path):
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path)

    def raw_load(path):
        msd, osd = get_state_dict(model, optimizer)
        sd = {"model": msd, "optimizer": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])

    sync = Checkpointer(CheckpointConfig(checkpoint_dir=os.path.join(root, "managed")), device_type="cpu")
    # the same without file digests (no manifest written, nothing verified): the cost of integrity
    sync_off = Checkpointer(CheckpointConfig(checkpoint_dir=os.path.join(root, "managed_off")), device_type="cpu",
                            integrity=False)
    results = {"raw_save": [], "save_state": [], "save_no_integrity": [], "raw_load": [], "load_state": [],
               "load_no_integrity": [], "async_blocked": [], "async_total": []}
    # One Checkpointer per training run, as the Accelerator keeps it (it reuses its staging buffers).
    async_ckpt = Checkpointer(CheckpointConfig(checkpoint_dir=root, is_async=True), device_type="cpu")
    for repeat in range(args.repeats + 1):     # round 0 warms up (allocations, process groups)
        raw_dir, managed_dir, off_dir = fresh_dir(), fresh_dir(), fresh_dir()
        groups = [[("raw_save", lambda: raw_save(raw_dir)),
                   ("save_state", lambda: sync.save(state, output_dir=managed_dir)),
                   ("save_no_integrity", lambda: sync_off.save(state, output_dir=off_dir))],
                  [("raw_load", lambda: raw_load(raw_dir)),
                   ("load_state", lambda: sync.load(state, managed_dir)),
                   ("load_no_integrity", lambda: sync_off.load(state, off_dir))]]
        for group in groups:
            if repeat % 2:    # alternate the order within each group (caches, allocator)
                group.reverse()
            for key, fn in group:
                results[key].append(timed(fn))
        async_dir = fresh_dir()
        blocked = timed(lambda: async_ckpt.save(state, output_dir=async_dir))
        start = time.perf_counter()
        for _ in range(3):
            train_step()       # the loop goes on while the save is written
        async_ckpt.wait()
        dist.barrier()
        results["async_blocked"].append(blocked)
        results["async_total"].append(blocked + time.perf_counter() - start)
        if repeat == 0:
            for values in results.values():
                values.clear()
        elif rank == 0:
            print("async save phases (ms):", {k: round(v * 1000, 1) for k, v in async_ckpt.last_save_timings.items()})
            print("load_state phases (ms):", {k: round(v * 1000, 1) for k, v in sync.last_load_timings.items()})
        if rank == 0:
            for path in (raw_dir, managed_dir, off_dir, async_dir):
                shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
    async_ckpt.finish(state)

    if rank == 0:
        med = {k: statistics.median(v) for k, v in results.items()}
        print(f"model+optimizer payload: {payload_mb:.1f} MiB over 2 ranks (fp32 params + AdamW moments), "
              f"{args.repeats} repeats after 1 warm-up, dir {root}")
        for key, value in med.items():
            print(f"  {key:14s} {value * 1000:8.1f} ms   (all: {[round(x * 1000, 1) for x in results[key]]})")
        print(f"ratio save_state / raw dcp.save : {med['save_state'] / med['raw_save']:.3f}  (goal <= 1.15, "
              "integrity on)")
        print(f"ratio load_state / raw dcp.load : {med['load_state'] / med['raw_load']:.3f}")
        print(f"ratio save integrity on / off   : {med['save_state'] / med['save_no_integrity']:.3f}")
        print(f"ratio load integrity on / off   : {med['load_state'] / med['load_no_integrity']:.3f}")
        print(f"ratio async blocked / sync save : {med['async_blocked'] / med['save_state']:.3f}  (goal <= 0.2)")
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    tied_model(args, mesh)
    dist.destroy_process_group()


def _bytes(path):
    return sum(os.path.getsize(os.path.join(base, f)) for base, _, files in os.walk(path) for f in files)


def tied_model(args, mesh):
    """Checkpoint bytes and save time of a tied model: hyperacc's model bucket vs raw dcp.save(model.state_dict())."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hyperacc.checkpoint import Checkpointer, TrainState
    from hyperacc.config import CheckpointConfig

    rank = dist.get_rank()
    config = Qwen3Config(vocab_size=args.tied_vocab, hidden_size=args.tied_width, intermediate_size=3 * args.tied_width,
                         num_hidden_layers=args.tied_layers, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=args.tied_width // 8, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "the tie did not survive sharding"
    params = sum(p.numel() for p in model.parameters())
    box = [tempfile.mkdtemp(prefix="hyperacc_tied_bench_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    ckpt = Checkpointer(CheckpointConfig(checkpoint_dir=os.path.join(root, "managed"), save_optimizer=False,
                                         save_train_state=False), device_type="cpu")
    state = TrainState(models=[model], optimizers=[], schedulers=[], dp_size=dist.get_world_size())
    times = {"raw": [], "hyperacc": []}
    sizes = {}
    for repeat in range(args.tied_repeats + 1):          # round 0 warms up
        paths = {"raw": os.path.join(root, f"raw_{repeat}"), "hyperacc": os.path.join(root, f"hyperacc_{repeat}")}
        jobs = [("raw", lambda: dcp.save(model.state_dict(), checkpoint_id=paths["raw"])),
                ("hyperacc", lambda: ckpt.save(state, output_dir=paths["hyperacc"]))]
        for key, fn in (jobs if repeat % 2 else jobs[::-1]):
            dist.barrier()
            start = time.perf_counter()
            fn()
            dist.barrier()
            if repeat:
                times[key].append(time.perf_counter() - start)
        if rank == 0:
            sizes = {key: _bytes(path) for key, path in paths.items()}
            for path in paths.values():
                shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"tied model: Qwen3 vocab {args.tied_vocab} x width {args.tied_width}, {args.tied_layers} layers, "
              f"{params / 1e6:.1f} M parameters (fp32, the tied embedding/head {args.tied_vocab * args.tied_width / 1e6:.1f} M)"
              f", 2 ranks, {args.tied_repeats} repeats after 1 warm-up")
        for key in ("raw", "hyperacc"):
            print(f"  {key:9s} {sizes[key] / 2**20:9.1f} MiB   save {med[key] * 1000:8.1f} ms   "
                  f"(all: {[round(x * 1000, 1) for x in times[key]]})")
        print(f"ratio tied checkpoint bytes hyperacc / raw dcp.save(model.state_dict()) : "
              f"{sizes['hyperacc'] / sizes['raw']:.3f}")
        print(f"ratio tied save time hyperacc / raw dcp.save(model.state_dict())        : "
              f"{med['hyperacc'] / med['raw']:.3f}")
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()


if __name__ == "__main__":
    main()
