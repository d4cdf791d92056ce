"""transformers' `generate` on a model hyperacc sharded, with ranks that stop at different lengths.

    uneven_generate.py BASE_DIR OUT_DIR      (or the run ``uneven`` of tests/scripts/dpo_runs.py)

Rank r asks for 2 + 6 r new tokens, greedily, from the tiny causal LM of BASE_DIR prepared by hyperacc's
Accelerator (FSDP2 over every rank): rank 0 is done after 2 decoding steps while rank 1 still needs the
weights rank 0 holds for 6 more. Then the same through `seeded_sampling.seeded_generate` with sampling, on a
LoRA model (whose `generate` calls the base model, bypassing the sharded root). Each rank writes
OUT/rank<r>.json: its tokens, and the greedy tokens of an unsharded copy of the same model.
With UNMARKED=1 the FSDP-managed mark is removed first (the hang this guards against; not run by the suite).
"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hyperacc
from hyperacc.integrations import seeded_sampling


def main():
    run(sys.argv[1], sys.argv[2])


def run(base: str, out: str) -> None:
    """The whole check (also run as the ``uneven`` run of tests/scripts/dpo_runs.py's launch)."""
    acc = hyperacc.Accelerator(checkpoint=hyperacc.CheckpointConfig(save_ckpt=False), seed=3)
    rank = acc.process_index
    tok = AutoTokenizer.from_pretrained(base)
    reference = AutoModelForCausalLM.from_pretrained(base)
    model = acc.prepare(AutoModelForCausalLM.from_pretrained(base))
    if os.environ.get("UNMARKED"):
        for module in model.modules():
            del module._is_fsdp_managed_module
    ids = tok(["alpha beta gamma", "delta epsilon zeta eta"][rank % 2], return_tensors="pt").input_ids
    new = 2 + 6 * rank
    model.eval()
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        expected = reference.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)

    from peft import LoraConfig, get_peft_model

    lora = acc.prepare(get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                                      LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)))
    lora.eval()
    config = lora.generation_config.__class__(do_sample=True, temperature=0.7, top_k=50, max_new_tokens=new,
                                              min_new_tokens=new, eos_token_id=tok.eos_token_id,
                                              pad_token_id=tok.eos_token_id)
    with torch.no_grad(), seeded_sampling.seeded_generate(lora, seed=5, key="t", first_index=rank):
        sampled = lora.generate(input_ids=ids, generation_config=config)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump({"greedy": greedy[0].tolist(), "expected": expected[0].tolist(), "sampled": sampled[0].tolist(),
                   "prompt": ids[0].tolist()}, handle)
    acc.end_training()


if __name__ == "__main__":
    main()
