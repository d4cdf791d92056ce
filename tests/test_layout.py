"""The package's architecture stays what DESIGN.md says: layers, no cycles, small modules, old paths.

Fast (the source is read with ast; no process group): the same numbers `.ci/architecture_report.py`
prints and `make lint` (import-linter) enforces in CI, checked here too so that a developer running
only pytest sees a climb the moment it is written.
"""
from __future__ import annotations

import importlib
import importlib.util
import pathlib
import subprocess
import sys
import warnings

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("architecture_report", REPO / ".ci" / "architecture_report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def test_layers_hold_without_cycles():
    numbers = report.shape(REPO, report.layers(REPO))
    assert numbers["against_layers"] == [], "imports against the layers of .importlinter"
    assert numbers["cycles"] == [], "import cycles between hyperacc modules"
    assert numbers["root_modules"] <= 10
    assert numbers["over_400"] == {}, "modules over 400 lines: split them by concept"


def test_every_module_is_in_a_layer():
    modules, _ = report.collect(REPO)
    order = report.layers(REPO)
    unlayered = sorted(m for m in modules if report.layer_of(m, order) is None)
    assert unlayered == ["hyperacc", "hyperacc._moved"], "a new package needs its place in .importlinter"


def test_no_module_below_integrations_imports_an_integration_library():
    """PEFT, transformers' Trainer and TRL plug in through hyperacc.kinds and hyperacc.integrations."""
    modules, _ = report.collect(REPO)
    import ast
    offenders = []
    for name, path in modules.items():
        if name.startswith(("hyperacc.integrations", "hyperacc.tools")) or name in ("hyperacc",):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(t == lib or t.startswith(lib + ".") for t in targets for lib in ("peft", "trl")):
                offenders.append(name)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers") and \
                    any(a.name in ("Trainer", "TrainingArguments") for a in node.names):
                offenders.append(name)
    assert offenders == []


@pytest.mark.parametrize("old", sorted(importlib.import_module("hyperacc._moved").MOVED))
def test_old_module_paths_resolve_to_the_same_module(old):
    new = importlib.import_module("hyperacc." + importlib.import_module("hyperacc._moved").MOVED[old])
    sys.modules.pop(f"hyperacc.{old}", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"hyperacc.{old}")
    assert module is new
    assert module.__spec__.name == new.__name__, "the real module keeps its own spec"
    assert any(issubclass(w.category, DeprecationWarning) and new.__name__ in str(w.message) for w in caught)


def test_import_hyperacc_stays_light():
    """``import hyperacc`` (configs, the convert CLI) loads neither torch nor an integration library."""
    code = ("import sys, hyperacc, hyperacc.config; "
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'trl', 'datasets', 'accelerate') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_every_error_class_lives_in_hyperacc_errors():
    modules, _ = report.collect(REPO)
    import ast
    elsewhere = []
    for name, path in modules.items():
        if name == "hyperacc.errors":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Mismatch", "Timeout")) \
                    and not node.name.startswith("_"):
                elsewhere.append(f"{name}.{node.name}")
    assert elsewhere == []
