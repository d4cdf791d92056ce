"""The launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, FSDP_*, PARALLELISM_CONFIG_*,
ACCELERATE_*, HYPERACC_*): the one place that reads it; other modules ask these functions.
Torch-free, so that light modules (config, the convert CLI) stay cheap to import."""
from __future__ import annotations

import contextlib
import os
from typing import Mapping, Optional


def launch_env(env: Optional[Mapping[str, str]] = None) -> Mapping[str, str]:
    """``env``, or the process environment."""
    return os.environ if env is None else env


def env_value(name: str, default: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    return launch_env(env).get(name, default)


def env_flag(name: str, env: Optional[Mapping[str, str]] = None) -> bool:
    """A boolean launcher variable ("1"/"true"/"yes", any case); unset = False."""
    return str(launch_env(env).get(name, "false")).strip().lower() in ("1", "true", "yes")


def env_has_prefix(prefix: str, env: Optional[Mapping[str, str]] = None) -> bool:
    return any(name.startswith(prefix) for name in launch_env(env))


@contextlib.contextmanager
def env_hidden(names):
    """Remove ``names`` from the process environment for the block (e.g. switches that would make
    accelerate or transformers take over what hyperacc does), restored afterwards."""
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for the rendezvous of a launch started from Python
    (``accelerate launch --main_process_port``, ``torchrun --master_port``). A fixed default such
    as 29500, or one derived from the process id, collides with any other job on the machine."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def parse_env_text(text: str, default):
    """An environment variable's text as the type of the field's default (None: text, or None if empty)."""
    word = text.strip().lower()
    if isinstance(default, bool):
        if word not in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
            raise ValueError(f"cannot read {text!r} as a boolean (use true/false)")
        return word in ("1", "true", "yes", "on")
    if isinstance(default, (int, str)):
        return type(default)(text)
    return None if word in ("", "none", "null") else text.strip()
