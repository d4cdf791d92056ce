"""Restoring: which checkpoint to trust, what it holds, and putting the training state back.

Everything that can fail is checked on rank 0 before the collective DCP load (``plan_load``) and
the verdict is broadcast by the Checkpointer, so every rank raises the same error at the same
point. Integrity is checked even before that (``manifest_status`` + ``integrity``): no byte of a
checkpoint is trusted, parsed or unpickled-with-restrictions until its digest matched.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import List, Optional

from hyperacc.checkpoint import (_comm, buckets, custom_objects, discovery, frozen_base, integrity, lifecycle,
                                 optim_state, storage)
from hyperacc.checkpoint.state import FILE, PER_RANK, SHARED, select

logger = logging.getLogger("hyperacc.checkpoint")
warn0 = buckets.warn0


# --------------------------------------------------------------------------- integrity verdicts
def manifest_status(path: str, enabled: bool) -> tuple:
    """Rank 0: ("ok", files) to verify, ("legacy", why) / ("off", None) to load unverified, or
    ("bad", what) for a checkpoint that must not be loaded."""
    if not enabled:
        return "off", None
    try:
        sentinel = storage.read_sentinel(path)
    except (OSError, ValueError) as err:
        return "bad", f"checkpoint {path}: {storage.SENTINEL_FILE} is unreadable ({err})"
    try:
        files = integrity.read_manifest(path)
    except integrity.IntegrityError as err:
        return "bad", str(err)
    if files is None:
        if sentinel and sentinel.get("format_version", 1) >= 2 and sentinel.get("integrity"):
            return "bad", (f"checkpoint {path}: {integrity.MANIFEST_FILE} is missing (it is written before "
                           ".metadata: it was removed, or the directory was copied incompletely)")
        return "legacy", (f"checkpoint {path} has no {integrity.MANIFEST_FILE} (written before hyperacc recorded "
                          "checksums): loading it without verifying its files.")
    try:
        metadata = storage.read_dcp_metadata(path)
    except Exception as err:  # noqa: BLE001 - any failure to parse it means a damaged checkpoint
        return "bad", f"checkpoint {path}: file .metadata is unreadable ({type(err).__name__}: {err})"
    problem = integrity.check_dcp_references(path, metadata, files)
    return ("bad", f"checkpoint {path} is damaged: {problem}") if problem else ("ok", files)


def verify(path: str, enabled: bool, group=None) -> Optional[str]:
    """Collective: None when ``path`` may be loaded; else one line naming the directory, the file
    and what is wrong (the same on every rank)."""
    kind, detail = _comm.decide_on_rank0(lambda: manifest_status(path, enabled), group)
    if kind == "legacy":
        warn0(detail)
    if kind != "ok":
        return detail if kind == "bad" else None
    problems = integrity.verify_collectively(path, detail, group)
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"checkpoint {path} is damaged: {problems[0]}{more}"


def _candidates(source: str, root: str, lock) -> list:
    """Rank 0: the single-writer ``lock`` (given when this job may save into ``root``; taken only where
    ``root`` exists: nothing to guard, or create, elsewhere), then the checkpoints ``source`` may mean,
    best first (several only for "LATEST")."""
    if (lock is not None and os.path.isdir(root)
            and (source == "LATEST" or lifecycle.manages(root, discovery.resolve_source(source, root) or source))):
        lock.acquire()
    if source == "LATEST":
        candidates = discovery.latest_candidates(root)
        if candidates:
            return [os.path.abspath(p) for p in candidates]
    found = discovery.resolve_source(source, root)
    return [os.path.abspath(found)] if found is not None else []


def trusted_checkpoint(source: str, root: str, enabled: bool, group=None, *, lock=None) -> tuple:
    """Collective: (the checkpoint to load, its files verified, or None; the damaged ones passed over).
    "LATEST" falls back past damaged checkpoints to the newest older one that verifies."""
    candidates = _comm.decide_on_rank0(lambda: _candidates(source, root, lock), group)
    damaged = []
    for n, path in enumerate(candidates):
        problem = verify(path, enabled, group)
        if problem is None:
            return path, damaged
        damaged.append(path)
        if n + 1 < len(candidates):
            warn0(f"{problem}. restore_from='LATEST': falling back to {candidates[n + 1]}.")
            continue
        hint = (" No older checkpoint verifies either." if n else "")
        raise integrity.IntegrityError(f"{problem}.{hint} Restore another checkpoint (CheckpointConfig.restore_from="
                                       "<path>, or load_state(<path>)) or copy the damaged file back from a backup.")
    return None, damaged


# --------------------------------------------------------------------------- the load plan
def _mismatch_hint(sentinel: dict, adapters_only: bool) -> str:
    saved_peft = sentinel.get(storage.TRAINABLE_ONLY_KEY)
    if saved_peft and not adapters_only:
        return ("the checkpoint holds the trainable tensors of a PEFT run only: wrap the model with the same "
                "PEFT config before prepare(), or set CheckpointConfig.is_peft=True for a model whose frozen part comes from elsewhere")
    if saved_peft is False and adapters_only:
        return ("the checkpoint holds a full model, not adapters: a PEFT run resumes from its own checkpoints; "
                "start adapters from a full model by loading its weights (hyperacc.models.load_pretrained)")
    return "the model does not match the checkpoint: another architecture, config or adapter configuration"



def _check_shapes(path: str, model_keys, available) -> None:
    """A tensor of another shape (another model size, another LoRA rank): one line, before DCP's own error."""
    for keys in model_keys:
        if not isinstance(keys, dict):
            continue
        for key, shape in keys.items():
            saved = tuple(getattr(available[key], "size", shape))
            if saved != tuple(shape):
                raise RuntimeError(f"checkpoint {path}: model key {key} has shape {list(saved)} there and {list(shape)} "
                                   "in this model (another model size, or another adapter rank r): restore into the "
                                   "configuration that saved it.")


