"""`hyperacc.data.chat`: a rendered conversation's labels equal TRL's own assistant-only labels for the
same template and data (TRL's SFTTrainer dataset preparation, code hyperacc did not write)."""
from pathlib import Path

import pytest

trl = pytest.importorskip("trl")

from hyperacc.data.chat import IGNORE_INDEX, NO_GENERATION_BLOCKS, render_record  # noqa: E402

TEMPLATE = Path(trl.__file__).parent / "chat_templates" / "qwen3_training.jinja"

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "What is FSDP?"},
                  {"role": "assistant", "content": "Sharded data parallelism: each rank keeps a slice."}]},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Name a collective."},
                  {"role": "assistant", "content": "all-gather"},
                  {"role": "user", "content": "And another?"},
                  {"role": "assistant", "content": "reduce-scatter, which sums and shards."}]},
]
PROMPT_COMPLETION = [
    {"prompt": [{"role": "user", "content": "Two plus two?"}], "completion": [{"role": "assistant", "content": "Four."}]},
    {"prompt": [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"}],
     "completion": [{"role": "assistant", "content": "Blue."}]},
]


@pytest.fixture(scope="module")
def tokenizer(hyperacc_cache):
    from hyperacc.data.default_corpus import load_default_tokenizer

    tok = load_default_tokenizer()
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tok.chat_template = TEMPLATE.read_text()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _trl_labels(tokenizer, records, tmp_path, **options):
    """The labels TRL's SFTTrainer prepares for ``records`` (no training: its dataset preparation)."""
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    args = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], packing=False, max_length=None,
                         bf16=False, dataset_num_proc=None, **options)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(records),
                             processing_class=tokenizer)
    return [list(row["input_ids"]) for row in trainer.train_dataset], [list(row["labels"]) for row in trainer.train_dataset]


def test_messages_labels_equal_trls_assistant_only_labels(tokenizer, tmp_path):
    ids, labels = _trl_labels(tokenizer, CONVERSATIONS, tmp_path, assistant_only_loss=True)
    ours = [render_record(tokenizer, record) for record in CONVERSATIONS]
    assert [s["input_ids"] for s in ours] == ids
    assert [s["labels"] for s in ours] == labels
    for sample in ours:      # not all-or-nothing: prompts masked, every assistant turn trained
        trained = [t for t in sample["labels"] if t != IGNORE_INDEX]
        assert 0 < len(trained) < len(sample["input_ids"])
    second = tokenizer.decode([t for t in ours[1]["labels"] if t != IGNORE_INDEX])
    assert "all-gather" in second and "reduce-scatter" in second and "Name a collective" not in second


def test_prompt_completion_labels_equal_trls(tokenizer, tmp_path):
    ids, labels = _trl_labels(tokenizer, PROMPT_COMPLETION, tmp_path, assistant_only_loss=True,
                              completion_only_loss=True)
    ours = [render_record(tokenizer, record) for record in PROMPT_COMPLETION]
    assert [s["input_ids"] for s in ours] == ids
    assert [s["labels"] for s in ours] == labels
    assert "Four." in tokenizer.decode([t for t in ours[0]["labels"] if t != IGNORE_INDEX])


def test_a_template_without_generation_blocks_is_refused(tokenizer):
    plain = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    with pytest.raises(ValueError, match="generation") as error:
        render_record(tokenizer, CONVERSATIONS[0], chat_template=plain)
    assert str(error.value) == NO_GENERATION_BLOCKS


def test_a_record_without_the_messages_column_names_the_option(tokenizer):
    with pytest.raises(KeyError, match="messages_column=NAME"):
        render_record(tokenizer, {"conversation": CONVERSATIONS[0]["messages"]})
    sample = render_record(tokenizer, {"conversation": CONVERSATIONS[0]["messages"]}, messages_column="conversation")
    assert sample == render_record(tokenizer, CONVERSATIONS[0])
