"""examples/train_qwen.py imported in the test process, and its one-line ConfigErrors, for tests of
the example's checks (tests/test_bad_input.py, tests/test_peft_example.py)."""
from __future__ import annotations

import importlib.util

import pytest

from dist_utils import REPO
from hyperacc.tools.cli_config import ConfigError

SCRIPT = REPO / "examples" / "train_qwen.py"


def load_example(module_name: str):
    """The example as a module (its own sys.path setup included), under ``module_name``."""
    spec = importlib.util.spec_from_file_location(module_name, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config_error(example, args, *, preflight=False) -> str:
    """The message of the ConfigError ``args`` raise in load_config (and preflight), asserted to be
    one line that names a fix."""
    with pytest.raises(ConfigError) as info:
        cfg, world = example.load_config(list(map(str, args)))
        if preflight:
            example.preflight(cfg, world)
    message = str(info.value)
    assert "\n" not in message and "Fix" in message, message
    return message
