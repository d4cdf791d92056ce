"""A YAML file plus typed ``--section.field=value`` overrides -> a checked config dataclass.

A *schema* is a dataclass whose fields are *sections*: dataclasses, or ``Component`` nodes (a
callable named by ``_target_`` with its keyword arguments). Layers, lowest first: the section's
defaults (for hyperacc's own sections already resolved from the launch environment, see
``hyperacc.config``) <- the YAML file <- the command line. Merging, type conversion and key
checks are OmegaConf's (structured configs); this module adds what OmegaConf leaves to its user:
the command-line grammar, ``_target_`` components checked against the callable's signature, and
one ``ConfigError`` line per problem naming the key, the value, where it came from and the fix.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import sys
import typing
from typing import List, Literal, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hyperacc.config import default_of

__all__ = ["ConfigError", "Component", "parse_config", "build_config", "load_config", "dump_config",
           "save_config", "format_config", "config_help"]
TARGET = "_target_"
_NULL = ("null", "none", "~", "")


class ConfigError(ValueError):
    """A configuration problem found while parsing (before any training work starts)."""


def _hint(names, name: str) -> str:
    close = difflib.get_close_matches(str(name), [str(n) for n in names], n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


class Component:
    """``_target_`` (a dotted import path) plus configured keyword arguments; ``build(*args, **kw)``
    calls the target with them (runtime keywords win). Arguments read as ``comp.lr``/``comp["lr"]``."""

    def __init__(self, target: str, kwargs: Optional[dict] = None):
        self.__dict__.update(target=target, kwargs=dict(kwargs or {}))

    def resolve(self):
        module, _, name = self.target.rpartition(".")
        return getattr(importlib.import_module(module), name)

    def build(self, *args, **runtime_kwargs):
        return self.resolve()(*args, **{**self.kwargs, **runtime_kwargs})

    def __getattr__(self, name):
        try:
            return self.__dict__["kwargs"][name]
        except KeyError:
            raise AttributeError(f"Component {self.target!r} has no configured argument {name!r}") from None

    def __getitem__(self, key):
        return self.kwargs[key]

    def get(self, key, default=None):
        return self.kwargs.get(key, default)

    def __eq__(self, other):
        return isinstance(other, Component) and _plain(self) == _plain(other)

    def __repr__(self):
        return f"Component({self.target}, {self.kwargs})"


def _component(data: dict, where: str, shown) -> Component:
    """Import ``_target_`` and check (and convert) each keyword against its signature, now."""
    target = data.get(TARGET)
    try:
        params = inspect.signature(Component(target).resolve()).parameters
    except (ImportError, AttributeError, ValueError, TypeError) as err:
        raise ConfigError(f"{where}.{TARGET}={target!r} cannot be imported or inspected ({err}). Fix: give a dotted "
                          "import path of a callable, e.g. 'torch.optim.AdamW'.") from None
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    open_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = {}
    for name, value in data.items():
        key, default = f"{where}.{name}", getattr(params.get(name), "default", None)
        if name == TARGET:
            continue
        if name not in named and not open_kwargs:
            raise ConfigError(f"{shown(key, value)}: {target} takes no argument {name!r}.{_hint(named, name)} "
                              f"Fix: remove it or use one of: {', '.join(named)}.")
        if isinstance(default, tuple):
            if not isinstance(value, (list, tuple)) or len(value) != len(default):
                raise ConfigError(f"{shown(key, value)}: {key} must be a list of {len(default)} values like "
                                  f"{list(default)}. Fix: e.g. --{key}=[{','.join(map(str, default))}]")
            value = tuple(value)
        elif type(default) in (bool, int, float, str):
            value = _scalar(value, default)
            if value is _BAD:
                raise ConfigError(f"{shown(key, data[name])}: {key} must be {type(default).__name__}, got "
                                  f"{data[name]!r}. Fix: e.g. --{key}={default!r}")
        kwargs[name] = value
    return Component(target, kwargs)


_BAD = object()


def _scalar(value, default):
    """``value`` as the type of a keyword's default, else _BAD. An int default takes a float too
    (SGD's momentum=0 -> 0.9), and a float one takes text (YAML 1.1 reads 1e-4 as a string)."""
    kind = type(default)
    if isinstance(value, bool) != (kind is bool):
        return _BAD
    if kind in (bool, str) or (kind is int and isinstance(value, int)):
        return value if isinstance(value, kind) else _BAD
    try:
        return float(value)
    except (TypeError, ValueError):
        return _BAD


# ---------------------------------------------------------------------------------------------- input
class _UniqueKeyLoader(yaml.SafeLoader):
    """Refuses a key given twice in one mapping (PyYAML would silently keep the last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = key_node.value
            if key in seen:
                raise ConfigError(f"duplicate key {key!r} (first given on line {seen[key]}) again on line "
                                  f"{key_node.start_mark.line + 1}; one would silently win. Fix: keep one.")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_yaml(path) -> dict:
    """A YAML file's mapping of sections (empty file -> {})."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.load(handle, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except FileNotFoundError:
        raise ConfigError(f"Config file {str(path)!r} does not exist. Fix: pass an existing YAML path.") from None
    except ConfigError as err:
        raise ConfigError(f"Config file {str(path)!r}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"Config file {str(path)!r} is not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(data, (dict, type(None))):
        raise ConfigError(f"Config file {str(path)!r} must hold a mapping of sections, got {type(data).__name__}.")
    return data or {}


def _type_at(schema_cls, path: List[str]):
    """The declared type at a dotted path (a component keyword: its default's type), else None."""
    tp, value = schema_cls, None
    for part in path:
        if isinstance(value, Component):
            default = getattr(inspect.signature(value.resolve()).parameters.get(part), "default", None)
            return type(default) if isinstance(default, (bool, int, float, str)) else None
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            return None
        field = next((f for f in dataclasses.fields(tp) if f.name == part), None)
        if field is None:
            return None
        tp = typing.get_type_hints(tp).get(part, field.type)
        value = field.default_factory() if field.default_factory is not dataclasses.MISSING else None
        tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp) if typing.get_origin(tp) is \
            typing.Union else tp
    return tp


def _cli_value(text: str, tp):
    """A command-line value: its exact text for a str field, else read as YAML (u,v -> a list)."""
    if text.strip().lower() in _NULL:
        return None
    if tp is str:
        return text
    if (tp is list or typing.get_origin(tp) is list) and not text.lstrip().startswith("["):
        return [part.strip() for part in text.split(",") if part.strip()]
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506
    except ConfigError as err:
        raise ConfigError(f"{text!r}: {err}") from None
    except yaml.YAMLError:
        return text


def _parse_argv(schema_cls, argv: Sequence[str]):
    """(YAML path or None, [(dotted key, value, flag)]): the command-line grammar."""
    sections = [f.name for f in dataclasses.fields(schema_cls)]
    yaml_path, overrides, seen, i = None, [], {}, 0
    while i < len(argv):
        token, i = argv[i], i + 1
        if not token.startswith("--"):
            if token.startswith("-") or ("=" in token and not token.endswith((".yaml", ".yml"))):
                raise ConfigError(f"{token!r} is not an option: did you mean --{token.lstrip('-')}? "
                                  "Fix: write overrides as --section.field=value (see --help).")
            if yaml_path is not None:
                raise ConfigError(f"Unexpected argument {token!r}: a YAML config file ({yaml_path!r}) was already "
                                  "given. Fix: pass one YAML file (first) and --section.field=value overrides.")
            yaml_path = token
            continue
        name, has_value, text = token[2:].partition("=")
        path = name.split(".")
        if path[0] not in sections:
            raise ConfigError(f"Unknown section {path[0]!r} in {token!r}.{_hint(sections, path[0])} Fix: use "
                              f"--section.field=value with a section among: {', '.join(sections)}.")
        if len(path) < 2 or not all(path):
            raise ConfigError(f"{token}: give a field of the section, e.g. --{path[0]}.<field>=value.")
        if name in seen:
            raise ConfigError(f"--{name} is given twice ({seen[name]!r} and {token!r}); one would silently win. "
                              f"Fix: pass --{name} once.")
        tp = _type_at(schema_cls, path)
        if not has_value:
            nxt = argv[i] if i < len(argv) else None
            if tp is bool and (nxt is None or nxt.lower() not in ("true", "false", "yes", "no", "1", "0")):
                text = "true"                          # a bare boolean flag
            elif nxt is None or nxt.startswith("--"):
                raise ConfigError(f"--{name} has no value. Fix: --{name}=VALUE.")
            else:
                text, i = nxt, i + 1
            token = f"--{name}={text}"
        seen[name] = token
        if path[-1] == TARGET:
            raise ConfigError(f"{token}: {TARGET} cannot be overridden from the command line. Fix: set it under "
                              f"'{path[0]}' in the YAML config file (its arguments are then checked against it).")
        overrides.append((name, _cli_value(text, tp), token))
    return yaml_path, overrides


# ---------------------------------------------------------------------------------------------- layering
def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(repr, args))
    if typing.get_origin(tp) is typing.Union:
        return " or ".join(map(_type_name, args)) + " or null"
    return getattr(typing.get_origin(tp) or tp, "__name__", str(tp))


