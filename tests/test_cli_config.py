"""YAML + typed CLI overrides (hyperacc.tools.cli_config): parsing, type checks, errors, _target_ nodes."""
import dataclasses
from typing import List, Literal, Optional

import pytest
import torch

from examples.config_schema import TrainConfig
from hyperacc.tools.cli_config import (Component, ConfigError, build_config, config_help, dump_config, format_config,
                                 load_config, parse_config, save_config)
from hyperacc.config import CheckpointConfig, FSDPConfig, ParallelConfig


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# A small schema exercising every supported field type.
@dataclasses.dataclass
class Knobs:
    count: int = 1
    ratio: float = 0.5
    flag: bool = False
    name: str = "x"
    maybe: Optional[int] = None
    maybe_str: Optional[str] = "set"
    items: List[int] = dataclasses.field(default_factory=list)
    words: Optional[list] = None
    mode: Literal["a", "b"] = "a"
    extra: dict = dataclasses.field(default_factory=dict)


def _double(value, scale=2, offset=0):
    return value * scale + offset


@dataclasses.dataclass
class Schema:
    knobs: Knobs = dataclasses.field(default_factory=Knobs)
    fsdp: FSDPConfig = dataclasses.field(default_factory=FSDPConfig)
    fn: Component = dataclasses.field(
        default_factory=lambda: Component("test_cli_config._double", {"scale": 3}))


def test_defaults_without_yaml_or_args():
    cfg = parse_config(TrainConfig, argv=[])
    assert cfg == TrainConfig()
    assert cfg.training.mode == "production" and cfg.optimizer.target == "torch.optim.AdamW"


def test_yaml_load_and_cli_overrides_of_every_type(tmp_path):
    path = write(tmp_path, "knobs:\n  count: 4\n  ratio: 1e-4\n  name: from_yaml\n  extra: {a: 1}\n")
    cfg = parse_config(Schema, argv=[
        str(path), "--knobs.count=7", "--knobs.ratio", "2", "--knobs.flag", "--knobs.name=123",
        "--knobs.maybe=5", "--knobs.maybe_str=null", "--knobs.items=[1,2,3]", "--knobs.words=u,v",
        "--knobs.mode", "b", "--knobs.extra.b=[1, 2]"])
    k = cfg.knobs
    assert (k.count, k.ratio, k.flag, k.name, k.maybe, k.maybe_str) == (7, 2.0, True, "123", 5, None)
    assert isinstance(k.ratio, float)
    assert k.items == [1, 2, 3] and k.words == ["u", "v"] and k.mode == "b"
    assert k.extra == {"a": 1, "b": [1, 2]}
    # YAML alone: "1e-4" (PyYAML reads it as a string) is accepted for a float field.
    assert parse_config(Schema, yaml_path=path, argv=[]).knobs.ratio == pytest.approx(1e-4)


def test_bool_flag_forms():
    assert parse_config(Schema, argv=["--knobs.flag=false"]).knobs.flag is False
    assert parse_config(Schema, argv=["--knobs.flag", "no"]).knobs.flag is False
    cfg = parse_config(Schema, argv=["--knobs.flag", "--knobs.count=2"])
    assert cfg.knobs.flag is True and cfg.knobs.count == 2


def test_component_bool_flag_and_negative_value():
    cfg = parse_config(TrainConfig, argv=["--optimizer.amsgrad", "--parallel.dp_shard_size", "-1",
                                          "--optimizer.betas=[0.8,0.9]"])
    assert cfg.optimizer.amsgrad is True and cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.parallel.dp_shard_size == -1


def test_fixed_train_flags():
    cfg = parse_config(TrainConfig, argv=[
        "--training.max_steps=3", "--training.global_batch_size=16", "--training.micro_batch_size=4",
        "--training.seed=7", "--training.mode=validate", "--fsdp.activation_checkpointing=true",
        "--checkpoint.checkpoint_dir=/tmp/ck", "--checkpoint.save_steps=2",
        "--checkpoint.restore_from=LATEST", "--logging.metrics_file=m.jsonl", "--training.dry_run",
        "--optimizer.lr=1e-3", "--model.overrides.hidden_size=64"])
    t = cfg.training
    assert (t.max_steps, t.global_batch_size, t.micro_batch_size, t.seed, t.mode, t.dry_run) == \
        (3, 16, 4, 7, "validate", True)
    assert cfg.fsdp.activation_checkpointing is True
    assert (cfg.checkpoint.checkpoint_dir, cfg.checkpoint.save_steps, cfg.checkpoint.restore_from) == \
        ("/tmp/ck", 2, "LATEST")
    assert cfg.logging.metrics_file == "m.jsonl"
    assert cfg.optimizer.lr == 1e-3 and cfg.model.overrides == {"hidden_size": 64}


