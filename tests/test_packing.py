"""Padding-free packing (`hyperacc.data.packing`) in one process: a packed micro-batch computes what its
samples compute one by one, unpadded -- loss, gradients and the MoE sequence-wise aux term -- and no
sample sees another (transformers' own packed-sequence masking, code hyperacc did not write)."""
import pytest
import torch

from hyperacc.data.packing import count_sequences, pack_collate, packed_boundaries, sequence_index

LENGTHS = [7, 13, 4, 21]
VOCAB = 97


def _samples(seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        ids = torch.randint(0, VOCAB, (n,), generator=gen)
        labels = ids.clone()
        labels[: n // 3] = -100                       # a prompt: not trained
        out.append({"input_ids": ids, "labels": labels})
    return out


def _model(kind, attn):
    from transformers import Qwen3Config

    from hyperacc.models import build_causal_lm, qwen3_moe_config
    from hyperacc.training.router_aux import SequenceAuxLoss

    torch.manual_seed(0)
    if kind == "dense":
        config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    else:
        config = qwen3_moe_config(vocab_size=VOCAB)
    config.use_cache = False
    model = build_causal_lm(config, attn_implementation=attn, router_aux_loss=kind == "moe",
                            experts_implementation="eager" if kind == "moe" else None).double().float()
    if kind == "moe":
        SequenceAuxLoss(model, lambda: None)          # outside step mode: the mean over this forward's sequences
    return model


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def test_pack_collate_layout():
    samples = _samples()
    batch = pack_collate(samples)
    assert set(batch) == {"input_ids", "labels", "position_ids"}         # no attention_mask: packed form
    total = sum(LENGTHS)
    assert all(v.shape == (1, total) for v in batch.values())
    assert torch.equal(batch["input_ids"][0], torch.cat([s["input_ids"] for s in samples]))
    starts = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0)[:-1].tolist()])
    assert (batch["labels"][0, starts] == -100).all()                     # no target across a boundary
    expected = torch.cat([s["labels"] for s in samples])
    expected[starts] = -100
    assert torch.equal(batch["labels"][0], expected)
    assert torch.equal(batch["position_ids"][0], torch.cat([torch.arange(n) for n in LENGTHS]))
    assert count_sequences(batch) == len(LENGTHS) and packed_boundaries(batch) == len(LENGTHS) - 1
    assert sequence_index(batch["position_ids"])[0].tolist() == sum(([i] * n for i, n in enumerate(LENGTHS)), [])
    # padded rows (attention_mask present) count one sample per row
    assert count_sequences({"labels": torch.zeros(3, 5), "attention_mask": torch.ones(3, 5),
                            "position_ids": torch.zeros(3, 5, dtype=torch.long)}) == 3


@pytest.mark.parametrize("bad, needle", [
    ({"input_ids": torch.arange(3), "labels": torch.arange(3), "attention_mask": torch.tensor([1, 1, 0])}, "padded"),
    ({"input_ids": torch.arange(3), "labels": torch.arange(3), "token_type_ids": torch.zeros(3)}, "token_type_ids"),
    ({"input_ids": torch.arange(3), "labels": torch.arange(2)}, "same non-empty 1-D"),
    ({"input_ids": torch.arange(0), "labels": torch.arange(0)}, "same non-empty 1-D"),
    ({"input_ids": torch.arange(3)}, "'input_ids' and 'labels' only"),
])
def test_pack_collate_refuses_what_it_cannot_pack(bad, needle):
    with pytest.raises(ValueError, match=needle):
        pack_collate([bad])


@pytest.mark.parametrize("kind, attn", [("dense", "sdpa"), ("dense", "eager"), ("dense", "packed_sdpa"),
                                        ("moe", "eager"), ("moe", "sdpa"), ("moe", "packed_sdpa")])
