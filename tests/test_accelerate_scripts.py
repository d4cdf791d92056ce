"""accelerate's own test scripts, run on hyperacc, and 0-d (scalar) parameters.

`accelerate/test_utils/scripts/test_sync.py` (from the installed accelerate, not vendored) is copied
to tmp_path with its import line swapped to `from hyperacc import Accelerator` and run on 1 process
(`python`) and on 2 (`accelerate launch` with accelerate_configs/cpu_fsdp2_2proc.yaml: FSDP2 over
gloo); it must exit 0. Its model (RegressionModel) has only 0-d parameters, which FSDP2 refuses and
hyperacc replicates (`hyperacc.sharding.replicated`); `test_dataloader_break` asserts that the loader
`prepare()` returned is `gradient_state.active_dataloader`.

Deviation (the "all sub-tests" runs only; the as-shipped runs have none): the script picks its
sub-tests by `state.distributed_type` -- the `no_sync` no-op test for `DistributedType.NO`, the
distributed `no_sync`/`trigger_sync_in_backward` tests and the gradient-accumulation matrix
(split_batches x dispatch_batches x sync_each_batch) for `MULTI_*` (DDP) types. hyperacc reports
`DistributedType.FSDP` (it shards with FSDP2, also on one process), which selects none of them, so
as shipped only `test_dataloader_break` and one `test_gradient_accumulation_with_opt_and_scheduler`
run. The copy therefore selects them by process count instead (`num_processes == 1` for the no-op
test, `num_processes > 1` added to the `MULTI_*` conditions); the sub-tests themselves are
unchanged and all of them pass, including their DDP `no_sync` assertions (gradients not in sync
inside `no_sync`, in sync after the next synchronised backward).

The scalar-parameter unit check (tests/scripts/scalar_params.py) compares gradients with a
one-process reference, checks them bit for bit against the FSDP-reduced gradient of a 1-D twin,
and round-trips them through save_state/load_state, get_state_dict and save_model.
"""
from __future__ import annotations

import json
from pathlib import Path

import accelerate
import pytest

from dist_utils import REPO, run_accelerate, run_python, run_torchrun

FSDP2_CONFIG = REPO / "accelerate_configs" / "cpu_fsdp2_2proc.yaml"
ACCELERATE_SCRIPTS = Path(accelerate.__file__).resolve().parent / "test_utils" / "scripts"

IMPORT = "from accelerate.accelerator import Accelerator, DataLoaderConfiguration, GradientAccumulationPlugin\n"
HYPERACC_IMPORT = ("from accelerate.accelerator import DataLoaderConfiguration, GradientAccumulationPlugin\n"
                   "from hyperacc import Accelerator\n")
# The deviation of the "all sub-tests" copy (see the module docstring): select by process count.
GATES = [
    ("    if state.distributed_type == DistributedType.NO:\n", "    if state.num_processes == 1:\n", 1),
    ("    if state.distributed_type in (\n        DistributedType.MULTI_GPU,\n",
     "    if state.num_processes > 1 or state.distributed_type in (\n        DistributedType.MULTI_GPU,\n", 3),
]

HEADERS = {   # sub-tests that must have run (printed by the script's main on rank 0)
    ("shipped", 1): ["dataloader break", "with optimizer and scheduler"],
    ("shipped", 2): ["dataloader break", "with optimizer and scheduler"],
    ("all", 1): ["dataloader break", "NOOP `no_sync`", "with optimizer and scheduler"],
    ("all", 2): ["dataloader break", "Distributed `no_sync` context manager**",
                 "`no_sync` context manager with multiple forwards",
                 "`split_batches=True` and `dispatch_batches=True` and `sync_each_batch=True`",
                 "with optimizer and scheduler,  `split_batches=False` and `dispatch_batches=False` and "
                 "`sync_each_batch=True`"],
}


def _swapped(text: str, old: str, new: str, count: int) -> str:
    found = text.count(old)
    assert found == count, (f"accelerate's test_sync.py changed ({found} x {old!r}, expected {count}): "
                            "update the swap in tests/test_accelerate_scripts.py")
    return text.replace(old, new)


def copy_test_sync(tmp_path: Path, variant: str) -> Path:
    text = (ACCELERATE_SCRIPTS / "test_sync.py").read_text()
    text = _swapped(text, IMPORT, HYPERACC_IMPORT, 1)
    if variant == "all":
        for old, new, count in GATES:
            text = _swapped(text, old, new, count)
    script = tmp_path / "test_sync.py"
    script.write_text(text)
    return script


# The as-shipped script in the slow set: the "all" copy runs its sub-tests and more, differing from it only
# in the import and the gate lines (test_copy_differs_only_in_import_and_gates), on 1 and 2 processes.
# The copy on 1 process in the slow set too: its 2-process run passes through the same sub-tests and more.
@pytest.mark.parametrize("variant, nproc", [pytest.param("shipped", 1, marks=pytest.mark.slow),
                                            pytest.param("all", 1, marks=pytest.mark.slow), ("all", 2),
                                            pytest.param("shipped", 2, marks=pytest.mark.slow)])
def test_accelerate_test_sync(tmp_path, variant, nproc):
    script = copy_test_sync(tmp_path, variant)
    if nproc == 1:
        proc = run_python(script, timeout=300)
    else:
        proc = run_accelerate(script, FSDP2_CONFIG, timeout=300)
    for header in HEADERS[(variant, nproc)]:
        assert header in proc.stdout, (header, proc.stdout[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def _result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, stdout[-3000:]
    return json.loads(lines[0][len("RESULT "):])


@pytest.fixture(scope="module")
def one_process_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("scalar_1proc")
    return _result(run_python(REPO / "tests" / "scripts" / "scalar_params.py", args=[out], timeout=300).stdout)


def _assert_close(got: dict, want: dict) -> None:
    for key in ("first_grads", "final"):
        for name in ("a", "b"):
            a, b = got[key][name], want[key][name]
            assert abs(a - b) <= 1e-6 * max(abs(b), 1.0), (key, name, a, b)


def test_scalar_parameters_two_processes(tmp_path, one_process_result):
    """0-d parameters on 2 processes (FSDP over gloo): exact gradients (in-script checks, see the
    script), same gradients and trained values as the 1-process run, checkpoint round trip."""
    assert one_process_result["world"] == 1
    result = _result(run_accelerate(REPO / "tests" / "scripts" / "scalar_params.py", FSDP2_CONFIG,
                                    args=[tmp_path], timeout=300).stdout)
    assert result["world"] == 2
    _assert_close(result, one_process_result)


@pytest.mark.slow
def test_scalar_parameters_hsdp(tmp_path, one_process_result):
    """The same on a 2-D mesh (dp_replicate=2 x dp_shard=1): the all-reduce runs per mesh dimension."""
    result = _result(run_torchrun(REPO / "tests" / "scripts" / "scalar_params.py", 2,
                                  args=[tmp_path, "hsdp"], timeout=300).stdout)
    _assert_close(result, one_process_result)


def test_copy_differs_only_in_import_and_gates(tmp_path):
    """The "all" copy differs from accelerate's script only in the import and the gate lines."""
    original = set((ACCELERATE_SCRIPTS / "test_sync.py").read_text().splitlines())
    copied = copy_test_sync(tmp_path, "all").read_text().splitlines()
    changed = [line for line in copied if line not in original]
    allowed = {*HYPERACC_IMPORT.splitlines(), *(new.splitlines()[0] for _, new, _ in GATES)}
    assert set(changed) <= allowed, changed