@pytest.mark.parametrize("argv, needles", [
    (["--trainig.max_steps=3"], ["trainig", "Did you mean 'training'"]),
    (["--training.max_step=3"], ["training.max_step", "Did you mean 'max_steps'"]),
    (["--training.max_steps=abc"], ["--training.max_steps=abc", "must be int", "Fix"]),
    (["--training.max_steps=2.5"], ["must be int"]),
    (["--training.dry_run=maybe"], ["must be bool"]),
    (["--training.mode=valdate"], ["'validate'", "Did you mean 'validate'"]),
    (["--fsdp.mixed_precision=fp8"], ["fsdp", "mixed_precision"]),
    (["--training.global_batch_size=10", "--training.micro_batch_size=4"],
     ["global_batch_size=10", "micro_batch_size=4", "multiple"]),
    (["--optimizer._target_=torch.optim.SGD"], ["_target_", "cannot be overridden", "YAML"]),
    (["--optimizer.lrr=0.1"], ["lrr", "Did you mean 'lr'"]),
    (["--optimizer.lr=fast"], ["--optimizer.lr=fast", "must be float"]),
    (["--optimizer.betas=0.9"], ["--optimizer.betas=0.9", "list of 2 values", "Fix"]),
    (["--training.max_steps.x=1"], ["--training.max_steps.x=1", "must be int"]),
    (["--training"], ["--training.<field>"]),
    (["--training.max_steps"], ["has no value"]),
    (["a.yaml", "b.yaml"], ["b.yaml"]),
])
def test_errors_are_config_errors_naming_key_and_fix(argv, needles):
    with pytest.raises(ConfigError) as info:
        parse_config(TrainConfig, argv=argv)
    assert isinstance(info.value, ValueError)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_yaml_errors(tmp_path):
    with pytest.raises(ConfigError, match="Unknown section 'optimiser'.*'optimizer'"):
        parse_config(TrainConfig, write(tmp_path, "optimiser:\n  lr: 0.1\n"), argv=[])
    with pytest.raises(ConfigError, match="Unknown field 'training.seeed'.*'seed'"):
        parse_config(TrainConfig, write(tmp_path, "training:\n  seeed: 1\n"), argv=[])
    with pytest.raises(ConfigError, match="YAML file.*: training.max_steps must be int, got 'ten'"):
        parse_config(TrainConfig, write(tmp_path, "training:\n  max_steps: ten\n"), argv=[])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(TrainConfig, tmp_path / "missing.yaml", argv=[])


def test_target_with_unknown_kwarg_refused_at_parse_time(tmp_path):
    path = write(tmp_path, "optimizer:\n  _target_: torch.optim.SGD\n  lr: 0.1\n  betas: [0.9, 0.9]\n")
    with pytest.raises(ConfigError, match="torch.optim.SGD takes no argument 'betas'"):
        parse_config(TrainConfig, path, argv=[])
    bad = write(tmp_path, "optimizer:\n  _target_: torch.optim.NoSuchThing\n", "bad.yaml")
    with pytest.raises(ConfigError, match="cannot be imported"):
        parse_config(TrainConfig, bad, argv=[])


def test_target_from_yaml_replaces_default_kwargs_and_builds(tmp_path):
    path = write(tmp_path, "optimizer:\n  _target_: torch.optim.SGD\n  lr: 0.5\n  momentum: 0.9\n")
    cfg = parse_config(TrainConfig, path, argv=["--optimizer.nesterov=true"])
    assert cfg.optimizer.kwargs == {"lr": 0.5, "momentum": 0.9, "nesterov": True}  # no AdamW betas
    param = torch.nn.Parameter(torch.zeros(2))
    opt = cfg.optimizer.build([param])
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.9


