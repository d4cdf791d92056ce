"""YAML files and typed ``--section.field=value`` command-line overrides for training scripts.

A *schema* is a dataclass whose fields are *sections*: section dataclasses (or ``Component``
nodes). ``parse_config(schema_cls, yaml_path, argv)`` reads the YAML file, applies the CLI
overrides, checks every value against the field types and returns a schema instance. Every
problem (unknown section or field, wrong type, unknown keyword for a ``_target_`` callable,
``_target_`` overridden from the CLI, a failed cross-field check) raises one ``ConfigError``
naming the key, the value and the fix, before anything heavy starts.

Section dataclasses are constructed with keyword arguments for the fields the YAML/CLI gave
*only*, so ``hyperacc.config.explicit_fields()`` of the ``parallel``/``fsdp``/``checkpoint``
sections reports exactly what the user set; the other fields may later come from the
``accelerate launch`` environment.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import math
import sys
import types
import typing
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import yaml

from hyperacc.config import CheckpointConfig, FSDPConfig, ParallelConfig

__all__ = [
    "ConfigError", "Component", "parse_config", "build_config", "dump_config", "save_config",
    "load_config", "format_config", "config_help", "TrainConfig", "ModelConfig", "DataConfig",
    "TrainingConfig", "LRSchedulerConfig", "LoggingConfig", "EvalConfig", "default_optimizer",
]

TARGET_KEY = "_target_"
_NULL_WORDS = ("", "~", "null", "none", "None", "NULL", "Null")
_MISSING = object()
_UNIONS = (Union, types.UnionType) if hasattr(types, "UnionType") else (Union,)


class ConfigError(ValueError):
    """A configuration problem found while parsing (before any training work starts)."""


# ---------------------------------------------------------------------------------------------
# Component: a node with ``_target_``
# ---------------------------------------------------------------------------------------------

def _import_target(path: str):
    if not isinstance(path, str) or "." not in path:
        raise ImportError(f"{path!r} is not a dotted path like 'torch.optim.AdamW'")
    # Import the longest importable module prefix, then walk attributes.
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no importable module in {path!r}")


class Component:
    """A callable named by a dotted import path (``_target_``) plus configured keyword arguments.

    ``build(*args, **runtime_kwargs)`` calls the target with the configured keyword arguments
    updated by the runtime ones (runtime wins), e.g. ``cfg.optimizer.build(model.parameters())``.
    Configured arguments are readable as ``comp["lr"]``, ``comp.get("lr")`` or ``comp.lr``.
    """

    __slots__ = ("target", "kwargs")

    def __init__(self, target: str, kwargs: Optional[dict] = None, **more):
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "kwargs", {**(kwargs or {}), **more})

    def resolve(self):
        """The callable the target names (imported now)."""
        return _import_target(self.target)

    def build(self, *args, **runtime_kwargs):
        call_kwargs = {**self.kwargs, **runtime_kwargs}
        target = self.resolve()
        try:
            params = inspect.signature(target).parameters
        except (TypeError, ValueError):
            params = {}
        for name, value in list(call_kwargs.items()):
            param = params.get(name)
            if param is not None and isinstance(param.default, tuple) and isinstance(value, list):
                call_kwargs[name] = tuple(value)
        return target(*args, **call_kwargs)

    def __getitem__(self, key):
        return self.kwargs[key]

    def get(self, key, default=None):
        return self.kwargs.get(key, default)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return object.__getattribute__(self, "kwargs")[name]
        except KeyError:
            raise AttributeError(f"Component {self.target!r} has no configured argument {name!r}") from None

    def __setattr__(self, name, value):
        if name in ("target", "kwargs"):
            object.__setattr__(self, name, value)
        else:
            self.kwargs[name] = value

    def __eq__(self, other):
        return (isinstance(other, Component) and self.target == other.target
                and _plain(self.kwargs) == _plain(other.kwargs))

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"Component({self.target}{', ' if args else ''}{args})"

    def __copy__(self):
        return Component(self.target, dict(self.kwargs))

    def __deepcopy__(self, memo):
        import copy
        return Component(self.target, copy.deepcopy(self.kwargs, memo))

    def __getstate__(self):
        return {"target": self.target, "kwargs": self.kwargs}

    def __setstate__(self, state):
        object.__setattr__(self, "target", state["target"])
        object.__setattr__(self, "kwargs", state["kwargs"])


def _component_signature(target_path: str, where: str):
    try:
        target = _import_target(target_path)
    except Exception as err:  # noqa: BLE001 - any import failure is a config error
        raise ConfigError(f"{where}.{TARGET_KEY}={target_path!r} cannot be imported ({err}). "
                          "Fix: give a dotted import path of a callable, e.g. 'torch.optim.AdamW'.") from None
    if not callable(target):
        raise ConfigError(f"{where}.{TARGET_KEY}={target_path!r} is not callable. "
                          "Fix: name a class or function.")
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------

class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            try:
                key = self.construct_object(key_node, deep=True)
                hash(key)
            except Exception:  # noqa: BLE001 - unhashable keys: left to the base class to report
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given on line {seen[key] + 1}); PyYAML would silently "
                    f"keep the last one. Fix: keep one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _safe_load(stream):
    return yaml.load(stream, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


class _CliValue:
    """A value given on the command line: raw text, parsed as a YAML scalar when checked."""

    __slots__ = ("text", "flag")

    def __init__(self, text: str, flag: str):
        self.text = text
        self.flag = flag

    def parsed(self):
        try:
            return _safe_load(self.text)
        except yaml.constructor.ConstructorError as err:
            if "duplicate key" in str(err.problem):
                raise ConfigError(f"{self.flag}: {err.problem}") from None
            return self.text
        except yaml.YAMLError:
            return self.text


def _resolve_cli(value):
    """Replace CLI values nested in dicts/lists (e.g. --model.overrides.key=v) by parsed YAML."""
    if isinstance(value, _CliValue):
        return value.parsed()
    if isinstance(value, dict):
        return {k: _resolve_cli(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_cli(v) for v in value]
    return value


def _plain(value):
    """Plain YAML-able data: dataclasses -> dict, Component -> dict with _target_, tuple -> list."""
    if isinstance(value, Component):
        return {TARGET_KEY: value.target, **{k: _plain(v) for k, v in value.kwargs.items()}}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if origin in _UNIONS:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]" if args else origin.__name__
    return getattr(tp, "__name__", str(tp))


def _example(tp) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return str(args[0])
    if origin in _UNIONS:
        return _example(next(a for a in args if a is not type(None)))
    if tp is bool:
        return "true"
    if tp is int:
        return "8"
    if tp is float:
        return "0.5"
    if tp is str:
        return "text"
    if tp is list or origin in (list, tuple):
        return "[a,b]"
    if tp is dict or origin is dict:
        return "{key: value}"
    return "..."


class _TypeMismatch(Exception):
    pass


def _convert(value, tp, *, from_cli: bool, raw_text: Optional[str]):
    """Check/convert ``value`` to ``tp``; raise _TypeMismatch when it does not fit."""
    if tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in _UNIONS:
        optional = type(None) in args
        if optional and (value is None or (isinstance(value, str) and value in _NULL_WORDS
                                           and from_cli)):
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, from_cli=from_cli, raw_text=raw_text)
            except _TypeMismatch:
                continue
        raise _TypeMismatch
    if origin is Literal:
        for choice in args:
            if value == choice and type(value) is type(choice):
                return choice
        if raw_text is not None and raw_text in [str(c) for c in args]:
            return next(c for c in args if str(c) == raw_text)
        raise _TypeMismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _TypeMismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _TypeMismatch
    if tp is float:
        if isinstance(value, bool):
            raise _TypeMismatch
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # PyYAML reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise _TypeMismatch from None
        raise _TypeMismatch
    if tp is str:
        if raw_text is not None:
            return raw_text
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise _TypeMismatch
    if tp is list or tp is tuple or origin in (list, tuple, Sequence, typing.Sequence):
        if isinstance(value, str) and from_cli and not value.startswith("["):
            value = [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, (list, tuple)):
            raise _TypeMismatch
        container = tuple if (tp is tuple or origin is tuple) else list
        if not args:
            return container(value)
        if container is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(args) != len(value):
                raise _TypeMismatch
            return tuple(_convert(v, a, from_cli=False, raw_text=None) for v, a in zip(value, args))
        item_tp = args[0]
        return container(_convert(v, item_tp, from_cli=from_cli, raw_text=None) for v in value)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise _TypeMismatch
        if len(args) == 2:
            return {k: _convert(v, args[1], from_cli=False, raw_text=None) for k, v in value.items()}
        return dict(value)
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _TypeMismatch
    return value


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def _first_flag(value) -> Optional[str]:
    if isinstance(value, _CliValue):
        return value.flag
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        for item in value:
            flag = _first_flag(item)
            if flag is not None:
                return flag
    return None


def _describe_source(value, key: str, source: str) -> str:
    if isinstance(value, _CliValue):
        return f"--{key}={value.text}"
    flag = _first_flag(value)
    if flag is not None:
        return flag
    return f"{key}={value!r} (from {source})"


def _check_value(value, tp, key: str, source: str):
    from_cli = isinstance(value, _CliValue)
    raw = value.text if from_cli else None
    parsed = value.parsed() if from_cli else value
    # Bare strings on the CLI keep their exact text for str fields; null-words stay null for Optional.
    raw_for_str = raw if (from_cli and not _is_null(parsed, raw, tp)) else None
    parsed = _resolve_cli(parsed)
    try:
        return _convert(parsed, tp, from_cli=from_cli, raw_text=raw_for_str)
    except _TypeMismatch:
        pass
    shown = _describe_source(value, key, source)
    got = f"{parsed!r} ({type(parsed).__name__})"
    origin = typing.get_origin(tp)
    if origin is Literal or (origin in _UNIONS
                             and any(typing.get_origin(a) is Literal for a in typing.get_args(tp))):
        choices = [c for a in ((tp,) if origin is Literal else typing.get_args(tp))
                   if typing.get_origin(a) is Literal for c in typing.get_args(a)]
        hint = _did_you_mean(str(parsed), [str(c) for c in choices])
        raise ConfigError(f"{shown}: {key} must be one of {', '.join(map(repr, choices))}, got {got}."
                          f"{hint} Fix: --{key}={choices[0]}")
    raise ConfigError(f"{shown}: {key} must be {_type_name(tp)}, got {got}. "
                      f"Fix: e.g. --{key}={_example(tp)}")


def _is_null(parsed, raw, tp) -> bool:
    origin = typing.get_origin(tp)
    optional = origin in _UNIONS and type(None) in typing.get_args(tp)
    return parsed is None or (optional and raw in _NULL_WORDS)


# ---------------------------------------------------------------------------------------------
# Building dataclasses from nested data
# ---------------------------------------------------------------------------------------------

def _hints(cls) -> dict:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _field_default(field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return _MISSING


def _is_type_or_optional(tp, cls) -> bool:
    """``tp`` is ``cls`` itself or a union (e.g. Optional) that contains it."""
    if tp is cls:
        return True
    return typing.get_origin(tp) in _UNIONS and cls in typing.get_args(tp)


def _is_component_type(tp) -> bool:
    return _is_type_or_optional(tp, Component)


def _build_component(data, default, key: str, source: str) -> Component:
    if isinstance(data, Component):
        data = _plain(data)
    if not isinstance(data, dict):
        raise ConfigError(f"{key} must be a mapping with {TARGET_KEY!r} and keyword arguments, got "
                          f"{data!r}. Fix: in YAML write '{key.split('.')[-1]}: {{{TARGET_KEY}: "
                          "package.module.Callable, arg: value}'.")
    target_value = data.get(TARGET_KEY, _MISSING)
    if isinstance(target_value, _CliValue):
        raise ConfigError(f"--{key}.{TARGET_KEY}={target_value.text}: {TARGET_KEY} cannot be overridden "
                          f"from the command line. Fix: set '{TARGET_KEY}' under '{key}' in the YAML "
                          "config file (its keyword arguments are checked against the new target).")
    if target_value is _MISSING:
        if not isinstance(default, Component):
            raise ConfigError(f"{key} has no {TARGET_KEY!r}. Fix: add '{TARGET_KEY}: "
                              "package.module.Callable' under it in the YAML file.")
        target = default.target
    else:
        target = target_value
        if not isinstance(target, str):
            raise ConfigError(f"{key}.{TARGET_KEY}={target!r} must be a dotted import path string.")
    # Start from the default's arguments only when the target is the same callable.
    kwargs = dict(default.kwargs) if isinstance(default, Component) and default.target == target else {}
    signature = _component_signature(target, key)
    params = signature.parameters if signature is not None else {}
    accepts_any = signature is None or any(p.kind is inspect.Parameter.VAR_KEYWORD
                                           for p in params.values())
    for name, value in data.items():
        if name == TARGET_KEY:
            continue
        param = params.get(name)
        if param is None and not accepts_any:
            named = [p for p, v in params.items()
                     if v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)]
            raise ConfigError(
                f"{_describe_source(value, f'{key}.{name}', source)}: {target} takes no argument "
                f"{name!r}.{_did_you_mean(name, named)} Fix: remove it or use one of: "
                f"{', '.join(named)}.")
        if param is not None and param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigError(f"{key}.{name}: {name!r} is a variadic parameter of {target} and cannot be "
                              "configured by name.")
        if param is not None and param.default is not inspect.Parameter.empty and \
                type(param.default) in (bool, int, float, str):
            expected = float if type(param.default) is int and isinstance(_peek(value), float) \
                else type(param.default)
            value = _check_value(value, expected, f"{key}.{name}", source)
        else:
            value = _resolve_cli(value)
        if param is not None and isinstance(param.default, tuple):
            if not isinstance(value, (list, tuple)) or len(value) != len(param.default):
                raise ConfigError(
                    f"{_describe_source(data[name], f'{key}.{name}', source)}: {key}.{name} must be a "
                    f"list of {len(param.default)} values like {list(param.default)}, got {value!r}. "
                    f"Fix: e.g. --{key}.{name}=[{','.join(map(str, param.default))}]")
            value = tuple(value)
        kwargs[name] = value
    return Component(target, kwargs)


def _peek(value):
    return value.parsed() if isinstance(value, _CliValue) else value


def _build_dataclass(cls, data, key: str, source: str):
    if data is None:
        data = {}
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{key or 'config'} must be a mapping of fields, got {data!r}. "
                          f"Fix: write '{key}:' followed by indented 'field: value' lines.")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for name, value in data.items():
        sub_key = f"{key}.{name}" if key else str(name)
        if name not in fields:
            what = "section" if not key else "field"
            known = ", ".join(fields)
            raise ConfigError(f"Unknown {what} {sub_key!r}.{_did_you_mean(str(name), fields)} "
                              f"Fix: use one of: {known}.")
        tp = hints.get(name, fields[name].type)
        kwargs[name] = _build_value(value, tp, _field_default(fields[name]), sub_key, source)
    try:
        return cls(**kwargs)  # only the given fields: explicit-field tracking stays exact
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        given = ", ".join(f"{k}={_plain(v)!r}" for k, v in kwargs.items())
        raise ConfigError(f"{key or cls.__name__} ({given}): {err}") from None


def _build_value(value, tp, default, key: str, source: str):
    if _is_component_type(tp):
        if _peek(value) is None and type(None) in (typing.get_args(tp) or ()):
            return None
        return _build_component(value, default, key, source)
    dc_type = _dataclass_type(tp)
    if dc_type is not None:
        if _peek(value) is None and type(None) in typing.get_args(tp):
            return None
        if isinstance(value, _CliValue):
            raise ConfigError(f"--{key}={value.text}: {key} is a section. Fix: set its fields, "
                              f"e.g. --{key}.<field>=value.")
        return _build_dataclass(dc_type, value, key, source)
    return _check_value(value, tp, key, source)


def _dataclass_type(tp):
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    origin = typing.get_origin(tp)
    if origin in _UNIONS:
        for arg in typing.get_args(tp):
            if isinstance(arg, type) and dataclasses.is_dataclass(arg):
                return arg
    return None


def _run_validators(cfg):
    sections = [getattr(cfg, f.name) for f in dataclasses.fields(cfg)]
    for obj in sections + [cfg]:
        check = getattr(obj, "validate", None)
        if callable(check) and dataclasses.is_dataclass(obj):
            try:
                check()
            except ConfigError:
                raise
            except ValueError as err:
                raise ConfigError(str(err)) from None


def build_config(schema_cls, data: Optional[dict] = None, *, source: str = "dict"):
    """Build ``schema_cls`` from nested plain data (as read from YAML), with all checks."""
    cfg = _build_dataclass(schema_cls, data or {}, "", source)
    _run_validators(cfg)
    return cfg


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def _type_at(schema_cls, path: List[str]):
    """The declared type at a dotted path, or None when unknown (dict keys, component kwargs)."""
    tp: Any = schema_cls
    default: Any = None
    for depth, part in enumerate(path):
        if _is_component_type(tp) and isinstance(default, Component) and depth == len(path) - 1:
            # A keyword of the default target: its default value tells the type (best effort).
            try:
                param = inspect.signature(default.resolve()).parameters.get(part)
            except Exception:  # noqa: BLE001
                return None
            return type(param.default) if param is not None and isinstance(param.default, bool) else None
        dc = _dataclass_type(tp)
        if dc is None:
            return None
        fields = {f.name: f for f in dataclasses.fields(dc)}
        if part not in fields:
            return None
        tp = _hints(dc).get(part, fields[part].type)
        default = _field_default(fields[part])
    return tp


def _is_bool_type(tp) -> bool:
    return _is_type_or_optional(tp, bool)


_BOOL_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0"}


def _parse_argv(schema_cls, argv: Sequence[str]) -> Tuple[Optional[str], List[Tuple[List[str], _CliValue]]]:
    yaml_path = None
    overrides = []
    seen: Dict[str, str] = {}
    i = 0
    argv = list(argv)
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":
            continue
        if not token.startswith("--"):
            if token.startswith("-") and len(token) > 1:
                raise ConfigError(f"Unknown option {token!r}. Fix: use --section.field=value "
                                  "(see --help).")
            if "=" in token and not token.endswith((".yaml", ".yml")):
                raise ConfigError(f"{token!r} is not an option (no leading dashes): did you mean --{token.lstrip('-')}? "
                                  "Fix: write overrides as --section.field=value.")
            if yaml_path is not None:
                raise ConfigError(f"Unexpected argument {token!r}: a YAML config file ({yaml_path!r}) "
                                  "was already given. Fix: pass one YAML file and --section.field=value "
                                  "overrides.")
            yaml_path = token
            continue
        body = token[2:]
        name = body.split("=", 1)[0]
        _check_flag_name(schema_cls, name, token)
        if name in seen:
            raise ConfigError(f"--{name} is given twice ({seen[name]!r} and {token!r}); one would silently win. "
                              f"Fix: pass --{name} once.")
        seen[name] = token
        if "=" in body:
            text = body.split("=", 1)[1]
        else:
            tp = _type_at(schema_cls, name.split("."))
            nxt = argv[i] if i < len(argv) else None
            if _is_bool_type(tp) and (nxt is None or nxt.lower() not in _BOOL_WORDS):
                text = "true"  # bare boolean flag
            elif nxt is None or (nxt.startswith("--") and len(nxt) > 2):
                raise ConfigError(f"--{name} has no value. Fix: --{name}=VALUE.")
            else:
                text = nxt
                i += 1
        path = name.split(".")
        overrides.append((path, _CliValue(text, token)))
    return yaml_path, overrides


def _check_flag_name(schema_cls, name: str, token: str):
    path = name.split(".")
    if not name or any(not part for part in path):
        raise ConfigError(f"Malformed option {token!r}. Fix: --section.field=value.")
    if len(path) < 2:
        sections = [f.name for f in dataclasses.fields(schema_cls)]
        if name in sections:
            raise ConfigError(f"--{name}: give a field of the section, e.g. --{name}.<field>=value.")
        raise ConfigError(f"Unknown section {name!r} in {token!r}.{_did_you_mean(name, sections)} "
                          f"Fix: use --section.field=value with a section among: {', '.join(sections)}.")


def _set_path(data: dict, path: List[str], value):
    node = data
    for depth, part in enumerate(path[:-1]):
        child = node.get(part)
        if isinstance(child, Component):
            child = _plain(child)
        if child is None:
            child = {}
        elif not isinstance(child, dict):
            prefix = ".".join(path[:depth + 1])
            raise ConfigError(f"--{'.'.join(path)}: {prefix!r} is a value ({child!r}), not a section. "
                              f"Fix: --{prefix}=VALUE.")
        node[part] = child
        node = child
    node[path[-1]] = value


def load_yaml(path) -> dict:
    """Read a YAML config file into a dict (empty file -> {})."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = _safe_load(handle)
    except FileNotFoundError:
        raise ConfigError(f"Config file {str(path)!r} does not exist. Fix: pass an existing YAML path.") from None
    except yaml.YAMLError as err:
        detail = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
        raise ConfigError(f"Config file {str(path)!r} is not valid YAML: {detail}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {str(path)!r} must hold a mapping of sections, got "
                          f"{type(data).__name__}.")
    return data


