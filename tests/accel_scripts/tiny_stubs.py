"""Local stand-ins for what accelerate's examples fetch from the hub.

The client scripts in this folder are accelerate example scripts with the hub taken out: instead of
``AutoTokenizer.from_pretrained(...)``, ``load_dataset(...)``, ``evaluate.load(...)`` and
``from_pretrained(<checkpoint>)`` they use the small, deterministic objects below. Everything is
built from seeded generators, so every process and every run sees the same data.

- ``TinyTokenizer``: a word-level tokenizer over the synthetic words ``w0 .. wN`` with the calls the
  examples make (``__call__`` on single texts or pairs, ``pad``, ``pad_token``/``eos_token``,
  ``save_pretrained``).
- ``load_mrpc_like()``: a paraphrase-pair classification task shaped like GLUE MRPC (``sentence1``,
  ``sentence2``, ``label``, ``idx``) with a learnable signal (accuracy rises well above chance in a
  few dozen steps).
- ``load_wikitext_like()``: lines of text from a seeded Markov chain (some empty, like wikitext),
  for the causal-LM scripts.
- ``tiny_bert_config()``, ``tiny_llama_config()``, ``tiny_qwen_config()``: model configs for
  ``AutoModelFor*.from_config``.
- ``PairClassificationMetric``: accuracy and F1 with ``add_batch``/``compute`` (``evaluate`` is not a
  dependency).
- ``JsonlTracker``: an accelerate ``GeneralTracker`` that writes JSON lines, so tracking can be checked.
- ``report(accelerator, **fields)``: prints one ``METRIC {json}`` line on the main process.
"""
from __future__ import annotations

import json
import os
import random

import torch
from datasets import Dataset, DatasetDict
from transformers import BatchEncoding, BertConfig, LlamaConfig, Qwen3Config

from accelerate.tracking import GeneralTracker

NUM_WORDS = 120
SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "[EOS]"]
VOCAB_SIZE = len(SPECIALS) + NUM_WORDS


def report(accelerator, **fields):
    """One machine-readable line on the main process: ``METRIC {json}``."""
    if accelerator.is_main_process:
        print("METRIC " + json.dumps(fields, sort_keys=True), flush=True)


# ----------------------------------------------------------------------------------------- tokenizer

class TinyTokenizer:
    """Word-level tokenizer: ``"w17 w3"`` -> ``[4 + 17, 4 + 3]``.

    ``style="bert"`` adds ``[CLS] a [SEP] (b [SEP])`` and token_type_ids; ``style="gpt"`` adds nothing
    and has no pad token until one is assigned (``tokenizer.pad_token = tokenizer.eos_token``).
    """

    def __init__(self, style: str = "bert"):
        self.style = style
        self.vocab = {tok: i for i, tok in enumerate(SPECIALS)}
        self.vocab.update({f"w{i}": len(SPECIALS) + i for i in range(NUM_WORDS)})
        self.eos_token = "[EOS]"
        self._pad_token = "[PAD]" if style == "bert" else None
        self.model_max_length = 512

    def __len__(self):
        return len(self.vocab)

    @property
    def pad_token(self):
        return self._pad_token

    @pad_token.setter
    def pad_token(self, value):
        self._pad_token = value

    @property
    def pad_token_id(self):
        return None if self._pad_token is None else self.vocab[self._pad_token]

    @property
    def eos_token_id(self):
        return self.vocab[self.eos_token]

    def _ids(self, text: str) -> list:
        return [self.vocab[w] for w in text.split()]

    def _encode(self, text, pair, truncation, max_length):
        first = self._ids(text)
        if self.style == "gpt":
            ids, types = first, [0] * len(first)
        else:
            ids = [self.vocab["[CLS]"]] + first + [self.vocab["[SEP]"]]
            types = [0] * len(ids)
            if pair is not None:
                second = self._ids(pair) + [self.vocab["[SEP]"]]
                ids, types = ids + second, types + [1] * len(second)
        if truncation:
            limit = max_length or self.model_max_length
            ids, types = ids[:limit], types[:limit]
        out = {"input_ids": ids, "attention_mask": [1] * len(ids)}
        if self.style == "bert":
            out["token_type_ids"] = types
        return out

    def __call__(self, text, text_pair=None, truncation=False, max_length=None, return_attention_mask=True):
        batched = isinstance(text, (list, tuple))
        texts = list(text) if batched else [text]
        pairs = (list(text_pair) if batched else [text_pair]) if text_pair is not None else [None] * len(texts)
        rows = [self._encode(t, p, truncation, max_length) for t, p in zip(texts, pairs)]
        keys = [k for k in rows[0] if return_attention_mask or k != "attention_mask"] if rows else ["input_ids"]
        data = {k: [r[k] for r in rows] for k in keys} if batched else {k: rows[0][k] for k in keys}
        return BatchEncoding(data)

    def pad(self, examples, padding="longest", max_length=None, pad_to_multiple_of=None, return_tensors="pt"):
        """Pad a list of feature dicts (rows of a tokenized dataset) into one BatchEncoding."""
        if self.pad_token_id is None:
            raise ValueError("this tokenizer has no pad token; set tokenizer.pad_token first")
        longest = max(len(e["input_ids"]) for e in examples)
        if padding == "max_length" and max_length is not None:
            length = max_length
        else:
            length = longest if max_length is None else min(longest, max_length)
        if pad_to_multiple_of:
            length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
        fill = {"input_ids": self.pad_token_id, "attention_mask": 0, "token_type_ids": 0}
        batch = {}
        for key in examples[0]:
            values = [e[key] for e in examples]
            if key in fill:
                batch[key] = [list(v[:length]) + [fill[key]] * (length - len(v[:length])) for v in values]
            else:
                batch[key] = values
        return BatchEncoding(batch, tensor_type=return_tensors)

    def save_pretrained(self, directory):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "tiny_tokenizer.json"), "w") as f:
            json.dump({"style": self.style, "vocab": self.vocab, "pad_token": self.pad_token}, f)


