"""FSDPConfig.compile in one process: where its settings come from (arguments, accelerate's
dynamo_backend / TorchDynamoPlugin, the ACCELERATE_DYNAMO_* variables of an accelerate config file),
the errors raised before any collective, the recompile watch, and a compiled prepared model that keeps
its parameter names and trains as the eager model does. Multi-process layouts: tests/test_compile.py;
the example under accelerate launch: tests/test_compile_example.py."""
import copy
import warnings

import pytest
import torch
from accelerate.utils import TorchDynamoPlugin

import hyperacc
from hyperacc.sharding import compile as compilation
from hyperacc.config import FSDPConfig, ParallelConfig
from hyperacc.models import build_causal_lm, qwen3_moe_config

DYNAMO_ENV = ("ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE", "ACCELERATE_DYNAMO_USE_FULLGRAPH",
              "ACCELERATE_DYNAMO_USE_DYNAMIC", "HYPERACC_FSDP_COMPILE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in DYNAMO_ENV:
        monkeypatch.delenv(name, raising=False)


def test_off_by_default():
    config = FSDPConfig()
    assert config.compile is False and config.compile_backend == "inductor"


def test_accelerate_config_file_dynamo_variables_turn_it_on(monkeypatch):
    """What `accelerate launch` exports for a config file's dynamo_config."""
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "AOT_EAGER")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "max-autotune-no-cudagraphs")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "False")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", "True")
    config = FSDPConfig()
    assert (config.compile, config.compile_backend, config.compile_mode) == (True, "aot_eager",
                                                                              "max-autotune-no-cudagraphs")
    assert config.compile_fullgraph is False and config.compile_dynamic is True
    assert FSDPConfig(compile=False).compile is False           # an explicit value wins
    monkeypatch.setenv("HYPERACC_FSDP_COMPILE", "false")         # so does hyperacc's own variable
    assert FSDPConfig().compile is False


