"""Precision recipes (hyperacc.precision), the AdamW that serves them (hyperacc.precision.adamw) and the dry
run's plan of them; one process, no launcher. The multi-process parts (sharded bf16 training,
checkpoints across recipes, HF export dtype) are in tests/scripts/precision_run.py."""
import json
import math
import subprocess
import sys

import pytest
import torch

from dist_utils import REPO, run_python, run_together, run_torchrun
from example_utils import load_example, run_main
from hyperacc import FSDPConfig
from hyperacc.precision import adamw as optim
from hyperacc.precision import rounding
from hyperacc.precision import RECIPES, adapt_optimizer, check_recipe, get_recipe

SCRIPT = REPO / "examples" / "train_qwen.py"
CONFIG_30B = REPO / "examples" / "configs" / "qwen3_30b_a3b.yaml"


def _pair(seed=0, shapes=((7, 5), (3,), (64, 3))):
    torch.manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return ours, theirs


@pytest.mark.parametrize("chunk", [None, 16])
def test_adamw_in_fp32_is_torch_adamw_bitwise(monkeypatch, chunk):
    if chunk:   # the chunked path (huge shards) must not change a single bit either
        monkeypatch.setattr(optim, "CHUNK", chunk)
    ours, theirs = _pair()
    a = optim.AdamW(ours, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    b = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for _ in range(6):
        for p, q in zip(ours, theirs):
            grad = torch.randn_like(p)
            p.grad, q.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        assert torch.equal(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"])
        assert a.state[p]["step"].item() == b.state[q]["step"].item() == 6


def test_stochastic_rounding_is_unbiased_exact_and_reproducible():
    value = torch.full((200_000,), 1.0 + 2 ** -10)           # a quarter of a bf16 step above 1.0
    noise = rounding.rounding_noise(rounding.rounding_key(3, 1, "w"), torch.arange(value.numel()))
    out = torch.empty_like(value, dtype=torch.bfloat16)
    optim.stochastic_round_(out, value, noise)
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert out.float().mean().item() == pytest.approx(1.0 + 2 ** -10, abs=2e-5)   # round-to-nearest: 1.0
    again = torch.empty_like(out)
    optim.stochastic_round_(again, value, noise.clone())
    assert torch.equal(out, again)
    exact = torch.tensor([0.5, -3.0, 1.5, 0.0])                  # representable: never moved
    target = torch.empty(4, dtype=torch.bfloat16)
    optim.stochastic_round_(target, exact, rounding.rounding_noise((0, 0), torch.arange(4)))
    assert torch.equal(target.float(), exact)


def test_rounding_noise_is_uniform_keyed_and_decorrelated():
    indices = torch.arange(1 << 18)
    a = rounding.rounding_noise(rounding.rounding_key(0, 1, "w"), indices)
    assert a.dtype == torch.int32 and int(a.min()) >= 0 and int(a.max()) < 1 << 16
    counts = torch.bincount(a >> 12, minlength=16).double()      # 16 buckets of the 16 bits
    assert (counts / counts.mean() - 1).abs().max() < 0.03
    for other in (rounding.rounding_key(0, 2, "w"), rounding.rounding_key(1, 1, "w"), rounding.rounding_key(0, 1, "v")):
        b = rounding.rounding_noise(other, indices)               # another step, seed or parameter
        assert (a == b).double().mean() < 1e-3
        assert abs(torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1]) < 0.01
    big = torch.tensor([5, 5 + (1 << 32)])                       # indices past 2**32 differ too
    assert rounding.rounding_noise((0, 0), big, wide=True).unique().numel() == 2


def test_element_indices_of_plain_tensors_are_row_major_positions():
    t = torch.empty(3, 4, 5).transpose(0, 2)                     # any logical shape, any strides
    assert torch.equal(rounding.element_indices(t), torch.arange(60))
    assert torch.equal(rounding.element_indices(t, 7, 10), torch.arange(7, 17))
    assert torch.equal(rounding.element_indices(torch.tensor(2.0)), torch.tensor([0]))


def test_small_updates_survive_stochastic_rounding_and_vanish_when_rounded_to_nearest():
    def train(stochastic):
        p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        opt = optim.AdamW([p], lr=1e-4, weight_decay=0.0, stochastic_rounding=stochastic)
        for _ in range(50):
            p.grad = torch.ones_like(p)     # Adam's step is ~lr: 1e-4, a 40th of bf16's step at 1.0
            opt.step()
        return p.float().mean().item()
    assert train(False) == 1.0                                    # every update rounded away
    assert train(True) == pytest.approx(1.0 - 50 * 1e-4, rel=2e-4)
    assert RECIPES["bf16"].stochastic_rounding and RECIPES["bf16_sr"].stochastic_rounding


def test_recipe_bytes_and_states():
    assert {n: sum(r.bytes_per_param().values()) for n, r in RECIPES.items()} == \
        {"fp32_master": 16, "bf16": 12, "bf16_sr": 8}
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    opt = optim.AdamW([p])
    adapt_optimizer(opt, get_recipe("bf16_sr"))
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16 and opt.stochastic_rounding
    explicit = optim.AdamW([p], state_dtype=torch.float32, stochastic_rounding=False)
    adapt_optimizer(explicit, get_recipe("bf16_sr"))           # explicit arguments win over the recipe
    assert explicit.state_dtype == torch.float32 and explicit.stochastic_rounding is False


def test_rounding_follows_the_run_seed_and_parameter_names():
    def rounded(run_seed, name, **kwargs):
        p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        opt = optim.AdamW([p], lr=1e-4, weight_decay=0.0, **kwargs)
        adapt_optimizer(opt, get_recipe("bf16_sr"), seed=run_seed, names={id(p): name})   # what prepare passes
        p.grad = torch.ones_like(p)
        opt.step()
        return opt.seed, p.detach().clone()
    seed, a = rounded(7, "w")
    assert seed == 7 and torch.equal(a, rounded(7, "w")[1])          # training.seed reaches the rounding
    assert not torch.equal(a, rounded(8, "w")[1]) and not torch.equal(a, rounded(7, "v")[1])
    assert rounded(7, "w", seed=3)[0] == 3                            # an explicit seed wins


def test_bad_recipes_fail_with_one_clear_line():
    with pytest.raises(ValueError, match=r"precision='fp16' is not a recipe; choose one of fp32_master, bf16, bf16_sr"):
        FSDPConfig(precision="fp16")
    with pytest.raises(ValueError, match="without a loss scaler"):
        check_recipe(get_recipe("fp32_master"), mixed_precision="fp16", device_type="cpu", has_loss_scaler=False)
    with pytest.raises(ValueError, match="cannot compute in mixed_precision='fp16'"):
        check_recipe(get_recipe("bf16"), mixed_precision="fp16", device_type="cuda", has_loss_scaler=True)
    check_recipe(get_recipe("fp32_master"), mixed_precision="fp16", device_type="cuda", has_loss_scaler=True)
    if not torch.cuda.is_available():     # bf16 where the device cannot: named, with the fix
        with pytest.raises(ValueError, match="needs bf16, which this cuda device does not support"):
            check_recipe(get_recipe("bf16_sr"), mixed_precision=None, device_type="cuda", has_loss_scaler=False)
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="hyperacc.precision.adamw.AdamW"):
        adapt_optimizer(torch.optim.AdamW([p]), get_recipe("bf16"))
    adapt_optimizer(torch.optim.AdamW([p]), get_recipe("fp32_master"))      # fine: fp32 master weights