# ------------------------------------------------------------------------------------------ datasets

def _sentence(rng: random.Random, lean: int, length: int) -> str:
    """Words drawn mostly from one half of the vocabulary (``lean`` 0 or 1), partly from anywhere."""
    half = NUM_WORDS // 2
    words = []
    for _ in range(length):
        if rng.random() < 0.6:
            words.append(lean * half + rng.randrange(half))
        else:
            words.append(rng.randrange(NUM_WORDS))
    return " ".join(f"w{w}" for w in words)


def load_mrpc_like(n_train: int = 256, n_validation: int = 83, seed: int = 1234) -> DatasetDict:
    """An MRPC-shaped pair task. Paraphrase pairs (label 1) lean to the lower half of the vocabulary,
    the others to the upper half; sentence2 of a paraphrase reuses words of sentence1. Lengths vary,
    so batches need padding. ``n_validation`` is odd on purpose: uneven across processes."""
    rng = random.Random(seed)

    def split(n, offset):
        rows = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
        for i in range(n):
            label = rng.randrange(2)
            lean = 0 if label == 1 else 1
            s1 = _sentence(rng, lean, rng.randint(6, 18))
            if label == 1:
                words = s1.split()
                rng.shuffle(words)
                s2 = " ".join(words[: max(4, len(words) - rng.randint(0, 4))])
            else:
                s2 = _sentence(rng, lean, rng.randint(6, 18))
            rows["sentence1"].append(s1)
            rows["sentence2"].append(s2)
            rows["label"].append(label)
            rows["idx"].append(offset + i)
        return Dataset.from_dict(rows)

    return DatasetDict(train=split(n_train, 0), validation=split(n_validation, n_train))


def load_wikitext_like(n_train: int = 240, n_validation: int = 61, seed: int = 4321) -> DatasetDict:
    """Lines of 'text' from a seeded sparse Markov chain over the words (each word has 3 likely
    successors), so a small LM's loss falls quickly. About one line in six is empty, as in wikitext."""
    rng = random.Random(seed)
    successors = [[rng.randrange(NUM_WORDS) for _ in range(3)] for _ in range(NUM_WORDS)]

    def line():
        if rng.random() < 1 / 6:
            return ""
        word = rng.randrange(NUM_WORDS)
        words = [word]
        for _ in range(rng.randint(8, 40) - 1):
            word = rng.choice(successors[word]) if rng.random() < 0.9 else rng.randrange(NUM_WORDS)
            words.append(word)
        return " ".join(f"w{w}" for w in words)

    return DatasetDict(train=Dataset.from_dict({"text": [line() for _ in range(n_train)]}),
                       validation=Dataset.from_dict({"text": [line() for _ in range(n_validation)]}))


# ---------------------------------------------------------------------------------------------- models