def test_a_bad_dynamo_variable_is_named(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", "maybe")
    with pytest.raises(ValueError, match="ACCELERATE_DYNAMO_USE_DYNAMIC='maybe'"):
        FSDPConfig()


def test_dynamo_backend_no_keeps_it_off(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    config = FSDPConfig()
    assert config.compile is False and config.compile_backend == "inductor"
    assert FSDPConfig(compile=True).compile_backend == "inductor"


def test_accelerator_dynamo_arguments_reach_the_config():
    base = FSDPConfig()
    on = compilation.apply_dynamo_arguments(base, dynamo_backend="aot_eager")
    assert on.compile and on.compile_backend == "aot_eager" and base.compile is False
    plugin = TorchDynamoPlugin(backend="inductor", mode="max-autotune-no-cudagraphs", fullgraph=True, dynamic=True)
    on = compilation.apply_dynamo_arguments(base, dynamo_plugin=plugin)
    assert (on.compile, on.compile_backend, on.compile_mode, on.compile_fullgraph, on.compile_dynamic) == \
        (True, "inductor", "max-autotune-no-cudagraphs", True, True)
    # transformers' TrainingArguments(torch_compile=True) builds this plugin (backend, mode, dynamic=None)
    on = compilation.apply_dynamo_arguments(base, dynamo_plugin=TorchDynamoPlugin(backend="inductor", mode=None))
    assert on.compile and on.compile_mode is None and on.compile_dynamic is None
    assert compilation.apply_dynamo_arguments(on, dynamo_backend="no").compile is False
    assert compilation.apply_dynamo_arguments(
        on, dynamo_plugin=TorchDynamoPlugin(backend="inductor", disable=True)).compile is False
    with pytest.raises(ValueError, match="both"):
        compilation.apply_dynamo_arguments(base, dynamo_backend="inductor", dynamo_plugin=plugin)


def _error(config, device="cpu", parallel=None, kind=ValueError):
    with pytest.raises(kind) as info:
        compilation.check_backend(config, device, parallel)
    message = str(info.value)
    assert "\n" not in message and ("Fix" in message or "choose" in message), message
    return message


def test_bad_settings_fail_before_any_collective(monkeypatch):
    assert compilation.check_backend(FSDPConfig(compile=False, compile_backend="nope"), "cpu") is None
    assert "'nope'" in _error(FSDPConfig(compile=True, compile_backend="nope"))
    assert "CUDA graphs" in _error(FSDPConfig(compile=True, compile_mode="reduce-overhead"))
    assert "compile_mode" in _error(FSDPConfig(compile=True, compile_mode="fastest"))
    tp = ParallelConfig(tp_size=2)
    assert "tp_size" in _error(FSDPConfig(compile=True, compile_backend="aot_eager", compile_fullgraph=True),
                               parallel=tp)
    compilation.check_backend(FSDPConfig(compile=True, compile_backend="aot_eager"), "cpu", tp)


def test_inductor_without_a_cpu_compiler_is_an_error(monkeypatch):
    from torch._inductor import cpp_builder
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: "/no/such/g++")
    message = _error(FSDPConfig(compile=True), kind=RuntimeError)
    assert "C++ compiler" in message and "aot_eager" in message
    compilation.check_backend(FSDPConfig(compile=True, compile_backend="aot_eager"), "cpu")


def test_inductor_on_a_device_without_code_generator_is_an_error():
    """e.g. an NPU whose torch_npu registers no inductor backend: an error, never a silent eager run."""
    message = _error(FSDPConfig(compile=True), device="npu", kind=RuntimeError)
    assert "'npu'" in message and "compile=false" in message


def test_compile_watch_warns_once_on_a_recompile_storm():
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    watch = compilation.CompileWatch(True, warmup_steps=1, storm_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 6):
            fn(torch.ones(step))          # a new shape every step, never dynamic: a recompile each step
            record = watch.step(step)
    assert record["compiles"] == 5 and watch.after_warmup == 4
    storms = [w for w in caught if "still compiling" in str(w.message)]
    assert len(storms) == 1 and "compile_dynamic" in str(storms[0].message)
    assert compilation.CompileWatch(False).step(3) == {}


def _batches(vocab, count=3):
    generator = torch.Generator().manual_seed(5)
    lengths = [12, 7, 12][:count]
    return [torch.randint(0, vocab, (2, n), generator=generator) for n in lengths]


@pytest.mark.slow      # the default run proves it on 2 processes (tests/test_compile.py)
def test_compiled_model_keeps_names_and_trains_like_eager():
    """One process: the prepared compiled model has the eager model's parameter names (so checkpoint
    keys and exports), its blocks are compiled, and three SGD steps match eager (aot_eager numerics)."""
    config = qwen3_moe_config()
    torch.manual_seed(0)
    eager = build_causal_lm(config)
    model = copy.deepcopy(eager)
    acc = hyperacc.Accelerator(fsdp=FSDPConfig(compile=True, compile_backend="aot_eager"),
                               checkpoint=hyperacc.CheckpointConfig(save_ckpt=False))
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = acc.prepare(model, optimizer)
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in eager.named_parameters()]
        assert all("_orig_mod" not in key for key in model.state_dict())
        blocks = model.model.layers
        assert all(hasattr(block.forward, "_torchdynamo_orig_callable") or "compile" in repr(block.forward)
                   for block in blocks), [repr(b.forward) for b in blocks]
        eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
        frames = compilation.compiled_frames()
        for ids in _batches(config.vocab_size):
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            reference = eager(input_ids=ids, labels=ids).loss
            reference.backward()
            eager_opt.step()
            eager_opt.zero_grad()
            assert abs(loss.item() - reference.item()) <= 1e-5 * abs(reference.item()), (loss, reference)
        assert compilation.compiled_frames() > frames
        assert model.config.use_cache is False      # no per-layer cache state to specialise on
    finally:
        acc.end_training()


def test_a_model_compiled_whole_is_refused():
    model = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    with pytest.raises(ValueError, match="already torch.compile'd"):
        compilation.check_model(model, FSDPConfig(compile=True))
    compilation.check_model(model, FSDPConfig(compile=False))


def test_compile_without_blocks_is_an_error():
    """Nothing to compile would be a silent eager run."""
    with pytest.raises(ValueError, match="no transformer block"):
        compilation.compile_blocks([], FSDPConfig(compile=True))


@pytest.mark.slow
def test_lora_model_compiled_trains_as_eager():
    """A PEFT LoRA model: its LoRA layers are inside the compiled blocks; PEFT's disable_adapter
    switch still applies. aot_eager gives the eager run's losses."""
    pytest.importorskip("peft")
    from dist_utils import REPO, run_python

    def run(backend):
        out = run_python(REPO / "tests" / "scripts" / "peft_compile.py", [backend], timeout=300).stdout.split()
        values = [float(out[i + 1]) for i, word in enumerate(out) if word == "LOSS"]
        return values, int(out[out.index("FRAMES") + 1])

    (compiled, frames), (eager, none) = run("aot_eager"), run("none")
    assert frames > 0 and none == 0 and len(compiled) == len(eager) == 5
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(compiled, eager)), (compiled, eager)
