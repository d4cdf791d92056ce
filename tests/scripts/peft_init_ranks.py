"""A PEFT model built before the Accelerator (each rank's RNG unseeded alike) is prepared on 2 ranks
with HSDP (dp_replicate 2): the adapters must be rank 0's everywhere, replicas identical.
Prints one JSON line from rank 0."""
import json
import os

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen3Config

import hyperacc

rank = int(os.environ["RANK"])
torch.manual_seed(1)                              # the same base everywhere
config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False)
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
torch.manual_seed(100 + rank)                     # adapters initialised differently per rank
model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
before = dict(model.named_parameters())[name].detach().clone()
acc = hyperacc.Accelerator(seed=3, parallel=hyperacc.ParallelConfig(dp_replicate_size=2))
model = acc.prepare(model)
after = dict(model.named_parameters())[name].to_local()
copies = [torch.zeros_like(after) for _ in range(2)]
torch.distributed.all_gather(copies, after.contiguous())
rank0_before = before.clone()
torch.distributed.broadcast(rank0_before, src=0)
if rank == 0:
    print(json.dumps({"replicas_equal": torch.equal(copies[0], copies[1]),
                      "is_rank0_init": torch.equal(after, rank0_before)}))
acc.end_training()
