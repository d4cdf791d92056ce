"""How examples/train_qwen.py stops on an error it can name: one line, printed once, in the example's
own flag names, and an exit code (2: config error, 3: a check stopped training, 4: a collective timed out).

Printed once: every error reaching `exit_with` is raised on every rank alike (the checks run on every
rank before anything is built, and later failures are agreed between the ranks), so rank 0's line is
everyone's. Rank 0 prints and exits at once; the launcher (torchrun, ``accelerate launch``) then stops
the other ranks, which meanwhile wait quietly and, when stopped, exit with the same code. A rank that
is *not* stopped within ``LINGER_S`` (its error was its own, e.g. a path another node does not see, or
a launcher that does not stop the others) prints its line then: an error is never lost.

Flag names: hyperacc's errors name its API (``CheckpointConfig.restore_from='LATEST'``,
``load_state('LATEST')``, ``MicroBatchDataLoader.resume_mismatch='restart'``,
``hyperacc.models.load_pretrained(DIR)``, hyperacc.data's ``chat_template='chatml'`` /
``messages_column=NAME`` / ``seq_len`` keywords), which a user of the example sets as flags; `as_flags` rewrites those names mechanically, so the fix printed is one that
works on the command line the user typed.
"""
import os
import re
import signal
import sys
import time

# Long enough for rank 0 to reach the same error on a loaded machine: the ranks start together but
# import and check at the speed the CPU gives each (10 s was too short under a parallel test load,
# and rank 1 then printed the line as well).
LINGER_S = 30.0

# hyperacc class -> the example's section holding its fields (the sections *are* these dataclasses).
SECTIONS = {"CheckpointConfig": "checkpoint", "FSDPConfig": "fsdp", "ParallelConfig": "parallel"}
# MicroBatchDataLoader's / StreamingDataLoader's constructor arguments -> the flags the example builds it from.
LOADER_FLAGS = {"resume_mismatch": "data.resume_mismatch", "shuffle": "data.shuffle", "bad_rows": "data.bad_rows",
                "window": "data.stream_window",
                "global_batch_size": "training.global_batch_size", "micro_batch_size": "training.micro_batch_size",
                "seed": "training.seed"}
_VALUE = r"""(?:=('[^']*'|"[^"]*"|[^\s,;)]+))?"""
_FIELD = re.compile(r"\b(CheckpointConfig|FSDPConfig|ParallelConfig|MicroBatchDataLoader|StreamingDataLoader)\.(\w+)" + _VALUE)
_LOAD_STATE = re.compile(r"""(?<![.\w])load_state\(('[^']*'|"[^"]*")\)""")    # hyperacc's, not accelerator.load_state
# hyperacc.data's keyword arguments (build_chat_dataset, prepare_chat_tokenizer, chat_collate) -> --data.* flags.
_DATA_KEYWORD = re.compile(r"(?<![\w.\-])(chat_template|messages_column|seq_len|dataset|bad_rows)=('[^']*'|\"[^\"]*\"|[^\s,;)]+)")
_DATA_CALLS = ((re.compile(r"chat_collate\(tokenizer, packing=False\)"), "--data.packing=false"),
               (re.compile(r"\(build_text_dataset\)"), "(--data.format=text)"),
               (re.compile(r"\((?:build_train_dataset|build_chat_dataset)\((dataset=PATH)\)\)"), r"(\1)"))
_PRETRAINED = re.compile(r"""\bhyperacc\.models\.load_pretrained\(('[^']*'|"[^"]*"|\w+)\)""")
_REPEATS = ((re.compile(r"(--[\w.]+(?:=[^\s,;)]+)?) \(\1\)"), r"\1"),       # "X (X)" once both became the flag
            (re.compile(r"\((--[\w.]+(?:=[^\s,;)]+)?), or \1\)"), r"(\1)"))   # "(X, or X)"


def _flag(name: str, value) -> str:
    if value is None:
        return f"--{name}"
    if value[:1] in "'\"":
        value = value[1:-1]
    return f"--{name}={ {'None': 'null', 'True': 'true', 'False': 'false'}.get(value, value)}"


def as_flags(text: str) -> str:
    """``text`` with hyperacc's API names replaced by the example's flags (unknown names left as they are)."""
    def field(match):
        cls, name, value = match.groups()
        flag = LOADER_FLAGS.get(name) if cls.endswith("DataLoader") else f"{SECTIONS[cls]}.{name}"
        if flag is None:
            return match.group(0)
        end = ""
        if value is not None and value[:1] not in "'\"":      # an unquoted value ends before the full stop
            stripped = value.rstrip(".:")
            end, value = value[len(stripped):], stripped
        return _flag(flag, value) + end

    text = _FIELD.sub(field, text)
    text = _LOAD_STATE.sub(lambda m: _flag("checkpoint.restore_from", m.group(1)), text)
    text = _PRETRAINED.sub(lambda m: _flag("model.name_or_path", m.group(1)), text)
    for call, flag in _DATA_CALLS:
        text = call.sub(flag, text)
    text = _DATA_KEYWORD.sub(lambda m: _flag(f"data.{m.group(1)}", m.group(2)), text)
    for repeat, once in _REPEATS:
        text = repeat.sub(once, text)
    return text


def rank() -> int:
    """This process's global rank from the launcher's environment (no process group needed)."""
    return int(os.environ.get("RANK", "0") or 0)


def exit_with(prefix: str, err: BaseException, code: int):
    """Print ``prefix: <err as one line, in flag names>`` once (rank 0; see the module docstring) and
    exit with ``code``. HYPERACC_DEBUG=1 re-raises instead (the traceback)."""
    if os.environ.get("HYPERACC_DEBUG") == "1":
        raise err
    line = f"{prefix}: {as_flags(' '.join(part.strip() for part in str(err).splitlines() if part.strip()))}"
    try:
        import torch.distributed as dist
        if dist.is_initialized():            # every rank raised the same error at the same point
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - leaving anyway
        pass
    if rank() != 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Rank 0 prints; the launcher stopping this rank is the normal end: leave with the same code.
        signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
        time.sleep(LINGER_S)
    print(line, file=sys.stderr, flush=True)
    sys.exit(code)