def _explain(err: OmegaConfBaseException, schema_cls, section: str, shown, value) -> ConfigError:
    key = f"{section}.{err.full_key}"
    if isinstance(err.parent_node, dict) or hasattr(err.parent_node, "keys"):
        known = [str(k) for k in err.parent_node.keys()]
        if err.key is not None and str(err.key) not in known:
            return ConfigError(f"Unknown field {key!r}.{_hint(known, err.key)} Fix: use one of: {', '.join(known)}.")
    tp = _type_at(schema_cls, key.split("."))
    choices = [str(c) for c in typing.get_args(tp)] if typing.get_origin(tp) is Literal else []
    fix = f"--{key}={choices[0]}" if choices else f"e.g. --{key}=<{_type_name(tp)}>"
    return ConfigError(f"{shown(key, value)}: {key} must be {_type_name(tp)}, got {value!r}."
                       f"{_hint(choices, value) if choices else ''} Fix: {fix}")


def _nested(key: str, value) -> dict:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _lookup(data, key: str):
    for part in key.split("."):
        data = data.get(part) if isinstance(data, dict) else data
    return data


def build_config(schema_cls, data: Optional[dict] = None, *, source: str = "dict", overrides=()):
    """Build ``schema_cls`` from nested data (as read from YAML) and CLI overrides, with all checks."""
    data, flags = dict(data or {}), {key: flag for key, _, flag in overrides}
    sections = {f.name: f for f in dataclasses.fields(schema_cls)}
    for name in data:
        if name not in sections:
            raise ConfigError(f"Unknown section {name!r} in the {source}.{_hint(sections, name)} "
                              f"Fix: use one of: {', '.join(sections)}.")

    def shown(key, value):
        flag = next((f for k, f in flags.items() if k == key or key.startswith(k + ".") or k.startswith(key + ".")),
                    None)
        return flag or f"{key}={value!r} (from {source})"

    defaults, built = schema_cls(), {}
    for name in sections:
        default, given = getattr(defaults, name), data.get(name)
        layers = [("yaml", given)] if given is not None else []
        layers += [(k, v) for k, v, _ in overrides if k.split(".")[0] == name]
        if isinstance(default, Component):
            if given is not None and not isinstance(given, dict):
                raise ConfigError(f"{name} must be a mapping with {TARGET!r} and keyword arguments, got {given!r}. "
                                  f"Fix: in YAML write '{name}: {{{TARGET}: package.module.Callable, arg: value}}'.")
            replaced = given is not None and given.get(TARGET, default.target) != default.target
            node = {} if replaced else _plain(default)     # a new target starts from no arguments
            for key, value in layers:
                node = OmegaConf.to_container(OmegaConf.merge(node, value if key == "yaml" else _nested(key, value)[name]))
            built[name] = _component(node, name, shown)
            continue
        node = OmegaConf.structured(default)
        for key, value in layers:
            try:
                node = OmegaConf.merge(node, value if key == "yaml" else _nested(key, value)[name])
            except OmegaConfBaseException as err:
                full = f"{name}.{err.full_key}"
                raise _explain(err, schema_cls, name, shown, _lookup({name: value} if key == "yaml" else
                                                                     _nested(key, value), full)) from None
        try:
            built[name] = OmegaConf.to_object(node)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{name}: {' '.join(str(err).split())}") from None
    cfg = schema_cls(**built)
    for section in [*built.values(), cfg]:
        if callable(getattr(section, "validate", None)):
            section.validate()
    return cfg


