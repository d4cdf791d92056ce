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


def run_main(example, args, capsys) -> tuple:
    """``example.main(args)`` in this process, as ``python examples/train_qwen.py ARGS`` runs it, for the
    checks that stop before any process group exists (config errors, the dry run): (exit code, stdout,
    stderr). A ConfigError reaches ``exit_with`` -- one line, ``sys.exit(2)`` -- exactly as in a process
    of its own, and anything else escaping ``main`` fails the calling test with its traceback; a test
    file keeps one plain-python run of the example for the interpreter's exit code (a process start-up
    costs ~3 s, the check itself milliseconds)."""
    capsys.readouterr()
    try:
        example.main([str(arg) for arg in args])
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err