def tiny_bert_config(num_labels: int = 2) -> BertConfig:
    return BertConfig(vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=128, num_labels=num_labels)


def tiny_llama_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       pad_token_id=3, bos_token_id=3, eos_token_id=3, tie_word_embeddings=True)


def tiny_qwen_config() -> Qwen3Config:
    return Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                       pad_token_id=3, bos_token_id=3, eos_token_id=3, tie_word_embeddings=False)


# --------------------------------------------------------------------------------------------- metric

class PairClassificationMetric:
    """Accuracy and F1 of the positive class, accumulated over ``add_batch`` calls."""

    def __init__(self):
        self.predictions, self.references = [], []

    def add_batch(self, predictions, references):
        self.predictions += torch.as_tensor(predictions).reshape(-1).tolist()
        self.references += torch.as_tensor(references).reshape(-1).tolist()

    def compute(self):
        pairs = list(zip(self.predictions, self.references))
        tp = sum(1 for p, r in pairs if p == 1 and r == 1)
        fp = sum(1 for p, r in pairs if p == 1 and r == 0)
        fn = sum(1 for p, r in pairs if p == 0 and r == 1)
        accuracy = sum(1 for p, r in pairs if p == r) / max(len(pairs), 1)
        f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
        result = {"accuracy": accuracy, "f1": f1, "num_samples": len(pairs)}
        self.predictions, self.references = [], []
        return result


# -------------------------------------------------------------------------------------------- tracker

class JsonlTracker(GeneralTracker):
    """A custom accelerate tracker: config and logged values as JSON lines in ``<logging_dir>/<run>.jsonl``."""

    name = "jsonl"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str, logging_dir: str):
        super().__init__()
        self.run_name = run_name
        self.path = os.path.join(logging_dir, f"{run_name}.jsonl")
        self._file = None    # opened on first use: accelerate calls a main_process_only tracker on rank 0 only

    @property
    def tracker(self):
        if self._file is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._file = open(self.path, "w")
        return self._file

    def store_init_configuration(self, values: dict):
        self.tracker.write(json.dumps({"config": values}, sort_keys=True, default=str) + "\n")
        self.tracker.flush()

    def log(self, values: dict, step=None, **kwargs):
        clean = {k: (v.item() if hasattr(v, "item") else v) for k, v in values.items()}
        self.tracker.write(json.dumps({"step": step, "values": clean}, sort_keys=True) + "\n")
        self.tracker.flush()

    def finish(self):
        self.tracker.write(json.dumps({"finished": True}) + "\n")
        self.tracker.close()
        self._file = None


# ------------------------------------------------------------------------------- shared data loaders

def get_mrpc_dataloaders(accelerator, batch_size: int = 16, eval_batch_size: int = 32):
    """The ``get_dataloaders`` of accelerate's ``by_feature`` examples, on the local pair task: tokenize
    under ``main_process_first``, pad per batch (to a multiple of 8/16 under mixed precision),
    shuffled train loader, ordered eval loader (83 samples: uneven across processes)."""
    from torch.utils.data import DataLoader

    from accelerate import DistributedType

    tokenizer = TinyTokenizer("bert")
    datasets = load_mrpc_like()

    def tokenize_function(examples):
        return tokenizer(examples["sentence1"], examples["sentence2"], truncation=True, max_length=None)

    with accelerator.main_process_first():
        tokenized_datasets = datasets.map(
            tokenize_function, batched=True, remove_columns=["idx", "sentence1", "sentence2"]
        )
    tokenized_datasets = tokenized_datasets.rename_column("label", "labels")

    def collate_fn(examples):
        max_length = 128 if accelerator.distributed_type == DistributedType.XLA else None
        if accelerator.mixed_precision == "fp8":
            pad_to_multiple_of = 16
        elif accelerator.mixed_precision != "no":
            pad_to_multiple_of = 8
        else:
            pad_to_multiple_of = None
        return tokenizer.pad(examples, padding="longest", max_length=max_length,
                             pad_to_multiple_of=pad_to_multiple_of, return_tensors="pt")

    train_dataloader = DataLoader(
        tokenized_datasets["train"], shuffle=True, collate_fn=collate_fn, batch_size=batch_size
    )
    eval_dataloader = DataLoader(
        tokenized_datasets["validation"], shuffle=False, collate_fn=collate_fn, batch_size=eval_batch_size
    )
    return train_dataloader, eval_dataloader
