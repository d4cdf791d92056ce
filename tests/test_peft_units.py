"""PEFT support in one process, against real `peft`: the name mapping to base checkpoints, PEFT's own
adapter initialisation on meta-device models (LoRA, LoHa, LoKr, IA3), dtypes after prepare, the
frozen-base fingerprint, and the refusals. The multi-process cases are in tests/test_peft.py."""
import math

import pytest
import torch

peft = pytest.importorskip("peft")

import hyperacc  # noqa: E402
from hyperacc.checkpoint import frozen_base  # noqa: E402
from hyperacc.integrations.peft import base_names, check_layout, initial_adapter_values  # noqa: E402


def tiny_config(**overrides):
    from transformers import Qwen3Config

    return Qwen3Config(**{**dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False,
                                 tie_word_embeddings=False), **overrides})


def base_model(meta=True, dtype=torch.bfloat16, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(tiny_config(), dtype=dtype, attn_implementation="eager")
    return AutoModelForCausalLM.from_config(tiny_config(), dtype=dtype, attn_implementation="eager")


def lora(**kwargs):
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **kwargs})


def test_base_names_map_every_tensor_to_the_base_checkpoint():
    model = peft.get_peft_model(base_model(), lora(modules_to_save=["lm_head"]))
    names = base_names(model)
    plain = {n for n, _ in [*base_model().named_parameters(), *base_model().named_buffers()]}
    mapped = {key for key in names.values() if key is not None}
    assert mapped == plain                       # every base key, nothing else
    assert names["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == \
        "model.layers.0.self_attn.q_proj.weight"
    assert names["base_model.model.lm_head.original_module.weight"] == "lm_head.weight"
    assert names["base_model.model.lm_head.modules_to_save.default.weight"] == "lm_head.weight"
    adapters = sorted(n for n, key in names.items() if key is None)
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert len(adapters) == 2 * 2 * 2            # A and B, q and v, 2 layers


@pytest.mark.parametrize("config, zero, nonzero", [
    (lambda: lora(), "lora_B", "lora_A"),
    (lambda: peft.LoHaConfig(r=4, target_modules=["q_proj"]), "hada_w2_b", "hada_w1_a"),
    (lambda: peft.LoKrConfig(r=4, target_modules=["v_proj"]), "lokr_w1", "lokr_w2"),
])
def test_meta_adapters_get_peft_own_init_deterministically(config, zero, nonzero):
    """PEFT's initialisation (zeros where PEFT puts zeros, its random init elsewhere), the same for
    the same seed, another for another seed: the base model's _init_weights never touches adapters."""
    model = peft.get_peft_model(base_model(), config())
    assert all(p.is_meta for p in model.parameters())
    first, again = initial_adapter_values(model, seed=1), initial_adapter_values(model, seed=1)
    other = initial_adapter_values(model, seed=2)
    adapter_params = {n for n, key in base_names(model).items() if key is None}
    assert set(first) == adapter_params
    for name, value in first.items():
        assert value.shape == dict(model.named_parameters())[name].shape
        assert torch.equal(value, again[name])
        if f".{zero}." in name:
            assert value.abs().sum() == 0, name
        if f".{nonzero}." in name:
            assert value.abs().sum() > 0 and not torch.equal(value, other[name]), name


def test_ia3_vectors_start_at_one_on_meta():
    model = peft.get_peft_model(base_model(), peft.IA3Config(target_modules=["k_proj", "down_proj"],
                                                             feedforward_modules=["down_proj"]))
    values = initial_adapter_values(model, seed=0)
    assert values and all(torch.equal(v, torch.ones_like(v)) for v in values.values())


def test_weight_dependent_init_on_meta_is_refused():
    # (without low_cpu_mem_usage PEFT itself fails on the meta weights, at get_peft_model)
    model = peft.get_peft_model(base_model(), lora(init_lora_weights="pissa"), low_cpu_mem_usage=True)
    with pytest.raises(ValueError, match="init_lora_weights='pissa' is computed from the base weights"):
        initial_adapter_values(model, seed=0)


@pytest.mark.parametrize("tp, ep, what", [(2, 1, "tp_size=2"), (1, 2, "ep_size=2")])
def test_tp_and_ep_with_adapters_are_refused_in_one_line(tp, ep, what):
    model = peft.get_peft_model(base_model(), lora())
    with pytest.raises(NotImplementedError) as err:
        check_layout(model, tp, ep)
    assert what in str(err.value) and "\n" not in str(err.value)
    check_layout(base_model(), tp, ep)           # a plain model is not this check's business


def test_adapters_on_fused_expert_parameters_are_refused():
    from hyperacc.models import build_causal_lm, qwen3_moe_config

    moe = build_causal_lm(qwen3_moe_config(), meta_device=True)
    model = peft.get_peft_model(moe, peft.LoraConfig(r=4, target_modules=[],
                                                     target_parameters=["mlp.experts.gate_up_proj"]))
    with pytest.raises(NotImplementedError, match="target_parameters"):
        check_layout(model, 1, 1)


@pytest.fixture
def prepared(tmp_path):
    """A meta-device bf16 Qwen3 + LoRA prepared by one process under the default fp32_master recipe."""
    acc = hyperacc.Accelerator(seed=5, checkpoint=hyperacc.CheckpointConfig(checkpoint_dir=str(tmp_path / "ckpt")))
    model = peft.get_peft_model(base_model(), lora(modules_to_save=["lm_head"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    yield acc, model, optimizer
    acc.free_memory()


def test_prepare_keeps_the_frozen_base_in_its_dtype(prepared):
    acc, model, optimizer = prepared
    kinds = {(p.dtype, p.requires_grad) for p in model.parameters()}
    assert kinds == {(torch.bfloat16, False), (torch.float32, True)}
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with model.disable_adapter(), torch.no_grad():
        base_loss = model(input_ids=ids, labels=ids).loss
    loss = model(input_ids=ids, labels=ids).loss
    assert loss.item() == base_loss.item()       # LoRA B = 0 and the lm_head copy starts as the original
    loss.backward()
    optimizer.step()
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert all(p.grad is None for p in frozen)
    assert all(p not in optimizer.state for p in frozen)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_disable_adapter_keeps_the_trainable_flags_fsdp_reads(prepared):
    """PEFT toggles requires_grad to switch adapters off; under FSDP2 a toggle on an unsharded unit
    would be lost (a modules_to_save copy ended frozen): the flags survive the round trip."""
    acc, model, optimizer = prepared
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        with model.disable_adapter(), torch.no_grad():
            model(input_ids=ids)
        model(input_ids=ids, labels=ids).loss.backward()
        assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())


def test_adapters_only_checkpoint_is_detected_and_refused_onto_another_base(prepared, tmp_path):
    acc, model, optimizer = prepared
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    path = acc.save_state()
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k or ".modules_to_save." in k for k in model_keys)
    with torch.no_grad():       # "another base": one frozen weight changed by 1 %
        weight = model.base_model.model.model.layers[1].mlp.up_proj.weight
        (weight.to_local() if hasattr(weight, "to_local") else weight).mul_(1.01)
    with pytest.raises(RuntimeError, match=r"another base model: frozen parameter .*mlp\.up_proj\.weight differs"):
        acc.load_state(path)


def test_fingerprint_tolerates_summation_order_but_not_a_changed_base():
    saved = {"w": [1000, 3.0, 250.0]}
    assert frozen_base.first_difference(saved, {"w": [1000, 3.0 + 1e-13, 250.0 * (1 + 1e-13)]}) is None
    assert "w differs" in frozen_base.first_difference(saved, {"w": [1000, 3.0, 250.0 * 1.0001]})
    assert "w differs" in frozen_base.first_difference(saved, {"w": [999, 3.0, 250.0]})
    assert "not frozen" in frozen_base.first_difference(saved, {"v": [1000, 3.0, 250.0]})
    assert not math.isnan(saved["w"][1])


@pytest.mark.parametrize("text, value", [("true", True), ("0", False), ("", None)])
def test_is_peft_from_the_environment(monkeypatch, text, value):
    monkeypatch.setenv("HYPERACC_CHECKPOINT_IS_PEFT", text)
    assert hyperacc.CheckpointConfig().is_peft is value
    monkeypatch.delenv("HYPERACC_CHECKPOINT_IS_PEFT")
    assert hyperacc.CheckpointConfig().is_peft is None       # detected at save/load


def test_convert_refuses_an_adapters_only_checkpoint(prepared, tmp_path):
    from hyperacc.checkpoint.convert import ConvertError, to_hf

    acc, _, _ = prepared
    path = acc.save_state()
    with pytest.raises(ConvertError, match="adapter run only"):
        to_hf(path, str(tmp_path / "hf"), progress=False)
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow   # 2 processes; HSDP replicas of a seeded PEFT model are in the default set (test_peft.py)
def test_adapters_built_before_seeding_are_rank0s_on_every_replica():
    """PEFT draws adapter init from the global RNG: built before the Accelerator, each rank's differs.
    prepare() broadcasts rank 0's, so HSDP replicas start identical (they diverged from step 0 before)."""
    import json

    from dist_utils import REPO, run_torchrun

    proc = run_torchrun(REPO / "tests" / "scripts" / "peft_init_ranks.py", 2, timeout=300)
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert result["replicas_equal"] and result["is_rank0_init"], result


def test_tied_head_copy_is_read_through_the_tie(tmp_path):
    """A tied checkpoint holds no lm_head.weight; a modules_to_save copy of the (tied) head starts as
    the embedding matrix, as PEFT makes it from from_pretrained."""
    from transformers import AutoModelForCausalLM

    from hyperacc.models import load_pretrained

    AutoModelForCausalLM.from_config(tiny_config(tie_word_embeddings=True)).save_pretrained(tmp_path / "base")
    acc = hyperacc.Accelerator(seed=1, checkpoint=hyperacc.CheckpointConfig(save_ckpt=False))
    model = acc.prepare(peft.get_peft_model(load_pretrained(str(tmp_path / "base"), accelerator=acc),
                                            lora(modules_to_save=["lm_head"])))
    reference = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                    lora(modules_to_save=["lm_head"]))
    copy = model.base_model.model.lm_head.modules_to_save.default.weight
    expected = reference.base_model.model.lm_head.modules_to_save.default.weight
    assert torch.equal(copy.full_tensor() if hasattr(copy, "full_tensor") else copy, expected.float())


def _prepared_lora(tmp_path, name, **lora_kwargs):
    acc = hyperacc.Accelerator(seed=5, checkpoint=hyperacc.CheckpointConfig(checkpoint_dir=str(tmp_path / name)))
    model = peft.get_peft_model(base_model(), lora(**lora_kwargs))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    return acc, model


@pytest.mark.parametrize("change, message", [
    (dict(r=8), r"has shape \[4, 64\] there and \[8, 64\] in this model"),
    (dict(target_modules=["q_proj"]), r"holds trained tensor\(s\) this model has no place for: .*v_proj\.lora_"),
    (dict(target_modules=["q_proj", "v_proj", "k_proj"]), r"missing model key.*k_proj\.lora_"),
])
def test_resume_under_another_adapter_configuration_is_refused(tmp_path, change, message):
    """Another rank, fewer or more target modules: one RuntimeError naming it, never adapters
    dropped or half-loaded (the same base, so the fingerprint agrees)."""
    acc, _ = _prepared_lora(tmp_path, "saved")
    path = acc.save_state()
    acc, model = _prepared_lora(tmp_path, "resumed", **change)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    with pytest.raises(RuntimeError, match=message):
        acc.load_state(path)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
