"""from_pretrained under an FSDP launch with cpu-RAM-efficient loading (rank 0 alone holds the
weights), then prepare(): every rank's full weights must equal the files'. Prints CHECK lines."""
import sys

import torch
import transformers

from hyperacc import Accelerator

model_dir = sys.argv[1]
accelerator = Accelerator()
model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
meta_here = any(p.is_meta for p in model.parameters())
model = accelerator.prepare(model)
reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, device_map="cpu")
full = {name: p.full_tensor() for name, p in model.named_parameters()}
worst = max(float((full[name] - p.detach()).abs().max()) for name, p in reference.named_parameters())
buffers = dict(model.named_buffers())
worst_buffer = max(float((buffers[name] - b).abs().max()) for name, b in reference.named_buffers())
print(f"CHECK rank={accelerator.process_index} meta_before_prepare={meta_here} max_abs_diff={worst} buffer_diff={worst_buffer}", flush=True)

# Older transformers left the model on the meta device on ranks != 0: the same through prepare().
config = transformers.AutoConfig.from_pretrained(model_dir)
if accelerator.process_index == 0:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
else:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
model = accelerator.prepare(model)
worst = max(float((p.full_tensor() - reference.get_parameter(name).detach()).abs().max())
            for name, p in model.named_parameters())
buffers = dict(reference.named_buffers())
worst_buffer = max(float((b - buffers[name]).abs().max()) for name, b in model.named_buffers())
print(f"CHECK meta_on_other_ranks rank={accelerator.process_index} max_abs_diff={worst} "
      f"buffer_diff={worst_buffer}", flush=True)
accelerator.end_training()
