"""Conversations as training samples: rendered with the tokenizer's chat template, loss on the
assistant's tokens only.

Why the template decides: what the model must learn to produce is exactly what the template emits
inside its ``{% generation %}`` blocks (the assistant's content and, as the template marks it, its
end-of-turn token). transformers returns that as ``assistant_masks``
(``apply_chat_template(..., return_assistant_tokens_mask=True)``); every other token -- system and
user turns, role headers, tool results -- gets the label ``-100``. A template without generation
blocks cannot say where the assistant's tokens are: it is refused, naming the fix, rather than
guessed at from string offsets.

Three record shapes, as TRL and the hub's chat sets store them:
- ``{"messages": [{"role": ..., "content": ...}, ...]}`` (the column name is configurable);
- ``{"prompt": [...messages], "completion": [...messages]}``: the completion's tokens are where the
  rendered prompt (with the generation prompt) and the rendered conversation part, and only they
  are trained on (intersected with the assistant mask);
- ``{"prompt": "text", "completion": "text"}`` (TRL's standard, non-conversational form): no template;
  the text ``prompt + completion + EOS`` tokenized as one, trained on the completion (and EOS) only --
  from where the prompt's own tokens and the whole's part, as TRL's SFTTrainer does with
  ``completion_only_loss``.
Anything else is refused naming these forms. Labels are unshifted (``labels[i]`` is token ``i``), as
transformers' causal-LM losses expect.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

IGNORE_INDEX = -100
NO_GENERATION_BLOCKS = (
    "the tokenizer's chat template marks no assistant tokens ({% generation %} blocks): hyperacc cannot tell "
    "which tokens to train on. Fix: a training template that has them: chat_template='chatml' (hyperacc's "
    "ChatML template, for Qwen-style <|im_start|> turns) or chat_template=PATH of one (e.g. TRL's "
    "trl/chat_templates/<family>_training.jinja), as in prepare_chat_tokenizer(tokenizer, chat_template). Or train "
    "on plain text (build_text_dataset).")


# ChatML (the Qwen family's turn format) with the assistant's content and its <|im_end|> inside generation
# blocks: what the model learns to emit. hyperacc's own, for tokenizers without a training template.
CHATML_TRAINING_TEMPLATE = (
    "{%- if tools -%}{{- raise_exception('the chatml template does not render tool definitions: they would be "
    "dropped silently. Fix: chat_template=PATH of your model family\\'s training template with tools') -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is not string -%}{{- raise_exception('the chatml template renders text content "
    "only (a message has content that is not a string). Fix: flatten the content to text first') -}}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
BUILTIN_TEMPLATES = {"chatml": CHATML_TRAINING_TEMPLATE}
_PROBE = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]


def _template_text(chat_template: str) -> str:
    if chat_template in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[chat_template]
    path = os.path.expanduser(chat_template)
    if not os.path.isfile(path):
        raise ValueError(f"chat template {chat_template!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
                         "nor a file (a directory or a missing path). Fix: chat_template='chatml', or "
                         "chat_template=PATH of a Jinja template with {% generation %} blocks.")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if "{%" not in text and "{{" not in text:
        raise ValueError(f"chat template file {chat_template!r} holds no Jinja ({{% ... %}} / {{{{ ... }}}}): it is not a "
                         "chat template. Fix: pass the .jinja file of the template.")
    return text


def prepare_chat_tokenizer(tokenizer, chat_template: Optional[str] = None):
    """``tokenizer`` ready to render training conversations; returns it (changed in place).

    ``chat_template``: ``None`` keeps the tokenizer's own template; ``"chatml"`` is hyperacc's ChatML
    training template (its ``<|im_start|>``/``<|im_end|>`` tokens are added as special tokens when the
    vocabulary lacks them: size the model with ``len(tokenizer)`` afterwards); anything else is the path
    of a Jinja file (e.g. TRL's ``chat_templates/qwen3_training.jinja``). A tokenizer without a pad token
    pads with EOS. Raises one ValueError, naming the fix, when no template is set or the template marks no
    assistant tokens -- before any data is read.
    """
    if chat_template is not None:
        tokenizer.chat_template = _template_text(chat_template)
        if chat_template == "chatml":
            missing = [t for t in CHATML_TOKENS if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
            if missing:
                tokenizer.add_tokens(missing, special_tokens=True)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template. Fix: "
                         "chat_template='chatml' (hyperacc's ChatML training template) or chat_template=PATH of a "
                         "Jinja template with {% generation %} blocks.")
    if getattr(tokenizer, "pad_token_id", None) is None:
        tokenizer.pad_token = tokenizer.eos_token
    render_messages(tokenizer, _PROBE)          # NO_GENERATION_BLOCKS now, not at the first record
    return tokenizer


def _render(tokenizer, messages: Sequence[dict], *, chat_template: Optional[str], tools, mask: bool,
            generation_prompt: bool = False) -> dict:
    return tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=True, chat_template=chat_template,
                                         tools=tools, add_generation_prompt=generation_prompt,
                                         return_assistant_tokens_mask=mask)


def _as_list(ids) -> List[int]:
    return [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]


def render_messages(tokenizer, messages: Sequence[dict], *, chat_template: Optional[str] = None,
                    tools=None) -> Dict[str, List[int]]:
    """``input_ids`` of the whole conversation and ``labels``: the token on the assistant's tokens,
    ``-100`` elsewhere. Raises when the conversation has an assistant turn the template marks nothing of."""
    rendered = _render(tokenizer, messages, chat_template=chat_template, tools=tools, mask=True)
    ids, mask = _as_list(rendered["input_ids"]), _as_list(rendered["assistant_masks"])
    if any(m.get("role") == "assistant" for m in messages) and 1 not in mask:
        raise ValueError(NO_GENERATION_BLOCKS)
    return {"input_ids": ids, "labels": [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]}


def render_prompt_completion(tokenizer, prompt: Sequence[dict], completion: Sequence[dict], *,
                             chat_template: Optional[str] = None, tools=None) -> Dict[str, List[int]]:
    """The conversation ``prompt + completion``, trained on the completion's assistant tokens only."""
    prompt_ids = _as_list(_render(tokenizer, prompt, chat_template=chat_template, tools=tools, mask=False,
                                  generation_prompt=True)["input_ids"])
    sample = render_messages(tokenizer, list(prompt) + list(completion), chat_template=chat_template, tools=tools)
    start = 0
    for a, b in zip(prompt_ids, sample["input_ids"]):      # where the two renderings part
        if a != b:
            break
        start += 1
    sample["labels"] = [IGNORE_INDEX] * start + sample["labels"][start:]
    return sample


def render_text_prompt_completion(tokenizer, prompt: str, completion: str) -> Dict[str, List[int]]:
    """TRL's standard prompt-completion record: ``prompt + completion`` (+ EOS unless it ends with it) as one
    text, trained on the tokens from where the prompt tokenized alone and the whole part (the completion's)."""
    eos = tokenizer.eos_token
    if eos and not completion.endswith(eos):
        completion += eos
    prompt_ids = _as_list(tokenizer(text=prompt)["input_ids"])
    ids = _as_list(tokenizer(text=prompt + completion)["input_ids"])
    start = 0
    for a, b in zip(prompt_ids, ids):
        if a != b:
            break
        start += 1
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * start + ids[start:]}


