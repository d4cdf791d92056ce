"""TRL's online trainers (GRPO, RLOO) on hyperacc: they generate their own completions while training.

Three things differ from the preference trainers (`hyperacc.integrations.trl`), each exact here:

- **Completions do not depend on the layout.** TRL samples with the process's generator, seeded per rank
  (``set_seed(seed, device_specific=True)``): 1 and 2 processes, or a resumed run, draw other completions
  for the same prompts. Here sample ``i`` of the global generation batch at optimizer step ``s`` is drawn
  from noise seeded by (``args.seed``, ``s``, ``i``, token place) (`seeded_sampling`); TRL's sampler gives
  data-parallel rank ``r`` rows ``r * n ... r * n + n - 1`` of it, as hyperacc's loader does.
- **No rank waits for ever.** Generating on a sharded policy is a collective per decoding step (each block
  gathers its weights); a rank whose sequences all ended would stop calling it. hyperacc marks what it
  shards as FSDP-managed (transformers' ``_is_fsdp_managed_module``), so `generate` runs with
  ``synced_gpus``: finished ranks keep stepping until every rank is done.
- **Resume is exact or refused.** TRL keeps the completions of one generation for ``steps_per_generation
  x num_iterations`` micro-steps in memory, not in a checkpoint, and restarts its micro-step counter at 0: a
  resume inside such a block would train on fresh completions with shifted block boundaries. Saves are
  refused there up front (``save_steps`` a multiple of the block), resumes there refused, and the counter
  restored at the block's start.

Generation gathers the whole policy once per `generate` call when TRL's ``ds3_gather_for_generation`` is on
(its default; ``False``: block by block at every token), and runs an MoE model without router logits
(`seeded_sampling`). What cannot be served is refused in one line before any collective: vLLM (not installed on this kind of
machine; where it is, hyperacc does not drive it yet), transformers' continuous batching (each rank schedules
its own batches: the sharded forward would desynchronise), and on several processes tool calling, environments
and a custom ``rollout_func`` (ranks regenerate independently); and, once the Accelerator knows the layout,
tensor or expert parallelism (TRL counts every process as a data-parallel rank).
"""
from __future__ import annotations

import inspect
import math

from transformers import GenerationConfig

from hyperacc.integrations import seeded_sampling
from hyperacc.integrations.trl_reference import HyperaccTRLMixin


def _refusals(args, arguments) -> list:
    name = type(args).__name__
    problems = []
    if getattr(args, "use_vllm", False):
        problems.append(f"{name}.use_vllm=True: hyperacc generates with transformers' generate on the sharded policy "
                        "and does not drive vLLM. Set use_vllm=False (or run on plain accelerate with vLLM).")
    if getattr(args, "use_transformers_continuous_batching", False):
        problems.append(f"{name}.use_transformers_continuous_batching=True: each rank would schedule its own batches "
                        "while the sharded forward needs every rank in step. Set it to False.")
    if getattr(args, "world_size", 1) > 1:
        for option in ("tools", "environment_factory", "rollout_func"):
            if arguments.get(option):
                problems.append(f"{option}=: on several processes each rank would run its own extra generation "
                                "rounds on the sharded policy and the ranks would wait on each other for ever. "
                                f"Train without {option} on hyperacc, or on one process.")
    temperature = getattr(args, "temperature", 1.0)
    if temperature is not None and not temperature > 0:
        problems.append(f"{name}.temperature={temperature}: completions are sampled, and TRL divides the logits by "
                        "it for the loss too: it must be positive (1.0 samples the model as it is).")
    generation = GenerationConfig(**(getattr(args, "generation_kwargs", None) or {}))
    unsupported = seeded_sampling.unsupported_options(generation)
    if unsupported:
        problems.append(f"{name}.generation_kwargs {', '.join(unsupported)}: hyperacc's per-sample seeded sampling "
                        "applies temperature, top_k, top_p and min_p (and the non-sampling processors such as "
                        "repetition_penalty) only. Drop them from generation_kwargs.")
    block = _block(args)
    strategy = getattr(getattr(args, "save_strategy", None), "value", getattr(args, "save_strategy", None))
    if block > 1 and strategy == "steps" and args.save_steps >= 1 and int(args.save_steps) % block:
        problems.append(f"{name}.save_steps={args.save_steps}: completions are generated once every {block} optimizer "
                        "steps (steps_per_generation x num_iterations / gradient_accumulation_steps) and kept in "
                        "memory, not in checkpoints, so a run resumed between two generations would not continue as "
                        f"it would have. Set save_steps to a multiple of {block}.")
    return problems


