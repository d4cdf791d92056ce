"""Bad input is one ConfigError naming the problem and the fix, found before any process group exists,
and never touching a config, checkpoint or data file. In-process (load_config / preflight / the check
functions) except one plain-python run of the example for the exit code and the untouched config."""
import math
import re

import pytest
import torch

from example_utils import config_error, load_example, run_main  # noqa: E402
from dist_utils import REPO, run_python
from hyperacc.tools.cli_config import Component, ConfigError
from hyperacc.tools.preflight import check_optimizer

SCRIPT = REPO / "examples" / "train_qwen.py"


@pytest.fixture(scope="module")
def example():
    return load_example("train_qwen_bad_input")


_config_error = config_error


# ------------------------------------------------------------------- 1, 2 and siblings: non-finite numbers
@pytest.mark.parametrize("flag, value", [
    ("training.collective_timeout_s", "nan"), ("training.collective_timeout_s", "inf"),
    ("training.collective_timeout_s", "0"), ("training.collective_timeout_s", "-5"),
    ("training.collective_timeout_s", "1e30"),          # finite, but no timedelta holds it
    ("training.device_memory_gb", "nan"), ("training.device_memory_gb", "inf"),
    ("training.device_memory_gb", "0"), ("training.device_memory_gb", "-64"),
    ("training.gradient_clipping", "nan"), ("training.gradient_clipping", "inf"),
    ("lr_scheduler.min_lr_ratio", "nan"), ("optimizer.lr", "nan"), ("optimizer.weight_decay", "nan"),
    ("model.overrides.rope_theta", ".nan"),
])
def test_non_finite_and_out_of_range_numbers_are_refused(example, flag, value):
    message = _config_error(example, [f"--{flag}={value}"])
    assert flag in message, message


@pytest.mark.parametrize("override, needle", [
    ("rope_theta=.inf", "rope_parameters.rope_theta=inf is not a finite number"),
    ("rope_theta=nan", "rope_parameters.rope_theta='nan' is text where Qwen3MoeConfig has a number"),  # YAML: a str
    ("router_aux_loss_coef=abc", "model: Validation error for field 'router_aux_loss_coef'"),  # was a traceback
])
def test_model_override_values_are_checked_in_preflight(example, override, needle):
    message = _config_error(example, [f"--model.overrides.{override}"], preflight=True)
    assert needle in message, message


@pytest.mark.parametrize("args, needle", [
    (["--model.overrides.router_aux_loss_coef=abc"], "model: Validation error for field 'router_aux_loss_coef'"),
    (["--data.tokenizer=/no/such/tokenizer_dir"], "data.tokenizer: cannot load tokenizer '/no/such/tokenizer_dir'"),
])
def test_dry_run_reports_bad_model_and_tokenizer_in_one_line(example, args, needle):
    cfg, world = example.load_config(["--training.dry_run=true", "--training.dry_run_world_size=1", *args])
    with pytest.raises(ConfigError, match=re.escape(needle)):                 # was a traceback
        example.dry_run(cfg, world)


def test_non_finite_optimizer_arguments_are_refused():
    # inf passes torch's own `0 <= lr` check; hyperacc's AdamW let NaN through its `lr < 0` check.
    with pytest.raises(ConfigError, match=r"optimizer.lr=inf is not a finite number"):
        check_optimizer(Component("torch.optim.AdamW", {"lr": math.inf}))
    for bad in ({"lr": math.nan}, {"eps": math.inf}, {"weight_decay": math.nan}, {"betas": (0.9, math.nan)}):
        with pytest.raises(ValueError, match="AdamW: "):
            from hyperacc.precision.adamw import AdamW
            AdamW([torch.nn.Parameter(torch.zeros(1))], **bad)