def test_fp16_without_a_scaler_is_refused_by_the_accelerator():
    code = ("import hyperacc; hyperacc.Accelerator(fsdp=hyperacc.FSDPConfig(mixed_precision='fp16'), "
            "checkpoint=hyperacc.CheckpointConfig(save_ckpt=False))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode != 0 and "mixed_precision='fp16' without a loss scaler" in out.stderr, out.stderr[-2000:]


# The example's dry run and its refusals stop before any process group exists: they run through the
# example's main() in this process (example_utils.run_main; a process start-up costs ~3 s each). The
# interpreter's exit code is checked by the plain-python run of test_the_rfc_config_offline_says_so_in_one_line.
@pytest.fixture(scope="module")
def example():
    return load_example("train_qwen_test_precision")


@pytest.mark.parametrize("ep", [1, 8])
def test_30b_rfc_config_fits_64gb_without_offload(example, capsys, tmp_path, ep):
    report = tmp_path / "plan.json"
    code, stdout, stderr = run_main(example, [CONFIG_30B, "--training.dry_run=true", f"--parallel.ep_size={ep}",
                                              f"--training.dry_run_report={report}"], capsys)
    assert code == 0, stderr[-2000:]
    plan = json.loads(report.read_text())
    assert plan["world_size"] == 8 and plan["cpu_offload"] is False and plan["precision"] == "bf16"
    assert 30.4e9 < plan["total_params"] < 30.7e9                     # the real architecture
    assert plan["total_params"] / 8 <= plan["params_per_rank"] < plan["total_params"] / 8 * 1.01
    assert plan["per_rank_total_bytes"] <= 60 * 2 ** 30 and plan["fits"] is True
    per = plan["per_rank_bytes"]
    params = plan["params_per_rank"]
    assert per["params"] == per["grads"] == 2 * params and per["optimizer states"] == 8 * params
    assert "device peak" in stdout and "precision=bf16" in stdout


def test_the_plan_follows_the_recipe(example, capsys, tmp_path):
    """fp32 master weights do not fit 64 GB at seq 1024 (the reason for the bf16 default): the dry
    run says so in one line, exit 2, and the JSON it wrote says fits=false."""
    report = tmp_path / "plan.json"
    code, _, stderr = run_main(example, [CONFIG_30B, "--training.dry_run=true", "--fsdp.precision=fp32_master",
                                         f"--training.dry_run_report={report}"], capsys)
    assert code == 2, stderr[-2000:]
    error = [line for line in stderr.splitlines() if line.startswith("config error")]
    assert len(error) == 1 and "training.device_memory_gb=64" in error[0] and "--fsdp.precision=bf16" in error[0]
    plan = json.loads(report.read_text())
    assert plan["fits"] is False and plan["per_rank_bytes"]["optimizer states"] == 8 * plan["params_per_rank"]


def test_a_training_run_that_does_not_fit_stops_before_anything_is_built(example, capsys, tmp_path):
    code, _, stderr = run_main(example, ["--training.device_memory_gb=0.001", "--checkpoint.save_ckpt=true",
                                         f"--checkpoint.checkpoint_dir={tmp_path / 'ck'}"], capsys)
    assert code == 2 and "training.device_memory_gb=0.001" in stderr, stderr[-2000:]
    assert not (tmp_path / "ck").exists()


def test_model_dtype_must_agree_with_the_recipe(example, capsys):
    code, _, stderr = run_main(example, ["--model.dtype=bfloat16", "--training.dry_run=true"], capsys)
    assert code == 2
    assert "model.dtype=bfloat16 contradicts fsdp.precision=fp32_master" in stderr, stderr[-2000:]


# ----------------------------------------------------------------------------- 2 real FSDP2 processes
PRECISION_RUN = REPO / "tests" / "scripts" / "precision_run.py"


# Slow: the same checks ride tests/test_replicas.py's default 2-process launch (precision_run.py --then).
@pytest.fixture(scope="module")
def bf16_sr_run(tmp_path_factory):
    """One launch (precision_run.py --then, a start-up costs more than these runs): run a saves steps 2 and 4
    and exports; b resumes its step 2 under the same recipe; c its step 4 under fp32_master."""
    out = tmp_path_factory.mktemp("precision")
    run_torchrun(PRECISION_RUN, 2, [
        out / "a.json", "--precision", "bf16_sr", "--ckpt", out / "ck", "--steps", 4, "--save-steps", 2,
        "--export", out / "hf",
        "--then", out / "b.json", "--precision", "bf16_sr", "--ckpt", out / "ck_b", "--steps", 4,
        "--restore", out / "ck" / "global_step_2",
        "--then", out / "c.json", "--precision", "fp32_master", "--ckpt", out / "ck_c", "--steps", 5,
        "--restore", out / "ck" / "global_step_4"])
    return out, json.loads((out / "a.json").read_text())


@pytest.mark.slow   # by default: tests/test_replicas.py::test_bf16_sr_trains_sharded_bf16_with_bf16_states (its shared 2-process launch)
def test_bf16_sr_trains_sharded_bf16_with_bf16_states(bf16_sr_run):
    _, run = bf16_sr_run
    assert run["param_dtypes"] == run["grad_dtypes"] == run["state_dtypes"] == ["bfloat16"]
    assert run["stochastic_rounding"] is True
    losses = [run["steps"][str(s)]["loss"] for s in range(1, 5)]
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0]