def test_packed_equals_samples_one_by_one(kind, attn):
    """Loss and gradients of one packed row == the token-weighted mean of the samples run alone,
    unpadded (plus, for MoE, the mean of their own sequence-wise aux terms)."""
    from hyperacc.models import packed_attention

    model = _model(kind, attn)
    samples = _samples()
    packed_attention._last = (lambda: None, None)
    out = model(**pack_collate(samples))       # packed_sdpa: the one forward with a (packed) mask here
    out.loss.backward()
    packed_loss, packed_grads = out.loss.detach(), _grads(model)
    model.zero_grad()
    tokens = sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    reference, aux = torch.zeros(()), []
    for sample in samples:
        alone = model(input_ids=sample["input_ids"][None], labels=sample["labels"][None])
        ce_sum = torch.nn.functional.cross_entropy(alone.logits[0, :-1].float(), sample["labels"][1:],
                                                   ignore_index=-100, reduction="sum")
        reference = reference + ce_sum / tokens
        if kind == "moe":                 # the rest of its loss is coef x its own aux term, with its graph
            n = int((sample["labels"][1:] != -100).sum())
            reference = reference + (alone.loss - ce_sum / n) / len(samples)
            aux.append(alone.aux_loss)
    reference.backward()
    reference = reference.detach()
    if attn == "packed_sdpa":                 # it did attend sample by sample (not the masked fallback)
        assert packed_attention._last[1] == LENGTHS
    assert _rel(packed_loss, reference) <= 1e-6, (packed_loss, reference)
    assert _rel(packed_grads, _grads(model)) <= 1e-6
    if kind == "moe":
        assert _rel(out.aux_loss, torch.stack(aux).mean()) <= 1e-6


@pytest.mark.parametrize("kind, attn", [("dense", "sdpa"), ("moe", "sdpa"), ("dense", "packed_sdpa")])
def test_no_attention_across_samples(kind, attn):
    """A changed token in one sample leaves every other sample's logits bitwise unchanged."""
    model = _model(kind, attn).eval()
    batch = pack_collate(_samples())
    changed = {k: v.clone() for k, v in batch.items()}
    where = LENGTHS[0] + 2                                   # inside sample 1
    changed["input_ids"][0, where] = (changed["input_ids"][0, where] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(**batch).logits[0], model(**changed).logits[0]
    owner = sequence_index(batch["position_ids"])[0]
    assert torch.equal(a[owner != 1], b[owner != 1])
    assert not torch.equal(a[owner == 1], b[owner == 1])    # the test can fail: sample 1 did change


def test_context_parallel_refuses_packed_rows():
    from hyperacc.parallel.context import PACKED_ROWS, ContextParallel

    cp = ContextParallel(None, 0, 2)
    with pytest.raises(ValueError) as err:
        cp.shard(pack_collate(_samples()[:2]))
    assert str(err.value) == PACKED_ROWS and "chat_collate(tokenizer, packing=False)" in PACKED_ROWS
    padded = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8, dtype=torch.long),
              "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    assert cp.shard(padded)["input_ids"].shape == (2, 4)    # unpacked rows still split


def _attention_inputs(mask):
    """q, k, v of one row of sum(LENGTHS) tokens (4 query heads over 2 kv heads) and its 4-D mask."""
    gen = torch.Generator().manual_seed(1)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(1, heads, total, 8, generator=gen) for heads in (4, 2, 2))
    return q, k, v, mask[None, None]


class _Attention(torch.nn.Module):
    num_key_value_groups, is_causal = 2, True


def test_packed_sdpa_takes_the_sample_path_only_for_the_exact_block_mask():
    """packed_sdpa == sdpa with the mask, whatever the mask; the sample-by-sample path only when the mask
    is the block-diagonal causal mask of the position_ids restarts (a padding mask, a window: fallback)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hyperacc.models import packed_attention as pa

    positions = pack_collate(_samples())["position_ids"]
    block = pa._block_causal(sequence_index(positions)[0])
    padded = block.clone()
    padded[:, -3:] = False                              # the last 3 keys masked: not what position_ids say
    window = block & torch.triu(torch.ones_like(block), diagonal=-4)
    for mask, expect_lengths in [(block, LENGTHS), (padded, None), (window, None)]:
        q, k, v, m = _attention_inputs(mask)
        pa._last = (lambda: None, None)
        ours, _ = pa.packed_sdpa_attention(_Attention(), q, k, v, m, position_ids=positions, scaling=0.3)
        assert pa._last[1] == expect_lengths
        reference, _ = sdpa_attention_forward(_Attention(), q, k, v, m, scaling=0.3)
        assert _rel(ours, reference) <= 1e-6
    q, k, v, m = _attention_inputs(block)                # traced by dynamo: lengths are data -> the masked path
    compiled = torch.compile(pa.packed_sdpa_attention, backend="eager", fullgraph=False)
    pa._last = (lambda: None, None)
    ours, _ = compiled(_Attention(), q, k, v, m, position_ids=positions, scaling=0.3)
    reference, _ = sdpa_attention_forward(_Attention(), q, k, v, m, scaling=0.3)
    assert pa._last[1] is None and _rel(ours, reference) <= 1e-6