def parse_config(schema_cls, yaml_path=None, argv: Optional[Sequence[str]] = None):
    """YAML file (optional) + CLI overrides -> a checked ``schema_cls`` instance.

    ``argv`` defaults to ``sys.argv[1:]``; it may hold one positional YAML path (when
    ``yaml_path`` is None), ``--section.field=value`` / ``--section.field value`` overrides and
    bare boolean flags (``--training.dry_run``). ``-h``/``--help`` prints every field and exits.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(config_help(schema_cls))
        raise SystemExit(0)
    cli_yaml, overrides = _parse_argv(schema_cls, argv)
    if cli_yaml is not None and yaml_path is not None:
        if not cli_yaml.endswith((".yaml", ".yml")):
            raise ConfigError(f"Unexpected argument {cli_yaml!r}: expected --section.field=value options (and at "
                              "most one CONFIG.yaml, given first). Fix: remove it or write it as an option.")
        raise ConfigError(f"Two YAML files given: {str(yaml_path)!r} and {cli_yaml!r}. Fix: pass one.")
    yaml_path = yaml_path if yaml_path is not None else cli_yaml
    data = load_yaml(yaml_path) if yaml_path is not None else {}
    source = f"YAML file {str(yaml_path)!r}" if yaml_path is not None else "defaults"
    for path, value in overrides:
        _set_path(data, path, value)
    return build_config(schema_cls, data, source=source)


def load_config(schema_cls, path):
    """Read a YAML file written by ``save_config`` back into ``schema_cls``."""
    return build_config(schema_cls, load_yaml(path), source=f"YAML file {str(path)!r}")


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------

def dump_config(cfg, *, explicit_only: bool = False) -> dict:
    """Plain nested dict of a config (Components as ``{_target_: ..., **kwargs}``).

    ``explicit_only=True`` keeps, for sections that record explicit fields (parallel, fsdp,
    checkpoint), only the fields that were set explicitly.
    """
    out = {}
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        plain = _plain(value)
        if explicit_only and hasattr(value, "_explicit") and isinstance(plain, dict):
            plain = {k: v for k, v in plain.items() if k in value._explicit}
        out[field.name] = plain
    return out


def save_config(cfg, path, *, explicit_only: bool = False) -> None:
    """Write ``dump_config(cfg)`` to ``path`` as YAML (loadable by ``load_config``/``parse_config``)."""
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(dump_config(cfg, explicit_only=explicit_only), handle, sort_keys=False,
                       default_flow_style=False)


def format_config(cfg) -> str:
    """Human-readable YAML text of the whole config; fields set explicitly are not marked."""
    text = yaml.safe_dump(dump_config(cfg), sort_keys=False, default_flow_style=False, width=100)
    return f"# {type(cfg).__name__}\n{text.rstrip()}"


def config_help(schema_cls) -> str:
    """Every ``--section.field`` flag with its type and default."""
    lines = [f"Options for {schema_cls.__name__} (usage: [CONFIG.yaml] [--section.field=value ...]):"]
    for section in dataclasses.fields(schema_cls):
        tp = _hints(schema_cls).get(section.name, section.type)
        default = _field_default(section)
        lines.append(f"\n  {section.name}:")
        if _is_component_type(tp):
            if isinstance(default, Component):
                lines.append(f"    {TARGET_KEY} = {default.target}   (set in YAML only)")
                for k, v in default.kwargs.items():
                    lines.append(f"    --{section.name}.{k}  (default {_plain(v)!r})")
            continue
        dc = _dataclass_type(tp)
        if dc is None:
            lines.append(f"    --{section.name}  {_type_name(tp)}  (default {default!r})")
            continue
        hints = _hints(dc)
        for f in dataclasses.fields(dc):
            lines.append(f"    --{section.name}.{f.name}  {_type_name(hints.get(f.name, f.type))}  "
                         f"(default {_plain(_field_default(f))!r})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The training schema
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ModelConfig:
    """Which model to train. ``name_or_path``: a pretrained directory or hub id (its weights are
    loaded); None builds ``preset`` from scratch. ``overrides``: transformers config fields
    (e.g. ``{hidden_size: 256, num_hidden_layers: 4}``) applied to the preset or pretrained config."""

    name_or_path: Optional[str] = None
    preset: str = "tiny"
    overrides: Dict[str, Any] = dataclasses.field(default_factory=dict)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: Optional[str] = None
    # MoE models only: the experts kernel ("grouped_mm", "eager" = per-expert loop, "batched_mm";
    # None = transformers' default) and the router's load-balancing loss (coefficient from the config).
    experts_implementation: Optional[str] = "grouped_mm"
    router_aux_loss: bool = True


@dataclasses.dataclass
class DataConfig:
    """Training data. ``dataset`` None = the embedded offline corpus; otherwise a hub id, a local
    dataset/file path (the training script decides how to read it). ``tokenizer`` None = the
    model's tokenizer when ``model.name_or_path`` is set, else the embedded offline tokenizer."""

    dataset: Optional[str] = None
    name: Optional[str] = None
    split: str = "train"
    text_column: str = "text"
    tokenizer: Optional[str] = None
    seq_len: int = 128
    num_proc: int = 1
    shuffle: bool = True
    eval_split: Optional[str] = None

    def validate(self):
        if self.seq_len < 1:
            raise ConfigError(f"data.seq_len={self.seq_len} must be >= 1. Fix: --data.seq_len=128")
        if self.num_proc < 1:
            raise ConfigError(f"data.num_proc={self.num_proc} must be >= 1. Fix: --data.num_proc=1")


