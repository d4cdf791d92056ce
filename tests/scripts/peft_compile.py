"""A LoRA model (PEFT) prepared by hyperacc, compiled with ``argv[1]`` ("none": eager), trained 4 SGD
steps of variable lengths, then run once with the adapter disabled. Prints ``LOSS x`` per forward and
``FRAMES n`` (compiled frames), for tests/test_compile_units.py to compare compiled with eager."""
import sys

import torch
from peft import LoraConfig, get_peft_model

import hyperacc
from hyperacc.sharding.compile import compiled_frames
from hyperacc.models import build_causal_lm, qwen3_moe_config


def main(backend):
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(build_causal_lm(qwen3_moe_config()), lora)
    compiled = backend != "none"
    acc = hyperacc.Accelerator(fsdp=hyperacc.FSDPConfig(compile=compiled, compile_backend=backend if compiled else None),
                               checkpoint=hyperacc.CheckpointConfig(save_ckpt=False))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model, optimizer = acc.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(1)
    for length in (12, 7, 12, 9):
        ids = torch.randint(0, 256, (2, length), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        print("LOSS", loss.item())
    with model.disable_adapter():
        ids = torch.randint(0, 256, (2, 12), generator=generator)
        print("LOSS", model(input_ids=ids, labels=ids).loss.item())
    print("FRAMES", compiled_frames())
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