@pytest.mark.slow   # by default: tests/test_replicas.py::test_bf16_sr_resumes_bitwise (its shared 2-process launch)
def test_bf16_sr_resumes_bitwise(bf16_sr_run):
    out, run = bf16_sr_run
    resumed = json.loads((out / "b.json").read_text())
    assert resumed["start"] == 2 and not resumed["warnings"]
    assert {s: resumed["steps"][s] for s in ("3", "4")} == {s: run["steps"][s] for s in ("3", "4")}


@pytest.mark.slow   # by default: tests/test_replicas.py::test_a_resume_under_another_recipe_casts_with_a_warning (its shared 2-process launch)
def test_a_resume_under_another_recipe_casts_with_a_warning(bf16_sr_run):
    out, _ = bf16_sr_run
    converted = json.loads((out / "c.json").read_text())
    assert any("saved under precision='bf16_sr' and this run uses 'fp32_master'" in w for w in converted["warnings"])
    assert converted["param_dtypes"] == converted["state_dtypes"] == ["float32"] and converted["start"] == 4
    assert math.isfinite(converted["steps"]["5"]["loss"])


@pytest.mark.slow   # by default: tests/test_replicas.py::test_hf_export_writes_the_parameters_dtype (its shared 2-process launch)
def test_hf_export_writes_the_parameters_dtype(bf16_sr_run):
    out, _ = bf16_sr_run
    headers = [json.loads(f.read_bytes()[8:8 + int.from_bytes(f.read_bytes()[:8], "little")])
               for f in (out / "hf").glob("*.safetensors")]
    assert headers and {v["dtype"] for h in headers for k, v in h.items() if k != "__metadata__"} == {"BF16"}
    assert json.loads((out / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def test_the_rfc_config_offline_says_so_in_one_line():
    # wikitext-2 through Hugging Face datasets: offline (no cache) one line that points at --data.dataset
    proc = run_python(SCRIPT, [CONFIG_30B, "--data.tokenizer=default", "--model.overrides.num_hidden_layers=1",
                               "--model.overrides.num_experts=8", "--checkpoint.save_ckpt=false",
                               "--logging.metrics_file=null", "--logging.tensorboard_dir=null"],
                      env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}, check=False, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("config error")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "'Salesforce/wikitext' is not cached" in errors[0] and "--data.dataset=PATH" in errors[0]


# ----------------------------------------------------------------------------- mixed precision outputs
MIXED_OUTPUTS = REPO / "tests" / "scripts" / "mixed_precision_outputs.py"


def _forward(folder, *runs):
    """Each run's record; the runs share one process (mixed_precision_outputs.py --then)."""
    folder.mkdir()
    outs, argv = [], []
    for args in runs:
        outs.append(folder / f"forward{len(outs)}.json")
        argv += [*(["--then"] if argv else []), outs[-1], *args]
    run_python(MIXED_OUTPUTS, argv, timeout=180)
    return [json.loads(out.read_text()) for out in outs]


def test_mixed_precision_bf16_returns_fp32_outputs_and_matches_accelerates_loss(tmp_path):
    """accelerate wraps a mixed-precision forward in convert_outputs_to_fp32; hyperacc casts the root
    unit's outputs (FSDP2 output_dtype): fp32 logits and loss, bf16 between the blocks. A bf16
    recipe without mixed_precision is a storage choice: its outputs stay bf16. accelerate's process
    state (AcceleratorState) is process-wide and keeps its mixed_precision: accelerate's run has a
    process of its own, hyperacc's two bf16 runs share one, the run without mixed precision another; the
    three processes run side by side (run_together: deterministic, independent)."""
    (theirs,), (ours, via_config), (recipe_only,) = run_together(
        lambda: _forward(tmp_path / "a", ["--engine", "accelerate"]),    # accelerate.Accelerator, same weights
        lambda: _forward(tmp_path / "b", ["--engine", "hyperacc"],       # Accelerator(mixed_precision="bf16")
                         ["--engine", "hyperacc", "--precision", "bf16"]),   # FSDPConfig(mixed_precision=)
        lambda: _forward(tmp_path / "c", ["--engine", "hyperacc", "--precision", "bf16", "--mixed-precision", "no"]))
    for run in (ours, theirs, via_config):
        assert run["logits_dtype"] == run["loss_dtype"] == "torch.float32", run
    assert ours["block_output_dtype"] == via_config["block_output_dtype"] == "torch.bfloat16"
    assert ours["param_dtype"] == "torch.float32" and via_config["param_dtype"] == "torch.bfloat16"
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=2 ** -8, abs=0)     # within one bf16 step
    assert ours["grads"] == theirs["grads"] > 0
    assert recipe_only["logits_dtype"] == "torch.bfloat16" and recipe_only["loss_dtype"] == "torch.float32"