@dataclasses.dataclass
class TrainingConfig:
    """The loop. Batch sizes are in samples (sequences of ``data.seq_len`` tokens);
    ``global_batch_size`` is per optimizer step over all data-parallel ranks and must be a
    multiple of ``micro_batch_size`` (and, at prepare time, of ``micro_batch_size * dp_size``).
    ``epochs``: at most this many passes over the data (training stops at ``max_steps`` or at
    the end of the last epoch, whichever comes first). ``gc_steps``/``empty_cache_steps``: run
    ``gc.collect()`` / empty the device cache every N steps (0 = never).
    ``mode``: ``validate`` = deterministic checks for correctness runs, ``production`` = speed.
    ``dry_run``: parse, build on the meta device and check the plan, then exit without training;
    ``dry_run_world_size`` plans for that many processes instead of the launched ones."""

    max_steps: int = 20
    global_batch_size: int = 8
    micro_batch_size: int = 2
    seed: int = 42
    mode: Literal["validate", "production"] = "production"
    dry_run: bool = False
    dry_run_world_size: Optional[int] = None
    gradient_clipping: Optional[float] = 1.0
    epochs: int = 1
    gc_steps: int = 0
    empty_cache_steps: int = 0

    def validate(self):
        for name in ("max_steps", "global_batch_size", "micro_batch_size", "epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"training.{name}={getattr(self, name)} must be >= 1. "
                                  f"Fix: --training.{name}=<positive integer>")
        for name in ("gc_steps", "empty_cache_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"training.{name}={getattr(self, name)} must be >= 0 (0 = never).")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"training.global_batch_size={self.global_batch_size} is not a multiple of "
                f"training.micro_batch_size={self.micro_batch_size}. Fix: e.g. "
                f"--training.global_batch_size="
                f"{max(1, self.global_batch_size // self.micro_batch_size) * self.micro_batch_size}"
                f" or change --training.micro_batch_size.")
        if self.dry_run_world_size is not None and self.dry_run_world_size < 1:
            raise ConfigError(f"training.dry_run_world_size={self.dry_run_world_size} must be >= 1.")
        if self.gradient_clipping is not None and self.gradient_clipping < 0:
            raise ConfigError(f"training.gradient_clipping={self.gradient_clipping} must be >= 0 "
                              "(0 or null disables clipping).")