def _refuse_unused_adapters(path: str, model_keys, available) -> None:
    """Adapters the checkpoint holds and this model has no place for would be dropped silently
    (a resume with fewer target modules): refused."""
    live = {k for keys in model_keys for k in keys}
    prefixes = {k.split(".", 1)[0] + "." for k in live}
    unused = sorted(k for k in available if any(k.startswith(p) for p in prefixes) and k not in live
                    and hasattr(available[k], "size"))
    if unused:
        raise RuntimeError(f"checkpoint {path} holds trained tensor(s) this model has no place for: {unused[0]}"
                           f"{f' (and {len(unused) - 1} more)' if len(unused) > 1 else ''} (another adapter "
                           "configuration: target_modules or modules_to_save changed?). Resume with the PEFT "
                           "config that saved it.")


def _tied_hint(sentinel: dict, missing: List[str]) -> Optional[str]:
    """When the keys missing are tied aliases the checkpoint stored once: the tie that differs."""
    saved = {f"{buckets.model_key(i)}.{alias}": f"{buckets.model_key(i)}.{kept}"
             for i, tied in enumerate(sentinel.get("tied") or []) for alias, kept in tied.items()}
    if missing and all(k in saved for k in missing):
        return (f"the checkpoint's model ties {missing[0]} to {saved[missing[0]]} (one parameter, stored once) and "
                "this model does not: build it with the same tie as the run that saved it (tie_word_embeddings)")
    return None