def parse_config(schema_cls, yaml_path=None, argv: Optional[Sequence[str]] = None):
    """``[CONFIG.yaml] [--section.field=value | --section.field value | --bool.flag ...]`` -> a
    checked ``schema_cls``; ``yaml_path`` is used when argv names none. ``--help`` lists every field."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(config_help(schema_cls))
        raise SystemExit(0)
    cli_yaml, overrides = _parse_argv(schema_cls, argv)
    if cli_yaml is not None and yaml_path is not None:
        raise ConfigError(f"Two YAML files given: {str(yaml_path)!r} and {cli_yaml!r}. Fix: pass one."
                          if cli_yaml.endswith((".yaml", ".yml")) else f"Unexpected argument {cli_yaml!r}: expected "
                          "--section.field=value options (and at most one CONFIG.yaml, first). Fix: remove it.")
    path = cli_yaml or yaml_path
    data = load_yaml(path) if path is not None else {}
    return build_config(schema_cls, data, source=f"YAML file {str(path)!r}" if path else "defaults",
                        overrides=overrides)


def load_config(schema_cls, path):
    """A YAML file written by ``save_config`` back into ``schema_cls``."""
    return build_config(schema_cls, load_yaml(path), source=f"YAML file {str(path)!r}")


# ---------------------------------------------------------------------------------------------- output
def _plain(value):
    if isinstance(value, Component):
        return {TARGET: value.target, **_plain(value.kwargs)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def dump_config(cfg) -> dict:
    """Plain nested data of a config (components as ``{_target_: ..., **kwargs}``)."""
    return _plain(cfg)


def save_config(cfg, path) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(dump_config(cfg), handle, sort_keys=False)


def format_config(cfg) -> str:
    text = yaml.safe_dump(dump_config(cfg), sort_keys=False, width=100)
    return f"# {type(cfg).__name__}\n{text.rstrip()}"


def config_help(schema_cls) -> str:
    """Every ``--section.field`` flag with its type and default."""
    lines = [f"Options for {schema_cls.__name__} (usage: [CONFIG.yaml] [--section.field=value ...]):"]
    for name, default in vars(schema_cls()).items():
        lines.append(f"\n  {name}:")
        if isinstance(default, Component):
            lines.append(f"    {TARGET} = {default.target}   (set in YAML only)")
            lines += [f"    --{name}.{k}  (default {v!r})" for k, v in _plain(default.kwargs).items()]
            continue
        hints = typing.get_type_hints(type(default))
        lines += [f"    --{name}.{f.name}  {_type_name(hints[f.name])}  (default {_plain(default_of(f))!r})"
                  for f in dataclasses.fields(default)]
    return "\n".join(lines)

