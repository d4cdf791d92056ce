"""`make demo` fits on one screen and says what it produced (issue 40, "a quiet demo").

The demo's command comes from the Makefile itself (its flags after examples/train_qwen.py, with
``$(DEMO_RUN)`` a temporary folder), launched as ``accelerate launch`` on 2 processes inside a
pseudo-terminal -- where a user sees it, and where tqdm draws its bars -- and the screen is rendered
(``\\r`` returns to the line's start) to count what the user reads: at most 40 lines, no config dump,
one training bar and one set of tokenizing bars (rank 0's), the step lines on lines of their own, and
the closing summary last. The default run makes the demo once, as tests/test_example.py's baseline
(the same 2-process, 30-step run of the default config; ``run_demo`` and ``assert_demo_screen`` here), and
checks its screen there; this file's own pseudo-terminal run of it is in the slow set. A second,
single-process run with ``--verbose`` and its output captured (a log file, not a terminal) prints the
resolved config, the same text as the file it writes, and no bar redraws (no ``\\r``) between its lines.
"""
from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import shlex
import signal
import struct
import subprocess
import termios
import time

import pytest
import yaml

from dist_utils import REPO, _env, accelerate_cmd, run_python

SCRIPT = REPO / "examples" / "train_qwen.py"
MAX_LINES = 40


def _demo_args(run_dir):
    """(accelerate config file, example flags) of the Makefile's demo recipe, ``$(DEMO_RUN)`` = run_dir."""
    lines = (REPO / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("demo:"))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip().rstrip("\\"))
    words = shlex.split(" ".join(recipe).replace("$(DEMO_RUN)", str(run_dir)))
    assert "$(" not in " ".join(words[words.index("examples/train_qwen.py"):]), words
    return REPO / words[words.index("--config_file") + 1], words[words.index("examples/train_qwen.py") + 1:]


def _run_in_terminal(cmd, timeout=400):
    """(exit code, bytes written) of ``cmd`` with stdout and stderr on a 120-column pseudo-terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
    proc = subprocess.Popen(cmd, cwd=str(REPO), env=_env(), stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            start_new_session=True)
    os.close(slave)
    out, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:          # EIO: every writer closed the terminal
                break
            if not data:
                break
            out.append(data)
        else:
            raise AssertionError(f"the demo ran over {timeout} s:\n{b''.join(out).decode(errors='replace')[-3000:]}")
        return proc.wait(timeout=60), b"".join(out)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)


def _screen(raw: bytes):
    """The lines a terminal shows for ``raw``: ``\\r`` returns to column 0 and later text overwrites;
    escape sequences (none expected from one bar) are dropped."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw.decode("utf-8", errors="replace"))
    lines, line, col = [], [], 0
    for ch in text:
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        else:
            line[col:col + 1] = [ch]
            col += 1
    if "".join(line).strip():
        lines.append("".join(line).rstrip())
    return lines


def run_demo(run):
    """(exit code, bytes written) of the Makefile's demo, ``$(DEMO_RUN)`` = ``run``, in a pseudo-terminal
    (tests/test_example.py's baseline is this run: the same flags, and its metrics.jsonl)."""
    config, flags = _demo_args(run)
    assert "--checkpoint.save_ckpt=true" in flags and not any("verbose" in f for f in flags), flags
    return _run_in_terminal(accelerate_cmd(SCRIPT, config, flags))


def assert_demo_screen(code, raw, run):
    """What the user reads of one demo run (``run_demo(run)``): one screen, one bar, the summary last."""
    screen = _screen(raw)
    text = "\n".join(screen)
    assert code == 0, text[-4000:]
    # the demo's length (the Makefile's own echo of the command adds its 2 lines)
    assert len(screen) <= MAX_LINES - 2, text
    assert raw.count(b"\n") <= MAX_LINES - 2, text
    # no config dump without --verbose; the resolved config went to a file, named before step 1
    assert "# TrainConfig" not in text and "name_or_path:" not in text, text
    resolved = run / "config.resolved.yaml"
    assert any(line.startswith("training to step 30,") and line.endswith(f"resolved config: {resolved}")
               for line in screen), text
    assert yaml.safe_load(resolved.read_text())["training"]["max_steps"] == 30
    # one bar source: rank 0's training bar once, its tokenizing bars once per split (train, validation)
    assert sum(line.startswith("train:") for line in screen) == 1, text
    assert sum(line.startswith("Tokenizing") for line in screen) == 2, text
    assert "30/30" in next(line for line in screen if line.startswith("train:")), text
    # step lines on lines of their own, above the bar (tqdm.write), every logging step once
    steps = [line for line in screen if "step=" in line and "eval" not in line]
    assert [int(re.match(r"step=(\d+) loss=", line).group(1)) for line in steps] == [5, 10, 15, 20, 25, 30], text
    # the summary closes the output
    start = next(i for i, line in enumerate(screen) if line.startswith("done: "))
    done, tail = screen[start], screen[start + 1:]
    match = re.fullmatch(r"done: 30 steps \(1 -> 30\) in [\d.]+ s; loss ([\d.]+) -> ([\d.]+), "
                         r"eval_loss [\d.]+ \(step 30\)", done)
    assert match and float(match.group(2)) < float(match.group(1)), done
    assert tail[0] == f"metrics:     {run}/metrics.jsonl" and (run / "metrics.jsonl").is_file(), tail
    assert tail[1] == f"checkpoints: {run} (LATEST = step 30)" and (run / "global_step_30").is_dir(), tail
    assert tail[2] == f"config:      {resolved}", tail
    assert tail[3] == "next:" and len(tail) == 7 and all(line.startswith("  --") for line in tail[4:]), tail
    assert any("--peft.method=lora" in line for line in tail) and any("restore_from=LATEST" in line for line in tail)


# The default run makes the demo once, as tests/test_example.py's baseline (the same 2-process, 30-step run
# of the default config) and checks its screen there: test_example.py::test_make_demo_is_the_baseline_and_fits_one_screen.
@pytest.mark.slow
def test_make_demo_fits_one_screen_with_one_bar_and_ends_with_the_summary(tmp_path):
    run = tmp_path / "run"
    assert_demo_screen(*run_demo(run), run)


def test_verbose_prints_the_resolved_config_it_writes_and_a_log_has_no_bar_redraws(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = run_python(SCRIPT, ["--verbose", "--training.max_steps=1", "--eval.eval_steps=0",
                               f"--logging.metrics_file={metrics}"], timeout=300)
    out = proc.stdout
    written = tmp_path / "m.config.resolved.yaml"       # no checkpoints: beside the metrics file
    dump = out.split("# TrainConfig\n", 1)[1].split("\ntraining to step 1,", 1)[0]
    assert yaml.safe_load(dump) == yaml.safe_load(written.read_text()), dump
    assert yaml.safe_load(dump)["training"]["verbose"] is True
    assert f"resolved config: {written}" in out and f"config:      {written}" in out, out[-3000:]
    assert "\r" not in out + proc.stderr and "train:" not in proc.stderr and "Tokenizing" not in proc.stderr
    assert "checkpoints: none saved" in out and out.rstrip().splitlines()[-1].startswith("  --help"), out[-3000:]