def plan_load(cfg, path: str, model_keys, live_groups: List[List[List[str]]], state, *,
              adapters_only: bool = False, frozen: Optional[list] = None, tied: Optional[list] = None,
              registered_objects: int = 0) -> dict:
    """Rank 0: check everything that could fail, before any collective. ``live_groups``: per
    optimizer to restore, its param groups' parameter names. ``model_keys``: what must be there
    (``adapters_only``: the trainable tensors). ``frozen``: the live frozen base's fingerprints
    (`frozen_base`), checked against the checkpoint's. ``tied``: per model, its tied ``{alias: kept}``
    keys (`buckets.tied_aliases`); the plan's ``tied_copies`` names the aliases a checkpoint written
    before ties were stored once still holds, which the load checks equal to their kept key.
    ``registered_objects``: how many objects are registered (accelerate's ``register_for_checkpointing``)."""
    problem = custom_objects.count_problem(path, registered_objects)
    if problem:
        raise RuntimeError(problem)
    sentinel = storage.read_sentinel(path) or {}
    available = storage.read_dcp_metadata(path).state_dict_metadata
    missing = [k for keys in model_keys for k in keys if k not in available]
    if missing:
        hint = _tied_hint(sentinel, missing) or _mismatch_hint(sentinel, adapters_only)
        raise RuntimeError(f"missing model key(s) in checkpoint {path}: {missing[:8]}"
                           f"{' ...' if len(missing) > 8 else ''} ({hint}).")
    copies = [sorted(alias for alias, kept in (aliases or {}).items()
                     if f"{buckets.model_key(i)}.{kept}" in keys and f"{buckets.model_key(i)}.{alias}" in available)
              for i, (keys, aliases) in enumerate(zip(model_keys, tied or [{}] * len(model_keys)))]
    _check_shapes(path, model_keys, available)
    if adapters_only:
        _refuse_unused_adapters(path, model_keys, available)
        if frozen is not None:
            frozen_base.check(path, sentinel.get("frozen_base"), frozen)
    if sentinel.get("contents") == "model":
        # A model-only checkpoint (`convert from-hf`): where a run starts, not where one resumes.
        logger.info("%s holds weights only: optimizer, schedule, loader and progress start fresh.", path)
        return {"path": path, "saved_optimizers": 0, "optim": [], "layout": "none", "model_only": True,
                "saved_world_size": None, "saved_dp_size": None, "embedded_numel": None, "same_topology": False,
                "tied_copies": copies}
    saved_precision = sentinel.get("precision")
    if saved_precision and saved_precision != state.precision:
        warn0(f"checkpoint {path} was saved under precision={saved_precision!r} and this run uses "
              f"{state.precision!r}: its parameters and optimizer states are cast to this run's dtypes as "
              "they load.")
    n_optimizers = len(live_groups)
    saved_optimizers = sentinel.get("optimizers")
    if saved_optimizers is None:
        saved_optimizers = len({k.split(".")[0] for k in available if k.startswith("optimizer")})
    if n_optimizers and saved_optimizers == 0:
        raise FileNotFoundError(f"{path} holds no optimizer state (saved with "
                                "CheckpointConfig.save_optimizer=False); set CheckpointConfig.restore_optimizer=False "
                                "to load it.")
    if n_optimizers and saved_optimizers != n_optimizers:
        warn0(f"The checkpoint holds {saved_optimizers} optimizer(s) but training has {n_optimizers}: "
              f"restoring the first {min(saved_optimizers, n_optimizers)} pair(s) in order, the rest "
              "keep their fresh state.")
    plan = {"path": path, "saved_optimizers": saved_optimizers, "optim": [],
            "saved_world_size": sentinel.get("world_size"), "saved_dp_size": sentinel.get("dp_size"),
            "embedded_numel": None, "same_topology": False, "tied_copies": copies}
    for i in range(min(saved_optimizers, n_optimizers)):
        plan["optim"].append(_optimizer_plan(path, available, i, live_groups[i]))
    _plan_train_state(cfg, path, sentinel, available, plan, state)
    return plan


def _optimizer_plan(path: str, available: dict, index: int, live: List[List[str]]) -> dict:
    structure = optim_state.saved_structure(available, buckets.optimizer_key(index))
    template = optim_state.groups_template(structure)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # a rank-0-only read: DCP notes it is not distributed
        storage.dcp_load({buckets.optimizer_key(index): template}, path, no_dist=True)
    groups = template["param_groups"]
    difference = optim_state.first_difference(index, groups, live)
    if difference:
        raise ValueError(f"cannot restore the optimizer state of {path}: {difference}. Build the optimizer as "
                         "it was at save time (same parameters, param groups and order), or set "
                         "CheckpointConfig.restore_optimizer=False to start it fresh.")
    return {"structure": structure, "groups": groups}


