"""Every flag of examples/train_qwen.py given what a hostile (or hurried) user gives it (issue 38, "try to break
it again"): a value of the wrong type, on the command line and in the YAML file; nan / inf / -inf where a number
goes; the config file itself where a path goes; a path that does not exist (an input) or cannot be created (an
output, under a file). Each case must end as ONE ConfigError line naming the flag and a fix, raised by
load_config or preflight (before any process group), with no file written and the config file untouched.

The cases are generated from the schema (config_schema.TrainConfig: its dataclass fields and the optimizer's
keywords), so a field added later is fuzzed too; the few values a field accepts on purpose are listed in
ACCEPTED with the reason, and checked to be accepted without writing anything. In-process (fast); one real
2-process ``accelerate launch`` proves the exit path (exit 2 from the worker, one line, the config untouched),
more in the slow set.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import typing

import pytest
import yaml

from dist_utils import REPO, run_accelerate
from example_utils import load_example
from hyperacc.tools.cli_config import ConfigError
from hyperacc.config.components import Component

SCRIPT = REPO / "examples" / "train_qwen.py"
CPU2 = REPO / "accelerate_configs" / "cpu_fsdp2_2proc.yaml"
TINY = REPO / "examples" / "configs" / "qwen3_moe_tiny.yaml"
sys.path.insert(0, str(REPO / "examples"))     # the schema and checks beside the example (as it imports them)

# Path-like fields: what the run reads (a missing path or the config file must be refused) and what it writes
# (the config file, or a path under a file, must be refused; a missing path is created, which is fine).
INPUTS = {"model.name_or_path", "data.dataset", "data.tokenizer", "data.chat_template", "checkpoint.restore_from"}
OUTPUTS = {"checkpoint.checkpoint_dir", "logging.metrics_file", "logging.tensorboard_dir", "peft.export_dir",
           "peft.merged_export_dir", "training.dry_run_report"}
PATHISH = ("_dir", "_file", "_path", "_report", "_from", "dataset", "tokenizer", "template")

# The flags that turn on the switch an option needs (config_checks.SWITCHES), so that the option's own check
# runs instead of the switch-off refusal. "@DATA" is a small JSONL file of text and chat records.
SWITCH_ON = {"fsdp.compile": ["--fsdp.compile=true", "--fsdp.compile_backend=aot_eager"],
             "checkpoint.save_ckpt": ["--checkpoint.save_ckpt=true"],
             "checkpoint.restore_from": ["--checkpoint.restore_from=LATEST"],
             "eval.eval_steps": [], "lr_scheduler.decay": [],          # on in the tiny YAML
             "data.format": [], "data.dataset": ["--data.dataset=@DATA"],
             "training.dry_run": ["--training.dry_run=true", "--training.dry_run_world_size=1"],
             "data.streaming": ["--data.streaming=true"]}
NEEDS = {"data.messages_column": ["--data.format=chat", "--data.dataset=@DATA"],
         "data.chat_template": ["--data.format=chat"], "data.packing": ["--data.format=chat"],
         "data.text_column": ["--data.dataset=@DATA"], "data.name": ["--data.dataset=@DATA"]}

# (flag, kind, value) -> why the value is accepted on purpose (checked: accepted, nothing written).
ACCEPTED = {
    ("fsdp.wrap_classes", "flag-type", "{a: 1}"): "a list of class names given as text: '{a: 1}' is one name; a "
                                                  "name no module has falls back to the model's own blocks, warning",
}


def _fields():
    """(dotted name, declared type) of every flag: dataclass fields, and the optimizer's keywords (their
    default's type)."""
    from config_schema import TrainConfig

    defaults = TrainConfig()
    for section in dataclasses.fields(TrainConfig):
        value = getattr(defaults, section.name)
        if isinstance(value, Component):
            yield from ((f"{section.name}.{k}", type(v)) for k, v in value.kwargs.items())
            continue
        hints = typing.get_type_hints(type(value))
        yield from ((f"{section.name}.{f.name}", hints[f.name]) for f in dataclasses.fields(value))


