"""``_target_`` components of a config, and the one error type of configuration problems.

A ``Component`` names a callable by import path (``_target_``) with its keyword arguments; its
keywords are checked against the callable's signature when parsed, and the runtime arguments a
script passes (e.g. the optimizer's parameter groups) when built, so a mismatch is one ConfigError
naming the component, the argument and the fix. (Re-exported by :mod:`hyperacc.tools.cli_config`.)
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
from hyperacc.errors import ConfigError  # noqa: F401 - defined with every error class

TARGET = "_target_"


def _hint(names, name) -> str:
    close = difflib.get_close_matches(str(name), [str(n) for n in names], n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


@dataclasses.dataclass
class Component:
    """``_target_`` (a dotted import path) plus configured keyword arguments; ``build(*args, **kw)``
    calls the target with them (runtime keywords win). Arguments read as ``comp.lr``/``comp["lr"]``."""

    target: str
    kwargs: dict = dataclasses.field(default_factory=dict)

    def resolve(self):
        module, _, name = self.target.rpartition(".")
        return getattr(importlib.import_module(module), name)

    def build(self, *args, **runtime_kwargs):
        """Call the target with ``args`` and the configured keywords (``runtime_kwargs`` win). A call
        its signature cannot take is one ConfigError (``check_call``), not a TypeError from inside it."""
        self.check_call(args, runtime_kwargs)
        return self.resolve()(*args, **{**self.kwargs, **runtime_kwargs})

    def check_call(self, args=(), runtime_kwargs=None, *, section: str = "") -> None:
        """ConfigError naming the target, the argument and the fix unless the target's signature accepts
        the runtime arguments the program passes (``args``, ``runtime_kwargs``) together with the
        configured keywords. No call is made; a target without an inspectable signature passes.
        ``section``: the config key of this component, for the message."""
        runtime_kwargs = dict(runtime_kwargs or {})
        try:
            signature = inspect.signature(self.resolve())
        except (ValueError, TypeError):
            return
        where, shape = f"{section}: " if section else "", f"{self.target}{_shape(signature)}"
        params = signature.parameters
        named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        takes_varargs = any(p.kind is p.VAR_POSITIONAL for p in params.values())
        takes_varkw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        fix = (f"Fix: a _target_ that takes the program's runtime arguments ({len(args)} positional first"
               f"{', then ' + ', '.join(map(repr, runtime_kwargs)) if runtime_kwargs else ''}) besides the "
               f"configured ones (e.g. a function def make(*args, **kwargs) that calls {self.target}).")
        if len(args) > len(positional) and not takes_varargs:
            raise ConfigError(f"{where}{shape} takes {len(positional)} positional argument(s) but the program "
                              f"passes {len(args)} at runtime ({_described(args)}). {fix}")
        for name in runtime_kwargs:
            if name not in named and not takes_varkw:
                raise ConfigError(f"{where}{shape} takes no argument {name!r}, which the program passes at "
                                  f"runtime. {fix}")
        for name in self.kwargs:
            if name not in named and not takes_varkw and name not in runtime_kwargs:
                key = f"{section}.{name}" if section else name
                raise ConfigError(f"{where}{shape} takes no argument {name!r} (configured as {key})."
                                  f"{_hint(named, name)} Fix: remove {key}, or use one of: {', '.join(named)}.")
        by_position = positional[:len(args)]
        for name in self.kwargs:
            if name in by_position and name not in runtime_kwargs:
                index = by_position.index(name)
                raise ConfigError(f"{where}{shape}: the program passes {len(args)} positional argument(s) at runtime "
                                  f"({_described(args)}), and #{index + 1} lands on {name!r}, which is configured "
                                  f"too ({section + '.' if section else ''}{name}). {fix}")
        try:
            signature.bind(*args, **{**self.kwargs, **runtime_kwargs})
        except TypeError as err:
            missing = [n for n, p in params.items() if p.default is p.empty
                       and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                       and n not in positional[:len(args)] and n not in self.kwargs and n not in runtime_kwargs]
            hint = (f"Fix: set {', '.join(f'{section}.{n}' if section else n for n in missing)} in the config."
                    if missing else fix)
            raise ConfigError(f"{where}{shape} cannot be called with the runtime argument(s) "
                              f"{_described(args) or 'none'} and the configured {sorted(self.kwargs)}: {err}. "
                              f"{hint}") from None

    def __getattr__(self, name):  # only called for names that are not attributes (none yet in a copy)
        if name not in self.__dict__.get("kwargs", {}):
            raise AttributeError(f"Component {self.__dict__.get('target')!r} has no configured argument {name!r}")
        return self.kwargs[name]

    def __getitem__(self, key):
        return self.kwargs[key]

    def get(self, key, default=None):
        return self.kwargs.get(key, default)


def _shape(signature) -> str:
    """A signature by its parameter names only (annotations and defaults can run to lines)."""
    parts, star = [], False
    for name, p in signature.parameters.items():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
        star = star or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        parts.append({p.VAR_POSITIONAL: f"*{name}", p.VAR_KEYWORD: f"**{name}"}.get(p.kind, name))
    return f"({', '.join(parts)})"


def _described(args) -> str:
    """Runtime positional arguments in words (their types, not their possibly huge values)."""
    return ", ".join(f"#{i + 1} a {type(a).__name__}" for i, a in enumerate(args))


def _component(data: dict, section: str) -> Component:
    """Import ``_target_`` and check (and convert) each keyword against its signature, now. An int
    default takes a float too (SGD's momentum=0 -> 0.9); a tuple default, a list of its length."""
    target, kwargs = data.get(TARGET), {k: v for k, v in data.items() if k != TARGET}
    try:
        params = inspect.signature(Component(target).resolve()).parameters
    except (ImportError, AttributeError, ValueError, TypeError) as err:
        raise ConfigError(f"{section}.{TARGET}={target!r} cannot be imported or inspected ({err}). Fix: give a "
                          "dotted import path of a callable, e.g. 'torch.optim.AdamW'.") from None
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    open_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for name, value in kwargs.items():
        key, default = f"{section}.{name}", getattr(params.get(name), "default", None)
        kind = type(default)
        if name not in named and not open_kwargs:
            raise ConfigError(f"{target} takes no argument {name!r}.{_hint(named, name)} "
                              f"Fix: remove {key} or use one of: {', '.join(named)}.")
        if kind is tuple:
            if not isinstance(value, (list, tuple)) or len(value) != len(default):
                raise ConfigError(f"{key} must be a list of {len(default)} values like {list(default)}, got "
                                  f"{value!r}. Fix: e.g. --{key}=[{','.join(map(str, default))}]")
            kwargs[name] = tuple(value)
        elif kind in (bool, int, float, str):
            try:
                if isinstance(value, bool) != (kind is bool) or kind is str and not isinstance(value, str):
                    raise TypeError(value)     # reported below
                kwargs[name] = float(value) if kind is float or kind is int and not isinstance(value, int) else value
            except (TypeError, ValueError):
                raise ConfigError(f"{key} must be {kind.__name__}, got {value!r}. "
                                  f"Fix: e.g. --{key}={default!r}") from None
    return Component(target, kwargs)


# ---------------------------------------------------------------------------------------------- input