# ------------------------------------------------------------------- 3, 4: optimizers under a bf16 recipe
def test_torch_adam_under_bf16_is_a_preflight_error(example, tmp_path):
    config = tmp_path / "adam.yaml"
    config.write_text("optimizer:\n  _target_: torch.optim.Adam\n  lr: 0.001\n")
    message = _config_error(example, [config, "--fsdp.precision=bf16"], preflight=True)
    assert "optimizer._target_=torch.optim.Adam under fsdp.precision=bf16" in message, message
    assert "_target_: torch.optim.AdamW" in message and "--fsdp.precision=fp32_master" in message, message
    example.preflight(*example.load_config([str(config)]))          # fine with fp32 master weights


def test_amsgrad_under_bf16_sr_names_amsgrad_not_lr(example, tmp_path):
    config = tmp_path / "ams.yaml"
    config.write_text("optimizer:\n  _target_: torch.optim.AdamW\n  lr: 0.001\n  amsgrad: true\n")
    message = _config_error(example, [config, "--fsdp.precision=bf16_sr"], preflight=True)
    assert "optimizer.amsgrad=True" in message and "hyperacc.precision.adamw.AdamW" in message, message
    assert "drop optimizer.amsgrad" in message and "--fsdp.precision=fp32_master" in message, message
    assert "optimizer.lr" not in message, message
    # amsgrad=false is AdamW's own update: dropped, not refused
    cfg, _ = example.load_config([str(config), "--fsdp.precision=bf16_sr", "--optimizer.amsgrad=false"])
    assert example.optimizer_config(cfg).kwargs.get("amsgrad") is None
    # In general, a keyword the optimizer does not take is named, with the fix (not blamed on lr).
    with pytest.raises(ConfigError) as info:
        check_optimizer(Component("hyperacc.precision.adamw.AdamW", {"lr": 1e-3, "amsgrad": True}))
    assert "'amsgrad'" in str(info.value) and "lr=3e-4" not in str(info.value), str(info.value)


