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


# `make test` runs the files on 2 pytest-xdist workers (`-n 2 --dist loadfile`: a module's tests, and so
# its module fixture's launches, stay on one worker). A worker takes the next file when it is free, so the
# files that cost the most CPU go first and the run does not end with one worker busy and the other idle
# (measured with HYPERACC_CPU_LOG=FILE, below; the rest keep their order).
HEAVY_FIRST = ("test_example", "test_preference", "test_accelerate_compat", "test_fail_closed", "test_router_aux",
               "test_compile", "test_trainer", "test_core", "test_replicas", "test_fault_tolerance", "test_instruction_data",
               "test_streaming", "test_example_preflight", "test_checkpoint_dist", "test_checkpoint_edges",
               "test_iterable_data", "test_flag_fuzz", "test_precision", "test_weights", "test_peft",
               "test_stream_resume", "test_accelerate_scripts")


def _module_rank(item) -> int:
    name = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
    return HEAVY_FIRST.index(name) if name in HEAVY_FIRST else len(HEAVY_FIRST)


def pytest_collection_modifyitems(config, items):
    order = {id(item): index for index, item in enumerate(items)}
    items.sort(key=lambda item: (_module_rank(item), order[id(item)]))
    if SLOW:
        return
    skip = pytest.mark.skip(reason="slow: run with HYPERACC_SLOW_TESTS=1 (make test-all)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# Where the time goes: HYPERACC_CPU_LOG=FILE appends each test's CPU seconds (this process and the launches
# it waited for; a module fixture's cost lands on its first test) -- what a 2-worker run's wall time follows.
_CPU_LOG = os.environ.get("HYPERACC_CPU_LOG")
if _CPU_LOG:
    import resource

    def _cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        start = _cpu()
        yield
        with open(_CPU_LOG, "a") as handle:
            handle.write(f"{_cpu() - start:.2f}\t{item.nodeid}\n")