def _plan_train_state(cfg, path, sentinel, available, plan, state) -> None:
    layout = sentinel.get("train_state")
    if layout is None:  # not written by hyperacc: detect from the files
        if os.path.isdir(os.path.join(path, storage.EXTRA_STATE_DIR)):
            layout = "per_rank"
        elif storage.EMBEDDED_EXTRA_KEY in available:
            layout = "embedded"
        else:
            layout = "none"
    plan["layout"] = layout
    if not cfg.restore_train_state:
        return
    if layout == "none":
        raise FileNotFoundError(f"{path} holds no training state (saved with "
                                "CheckpointConfig.save_train_state=False: weights only). Set "
                                "CheckpointConfig.restore_train_state=False to load just the weights.")
    world = _comm.world_size()
    plan["same_topology"] = (sentinel.get("world_size") == world and sentinel.get("dp_size") == int(state.dp_size))
    if layout == "per_rank":
        needed = range(world) if plan["same_topology"] else [0]
        absent = [storage.extra_state_path(path, r) for r in needed
                  if not os.path.isfile(storage.extra_state_path(path, r))]
        if absent:
            raise FileNotFoundError(f"extra_state file(s) missing from {path}: {absent[:4]} (the "
                                    "training-state bucket of this checkpoint is incomplete).")
    elif layout == "embedded":
        if storage.EMBEDDED_EXTRA_KEY not in available:
            raise FileNotFoundError(f"{path} says its training state is embedded in the DCP payload "
                                    f"but the '{storage.EMBEDDED_EXTRA_KEY}' item (extra_state) is missing.")
        plan["embedded_numel"] = int(available[storage.EMBEDDED_EXTRA_KEY].size.numel())
    else:
        raise RuntimeError(f"{path}: unknown training-state layout {layout!r}")


# --------------------------------------------------------------------------- train state
def restore_train_state(states: dict, state, plan: dict, payload: dict, cfg) -> None:
    """On every rank, after the DCP load: the extra-state buckets (progress, lr_scheduler(s), loader) from
    the embedded item or this rank's file, this rank's RNG (or re-derived where the saved streams cannot
    be mapped onto the ranks), then the registered objects (their count was checked by the plan)."""
    if cfg.restore_train_state and not plan.get("model_only"):
        _restore_extra_state(states, state, plan, payload)
    custom_objects.load(select(states, FILE), plan["path"])


def _restore_extra_state(states: dict, state, plan: dict, payload: dict) -> None:
    path = plan["path"]
    if plan["layout"] == "embedded":
        extra = storage.tensor_to_obj(payload[storage.EMBEDDED_EXTRA_KEY], f"extra_state in {path}")
    else:
        own = _comm.rank() if plan["same_topology"] else 0
        extra = storage.load_weights_only(storage.extra_state_path(path, own),
                                          f"extra_state file of rank {own} in {path}")
    for key, bucket in select(states, SHARED).items():      # in order: the loader's epoch is progress's
        bucket.load_state_dict(extra.get(key))
    step = int(state.progress.global_step)
    if plan["layout"] == "per_rank" and plan["same_topology"] and "rng" in extra:
        for key, bucket in select(states, PER_RANK).items():
            bucket.load_state_dict(extra[key])
        return
    why = ("the checkpoint keeps no per-rank RNG (embedded extra-state layout)" if plan["layout"] == "embedded"
           else f"the topology changed (saved world size {plan['saved_world_size']}, dp size "
                f"{plan['saved_dp_size']}; now {_comm.world_size()}, {state.dp_size})")
    if plan["layout"] == "embedded":
        logger.info("RNG re-derived from (seed, step, rank): %s", why)
    else:
        warn0(f"RNG states not restored because {why}: re-deriving them from (seed={state.seed}, "
              f"step={step}, rank).")
    states["rng"].rederive(int(state.seed), step)
