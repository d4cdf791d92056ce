"""Slow set (make test-all): the 30B rehearsal at true width on 8 processes (`make rehearse`, ~12 min)
and the memory plan against a measured 2-process bf16 run."""
import re

import pytest

from dist_utils import REPO, run_python


@pytest.mark.slow
def test_rehearsal_at_true_width_exits_0(tmp_path):
    proc = run_python(REPO / "examples" / "rehearse_30b.py", ["--out", tmp_path], timeout=1800)
    assert proc.stdout.count("-- ok") == 2, proc.stdout[-3000:]
    assert "resumed steps bitwise equal: True" in proc.stdout


@pytest.mark.slow
def test_a_two_process_bf16_run_matches_its_memory_plan():
    proc = run_python(REPO / "benchmarks" / "memory_plan.py", ["--cases", "fsdp:bf16:1", "--steps", "2"], timeout=900)
    ratio = float(re.search(r"measured/planned: min ([0-9.]+)", proc.stdout).group(1))
    assert 0.8 <= ratio <= 1.25, proc.stdout[-2000:]
