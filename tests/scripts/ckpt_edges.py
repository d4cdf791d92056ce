"""Checkpoint edges (tests/test_checkpoint_edges.py): who asks for saves, other tools' checkpoints, tied weights.

Modes (the first argument), each writing OUT (JSON; one file per rank as OUT.rank<R> where it runs on ranks):
  policy WORK OUT        one process: several custom loops one after another, each in its own empty
                         working directory under WORK, with the ways a loop may or may not ask for saves;
                         records every file each left behind.
  accelerate_save DIR    plain accelerate (no hyperacc): train a tiny model two steps, save_state(DIR).
  accelerate_fix DIR OUT plain accelerate: the fix `load_state` names for DIR, followed word for word
                         (prepare the same model and optimizer, load_state, save_pretrained), then
                         hyperacc.models.load_pretrained of the export; records whether the weights equal
                         the ones accelerate saved.
  dist WORK OUT          torchrun, 2 ranks: save_state/load_state into accelerate's and a Trainer's
                         checkpoint (the refusals, per rank), then a tied model: save, resume bitwise,
                         an old-format checkpoint (both keys) and an untied one with the same keys.
"""
import json
import os
import sys
import warnings

import torch

warnings.simplefilter("ignore")
VOCAB = 64


def tied_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)


def listing(root):
    """Every file under ``root``, relative, sorted (directories show through their files)."""
    out = []
    for base, _, files in os.walk(root):
        out += [os.path.relpath(os.path.join(base, f), root) for f in files]
    return sorted(out)


# ------------------------------------------------------------------------------------------ policy
def policy(work, out):
    import hyperacc
    from accelerate.utils import ProjectConfiguration
    from torch.utils.data import DataLoader, TensorDataset

    def loop(name, env=None, use_step_end=True, explicit=(), **kwargs):
        """2 epochs x 4 steps in WORK/name as the working directory; returns the files it left there."""
        where = os.path.join(work, name)
        os.makedirs(where)
        os.chdir(where)
        os.environ.update(env or {})
        try:
            acc = hyperacc.Accelerator(seed=0, **kwargs)
        finally:
            for key in env or {}:
                del os.environ[key]
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
        model, opt, loader = acc.prepare(model, opt, loader)
        if not acc.project_configuration.automatic_checkpoint_naming:
            acc.load_state()        # CheckpointConfig.restore_from: None does nothing; LATEST finds nothing
        saved = []
        for _ in range(2):
            for (x,) in loader:
                acc.backward(model(x).square().mean())
                opt.step()
                opt.zero_grad()
                if use_step_end:
                    saved.append(acc.step_end())
        for target in explicit:
            saved.append(acc.save_state(*target))
        acc.end_training()
        os.chdir(work)
        return {"files": listing(where), "returned": [os.path.relpath(p, where) for p in saved if p]}

    C = hyperacc.CheckpointConfig
    record = {
        "default": loop("default"),
        "default_config": loop("default_config", checkpoint=C()),
        "restore_only": loop("restore_only", checkpoint=C(restore_from="LATEST")),
        "project_dir": loop("project_dir", project_dir="proj"),
        "accelerate_style": loop("accelerate_style", use_step_end=False,
                                 project_config=ProjectConfiguration(project_dir="proj")),
        "save_ckpt_false": loop("save_ckpt_false", checkpoint=C(checkpoint_dir="mine", save_ckpt=False)),
        "checkpoint_dir": loop("checkpoint_dir", checkpoint=C(checkpoint_dir="mine")),
        "save_steps": loop("save_steps", checkpoint=C(save_steps=3, save_epochs=0)),
        "save_steps_project": loop("save_steps_project", project_dir="proj", checkpoint=C(save_steps=3, save_epochs=0)),
        "env_dir": loop("env_dir", env={"HYPERACC_CHECKPOINT_CHECKPOINT_DIR": "envdir"}),
        "env_steps": loop("env_steps", env={"HYPERACC_CHECKPOINT_SAVE_STEPS": "4", "HYPERACC_CHECKPOINT_SAVE_EPOCHS": "0"}),
        "automatic": loop("automatic", project_config=ProjectConfiguration(project_dir="proj",
                                                                           automatic_checkpoint_naming=True)),
        "explicit_only": loop("explicit_only", explicit=[(), ("mine",)]),
    }
    try:
        hyperacc.Accelerator(project_config=ProjectConfiguration(automatic_checkpoint_naming=True))
        record["automatic_no_project_dir"] = None
    except ValueError as err:
        record["automatic_no_project_dir"] = str(err)
    with open(out, "w") as handle:
        json.dump(record, handle)


