"""The dry run's activation term (hyperacc.tools.dry_run) against a real Qwen3-MoE on CPU, one process.

What autograd saves is measured with saved-tensor hooks (one block, no recompute); what forward +
backward hold at their peak under recompute -- every block's input, then one block re-materialised
with the gradients of its activations -- with a dispatch mode that counts live tensor storages.
The model is small but shaped where the plan used to miss: a vocabulary so small that activations
dominate, top-4 routing, so that one block's backward weighs as much as all the blocks' inputs.
The multi-process check of the whole plan is benchmarks/memory_plan.py (slow set: test_rehearsal)."""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hyperacc.tools.dry_run import activation_bytes, block_activations, plan_sharding
from hyperacc.models import build_causal_lm, qwen3_moe_config
from hyperacc.sharding import block_classes, enable_recompute, find_blocks

CONFIG = dict(vocab_size=256, hidden_size=256, num_hidden_layers=2, num_experts=8, num_experts_per_tok=4,
              moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, use_cache=False)
BATCH, SEQ = 2, 256


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages ops create while it is active (views and in-place results
    of their inputs are not new), each counted until it is freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen = {}

    def _release(self, key, nbytes):
        self._seen.pop(key, None)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
                if storage.nbytes() and key not in self._seen and key not in inputs:   # not a view, not in place
                    self._seen[key] = weakref.ref(storage, lambda _, k=key, n=storage.nbytes(): self._release(k, n))
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
        return out


def _model(recompute: bool, attn: str = "sdpa"):
    torch.manual_seed(0)
    model = build_causal_lm(qwen3_moe_config(**CONFIG), attn_implementation=attn, experts_implementation="grouped_mm",
                            router_aux_loss=False).train()
    if recompute:
        enable_recompute(find_blocks(model, block_classes(model, None)))
    for param in model.parameters():   # as FSDP does: a unit's gradients leave once reduced (planned apart)
        param.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    return model


def _peak_of_a_step(model) -> int:
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()          # warm-up: lazy buffers are not activations
    with LiveBytes() as tracker:
        out = model(input_ids=ids, labels=ids)               # the caller holds the output (the logits) ...
        out.loss.backward()                                  # ... through backward, as a training loop does
        del out
    return tracker.peak


def _plan(model, recompute: bool, attn: str = "sdpa") -> float:
    return activation_bytes(model.config, tokens=BATCH * SEQ, seq_len=SEQ, micro_batch_size=BATCH, compute=4,
                            layers=CONFIG["num_hidden_layers"], recompute=recompute, eager_attention=attn == "eager")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_one_blocks_saved_tensors_are_what_the_planner_counts(attn):
    model = _model(recompute=False, attn=attn)
    block = model.model.layers[0]
    captured = {}
    handle = block.register_forward_pre_hook(lambda m, a, k: captured.update(args=a, kwargs=k), with_kwargs=True)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    x = captured["args"][0].detach().requires_grad_(True)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        block(x, **captured["kwargs"])
    planned = block_activations(model.config, tokens=BATCH * SEQ, seq_len=SEQ, micro_batch_size=BATCH, compute=4,
                                eager_attention=attn == "eager")
    assert 0.9 <= planned.saved / sum(saved.values()) <= 1.15


@pytest.mark.parametrize("recompute", [True, False])
def test_the_activation_plan_is_the_measured_peak(recompute):
    """Under recompute the peak is every block's input plus one block re-materialised with its
    activations' gradients (or, with a large vocabulary, the loss's fp32 gradients); the planner
    counted one block's saved tensors only and was 0.81 of this peak."""
    model = _model(recompute)
    measured, planned = _peak_of_a_step(model), _plan(model, recompute)
    assert 0.9 <= planned / measured <= 1.15, (planned, measured)
    if recompute:   # well above what autograd saves at the end of forward: the blocks' inputs and one block
        inputs = CONFIG["num_hidden_layers"] * BATCH * SEQ * CONFIG["hidden_size"] * 4
        one_block = block_activations(model.config, tokens=BATCH * SEQ, seq_len=SEQ, micro_batch_size=BATCH,
                                      compute=4, eager_attention=False)
        assert planned > 1.2 * (inputs + one_block.saved)


def test_accumulated_gradients_are_planned():
    """Several micro-batches without a reduce in between: FSDP2 keeps every unit's unsharded
    gradients (fp32) while the next micro-batch's activations are live."""
    model = build_causal_lm(qwen3_moe_config(**CONFIG), meta_device=True, router_aux_loss=False)
    common = dict(world_size=2, micro_batch_size=BATCH, seq_len=SEQ, activation_checkpointing=True, device_type="cpu")
    one = plan_sharding(model, **common)
    two = plan_sharding(model, micro_batches=2, **common)
    every = plan_sharding(model, micro_batches=2, reduce_every_micro_batch=True, **common)
    params = sum(p.numel() for p in model.parameters())
    assert "accumulated grads" not in one.bytes and "accumulated grads" not in every.bytes
    assert two.bytes["accumulated grads"] == pytest.approx(4 * params, rel=0.01)
    assert two.device_bytes > every.device_bytes > one.device_bytes