def _block(args) -> int:
    """Optimizer steps between two generations (a resume is exact at their boundaries)."""
    micro = int(args.steps_per_generation or 1) * int(getattr(args, "num_iterations", 1) or 1)
    accumulation = int(args.gradient_accumulation_steps or 1)
    return math.lcm(micro, accumulation) // accumulation


class HyperaccOnlineMixin(HyperaccTRLMixin):
    """`HyperaccTRLMixin` for a TRL trainer that generates during training (see the module doc)."""

    _hyperacc_generation_seeded = True

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(super(HyperaccTRLMixin, self).__init__).bind(*args, **kwargs)   # TRL's
        config = bound.arguments.get("args")
        if config is not None:
            problems = _refusals(config, bound.arguments)
            if problems:
                raise NotImplementedError("; ".join(problems))
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        """As for every Trainer, then the layouts generation is not verified on (every rank the same answer,
        before the first collective of training)."""
        super().create_accelerator_and_postprocess()
        layout = self.accelerator.parallel_config
        if layout.tp_size > 1 or layout.ep_size > 1:
            raise NotImplementedError(
                f"{type(self).__name__} with tp_size={layout.tp_size}, ep_size={layout.ep_size}: TRL counts every "
                "process as a data-parallel rank (its generation batch, the rewards it gathers, the slice each "
                "process keeps), while tensor-parallel peers read the same prompts, and generation on tensor- or "
                "expert-parallel weights is not verified here (1 vs 2 processes disagree under tp_size=2). Shard "
                "with dp_shard_size / dp_replicate_size only for online training.")

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        """TRL's generation, with each sample drawn by its place in the global batch (module doc)."""
        mode = "train" if self.model.training else "eval"
        key = f"{mode}:{self.state.global_step}"
        model = self.accelerator.unwrap_model(self.model_wrapped)
        first = self.accelerator.dp_rank * len(prompt_ids)
        whole = bool(getattr(self.args, "ds3_gather_for_generation", True))   # TRL's "gather for generation"
        with seeded_sampling.seeded_generate(model, seed=self.args.seed, key=key, first_index=first,
                                             gather_whole=whole):
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)

    def _check_resumable(self, path: str, sentinel: dict) -> None:
        """Before anything is loaded: the completions are drawn from noise keyed by the run's seed (a resume under
        another seed would go on with other completions than the run it continues), and those of the generation
        in use are not in the checkpoint (a resume is exact only at a block's start; module doc)."""
        saved, step, block = sentinel.get("seed"), int(sentinel.get("global_step", 0)), _block(self.args)
        if saved is not None and int(saved) != int(self.args.seed):
            raise ValueError(f"{path} was saved by a run with seed={saved}, this one has seed={self.args.seed}: its "
                             "completions are drawn from noise keyed by the seed, so the resumed run would not "
                             f"continue the saved one. Resume with seed={saved}, or start a new run (without "
                             "resume_from_checkpoint) from its weights.")
        if step % block:
            raise RuntimeError(f"{path} was saved at step {step}, between two generations (every {block} steps): the "
                               f"completions in use then are not in the checkpoint. Resume a checkpoint at a multiple "
                               f"of {block}.")

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        """Restores the buckets, then TRL's micro-step counter at the start of the generation block."""
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._step = self.state.global_step * self.args.gradient_accumulation_steps