def test_component_build_runtime_kwargs_win():
    cfg = parse_config(Schema, argv=["--fn.offset=1"])
    assert cfg.fn.kwargs == {"scale": 3, "offset": 1}
    assert cfg.fn.build(2) == 7
    assert cfg.fn.build(2, scale=10) == 21
    default_adamw = TrainConfig().optimizer.build([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    assert default_adamw.defaults["lr"] == 0.01 and default_adamw.defaults["betas"] == (0.9, 0.95)


def test_layers_default_env_yaml_cli(tmp_path, monkeypatch):
    """defaults <- launch environment <- YAML <- CLI, field by field, even for values equal to a default."""
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("HYPERACC_CHECKPOINT_SAVE_STEPS", "7")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    path = write(tmp_path, "fsdp:\n  reshard_after_forward: true\nparallel:\n  tp_size: 1\n")
    cfg = parse_config(TrainConfig, path, argv=["--fsdp.mixed_precision=no", "--checkpoint.save_steps=0"])
    assert type(cfg.fsdp) is FSDPConfig and type(cfg.parallel) is ParallelConfig
    assert type(cfg.checkpoint) is CheckpointConfig
    assert cfg.fsdp.reshard_after_forward is True            # YAML beats the environment
    assert cfg.fsdp.activation_checkpointing is True         # the environment beats the default
    assert cfg.fsdp.mixed_precision is None                  # CLI "no" beats ACCELERATE_MIXED_PRECISION
    assert cfg.parallel.tp_size == 1 and cfg.checkpoint.save_steps == 0
    assert parse_config(TrainConfig, argv=[]).checkpoint.save_steps == 7
    # explicit constructor arguments beat the environment the same way
    assert FSDPConfig(reshard_after_forward=True).reshard_after_forward is True
    assert FSDPConfig().reshard_after_forward is False and FSDPConfig().mixed_precision == "bf16"


def test_save_load_round_trip(tmp_path):
    cfg = parse_config(TrainConfig, argv=["--training.max_steps=9", "--optimizer.lr=2e-4",
                                          "--model.overrides.num_hidden_layers=2",
                                          "--fsdp.wrap_classes=[Qwen3MoeDecoderLayer]",
                                          "--lr_scheduler.decay=linear"])
    path = tmp_path / "saved.yaml"
    save_config(cfg, path)
    again = load_config(TrainConfig, path)
    assert again == cfg
    assert parse_config(TrainConfig, argv=[str(path)]) == cfg
    assert dump_config(again) == dump_config(cfg)
    text = format_config(cfg)
    assert "max_steps: 9" in text and "_target_: torch.optim.AdamW" in text


def test_build_config_from_dict_and_help():
    cfg = build_config(TrainConfig, {"training": {"max_steps": 2}, "eval": {"eval_steps": 1}})
    assert cfg.training.max_steps == 2 and cfg.eval.eval_steps == 1
    text = config_help(TrainConfig)
    for flag in ("--training.max_steps", "--fsdp.activation_checkpointing", "--checkpoint.restore_from",
                 "--logging.metrics_file", "--optimizer.lr"):
        assert flag in text
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, argv=["--help"])


def test_lr_factor_shapes():  # the example's schedule (examples/config_schema.py)
    sched = TrainConfig().lr_scheduler
    sched.warmup_steps = 2
    assert sched.lr_factor(0, 10) == pytest.approx(0.5)
    assert sched.lr_factor(2, 10) == pytest.approx(1.0)
    assert sched.lr_factor(10, 10) == pytest.approx(sched.min_lr_ratio)


def test_repeated_flag_duplicate_yaml_key_and_dashless_flag_are_config_errors(tmp_path):
    # a flag given twice: neither silently wins
    with pytest.raises(ConfigError, match=r"--training.max_steps is given twice.*max_steps=2.*max_steps=3"):
        parse_config(TrainConfig, argv=["--training.max_steps=2", "--training.max_steps=3"])
    with pytest.raises(ConfigError, match="given twice"):  # the space-separated form counts too
        parse_config(TrainConfig, argv=["--training.max_steps", "2", "--training.max_steps=3"])
    # a key repeated in one YAML mapping (PyYAML alone keeps the last), naming both lines
    dup = write(tmp_path, "training:\n  max_steps: 2\n  seed: 1\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match=r"duplicate key max_steps.*line 4") as info:
        parse_config(TrainConfig, dup, argv=[])
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="--model.overrides=.*duplicate key a"):  # inline YAML on the CLI too
        parse_config(TrainConfig, argv=["--model.overrides={a: 1, a: 2}"])
    # an override without dashes is reported as such, with the default YAML given or not
    for yaml_path in (None, write(tmp_path, "training:\n  seed: 1\n", "ok.yaml")):
        with pytest.raises(ConfigError, match=r"did you mean --training.max_steps=2\?") as info:
            parse_config(TrainConfig, yaml_path, argv=["training.max_steps=2"])
        assert "Two YAML files" not in str(info.value)
    with pytest.raises(ConfigError, match="Unexpected argument 'extra'"):
        parse_config(TrainConfig, write(tmp_path, "{}\n", "d.yaml"), argv=["extra"])