def _base(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp


def _cases(name, tp):
    """(kind, value) pairs for one flag: "flag-*" values go on the command line, "yaml-*" into the YAML file."""
    b, origin = _base(tp), typing.get_origin(_base(tp))
    listy, mapping = b in (list, tuple) or origin in (list, tuple), b is dict or origin is dict
    if b is bool:
        flag, yml = ["maybe", "[1,2]", "2"], [-1]
    elif b is int:
        flag, yml = ["1.5", "[1,2]", "true"], []       # text: 'nan' below (YAML reads it as text for an int)
    elif b is float:
        flag, yml = ["abc", "[1,2]"], [{"a": 1}, [1.0]]
    elif listy:
        flag, yml = ["{a: 1}"], [{"a": 1}, 5]
    elif mapping:
        flag, yml = ["abc", "[1,2]"], [[1, 2], 5]
    elif origin is typing.Literal:
        flag, yml = ["bogus", "[a,b]"], [["a", "b"], {"a": 1}]
    else:   # str: the command line takes any text as typed; the YAML file can give it another type
        flag, yml = [], [["a", "b"], {"a": 1}]
    out = [("flag-type", v) for v in flag] + [("yaml-type", v) for v in yml]
    if b in (int, float):
        out += [("flag-nonfinite", v) for v in ("nan", "inf", "-inf")]
    if b is float:      # YAML's .nan / .inf are floats (for an int field the same refusal as 1.5)
        out += [("yaml-nonfinite", v) for v in (float("nan"), float("inf"), float("-inf"))]
    if name in INPUTS | OUTPUTS:
        out.append(("flag-path", "@CFG"))
        out.append(("flag-path", "@MISSING" if name in INPUTS else "@CFG/sub"))
    return out


FIELDS = dict(_fields())


def _extras(name):
    from config_checks import SWITCHES

    extras = list(NEEDS.get(name, []))
    if name.startswith("peft.") and name != "peft.method":
        extras.append("--peft.method=lora")
    for switch, _, options, _ in SWITCHES:
        if name in options:
            extras += SWITCH_ON[switch]
    if name == "checkpoint.checkpoint_dir":
        extras.append("--checkpoint.save_ckpt=true")
    return list(dict.fromkeys(extras))


def _snapshot(root):
    out = {}
    for folder, dirs, files in os.walk(root):
        out.update({os.path.join(folder, d): "dir" for d in dirs})
        for f in files:
            path = os.path.join(folder, f)
            out[path] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def example(hyperacc_cache):
    module = load_example("train_qwen_flag_fuzz")
    module.preflight(*module.load_config([]))      # the embedded tokenizer built once, into the module's cache
    return module


def _run(example, argv):
    """'accepted' or the ConfigError's message; anything else raised propagates (a traceback is a failure)."""
    try:
        cfg, world = example.load_config(argv)
        (example.dry_run if cfg.training.dry_run else example.preflight)(cfg, world)
    except ConfigError as err:
        return str(err)
    return "accepted"


def test_every_flag_is_fuzzed_and_path_fields_are_classified():
    from config_checks import SWITCHES

    assert len(FIELDS) > 60, sorted(FIELDS)
    pathish = {name for name, tp in FIELDS.items() if _base(tp) is str and name.rsplit(".", 1)[1].endswith(PATHISH)}
    assert pathish <= INPUTS | OUTPUTS, pathish - INPUTS - OUTPUTS      # a new path field: classify it
    assert (INPUTS | OUTPUTS) <= set(FIELDS)
    assert {switch for switch, *_ in SWITCHES} <= set(SWITCH_ON), "a new switch: say how the fuzz turns it on"
    generated = {(name, kind, value if isinstance(value, str) else repr(value))
                 for name, tp in FIELDS.items() for kind, value in _cases(name, tp)}
    assert set(ACCEPTED) <= generated, set(ACCEPTED) - generated


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_flag_fuzz(example, name, tmp_path, monkeypatch, capsys):
    from exit_report import as_flags

    monkeypatch.chdir(tmp_path)             # relative defaults (./checkpoints) land here, where they are seen
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"text {i} " * 20, "messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}) + "\n" for i in range(40)))
    problems, seen = [], 0
    for kind, value in _cases(name, FIELDS[name]):
        case = tmp_path / "case"
        shutil.rmtree(case, ignore_errors=True)
        case.mkdir()
        config = case / "run.yaml"
        sub = lambda text: (text.replace("@CFG", str(config)).replace("@MISSING", str(case / "no" / "such"))  # noqa: E731
                            .replace("@DATA", str(data)))
        text = yaml.safe_load(TINY.read_text())
        flags = [sub(e) for e in _extras(name)]
        if kind.startswith("yaml"):
            section, field = name.split(".", 1)
            text.setdefault(section, {})[field] = value
        else:
            flags.append(f"--{name}={sub(value)}")
        config.write_text(yaml.safe_dump(text))
        before = _snapshot(tmp_path)
        message = _run(example, [str(config), *flags])
        seen += 1
        what = f"{kind} {value!r}"
        if _snapshot(tmp_path) != before:
            problems.append(f"{what}: files changed: {sorted(set(_snapshot(tmp_path)) ^ set(before))}")
        key = (name, kind, value if isinstance(value, str) else repr(value))
        if key in ACCEPTED:
            if message != "accepted":
                problems.append(f"{what}: listed as accepted ({ACCEPTED[key]}) but: {message}")
            continue
        if message == "accepted":
            problems.append(f"{what}: accepted")
            continue
        shown = as_flags(message)
        if "\n" in message or "Fix" not in message or name not in shown:
            problems.append(f"{what}: not one line naming {name} with a fix: {shown}")
    capsys.readouterr()
    assert seen and not problems, "\n".join(problems)


# ----------------------------------------------------------------------------------------- regressions
def test_a_config_file_named_config_yaml_in_the_checkpoint_dir_is_refused(example, tmp_path):
    """A saving run writes its resolved config to <checkpoint_dir>/config.yaml: it overwrote a user's config
    file of that name (the run trained, then the file held the dumped config, comments gone)."""
    run = tmp_path / "run1"
    run.mkdir()
    config = run / "config.yaml"
    shutil.copy(TINY, config)
    message = _run(example, [str(config), f"--checkpoint.checkpoint_dir={run}", "--checkpoint.save_ckpt=true"])
    assert "it would be overwritten" in message and "--checkpoint.checkpoint_dir" in message, message
    assert config.read_text() == TINY.read_text()
    # not saving, or another directory: fine
    assert _run(example, [str(config), f"--checkpoint.checkpoint_dir={run}"]) == "accepted"
    assert _run(example, [str(config), f"--checkpoint.checkpoint_dir={tmp_path / 'ck'}",
                          "--checkpoint.save_ckpt=true"]) == "accepted"


def test_a_saved_run_config_is_a_usable_config_file(example, tmp_path):
    """A run's saved config.yaml lists every field, switch options at their defaults included: it must load
    (the switch-off refusal is for options that ask for something)."""
    from hyperacc.tools.cli_config import dump_config

    cfg, _ = example.load_config([])
    saved = tmp_path / "saved.yaml"
    saved.write_text(yaml.safe_dump(dump_config(cfg), sort_keys=False))
    again, world = example.load_config([str(saved)])
    assert dump_config(again) == dump_config(cfg)
    example.preflight(again, world)


def test_latest_in_a_checkpoint_dir_that_is_a_file_is_refused(example, tmp_path):
    """Was a warning and a silent fresh start (the run "resumed" from nothing)."""
    config = tmp_path / "run.yaml"
    shutil.copy(TINY, config)
    message = _run(example, [str(config), f"--checkpoint.checkpoint_dir={config}", "--checkpoint.restore_from=LATEST"])
    assert "which is a file" in message and "--checkpoint.checkpoint_dir" in as_flags_of(message), message


def test_a_pretrained_model_refuses_ignored_overrides_and_a_larger_tokenizer(example, tmp_path):
    """Found by the feature-pair matrix: a model with weights is built as its config.json says, so a differing
    model.overrides value was silently ignored; and chat data (two ChatML tokens added to the tokenizer) on a
    model whose vocabulary has no room for them stopped only at the first batch, with a fix
    (config.vocab_size) that does not apply to pretrained weights."""
    import torch

    from hyperacc.models import build_causal_lm, qwen3_moe_config

    torch.manual_seed(0)
    build_causal_lm(qwen3_moe_config(vocab_size=512)).save_pretrained(tmp_path / "model")
    common = [f"--model.name_or_path={tmp_path / 'model'}", "--data.tokenizer=default"]
    assert _run(example, common) == "accepted"
    assert _run(example, [*common, "--model.overrides.hidden_size=64"]) == "accepted"      # the saved value
    message = _run(example, [*common, "--model.overrides.hidden_size=32"])
    assert "model.overrides.hidden_size=32 with pretrained weights" in message and "ignored" in message, message
    message = _run(example, [*common, "--data.format=chat"])
    assert "the tokenizer has 514 entries" in message and "vocab_size=512" in message, message


def as_flags_of(message):
    from exit_report import as_flags

    return as_flags(message)


# ----------------------------------------------------------------------------------------- real launches
def _launch_error(tmp_path, config, args, hyperacc_cache):
    before = config.read_bytes()
    proc = run_accelerate(SCRIPT, CPU2, [config, *args], env={"HYPERACC_CACHE": hyperacc_cache}, timeout=300,
                          check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    # the worker exits 2 without a traceback (the launcher's own ChildFailedError report follows it)
    assert "exitcode  : 2" in proc.stderr and not re.search(r'File ".*/(examples|hyperacc)/', proc.stderr), \
        proc.stderr[-3000:]
    assert config.read_bytes() == before
    return lines[0]


def test_the_config_yaml_refusal_exits_2_once_under_accelerate(tmp_path, hyperacc_cache):
    run = tmp_path / "run1"
    run.mkdir()
    config = run / "config.yaml"
    shutil.copy(TINY, config)
    line = _launch_error(tmp_path, config, [f"--checkpoint.checkpoint_dir={run}", "--checkpoint.save_ckpt=true"],
                         hyperacc_cache)
    assert "it would be overwritten" in line and sorted(os.listdir(run)) == ["config.yaml"], line


@pytest.mark.slow
@pytest.mark.parametrize("args, needle", [
    (["--data.packing=2"], "data.packing must be bool (true or false), got 2"),
    (["--data.dataset=@CFG"], "is a file of no format hyperacc reads as data"),
    (["--model.overrides=[1,2]"], "model.overrides must be a mapping"),
])
def test_fuzzed_refusals_exit_2_once_under_accelerate(tmp_path, hyperacc_cache, args, needle):
    config = tmp_path / "run.yaml"
    shutil.copy(TINY, config)
    line = _launch_error(tmp_path, config, [a.replace("@CFG", str(config)) for a in args], hyperacc_cache)
    assert needle in line, line
    assert sorted(os.listdir(tmp_path)) == ["run.yaml"]