RECORD_FORMS = ("{'messages': [{'role': ..., 'content': ...}, ...]}, {'prompt': [messages], 'completion': [messages]} "
                "or {'prompt': 'text', 'completion': 'text'}")


def _check_messages(messages, field: str) -> None:
    """``messages`` is a list of mappings with a role (what a chat template renders; their content is the
    template's to judge): one ValueError naming the expected forms otherwise, not the template's own error."""
    bad = None if isinstance(messages, (list, tuple)) else messages
    for message in messages if bad is None else ():
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
            bad = message
            break
    if bad is not None or not messages:
        what = f"{type(bad).__name__} {str(bad)[:60]!r}" if bad is not None else "an empty list"
        raise ValueError(f"{field!r} holds {what} where a list of {{'role': ..., 'content': ...}} messages is "
                         f"expected. Records are {RECORD_FORMS}.")


def render_record(tokenizer, record: dict, *, messages_column: str = "messages",
                  chat_template: Optional[str] = None) -> Dict[str, List[int]]:
    """One dataset record (``messages_column``, or prompt/completion as messages or as text) as
    ``input_ids`` and ``labels``."""
    tools = record.get("tools")
    if "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return render_text_prompt_completion(tokenizer, prompt, completion)
        if isinstance(prompt, str) or isinstance(completion, str):
            raise ValueError(f"'prompt' is {type(prompt).__name__} and 'completion' {type(completion).__name__}: both "
                             f"must be text, or both lists of messages. Records are {RECORD_FORMS}.")
        _check_messages(prompt, "prompt")
        _check_messages(completion, "completion")
        return render_prompt_completion(tokenizer, prompt, completion, chat_template=chat_template, tools=tools)
    if messages_column not in record:
        raise KeyError(f"a chat record needs a {messages_column!r} column (role/content messages) or 'prompt' and "
                       f"'completion'; this one has {sorted(record)}. Fix: messages_column=NAME of the column "
                       "that holds the conversation.")
    _check_messages(record[messages_column], messages_column)
    return render_messages(tokenizer, record[messages_column], chat_template=chat_template, tools=tools)


def render_row(tokenizer, row: dict, *, messages_column: str = "messages", where: str = "a record",
               column_flag: str = "messages_column=") -> Dict[str, List[int]]:
    """`render_record` for a dataset row, with one ValueError naming ``where`` (e.g. its row number) when it
    cannot be rendered. A None field is an absent one: datasets fills a column that some records lack
    with None (a file mixing messages and prompt/completion records)."""
    record = {k: v for k, v in row.items() if v is not None}
    try:
        return render_record(tokenizer, record, messages_column=messages_column)
    except KeyError:
        raise ValueError(f"{where} has no {messages_column!r} messages and no 'prompt' + 'completion' (its fields: "
                         f"{sorted(record)}). Fix: {column_flag}NAME of the column that holds the "
                         "conversations.") from None
    except ValueError as e:         # a record of the wrong shape (`_check_messages`), a template refusal ...
        raise ValueError(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a template error
        raise ValueError(f"{where} cannot be rendered with the chat template: {type(e).__name__}: {e}") from None


def fit_sample(input_ids: Sequence[int], labels: Sequence[int], seq_len: int) -> Optional[Dict[str, List[int]]]:
    """The sample cut to its first ``seq_len`` tokens, or None when nothing of it is trained then (the
    model shifts: ``labels[0]`` is never a target, so a sample needs a label among ``labels[1:]``).
    One rule for every source (HF records, Megatron files), so that they give the same samples."""
    ids, lab = list(input_ids[:seq_len]), list(labels[:seq_len])
    if all(t == IGNORE_INDEX for t in lab[1:]):
        return None
    return {"input_ids": ids, "labels": lab}
