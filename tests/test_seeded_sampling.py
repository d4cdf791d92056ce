"""Per-sample seeded sampling (`hyperacc.integrations.seeded_sampling`), in this process.

The draw is a sample of softmax(warped logits) (frequencies over many samples), a sample's token does not
depend on the batch it is drawn in (rows 2-3 of a batch of 4 = a batch of 2 starting at index 2), `generate`
gives the same completions either way, greedy generation is left as it was, and an option the sampler cannot
honour is named.
"""
import pytest
import torch
import transformers

from hyperacc.integrations import seeded_sampling


def test_the_draw_follows_the_warped_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows = 6000
    draw = seeded_sampling.GumbelDraw(seed=1, key="k", first_index=0)
    warped = transformers.TemperatureLogitsWarper(0.7)(None, logits.expand(rows, -1).clone())
    out = draw(torch.zeros(rows, 3, dtype=torch.long), warped)
    assert torch.all((out == 0).sum(-1) == 1) and torch.all(torch.isinf(out).sum(-1) == logits.numel() - 1)
    freq = torch.bincount(out.argmax(-1), minlength=logits.numel()).float() / rows
    expected = torch.softmax(logits / 0.7, -1)
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)


def test_a_sample_is_drawn_alike_in_any_batch():
    torch.manual_seed(0)
    scores = torch.randn(4, 50)
    ids = torch.zeros(4, 5, dtype=torch.long)
    whole = seeded_sampling.GumbelDraw(seed=3, key="s", first_index=0)(ids, scores.clone())
    part = seeded_sampling.GumbelDraw(seed=3, key="s", first_index=2)(ids[2:], scores[2:].clone())
    assert torch.equal(whole[2:], part)
    other_key = seeded_sampling.GumbelDraw(seed=3, key="t", first_index=0)(ids, scores.clone())
    assert not torch.equal(whole.argmax(-1), other_key.argmax(-1))


@pytest.fixture(scope="module")
def tiny():
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_generate_gives_a_sample_the_same_completion_in_any_batch(tiny):
    prompts = torch.randint(1, 64, (4, 5), generator=torch.Generator().manual_seed(1))
    config = transformers.GenerationConfig(do_sample=True, temperature=0.8, top_k=20, top_p=0.95,
                                           max_new_tokens=6, min_new_tokens=6, pad_token_id=0)
    with torch.no_grad(), seeded_sampling.seeded_generate(tiny, seed=7, key="0", first_index=0):
        whole = tiny.generate(prompts, generation_config=config)
    with torch.no_grad(), seeded_sampling.seeded_generate(tiny, seed=7, key="0", first_index=2):
        part = tiny.generate(prompts[2:], generation_config=config)
    assert torch.equal(whole[2:], part)
    assert "generate" not in tiny.__dict__            # the override ends with the block
    greedy = transformers.GenerationConfig(do_sample=False, max_new_tokens=4, pad_token_id=0)
    with torch.no_grad():
        plain = tiny.generate(prompts, generation_config=greedy)
        with seeded_sampling.seeded_generate(tiny, seed=7, key="0", first_index=0):
            assert torch.equal(tiny.generate(prompts, generation_config=greedy), plain)


def test_options_it_cannot_honour_are_named():
    config = transformers.GenerationConfig(do_sample=True, typical_p=0.9, num_beams=2)
    assert seeded_sampling.unsupported_options(config) == ["typical_p=0.9", "num_beams=2"]
    assert seeded_sampling.unsupported_options(transformers.GenerationConfig(do_sample=True, top_p=0.9)) == []