def default_optimizer() -> Component:
    """AdamW with LLM pre-training defaults."""
    return Component("torch.optim.AdamW", {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                           "weight_decay": 0.1})


@dataclasses.dataclass
class LRSchedulerConfig:
    """Linear warm-up for ``warmup_steps``, then ``decay`` from the optimizer's lr down to
    ``min_lr_ratio * lr`` at ``total_steps`` (None: ``training.max_steps``).

    A separate ``total_steps`` lets a job stop early (``training.max_steps`` smaller) and resume
    later on the very same schedule.
    """

    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    total_steps: Optional[int] = None

    def validate(self):
        if self.warmup_steps < 0:
            raise ConfigError(f"lr_scheduler.warmup_steps={self.warmup_steps} must be >= 0.")
        if self.total_steps is not None and self.total_steps < 1:
            raise ConfigError(f"lr_scheduler.total_steps={self.total_steps} must be >= 1 (or null: "
                              "training.max_steps).")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"lr_scheduler.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]. "
                              "Fix: --lr_scheduler.min_lr_ratio=0.1")

    def lr_factor(self, step: int, max_steps: int) -> float:
        """Multiplier of the base lr after ``step`` scheduler steps (usable with LambdaLR)."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        span = max(1, max_steps - self.warmup_steps)
        progress = min(1.0, max(0.0, (step - self.warmup_steps) / span))
        if self.decay == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


@dataclasses.dataclass
class LoggingConfig:
    """Where step metrics go (see ``hyperacc.metrics.MetricsLogger``)."""

    metrics_file: Optional[str] = None
    logging_steps: int = 1
    tensorboard_dir: Optional[str] = None
    progress_bar: bool = True

    def validate(self):
        if self.logging_steps < 1:
            raise ConfigError(f"logging.logging_steps={self.logging_steps} must be >= 1. "
                              "Fix: --logging.logging_steps=1")


@dataclasses.dataclass
class EvalConfig:
    """Evaluation every ``eval_steps`` optimizer steps (0 = never) on ``eval_batches`` batches of
    ``eval_batch_size`` samples per rank (None = ``training.micro_batch_size``)."""

    eval_steps: int = 0
    eval_batches: int = 4
    eval_batch_size: Optional[int] = None

    def validate(self):
        if self.eval_steps < 0:
            raise ConfigError(f"eval.eval_steps={self.eval_steps} must be >= 0 (0 = never).")
        if self.eval_batches < 1:
            raise ConfigError(f"eval.eval_batches={self.eval_batches} must be >= 1.")
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            raise ConfigError(f"eval.eval_batch_size={self.eval_batch_size} must be >= 1.")


@dataclasses.dataclass
class TrainConfig:
    """The configuration of the training example: one section per concern."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    optimizer: Component = dataclasses.field(default_factory=default_optimizer)
    lr_scheduler: LRSchedulerConfig = dataclasses.field(default_factory=LRSchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    fsdp: FSDPConfig = dataclasses.field(default_factory=FSDPConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
