"""examples/train_qwen.py compiled under `accelerate launch`.

Default: an accelerate config file whose ``dynamo_config`` names INDUCTOR (no hyperacc flag) compiles
the blocks with inductor -- the launcher's ACCELERATE_DYNAMO_* variables reach FSDPConfig -- and the run
trains, logs its compile counts and recompiles nothing after warm-up. Slow: a bad backend is one
config-error line before anything starts; ``--fsdp.compile=true`` with aot_eager, recompute and the bf16
recipe gives the eager run's losses.
"""
import json

import pytest
import yaml

from dist_utils import REPO, run_accelerate
from example_utils import config_error, load_example

SCRIPT = REPO / "examples" / "train_qwen.py"
CPU2 = REPO / "accelerate_configs" / "cpu_fsdp2_2proc.yaml"
STEPS = 4


def _launch(tmp_path, name, args=(), dynamo=None):
    config = yaml.safe_load(CPU2.read_text())
    if dynamo:
        config["dynamo_config"] = dynamo
    config_file = tmp_path / f"{name}.yaml"
    config_file.write_text(yaml.safe_dump(config))
    metrics = tmp_path / f"{name}.jsonl"
    proc = run_accelerate(SCRIPT, config_file, [f"--training.max_steps={STEPS}", "--checkpoint.save_ckpt=false",
                                                "--logging.progress_bar=false", "--eval.eval_steps=0",
                                                f"--logging.metrics_file={metrics}", *args], timeout=500)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line]
    return proc, records


@pytest.mark.slow      # the compiled blocks run by default in tests/test_compile.py (library, 1 and 2 processes)
def test_accelerate_dynamo_config_compiles_the_example_with_inductor(tmp_path):
    proc, records = _launch(tmp_path, "inductor", ["--verbose"], dynamo={"dynamo_backend": "INDUCTOR"})
    assert "compile: true" in proc.stdout and "compile_backend: inductor" in proc.stdout, proc.stdout[-3000:]
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("torch.compile:"))
    compiled = int(summary.split()[1])
    assert compiled >= 1 and " 0 after step 2" in summary and " 0 run eagerly" in summary, summary
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["compiles"] >= 1 for r in records) and records[-1]["compiles"] == records[1]["compiles"]
    losses = [r["loss"] for r in records]
    assert all(loss == loss and loss < 20 for loss in losses) and losses[-1] < losses[0], losses


@pytest.mark.slow
def test_compiled_example_with_recompute_and_bf16_matches_eager(tmp_path):
    common = ["--fsdp.activation_checkpointing=true", "--fsdp.precision=bf16"]
    _, eager = _launch(tmp_path, "eager", common)
    _, compiled = _launch(tmp_path, "compiled", [*common, "--fsdp.compile=true", "--fsdp.compile_backend=aot_eager"])
    assert "compiles" not in eager[0] and compiled[-1]["compiles"] >= 1
    for a, b in zip(compiled, eager):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), (a, b)


@pytest.fixture(scope="module")
def example():
    return load_example("train_qwen_compile")


@pytest.mark.slow      # check_backend's messages are tested in tests/test_compile_units.py
def test_bad_compile_settings_are_one_config_error_each(example, hyperacc_cache):
    message = config_error(example, ["--fsdp.compile=true", "--fsdp.compile_backend=nope"], preflight=True)
    assert "fsdp.compile" in message and "'nope'" in message and "aot_eager" in message
    message = config_error(example, ["--fsdp.compile=true", "--fsdp.compile_mode=reduce-overhead"], preflight=True)
    assert "CUDA graphs" in message and "max-autotune-no-cudagraphs" in message