# ------------------------------------------------------------------- 5: outputs never overwrite inputs
def test_dry_run_report_on_an_input_or_a_directory_is_refused(example, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("training:\n  max_steps: 3\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text('{"text": "x"}\n')
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("{}\n")
    dry = [config, "--training.dry_run=true", "--training.dry_run_world_size=1"]
    cases = [([f"--training.dry_run_report={config}"], "is the config file"),
             ([f"--training.dry_run_report={tmp_path}"], "is a directory"),
             ([f"--training.dry_run_report={data / 'a.jsonl'}", f"--data.dataset={data}"], "is inside data.dataset"),
             ([f"--training.dry_run_report={metrics}", f"--logging.metrics_file={metrics}"],
              "is logging.metrics_file")]
    for args, needle in cases:
        message = _config_error(example, [*dry, *args])
        assert needle in message and "--training.dry_run_report" in message, message
    # siblings: the training run's own outputs
    message = _config_error(example, [config, f"--logging.metrics_file={config}"])
    assert "--logging.metrics_file=" in message and "is the config file" in message, message
    message = _config_error(example, [config, f"--logging.metrics_file={data / 'm.jsonl'}", f"--data.dataset={data}"])
    assert "is inside data.dataset" in message, message
    message = _config_error(example, [config, f"--logging.metrics_file={tmp_path / 'x'}",
                                      f"--logging.tensorboard_dir={tmp_path / 'x'}"])
    assert "are the same path" in message, message
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpoint_iteration.txt").write_text("4\n")
    message = _config_error(example, [config, f"--checkpoint.checkpoint_dir={ckpt}",
                                      f"--logging.metrics_file={ckpt / 'latest_checkpoint_iteration.txt'}"])
    assert "lies among the files --checkpoint.checkpoint_dir=" in message, message
    message = _config_error(example, [config, f"--checkpoint.checkpoint_dir={ckpt}",
                                      f"--logging.metrics_file={ckpt / 'global_step_4' / 'm.jsonl'}"])
    assert "lies among the files --checkpoint.checkpoint_dir=" in message, message
    example.load_config([str(config), f"--checkpoint.checkpoint_dir={ckpt}",       # names of their own: fine
                         f"--logging.metrics_file={ckpt / 'metrics.jsonl'}",
                         f"--logging.tensorboard_dir={ckpt / 'runs' / 'tb'}"])
    assert config.read_text() == "training:\n  max_steps: 3\n"


def test_dry_run_report_on_the_config_exits_2_and_leaves_it_alone(tmp_path):
    config = tmp_path / "run.yaml"
    text = "training:\n  max_steps: 3\n"
    config.write_text(text)
    proc = run_python(SCRIPT, [config, "--training.dry_run=true", f"--training.dry_run_report={config}"],
                      check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(lines) == 1 and "is the config file" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert config.read_text() == text


# ------------------------------------------------------------------- 6: a config file of any name
def test_config_file_without_a_yaml_suffix(example, tmp_path):
    for name in ("my_config", "cfg.txt"):
        path = tmp_path / name
        path.write_text("training:\n  max_steps: 3\n")
        cfg, _ = example.load_config([str(path), "--training.seed=5"])
        assert (cfg.training.max_steps, cfg.training.seed) == (3, 5)
    missing = tmp_path / "no_such_config"
    message = _config_error(example, [missing])
    assert repr(str(missing)) in message and "does not exist" in message, message
    assert "qwen3_moe_tiny" not in message, message                   # not blamed on the default file
    not_yaml = tmp_path / "notes.txt"
    not_yaml.write_text("key: [unclosed\n")
    message = _config_error(example, [not_yaml])
    assert "is not valid YAML (the positional argument is read as the YAML config file)" in message, message


# ------------------------------------------------------------------- 7: runtime arguments of _target_ components
def make_optimizer_without_params(lr=0.1):          # a _target_ that forgets the parameters
    return lr


def make_optimizer_keywords_only(*, lr=0.1):
    return lr


def make_optimizer(params, lr=0.1):
    return torch.optim.SGD(params, lr=lr)


def test_component_runtime_arguments_are_checked(example, tmp_path):
    config = tmp_path / "custom.yaml"
    config.write_text("optimizer:\n  _target_: test_bad_input.make_optimizer_without_params\n  lr: 0.1\n")
    message = _config_error(example, [config], preflight=True)
    assert message.startswith("optimizer: test_bad_input.make_optimizer_without_params(lr): the program passes 1 "
                              "positional argument(s) at runtime (#1 a list), and #1 lands on 'lr', which is "
                              "configured too (optimizer.lr). Fix: a _target_ that takes"), message
    config.write_text("optimizer:\n  _target_: test_bad_input.make_optimizer_keywords_only\n")
    message = _config_error(example, [config], preflight=True)
    assert ("optimizer: test_bad_input.make_optimizer_keywords_only(*, lr) takes 0 positional argument(s) but the "
            "program passes 1 at runtime (#1 a list)") in message, message
    config.write_text("optimizer:\n  _target_: test_bad_input.make_optimizer_without_params\n")
    message = _config_error(example, [config], preflight=True)
    assert "make_optimizer_without_params returned a list, not a torch.optim.Optimizer" in message, message
    component = Component("test_bad_input.make_optimizer", {"lr": 0.5})
    params = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ConfigError, match=r"make_optimizer\(params, lr\) takes no argument 'distributed_setup', "
                                          r"which the program passes at runtime\. Fix: "):
        component.build(params, distributed_setup=True)
    assert component.build(params, lr=0.25).param_groups[0]["lr"] == 0.25     # runtime keywords still win


# ------------------------------------------------------------------- 8: the transformers requirement
def test_transformers_requirement_covers_tp_and_ep(example, monkeypatch):
    required = re.search(r'"transformers>=([\d.]+)"', (REPO / "setup.py").read_text()).group(1)
    assert tuple(int(x) for x in required.split(".")[:2]) >= example.MIN_TRANSFORMERS_TP_EP
    from transformers.distributed.expert_parallel import apply_expert_parallelism  # noqa: F401 - what EP imports
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism  # noqa: F401 - what TP imports
    cfg, _ = example.load_config(["--parallel.ep_size=2"])
    monkeypatch.setattr("importlib.metadata.version", lambda name: "5.20.0")
    with pytest.raises(ConfigError, match=r"need transformers>=5\.23 .* but 5\.20\.0 is installed\. Fix: pip install"):
        example.check_transformers_for_tp_ep(cfg)


# ------------------------------------------------------------------- the checkpoint directory, before anything is built
def _fake_checkpoint(example, root, step, max_steps):
    """A complete step directory (its .metadata) holding the config.yaml the example writes."""
    import yaml
    from hyperacc.tools.cli_config import dump_config
    path = root / f"global_step_{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    cfg, _ = example.load_config([f"--training.max_steps={max_steps}"])
    (path / "config.yaml").write_text(yaml.safe_dump(dump_config(cfg)))
    (root / "latest_checkpoint_iteration.txt").write_text(f"{step}\n")
    return path


def _checkpoint_error(example, args):
    with pytest.raises(ConfigError) as info:
        cfg, _ = example.load_config(list(map(str, args)))
        example.check_checkpoint_start(cfg)
    message = str(info.value)
    assert "\n" not in message and "Fix" in message or "Pass an existing" in message, message
    return message


def test_checkpoint_problems_are_config_errors_before_anything_is_built(example, tmp_path):
    root = tmp_path / "ckpt"
    # a mistyped restore_from (was: checked after data and model were built, 100+ lines on every rank)
    message = _checkpoint_error(example, [f"--checkpoint.checkpoint_dir={root}",
                                          f"--checkpoint.restore_from={tmp_path / 'ckpt_typo'}"])
    assert "ckpt_typo" in message and "does not exist" in message
    _fake_checkpoint(example, root, 10, max_steps=20)
    # a fresh run into a directory holding another run's checkpoints (was: every save skipped, exit 0)
    message = _checkpoint_error(example, [f"--checkpoint.checkpoint_dir={root}", "--checkpoint.save_ckpt=true"])
    assert "holds checkpoints of another run (steps 10)" in message and "restore_from=LATEST" in message
    # max_steps changed on resume (was: the cosine silently rescaled, 2.4x lower LR at the next step)
    resume = [f"--checkpoint.checkpoint_dir={root}", "--checkpoint.save_ckpt=true", "--checkpoint.restore_from=LATEST"]
    message = _checkpoint_error(example, resume + ["--training.max_steps=50"])
    assert "20 -> 50" in message and "--lr_scheduler.total_steps=20" in message
    message = _checkpoint_error(example, resume + ["--training.max_steps=20", "--lr_scheduler.warmup_steps=5"])
    assert "lr_scheduler.warmup_steps: 3 -> 5" in message
    for fine in (["--training.max_steps=20"], ["--training.max_steps=50", "--lr_scheduler.total_steps=20"]):
        cfg, _ = example.load_config(resume + fine)
        example.check_checkpoint_start(cfg)          # the same schedule: accepted
    cfg, _ = example.load_config([f"--checkpoint.checkpoint_dir={root}", "--checkpoint.save_ckpt=false"])
    example.check_checkpoint_start(cfg)              # a run that does not save touches nothing: fine
    assert sorted(p.name for p in root.iterdir()) == ["global_step_10", "latest_checkpoint_iteration.txt"]


def test_a_mistyped_restore_from_exits_2_in_one_line(example, capsys, tmp_path):
    # main() in this process (preflight refuses it before anything is built); the interpreter's exit code:
    # test_dry_run_report_on_the_config_exits_2_and_leaves_it_alone
    code, _, stderr = run_main(example, [f"--checkpoint.checkpoint_dir={tmp_path / 'ckpt'}",
                                         f"--checkpoint.restore_from={tmp_path / 'nope'}", "--training.max_steps=1"],
                               capsys)
    assert code == 2, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("config error:")]
    assert len(lines) == 1 and "nope" in lines[0] and "Traceback" not in stderr, stderr[-3000:]
    assert not (tmp_path / "ckpt").exists()
