"""The hand-written part of the generated reference: what code cannot say.

One line of meaning and an example value per configuration field, one line per accelerate constructor
keyword, one per instance attribute of the Accelerator. Everything else on the reference pages -- which
fields, members and keywords exist, defaults, types, environment variables, flags -- is read from the code by
``docs/gen_reference.py``. ``tests/test_docs.py`` checks that these notes cover exactly the fields and
keywords that exist (a new field without a note, or a note for a removed one, fails), and every example
value is parsed as the example's flag when the page is generated.
"""

# (example value, meaning) for every field: what code cannot say. The test checks the keys are exactly the
# dataclasses' fields; the example value is written as on the command line and parsed by the example's parser.
FIELD_NOTES = {
    "ParallelConfig": {
        "dp_replicate_size": ("2", "HSDP: the number of model replicas; each replica is sharded over `dp_shard`. "
                                   "Gradients are all-reduced across replicas after the last micro-batch."),
        "dp_shard_size": ("4", "FSDP2 shards per replica; `-1` takes the rest of the world "
                               "(world / (dp_replicate × cp × tp))."),
        "cp_size": ("2", "Context parallelism: every sequence of a micro-batch is split over this many ranks "
                         "(step mode only, right padding; see [Parallelism](../guides/parallelism.md#context-parallelism-cp))."),
        "tp_size": ("2", "Tensor parallelism, following the model's own transformers TP plan "
                         "(must divide the attention and KV heads)."),
        "ep_size": ("4", "Expert parallelism for MoE layers: each rank holds whole experts; must divide "
                         "dp_shard·cp·tp. accelerate has no key for it."),
    },
    "FSDPConfig": {
        "reshard_after_forward": ("false", "Free each block's gathered parameters after its forward (ZeRO-3 "
                                           "style); `false` keeps them until backward: more memory, fewer all-gathers."),
        "mixed_precision": ("bf16", "`bf16`/`fp16` compute with fp32 gradient reduction (FSDP2 "
                                    "`MixedPrecisionPolicy`); outputs come back in fp32. `no`/unset: full precision."),
        "cpu_offload": ("true", "Parameters, gradients and optimizer states in host memory (FSDP2 "
                                "`CPUOffloadPolicy`); on a CPU-only run a warning, nothing to offload."),
        "activation_checkpointing": ("true", "Recompute each block's activations in backward (non-reentrant); "
                                             "parameter names and checkpoint keys unchanged."),
        "wrap_classes": ("Qwen3MoeDecoderLayer", "The block classes sharded as FSDP2 units; unset: the model's "
                                                 "`_no_split_modules`."),
        "reduce_every_micro_batch": ("true", "Reduce-scatter gradients after every micro-batch instead of only "
                                             "the last: no unsharded gradients kept between micro-batches, more "
                                             "communication."),
        "precision": ("bf16", "The precision recipe: `fp32_master` (16 bytes/parameter with AdamW), `bf16` (12), "
                              "`bf16_sr` (8); see [Precision recipes](../guides/precision.md)."),
        "compile": ("true", "`torch.compile` each transformer block before sharding; see "
                            "[Compile](../guides/compile.md)."),
        "compile_backend": ("aot_eager", "The compile backend (`inductor`, `aot_eager`, ...); the example "
                                         "wants `--fsdp.compile=true` with it."),
        "compile_mode": ("max-autotune-no-cudagraphs", "torch.compile's `mode`; CUDA-graph modes are refused "
                                                       "(FSDP2 frees what a graph would capture)."),
        "compile_fullgraph": ("true", "torch.compile's `fullgraph`; refused with TP or EP (their pieces run eagerly)."),
        "compile_dynamic": ("true", "torch.compile's `dynamic`; unset: torch's automatic dynamic shapes."),
    },
    "CheckpointConfig": {
        "save_ckpt": ("false", "Automatic saves (the policy and the end of training) when asked; `false`: never. "
                               "An explicit `save_state()` always saves."),
        "checkpoint_dir": ("ckpt/run1", "Root of the `global_step_<N>/` directories and the LATEST pointer "
                                        "(`<project_dir>/checkpoints` when accelerate's `project_dir` is set)."),
        "save_steps": ("100", "Save every N optimizer steps (0: off)."),
        "save_epochs": ("0", "Save when every N-th epoch ends (0: off)."),
        "is_async": ("true", "Write in the background; the call returns once the state is copied to CPU memory."),
        "is_peft": ("true", "Unset: detected (a `peft.PeftModel` saves its trainable tensors only); `true`: "
                            "trainable tensors only for any model; `false`: the whole model."),
        "save_optimizer": ("false", "Save the optimizer bucket."),
        "save_train_state": ("false", "Save progress, schedulers, loader position and RNG."),
        "save_extra_state_per_rank": ("false", "Per-rank extra-state files (RNG included); `false` embeds the "
                                               "rank-identical state in the DCP payload and re-derives RNG."),
        "restore_from": ("LATEST", "`LATEST` or a path, read by `load_state()` without an argument; unset: "
                                   "no restore."),
        "restore_optimizer": ("false", "Restore the optimizer bucket (`false`: start it fresh)."),
        "restore_train_state": ("false", "Restore progress, schedulers, loader position and RNG."),
        "keep_last_n": ("3", "Keep only the newest N complete checkpoints (0: keep all)."),
        "save_consolidated": ("final", "Also write a Hugging Face export into the checkpoint: `none`, `final` "
                                       "or `every`."),
    },
}

