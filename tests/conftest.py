import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


@pytest.fixture(scope="module")
def hyperacc_cache(tmp_path_factory):
    """A private HYPERACC_CACHE for one test module (the default corpus and tokenizer go there)."""
    cache = str(tmp_path_factory.mktemp("hyperacc_cache"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYPERACC_CACHE", cache)
        yield cache


# The default run (CI, `make test`) is budgeted at 10 min on 2 cores: a multi-process launch costs
# ~5-10 s of start-up, so tests share launches (module fixtures; tests/scripts/run_sequence.py runs
# several runs of a script in one job; dist_utils.run_together puts independent deterministic launches
# side by side; tests/snippet_runs.py runs every snippet in one launch). Tests marked
# `@pytest.mark.slow` (more layouts of the same feature, long multi-process resumes; each names the
# default test that keeps its guarantee) run with HYPERACC_SLOW_TESTS=1 (`make test-all`).
SLOW = os.environ.get("HYPERACC_SLOW_TESTS") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a further layout/case of a feature the default run already covers "
                                       "(runs with HYPERACC_SLOW_TESTS=1)")


def pytest_collection_modifyitems(config, items):
    if SLOW:
        return
    skip = pytest.mark.skip(reason="slow: run with HYPERACC_SLOW_TESTS=1 (make test-all)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
