"""hyperacc's Trainer in this process (1 rank): what `Trainer.end()` and a weights-only save leave behind."""
import math
import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
from datasets import Dataset  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM, TrainingArguments  # noqa: E402

from hyperacc.integrations.transformers import Trainer  # noqa: E402


@pytest.fixture(autouse=True)
def _no_group_left_behind():
    """Each Trainer here starts a (1-rank) process group; later tests in this session expect none."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _trainer(out, **overrides):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    rows = torch.randint(0, 64, (12, 8), generator=torch.Generator().manual_seed(0)).tolist()
    args = dict(output_dir=str(out), per_device_train_batch_size=2, max_steps=3, use_cpu=True, report_to=[],
                logging_steps=1, save_strategy="no")
    args.update(overrides)
    return Trainer(model=model, args=TrainingArguments(**args),
                   train_dataset=Dataset.from_dict({"input_ids": rows, "labels": rows}))


def test_end_saves_nothing_and_destroys_the_process_group(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.train()
    assert dist.is_initialized()
    trainer.end()
    assert not dist.is_initialized(), "Trainer.end() must destroy the process group, as on accelerate"
    saved = [n for n in os.listdir(tmp_path) if n.startswith("global_step")]
    assert saved == [], f"save_strategy='no' but end() wrote {saved}"


def test_weights_only_checkpoint_cannot_be_resumed(tmp_path):
    trainer = _trainer(tmp_path, save_strategy="steps", save_steps=3, save_only_model=True)
    trainer.train()
    assert os.path.isdir(tmp_path / "global_step_3")
    trainer.end()
    with pytest.raises(ValueError, match="weights-only checkpoint .saved with save_only_model=True."):
        _trainer(tmp_path, save_strategy="steps", save_steps=3, max_steps=6,
                 save_only_model=True).train(resume_from_checkpoint=True)


def test_resume_true_names_plain_trainer_checkpoints(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "trainer_state.json").write_text("{}")
    with pytest.raises(ValueError, match="holds checkpoint-3: checkpoints of transformers' Trainer on plain accelerate"):
        _trainer(tmp_path).train(resume_from_checkpoint=True)


@pytest.mark.parametrize("strategy, refused", [("checkpoint", True), ("all_checkpoints", True), ("end", False),
                                               ("every_save", False)])
def test_hub_strategies_that_push_checkpoints_are_refused(tmp_path, strategy, refused):
    from hyperacc.integrations.trainer_args import refused_options

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], hub_strategy=strategy)
    args.push_to_hub = True          # set after __post_init__, which would reach for the Hub
    problems = refused_options(args)
    assert bool(problems) == refused, problems
    if refused:
        assert f"hub_strategy='{strategy}'" in problems[0] and "hub_strategy='end'" in problems[0]


def test_reduce_every_micro_batch_becomes_sync_each_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPERACC_FSDP_REDUCE_EVERY_MICRO_BATCH", "true")
    assert _trainer(tmp_path).accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False) is True
    monkeypatch.delenv("HYPERACC_FSDP_REDUCE_EVERY_MICRO_BATCH")
    assert _trainer(tmp_path).accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False) is False


def test_a_fresh_run_into_another_runs_checkpoints_stops_before_training(tmp_path):
    _trainer(tmp_path, save_strategy="steps", save_steps=3).train()
    again = _trainer(tmp_path, save_strategy="steps", save_steps=3)
    with pytest.raises(ValueError, match=r"already holds checkpoints of another run \(steps 3\)"):
        again.train()
    assert again.state.global_step == 0


def test_evaluate_then_train_adopts_the_model_sharded_for_evaluation(tmp_path):
    """Trainer prepares the model it evaluated again for training: hyperacc adopts the sharded model."""
    trainer = _trainer(tmp_path)
    trainer.eval_dataset = trainer.train_dataset
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert math.isfinite(before) and after < before, (before, after)


def test_resume_from_a_file_names_the_directory(tmp_path):
    (tmp_path / "global_step_3").mkdir()
    state = tmp_path / "global_step_3" / "trainer_state.json"
    state.write_text("{}")
    with pytest.raises(NotADirectoryError, match="is a file, not a checkpoint: pass the global_step_<N> directory"):
        _trainer(tmp_path / "run").train(resume_from_checkpoint=str(state))


def test_resuming_a_finished_run_trains_no_further_step(tmp_path):
    """12 rows, batch 2: 6 steps per epoch; max_steps=3 ends inside the epoch. Resuming that last checkpoint
    ran the rest of the epoch until the step-end check stopped it: one more step (learning rate 0, the
    schedule over) and its checkpoint global_step_4. Now nothing more is trained or saved."""
    trainer = _trainer(tmp_path, save_strategy="steps", save_steps=3)
    trainer.train()
    trainer.end()
    again = _trainer(tmp_path, save_strategy="steps", save_steps=3)
    again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 3
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("global_step")) == ["global_step_3"]
