"""Sampling in transformers' `generate` that depends on the sample, not on the rank that draws it.

Online trainers (GRPO, RLOO) sample their completions with ``do_sample=True``: `torch.multinomial` over
the whole local batch, from the process's global generator, which TRL seeds differently on every rank.
The same prompt in the same place of the global batch then gets another completion on 1 process than on
2, and after a resume than before it. Here each token is drawn by the Gumbel-max trick,
``argmax(logits + G)`` with G ~ Gumbel(0, 1), which samples exactly from ``softmax(logits)``, and G comes
from a generator seeded by (seed, key, the sample's index in the global batch, the token's place in the
completion): a completion is a function of its sample alone, whichever rank or world size draws it.

The sampling warpers (temperature, top-k, top-p, min-p) are applied first, as `generate` would: transformers
runs a caller's logits processors *before* its warpers, so the call is made greedy (``do_sample=False``)
with this module's processors doing the warping and the draw; greedy decoding then takes the drawn token.
Costs one `torch.rand` over the vocabulary per sample and token, on the logits' device.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib

import torch
import transformers

from hyperacc.sharding.fsdp import gathered_for_decoding

# Generation options whose warpers this module applies itself (as `generate` builds them, same order).
_WARPERS = ("temperature", "top_k", "top_p", "min_p")
# Sampling options it does not apply: refused rather than silently ignored.
_UNSUPPORTED = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None, "num_beams": 1}


def unsupported_options(config: transformers.GenerationConfig) -> list:
    """Sampling options of ``config`` that per-sample seeded sampling cannot honour."""
    return [f"{name}={getattr(config, name)!r}" for name, default in _UNSUPPORTED.items()
            if getattr(config, name, default) not in (default, None)]


class GumbelDraw(transformers.LogitsProcessor):
    """Draws one token per row from ``softmax(scores)`` with noise seeded per (sample, position), and
    returns scores that make greedy decoding take it (0 for the drawn token, -inf elsewhere)."""

    def __init__(self, seed: int, key: str, first_index: int):
        self.seed, self.key, self.first_index = int(seed), str(key), int(first_index)
        self.prompt_length = None

    def _generator(self, device: torch.device, index: int, position: int) -> torch.Generator:
        text = f"{self.seed}:{self.key}:{index}:{position}".encode()
        number = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 63) - 1)
        generator = torch.Generator(device=device)
        generator.manual_seed(number)
        return generator

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        position = input_ids.shape[1] - self.prompt_length     # the token's place in the completion
        rows, vocab = scores.shape
        noise = torch.empty(rows, vocab, dtype=torch.float32, device=scores.device)
        for row in range(rows):
            noise[row] = torch.rand(vocab, generator=self._generator(scores.device, self.first_index + row, position),
                                    device=scores.device)
        gumbel = -torch.log(-torch.log(noise.clamp_(min=torch.finfo(torch.float32).tiny)))
        drawn = (scores.float() + gumbel).argmax(dim=-1, keepdim=True)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, drawn, 0.0)


def _warpers(config: transformers.GenerationConfig) -> list:
    out = []
    if config.temperature is not None and config.temperature != 1.0:
        out.append(transformers.TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        out.append(transformers.TopKLogitsWarper(top_k=config.top_k))
    if config.top_p is not None and config.top_p < 1.0:
        out.append(transformers.TopPLogitsWarper(top_p=config.top_p))
    if config.min_p is not None:
        out.append(transformers.MinPLogitsWarper(min_p=config.min_p))
    return out


@contextlib.contextmanager
def seeded_generate(model: torch.nn.Module, *, seed: int, key: str, first_index: int, gather_whole: bool = False):
    """While inside, ``model.generate(..., generation_config=...)`` with ``do_sample=True`` samples row ``i``
    as sample ``first_index + i`` of draw ``key`` (see the module doc); greedy calls keep their meaning. Either
    runs with the sharded root's weights gathered, and with ``gather_whole`` every block's, for the call
    (`hyperacc.sharding.fsdp.gathered_for_decoding`: a PEFT model's `generate` bypasses the root's forward)."""
    original = model.generate

    def generate(*args, generation_config=None, logits_processor=None, **kwargs):
        config = generation_config if generation_config is not None else model.generation_config
        if getattr(getattr(model, "config", None), "output_router_logits", False):
            # An MoE model asked to return its router logits (for the aux loss in training) computes that loss
            # in every decoding step too, where transformers' formula fails on a cached step ("size of tensor
            # a (8) must match ... (96)": TRL's GRPO on plain accelerate stops there). Unused while generating.
            kwargs.setdefault("output_router_logits", False)
        if not config.do_sample:
            with gathered_for_decoding(model, whole=gather_whole):
                return original(*args, generation_config=generation_config, logits_processor=logits_processor,
                                **kwargs)
        greedy = copy.deepcopy(config)
        greedy.do_sample = False
        for name in _WARPERS:
            setattr(greedy, name, None)
        processors = transformers.LogitsProcessorList(list(logits_processor or []) + _warpers(config)
                                                      + [GumbelDraw(seed, key, first_index)])
        with gathered_for_decoding(model, whole=gather_whole):
            return original(*args, generation_config=greedy, logits_processor=processors, **kwargs)

    model.generate = generate               # an instance attribute: this model only, this call only
    try:
        yield model
    finally:
        del model.generate