# What hyperacc does with each of accelerate.Accelerator's constructor keywords (the test checks the keys
# are exactly accelerate's parameters).
KEYWORD_NOTES = {
    "device_placement": "accelerate's meaning: batches and models go to `accelerator.device`.",
    "split_batches": "Ignored with a warning, as by accelerate 1.15: pass "
                     "`dataloader_config=DataLoaderConfiguration(split_batches=...)`.",
    "mixed_precision": "`bf16`/`fp16` become FSDP2's `MixedPrecisionPolicy` (`FSDPConfig.mixed_precision`) when no "
                       "`fsdp=` is given; `fp8` is refused.",
    "gradient_accumulation_steps": "accelerate's `accumulate(model)`; step mode (`accumulate(model, batch)`) "
                                   "takes its count from the loader instead.",
    "cpu": "Forces the CPU device (as `device_type='cpu'`).",
    "dataloader_config": "accelerate's meaning for plain DataLoaders (`split_batches`, `dispatch_batches`, "
                         "`even_batches`, ...).",
    "deepspeed_plugin": "Refused (`NotImplementedError`): hyperacc shards with FSDP2.",
    "fsdp_plugin": "Mapped onto `FSDPConfig`: `reshard_after_forward`, `cpu_offload`, `activation_checkpointing`, "
                   "`transformer_cls_names_to_wrap`, `mixed_precision_policy` (FSDP1-only fields: a warning).",
    "torch_tp_plugin": "Refused: pass `parallelism_config=ParallelismConfig(tp_size=...)` or "
                       "`ParallelConfig(tp_size=...)`.",
    "megatron_lm_plugin": "Refused: use `ParallelConfig` for the mesh.",
    "rng_types": "accelerate's meaning (RNG synchronisation of plain DataLoaders).",
    "log_with": "accelerate's trackers, unchanged.",
    "project_dir": "accelerate's meaning; an unset `CheckpointConfig.checkpoint_dir` is `<project_dir>/checkpoints`.",
    "project_config": "accelerate's meaning; `automatic_checkpoint_naming=True` names saves "
                      "`<project_dir>/checkpoints/checkpoint_<i>` and makes the loop save.",
    "gradient_accumulation_plugin": "accelerate's meaning (`sync_each_batch=True` reduce-scatters every "
                                    "micro-batch).",
    "step_scheduler_with_optimizer": "accelerate's meaning for plain DataLoaders; in step mode a prepared "
                                     "scheduler steps once per optimizer step.",
    "kwargs_handlers": "accelerate's handlers; `InitProcessGroupKwargs(timeout=...)` sets the process group's "
                       "timeout.",
    "dynamo_backend": "Per-block compile (`FSDPConfig.compile`, `compile_backend`).",
    "dynamo_plugin": "Per-block compile with the plugin's backend, mode, fullgraph and dynamic.",
    "deepspeed_plugins": "Refused (`NotImplementedError`): hyperacc shards with FSDP2.",
    "parallelism_config": "Mapped onto `ParallelConfig` (dp_replicate, dp_shard, tp, cp sizes); `sp_size > 1` "
                          "is refused.",
}


INSTANCE_NOTES = {
    "parallel_config": "the resolved `ParallelConfig`",
    "fsdp_config": "the resolved `FSDPConfig`",
    "checkpoint_config": "the resolved `CheckpointConfig`",
    "seed": "the seed parameters are initialised from (42 unless `seed=` is given)",
    "runtime": "device, backend, process groups (`hyperacc.runtime`)",
    "recipe": "the precision recipe in force (`hyperacc.precision`)",
    "accumulator": "the step-mode gradient accumulator (`step_metrics()`, `step_tokens`, ...)",
    "progress": "global step, epoch, consumed samples and tokens (restored by `load_state`)",
    "step_hooks": "the hooks run by `optimizer.step()` and `step_end()` (`add_step_hook`)",
    "save_on_end": "`end_training`'s final save: None = when saves were asked for",
}
