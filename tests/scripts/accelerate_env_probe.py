"""Launched by `accelerate launch`: prints what hyperacc picked up from the launcher (rank 0)."""
import json


import hyperacc
from hyperacc.models import build_causal_lm, qwen3_moe_config

acc = hyperacc.Accelerator(checkpoint=hyperacc.CheckpointConfig(save_ckpt=False))
model = acc.prepare(build_causal_lm(qwen3_moe_config(), meta_device=True))
info = {
    "launcher": acc.runtime.launcher, "world": acc.num_processes,
    "dp_shard": acc.mesh["dp_shard"].size(), "dp_replicate": acc.mesh["dp_replicate"].size(),
    "dtensor": all(type(p).__name__ == "DTensor" for p in model.parameters()),
    "fsdp": {k: getattr(acc.fsdp_config, k) for k in ("reshard_after_forward", "mixed_precision",
                                                      "cpu_offload", "activation_checkpointing", "wrap_classes")},
}
if acc.is_main_process:
    print("PROBE " + json.dumps(info))
acc.end_training()