# ------------------------------------------------------------------------------- plain accelerate
def _accelerate_model(seed):
    from hyperacc.models import build_causal_lm

    return build_causal_lm(tied_config(), seed=seed)


def accelerate_save(directory):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = _accelerate_model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        acc.backward(model(input_ids=x, labels=x).loss)
        opt.step()
        opt.zero_grad()
    acc.save_state(directory)


def accelerate_fix(directory, out):
    """What the error says, step by step, in a new script; then a hyperacc start from the export."""
    from accelerate import Accelerator
    from safetensors.torch import load_file

    import hyperacc.models

    accelerator = Accelerator(cpu=True)
    model = _accelerate_model(2)                    # another init: load_state must bring the saved weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state(directory)
    export = os.path.join(os.path.dirname(out), "exported")
    accelerator.unwrap_model(model).save_pretrained(export, state_dict=accelerator.get_state_dict(model))
    started = hyperacc.models.load_pretrained(export)
    saved = load_file(os.path.join(directory, "model.safetensors"))
    state = started.state_dict()
    same = all(torch.equal(state[k], v) for k, v in saved.items() if k in state)
    with open(out, "w") as handle:
        json.dump({"equal": same, "compared": sorted(k for k in saved if k in state), "saved_keys": sorted(saved),
                   "tied": started.lm_head.weight is started.model.embed_tokens.weight}, handle)


# ------------------------------------------------------------------------------------------- dist
def _attempt(fn):
    try:
        fn()
        return None
    except Exception as err:  # noqa: BLE001 - recorded for the test
        return {"type": type(err).__name__, "message": str(err)}


def dist(work, out):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    import hyperacc
    from hyperacc.checkpoint import storage
    from hyperacc.models import build_causal_lm

    acc = hyperacc.Accelerator(seed=3, checkpoint=hyperacc.CheckpointConfig(checkpoint_dir=os.path.join(work, "ckpt")))
    rank = acc.process_index
    record = {}
    model = build_causal_lm(tied_config(), seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)

    # another tool's checkpoints: refused by save_state and load_state, nothing written
    for name in ("accelerate", "trainer"):
        target = os.path.join(work, name)
        record[f"save_{name}"] = _attempt(lambda: acc.save_state(target))
        record[f"load_{name}"] = _attempt(lambda: acc.load_state(target))

    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))

    def train(n):
        losses = []
        for _ in range(n):
            loss = model(input_ids=x, labels=x).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    def snapshot():
        params = {k: v.full_tensor().clone() for k, v in get_model_state_dict(model).items()}
        head = model.lm_head.weight
        moments = {k: v.full_tensor().clone() for k, v in opt.state[head].items() if hasattr(v, "full_tensor")}
        return params, moments, opt.state[head]["step"].clone()

    def same(a, b):
        return (all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
                and torch.equal(a[2], b[2]))

    train(2)
    new = acc.save_state()
    at_save = snapshot()
    old = os.path.join(work, "old_format")
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=old)      # both keys, as before ties were deduplicated
    after = train(2)
    at_end = snapshot()
    acc.load_state(new)
    record["tie_kept"] = model.lm_head.weight is model.model.embed_tokens.weight
    record["restored_bitwise"] = same(snapshot(), at_save)
    record["resumed_losses_equal"] = train(2) == after
    record["resumed_end_bitwise"] = same(snapshot(), at_end)
    record["new"] = new

    # an old-format checkpoint (both keys): weights only, so read the model bucket alone
    acc.checkpoint_config.restore_optimizer = acc.checkpoint_config.restore_train_state = False
    acc.load_state(old)
    record["old_loaded_bitwise"] = all(torch.equal(snapshot()[0][k], at_save[0][k]) for k in at_save[0])
    record["old_tie_kept"] = model.lm_head.weight is model.model.embed_tokens.weight

    # the same keys, values differing: saved from an untied model; refused, nothing loaded
    untied = os.path.join(work, "untied_values")
    state = get_model_state_dict(model)
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] + 2.0    # new tensors: the live
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0                          # weights stay as they are
    dcp.save({"model": state}, checkpoint_id=untied)
    before = snapshot()[0]
    record["untied"] = _attempt(lambda: acc.load_state(untied))
    record["untied_untouched"] = all(torch.equal(snapshot()[0][k], before[k]) for k in before)
    record["sentinel_tied"] = (storage.read_sentinel(new) or {}).get("tied")
    acc.end_training()
    with open(f"{out}.rank{rank}", "w") as handle:
        json.dump(record, handle)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    {"policy": policy, "accelerate_save": accelerate_save, "accelerate_fix": accelerate_fix, "dist": dist}[mode](*args)
