"""accelerate's constructor arguments on hyperacc.Accelerator: mapped with their meaning, or refused
with one error naming them; weights held by rank 0 alone reach every rank."""
import re
import subprocess
import sys
import warnings

import pytest
import torch
from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig
from torch.distributed.fsdp import MixedPrecisionPolicy

from dist_utils import REPO, _env, run_torchrun
from hyperacc.accelerator import compat


def test_fsdp_plugin_maps_to_fsdp_config(monkeypatch):
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "true")       # the plugin's values beat the launch
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "false")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "false")
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=False, activation_checkpointing=True,
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    config = compat.fsdp_config_from_plugin(plugin)
    assert (config.reshard_after_forward, config.activation_checkpointing, config.wrap_classes,
            config.mixed_precision) == (False, True, ["LlamaDecoderLayer"], "bf16")


def test_parallelism_config_maps_to_parallel_config():
    config = compat.parallel_config_from_accelerate(ParallelismConfig(dp_replicate_size=2, dp_shard_size=4))
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size, config.cp_size) == (2, 4, 1, 1)


def test_mixed_precision_argument_sets_fsdp_policy_unless_explicit(monkeypatch):
    from hyperacc import FSDPConfig
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    resolve = lambda fsdp, mp: compat.resolve_configs(  # noqa: E731
        parallel=None, fsdp=fsdp, checkpoint=None, parallelism_config=None, fsdp_plugin=None, mixed_precision=mp)[1]
    assert resolve(None, None).mixed_precision == "fp16"              # the launch environment
    assert resolve(None, "bf16").mixed_precision == "bf16"            # the argument beats it
    assert resolve(None, "no").mixed_precision is None
    assert resolve(FSDPConfig(mixed_precision="no"), "bf16").mixed_precision is None   # FSDPConfig beats both
    assert resolve(FSDPConfig(reshard_after_forward=False), "bf16").mixed_precision == "fp16"  # complete: env
    with pytest.raises(NotImplementedError, match="fp8"):
        resolve(FSDPConfig(), "fp8")


@pytest.mark.parametrize("kwargs, name", [
    ({"deepspeed_plugin": object()}, "deepspeed_plugin"),
    ({"megatron_lm_plugin": object()}, "megatron_lm_plugin"),
    ({"torch_tp_plugin": object()}, "torch_tp_plugin"),
])
def test_unsupported_plugins_are_refused_by_name(kwargs, name):
    from hyperacc import Accelerator
    with pytest.raises(NotImplementedError, match=name):
        Accelerator(**kwargs)


def test_constructor_accepts_accelerate_arguments_and_does_not_reseed(tmp_path):
    """Run in a fresh process: accelerate's state is a process-wide singleton."""
    script = tmp_path / "ctor.py"
    script.write_text(f"""
import warnings, torch
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, ProjectConfiguration
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from hyperacc import Accelerator
torch.manual_seed(123); expected = torch.rand(3)
torch.manual_seed(123)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    acc = Accelerator(device_placement=True, mixed_precision="no", cpu=True, rng_types=["generator"],
                      dataloader_config=DataLoaderConfiguration(even_batches=True), log_with=None,
                      project_config=ProjectConfiguration(project_dir={str(tmp_path)!r}, automatic_checkpoint_naming=True),
                      gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3),
                      step_scheduler_with_optimizer=True, kwargs_handlers=[], dynamo_backend="inductor",
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False))
assert torch.equal(torch.rand(3), expected), "the constructor reseeded the global RNG"
assert acc.gradient_accumulation_steps == 3 and acc.fsdp_config.reshard_after_forward is False
assert acc.distributed_type == DistributedType.FSDP and acc.is_fsdp2 and acc.mixed_precision == "no"
assert acc.project_dir == {str(tmp_path)!r}
assert acc.fsdp_config.compile and acc.fsdp_config.compile_backend == "inductor", acc.fsdp_config
acc.gradient_accumulation_steps = 5
assert acc.gradient_accumulation_steps == 5
print("OK")
""")
    proc = subprocess.run([sys.executable, str(script)], env=_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_weights_on_rank0_only_reach_every_rank(tmp_path):
    """`from_pretrained` under an FSDP launch with cpu-RAM-efficient loading, and a model left on the
    meta device on rank 1 (older transformers): after prepare() every rank holds the files' weights."""
    import transformers
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    proc = run_torchrun(REPO / "tests/scripts/rank0_weights.py", 2, args=[tmp_path / "model"],
                        env={"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"})
    # The ranks print concurrently, so lines may run together: match the numbers only.
    checks = re.findall(r"max_abs_diff=([-+0-9.e]+) buffer_diff=([-+0-9.e]+)", proc.stdout)
    assert len(checks) == 4, proc.stdout[-3000:]
    assert all(float(p) == 0.0 and float(b) == 0.0 for p, b in checks), proc.stdout


def test_not_supported_members_raise_naming_themselves():
    from hyperacc.accelerator import NOT_SUPPORTED, Accelerator
    for name in NOT_SUPPORTED:
        with pytest.raises(NotImplementedError, match=name):
            getattr(Accelerator, name)(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.warn_split_batches(None)
