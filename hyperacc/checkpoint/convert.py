"""Offline conversion between hyperacc checkpoints and Hugging Face safetensors, without a process
group, one tensor in memory at a time.

    python -m hyperacc.checkpoint.convert to-hf --checkpoint CKPT/global_step_N --output OUT [--config-from HF_DIR]
    python -m hyperacc.checkpoint.convert from-hf --model HF_DIR_OR_CACHED_ID --output CKPT_DIR

``to-hf`` writes what the in-job export writes (per-expert keys, index, config.json). The model's
config comes from the checkpoint's saved run config (``config.yaml``: the pretrained config or the
preset, with the run's overrides; the vocabulary size from the embedding) or ``--config-from``.
``from-hf`` writes a model-only checkpoint (no optimizer, no training state) that a run starts
from with ``CheckpointConfig.restore_from=CKPT_DIR`` (``load_state(CKPT_DIR)``): weights loaded, optimizer and progress fresh.
Why a model-only checkpoint rather than loading the HF directory in the job: DCP reshards it to
any world size and layout, and it is verified (file digests) like every other checkpoint.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import warnings
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from tqdm import tqdm

from hyperacc.checkpoint import buckets, containment, discovery, integrity, restore, storage
from hyperacc.weights import layout
from hyperacc.weights.export import entry_groups, hf_config, piece_of, write_metadata
from hyperacc.weights.files import WeightFiles, WeightsError, resolve_model_dir
from hyperacc.models import qwen3_moe_config
from hyperacc.models.build import build_for_sharded_load
from hyperacc.weights.export import export_tensors
from hyperacc.weights.load import plan
from hyperacc.weights.writer import RankWriter, plan_files, write_index
from hyperacc.errors import ConvertError  # noqa: F401 - defined with every error class

MODEL_ONLY = "model"     # the sentinel's "contents" for a checkpoint that holds weights only


# --------------------------------------------------------------------------- output directories
def _output_dir(path: str, overwrite: bool) -> str:
    path = os.path.abspath(path)
    if os.path.islink(path) or os.path.isfile(path):
        raise ConvertError(f"--output {path} exists and is not a directory; choose another path.")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise ConvertError(f"--output {path} is not empty; choose a new directory or pass --overwrite.")
    tmp = f"{path}.tmp-hyperacc-convert"
    shutil.rmtree(tmp, ignore_errors=True)       # a killed conversion of ours
    os.makedirs(tmp)
    return tmp


def _publish(tmp: str, path: str) -> None:
    """Put the finished ``tmp`` in place of ``path`` (the old contents go only once it is complete)."""
    path = os.path.abspath(path)
    old = None
    if os.path.isdir(path):
        old = f"{path}.old-hyperacc-convert"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    if old:
        shutil.rmtree(old)


# --------------------------------------------------------------------------- to-hf
def _config_from_run(checkpoint: str, embed_rows: Optional[int]):
    """The transformers config of a run from its saved ``config.yaml`` (model section)."""
    import yaml

    file = os.path.join(checkpoint, containment.RUN_CONFIG_FILE)
    if not os.path.isfile(file):
        raise ConvertError(f"{checkpoint} holds no {containment.RUN_CONFIG_FILE} (the run's config); pass "
                           "--config-from HF_DIR with the model's config.json.")
    with open(file) as handle:
        model_section = (yaml.safe_load(handle) or {}).get("model") or {}
    overrides = dict(model_section.get("overrides") or {})
    if embed_rows is not None:
        overrides.setdefault("vocab_size", embed_rows)
    if model_section.get("name_or_path"):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(resolve_model_dir(model_section["name_or_path"]))
        for key, value in overrides.items():
            setattr(config, key, value)
    elif model_section.get("preset", "tiny") == "tiny":

        config = qwen3_moe_config(**overrides)
    else:
        raise ConvertError(f"{file}: model.preset={model_section.get('preset')!r} is unknown; pass --config-from HF_DIR.")
    config.use_cache = False
    return config


def to_hf(checkpoint: str, output: str, *, config_from: Optional[str] = None, overwrite: bool = False,
          max_shard_bytes: int = 5 * 1024**3, progress: bool = True) -> str:
    """Stream the model bucket of a hyperacc checkpoint into a Hugging Face directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint = os.path.abspath(checkpoint)
    if not discovery.is_complete(checkpoint):
        raise ConvertError(f"--checkpoint {checkpoint} is not a complete checkpoint (no .metadata); pass a "
                           "global_step_<N> directory whose save finished.")
    problem = restore.verify(checkpoint, True)
    if problem:
        raise ConvertError(problem)
    if (storage.read_sentinel(checkpoint) or {}).get(storage.TRAINABLE_ONLY_KEY):
        raise ConvertError(f"{checkpoint} holds the trainable tensors of an adapter run only (no base model): "
                           "there is no full model to convert. Fix: export them from a run that resumes from "
                           "this checkpoint (Accelerator.save_model(model, DIR) writes the adapter).")
    metadata = storage.read_dcp_metadata(checkpoint).state_dict_metadata
    prefix = buckets.model_key(0) + "."
    saved = {k[len(prefix):]: v for k, v in metadata.items() if k.startswith(prefix) and hasattr(v, "size")}
    embed = next((tuple(v.size) for k, v in saved.items() if k.endswith("embed_tokens.weight")), None)
    if config_from:
        config = AutoConfig.from_pretrained(resolve_model_dir(config_from))
    else:
        config = _config_from_run(checkpoint, embed[0] if embed else None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")

    tensors = export_tensors(model)
    arch = type(model).__name__
    # a run stores a tied weight once (its sentinel names the ties): a config without the tie reads it twice
    tied = ((storage.read_sentinel(checkpoint) or {}).get("tied") or [{}])[0]
    source = {name: name if name in saved else tied.get(name, name) for name, _ in tensors}
    for name, tensor in tensors:
        name = source[name]
        if name not in saved:
            raise ConvertError(f"{checkpoint}: key {name!r} of {arch} is missing from the checkpoint: it holds "
                               "another architecture than this config (pass --config-from the right HF_DIR).")
        if tuple(saved[name].size) != tuple(tensor.shape):
            raise ConvertError(f"{checkpoint}: key {name!r} has shape {list(saved[name].size)} but {arch} of this "
                               f"config needs {list(tensor.shape)} (another model size or architecture).")
    known = {n for n, _ in tensors} | set(layout.aliases(model))
    extra = [k for k in saved if k not in known]
    if extra:
        raise ConvertError(f"{checkpoint}: key {extra[0]!r} matches no parameter of {arch} (another architecture?).")
    tensors = [(n, torch.empty(t.shape, dtype=saved[source[n]].properties.dtype, device="meta")) for n, t in tensors]
    files = plan_files(entry_groups(tensors), 1, max_shard_bytes)
    tmp = _output_dir(output, overwrite)
    writer = RankWriter(tmp, files, 0)
    for name, meta in tqdm(tensors, desc="to-hf", unit="tensor", disable=not progress):
        full = torch.empty(meta.shape, dtype=meta.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            storage.dcp_load({prefix + source[name]: full}, checkpoint, no_dist=True)
        for piece in layout.export_pieces(name, tuple(full.shape)):
            writer.write(piece.key, piece_of(full, piece))
        del full
    writer.close()
    write_metadata(tmp, hf_config(model, tensors[0][1].dtype if tensors else None),
                   model.generation_config if model.can_generate() else None)
    write_index(tmp, files)
    _publish(tmp, output)
    return os.path.abspath(output)


# --------------------------------------------------------------------------- from-hf
class _LazySavePlanner(DefaultSavePlanner):
    """DCP plans from meta tensors (shapes, dtypes) and asks for each tensor's data only when it
    writes it (`resolve_data` is DCP's extension point), so one tensor is in memory at a time."""

    def __init__(self, produce, bar):
        super().__init__()
        self._produce, self._bar = produce, bar

    def resolve_data(self, write_item):
        tensor = self._produce(write_item.index.fqn)
        self._bar.update(1)
        return tensor


def from_hf(model_dir: str, output: str, *, dtype=None, overwrite: bool = False, progress: bool = True) -> str:
    """Write a model-only DCP checkpoint of the Hugging Face weights in ``model_dir``."""
    try:
        model = build_for_sharded_load(model_dir, dtype=dtype)
        files = WeightFiles(resolve_model_dir(model_dir))
        pieces = plan(model, files)          # every missing/unexpected/mis-shaped key, before writing
    except WeightsError as err:
        raise ConvertError(str(err)) from None
    prefix = buckets.model_key(0) + "."
    tied = layout.aliases(model)        # a tied weight once, under its kept name, as a run's save stores it
    state = {prefix + name: tensor for name, tensor in model.state_dict().items() if name in pieces and name not in tied}
    owner = {prefix + name: name for name in model.state_dict()}

    def produce(fqn: str) -> torch.Tensor:
        name = owner[fqn]
        meta = state[fqn]
        full = torch.empty(meta.shape, dtype=meta.dtype)
        for piece in pieces[name]:
            source_index, dest_index = layout.intersect((0,) * full.dim(), tuple(full.shape), piece)
            dest = full[dest_index]
            dest.copy_(files.read(piece.key, source_index).reshape(dest.shape))
        return full

    tmp = _output_dir(output, overwrite)
    digest = storage.write_sentinel(tmp, {
        "integrity": integrity.ALGORITHM, "global_step": 0, "epoch": 0, "train_state": "none", "rng": "not_saved",
        "models": 1, "optimizers": 0, "schedulers": 0, "world_size": 1, "dp_size": 1,
        storage.TRAINABLE_ONLY_KEY: False, "seed": 0,
        "contents": MODEL_ONLY, "source": files.directory, "tied": [tied]})
    writer = integrity.IntegrityWriter(tmp, extra_files={storage.SENTINEL_FILE: digest}, thread_count=1)
    with tqdm(total=len(state), desc="from-hf", unit="tensor", disable=not progress) as bar:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")      # DCP notes that no process group is used
            dcp.save(state, checkpoint_id=tmp, storage_writer=writer, planner=_LazySavePlanner(produce, bar),
                     no_dist=True)
    files.close()
    _publish(tmp, output)
    return os.path.abspath(output)


# --------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyperacc.checkpoint.convert", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("to-hf", help="hyperacc checkpoint (global_step_N) -> Hugging Face safetensors directory")
    a.add_argument("--checkpoint", required=True)
    a.add_argument("--output", required=True)
    a.add_argument("--config-from", help="a Hugging Face directory (or cached hub id) whose config.json to use")
    a.add_argument("--max-shard-size", default="5GB")
    a.add_argument("--overwrite", action="store_true")
    b = sub.add_parser("from-hf", help="Hugging Face directory (or cached hub id) -> model-only hyperacc checkpoint")
    b.add_argument("--model", required=True)
    b.add_argument("--output", required=True)
    b.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    b.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.command == "to-hf":
            from accelerate.utils import convert_file_size_to_int

            out = to_hf(args.checkpoint, args.output, config_from=args.config_from, overwrite=args.overwrite,
                        max_shard_bytes=convert_file_size_to_int(args.max_shard_size))
        else:
            out = from_hf(args.model, args.output, dtype=getattr(torch, args.dtype) if args.dtype else None,
                          overwrite=args.overwrite)
    except (ConvertError, WeightsError, FileNotFoundError, integrity.IntegrityError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
