"""Old import paths of modules that moved into layered packages (issue 39), kept working.

Why a finder instead of one re-exporting file per old path: a file per path would keep 30 modules at
the package root and hide the layers again. ``import hyperacc.optim`` (or ``from hyperacc import
optim``) yields the very module object ``hyperacc.precision.adamw``, so a monkeypatch through either
name reaches the same code; a DeprecationWarning names the new path.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

MOVED = {
    "launch_env": "config.launch_env", "components": "config.components", "compilation": "sharding.compile",
    "mesh": "runtime.mesh", "progress": "runtime.progress", "watchdog": "runtime.watchdog",
    "housekeeping": "runtime.housekeeping", "optim": "precision.adamw", "rounding": "precision.rounding",
    "replicated": "sharding.replicated", "wrappers": "sharding.rebind", "model_setup": "models.setup",
    "packed_attention": "models.packed_attention", "accumulation": "training.accumulation",
    "router_aux": "training.router_aux", "step_checks": "training.step_checks",
    "replica_guard": "training.replica_guard", "metrics": "training.metrics",
    "metrics_sinks": "training.metrics_sinks", "checkpointing": "accelerator.checkpointing",
    "compat": "accelerator.compat", "dry_run": "tools.dry_run", "plan_report": "tools.plan_report",
    "cli_config": "tools.cli_config", "preflight": "tools.preflight", "activations": "tools.activations",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``hyperacc.<old>`` to the module now at ``hyperacc.<new>``."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname[len("hyperacc."):] if fullname.startswith("hyperacc.") else None
        if old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new = "hyperacc." + MOVED[spec.name[len("hyperacc."):]]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path will be removed).",
                      DeprecationWarning, stacklevel=3)
        module = importlib.import_module(new)
        self._spec = module.__spec__        # the import system sets __spec__ to the alias's: put it back
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec        # the module at the new path is already executed


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
