"""A YAML file plus typed ``--section.field=value`` overrides -> a checked config dataclass.

A *schema* is a dataclass whose fields are *sections*: dataclasses, or ``Component`` nodes (a callable
named by ``_target_`` and its keyword arguments). Layers, lowest first: the section defaults (hyperacc's
own already resolved from the launch environment, see ``hyperacc.config``) <- the YAML file <- each flag.
OmegaConf reads YAML (refusing duplicate keys), merges the layers and checks keys and types; this module
adds the command-line grammar, ``_target_`` keywords checked against the callable's signature, and one
``ConfigError`` line per problem naming the key, the value, where it came from and the fix.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import os
import sys
import typing
from typing import Literal, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from hyperacc.config import default_of

__all__ = ["ConfigError", "Component", "parse_config", "build_config", "load_config", "dump_config", "given_keys",
           "save_config", "format_config", "config_help", "config_file"]


from hyperacc.config.components import TARGET, Component, ConfigError, _component, _hint  # noqa: E402,F401 - re-exported


def load_yaml(path) -> dict:
    """A YAML file's mapping of sections (empty file -> {}). Any suffix: the file is read as YAML."""
    name = str(path)
    # A config file without a YAML suffix is still read as one; say so when it does not parse.
    note = "" if name.endswith((".yaml", ".yml")) else " (the positional argument is read as the YAML config file)"
    if os.path.isdir(name):
        raise ConfigError(f"Config file {name!r} is a directory{note}. Fix: pass the path of a YAML file.")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path))
    except FileNotFoundError:
        raise ConfigError(f"Config file {name!r} does not exist{note}. Fix: pass an existing YAML path.") from None
    except (yaml.YAMLError, OmegaConfBaseException, UnicodeDecodeError) as err:
        raise ConfigError(f"Config file {name!r} is not valid YAML{note}: {' '.join(str(err).split())}. Fix: "
                          "correct the file where shown, or pass the intended config file.") from None
    except OSError as err:
        raise ConfigError(f"Config file {name!r} cannot be read: {err.strerror or err}. Fix: pass a readable "
                          "YAML file.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {name!r} must hold a mapping of sections{note}, got {_short(data)}. Fix: "
                          "pass a YAML file of sections, e.g. 'training: {max_steps: 10}'.")
    return data


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def config_file(schema_cls, argv: Sequence[str]) -> Optional[str]:
    """The config file ``argv`` names (its positional argument, whatever its suffix), or None. With
    ``-h``/``--help``: None. A malformed ``argv`` is the ConfigError ``parse_config`` would raise."""
    if "-h" in argv or "--help" in argv:
        return None
    return _parse_argv(schema_cls(), list(argv))[0]


def _type_at(defaults, path: Sequence[str]):
    """The declared type at a dotted path (a component keyword: its default's type), else None."""
    value, tp = defaults, None
    for part in path:
        if isinstance(value, Component):
            return type(getattr(inspect.signature(value.resolve()).parameters.get(part), "default", None))
        if not dataclasses.is_dataclass(value):
            return None
        tp, value = typing.get_type_hints(type(value)).get(part), getattr(value, part, None)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp


def _parse_argv(defaults, argv: Sequence[str]):
    """(YAML path or None, [(flag, {section: {field: value}})]): the command-line grammar."""
    yaml_path, overrides, seen, i = None, [], {}, 0
    while i < len(argv):
        token, i = argv[i], i + 1
        if not token.startswith("--"):
            if token.startswith("-") or ("=" in token and not token.endswith((".yaml", ".yml"))):
                raise ConfigError(f"{token!r} is not an option: did you mean --{token.lstrip('-')}? Fix: see --help.")
            if yaml_path is not None:
                raise ConfigError(f"Unexpected argument {token!r}: the YAML file {yaml_path!r} is already given. "
                                  "Fix: pass one YAML file, then --section.field=value overrides.")
            yaml_path = token
            continue
        name, has_value, text = token[2:].partition("=")
        path = name.split(".")
        if len(path) < 2 or not all(path) or any(char in name for char in "[]\\"):
            raise ConfigError(f"{token}: give a field of the section, e.g. --{path[0]}.<field>=value.")
        if path[-1] == TARGET:
            raise ConfigError(f"{token}: {TARGET} cannot be overridden from the command line. Fix: set it in YAML.")
        if name in seen:
            raise ConfigError(f"--{name} is given twice ({seen[name]!r} and {token!r}). Fix: pass it once.")
        tp = _type_at(defaults, path)
        if not has_value:
            nxt = argv[i] if i < len(argv) else None
            if tp is bool and str(nxt).lower() not in ("true", "false", "yes", "no", "1", "0"):
                text = "true"                          # a bare boolean flag
            elif nxt is None or nxt.startswith("--"):
                raise ConfigError(f"--{name} has no value. Fix: --{name}=VALUE.")
            else:
                text, i = nxt, i + 1
        seen[name] = flag = f"--{name}={text}"
        if text.strip().lower() in ("null", "none", "~", ""):
            text = "null"
        elif tp is str or _names_only(tp):             # a str field takes the text as typed ('off' is not False)
            text = _quoted(text)
        elif (tp is list or typing.get_origin(tp) is list) and not text.lstrip().startswith("["):
            text = "[" + ", ".join(_quoted(part.strip()) for part in text.split(",") if part.strip()) + "]"
        try:
            layer = OmegaConf.from_dotlist([f"{name}={text}"])
        except (yaml.constructor.ConstructorError, OmegaConfBaseException) as err:   # e.g. a key given twice
            raise ConfigError(f"{flag}: {' '.join(str(err).split())}") from None
        except yaml.YAMLError:                         # not YAML: the text itself
            layer = OmegaConf.from_dotlist([f"{name}={_quoted(text)}"])
        overrides.append((flag, OmegaConf.to_container(layer)))
    return yaml_path, overrides


def _names_only(tp) -> bool:
    """A Literal of strings (e.g. ``Literal["sequence", "off"]``): YAML must not read ``off``/``no`` as bools."""
    return typing.get_origin(tp) is Literal and all(isinstance(a, str) for a in typing.get_args(tp))


def _quoted(text: str) -> str:
    """``text`` as a YAML scalar that reads back as exactly that text."""
    return "'" + text.replace("'", "''") + "'"


# ---------------------------------------------------------------------------------------------- layering
def _type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    return str(tp).replace("typing.", "") if typing.get_origin(tp) else getattr(tp, "__name__", str(tp))


def _explain(err: OmegaConfBaseException, defaults) -> str:
    """OmegaConf's error in a line naming the key, the value and the fix."""
    key = str(err.full_key)
    if isinstance(err, (ConfigAttributeError, ConfigKeyError)):      # a key the dataclass does not have
        known = [str(k) for k in err.parent_node.keys()]
        return f"Unknown field {key!r}.{_hint(known, err.key)} Fix: use one of: {', '.join(known)}."
    tp = _type_at(defaults, key.split("."))
    if tp is None:
        return f"{key}={err.value!r}: {str(err.msg).splitlines()[0]}"
    choices = [str(c) for c in typing.get_args(tp)] if typing.get_origin(tp) is Literal else []
    fix = f"--{key}={choices[0]}" if choices else f"e.g. --{key}=<{_type_name(tp)}>"
    return f"{key} must be {_type_name(tp)}, got {err.value!r}.{_hint(choices, err.value)} Fix: {fix}"


def _refuse_nan(value, path, defaults) -> None:
    """One ConfigError at the first NaN anywhere in a section (a field, a component keyword, a value in
    a dict or list): NaN is never a setting. It compares false with everything, so range checks such
    as ``value > 0`` let it through, and a NaN timeout, lr or memory size fails only much later."""
    if isinstance(value, float) and math.isnan(value):
        key, default = ".".join(path), _default_at(defaults, path)
        example = (f"e.g. --{key}={default!r}" if isinstance(default, (int, float)) and not isinstance(default, bool)
                   and math.isfinite(default) else f"--{key}=<a number>" + (" (or null)" if default is None else ""))
        raise ConfigError(f"{key}=nan is not a number. Fix: {example}")
    if isinstance(value, dict):
        for k, v in value.items():
            _refuse_nan(v, [*path, str(k)], defaults)
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, float) and math.isnan(v):
                key = ".".join(path)
                raise ConfigError(f"{key} holds nan, which is not a number. Fix: e.g. "
                                  f"--{key}={dump_config(_default_at(defaults, path))!r}")
            _refuse_nan(v, path, defaults)


def _default_at(defaults, path: Sequence[str]):
    """The default value at a dotted path (a component keyword: configured, else its signature's), or None."""
    value = defaults
    for part in path:
        if isinstance(value, Component):
            if part in value.kwargs:
                value = value.kwargs[part]
                continue
            try:
                value = inspect.signature(value.resolve()).parameters[part].default
            except (ImportError, AttributeError, ValueError, TypeError, KeyError):
                return None
            value = None if value is inspect.Parameter.empty else value
        elif dataclasses.is_dataclass(value):
            value = getattr(value, part, None)
        elif isinstance(value, dict):
            value = value.get(part)
        else:
            return None
    return value


def _check_layer(layer: dict, defaults) -> None:
    """One ConfigError for a value OmegaConf would take wrongly or trip over: an int other than 0/1 for a
    bool (OmegaConf reads ``2`` and ``-1`` as true), a mapping where a list goes or a list where a
    mapping goes (OmegaConf raises a bare TypeError, "Cannot merge incompatible container types")."""
    for section, fields in layer.items():
        for name, value in (fields.items() if isinstance(fields, dict) else ()):
            path = [section, str(name)]
            try:
                tp = _type_at(defaults, path)
            except (ImportError, AttributeError, ValueError, TypeError):
                continue                               # a _target_ that does not resolve: named by _component
            key, origin = ".".join(path), typing.get_origin(tp)
            if tp is bool and isinstance(value, int) and not isinstance(value, bool) and value not in (0, 1):
                raise ConfigError(f"{key} must be bool (true or false), got {value!r}. Fix: --{key}=true or "
                                  f"--{key}=false")
            listy, mapping = tp in (list, tuple) or origin in (list, tuple), tp is dict or origin is dict
            if (listy and isinstance(value, dict)) or (mapping and isinstance(value, (list, tuple))):
                default = dump_config(_default_at(defaults, path))
                example = (str(default).replace(" ", "") if default else "[a,b]" if listy else "{name: value}")
                raise ConfigError(f"{key} must be {'a list' if listy else 'a mapping'}, got {_short(value)}. Fix: "
                                  f"e.g. --{key}={example} (see --help)")


def build_config(schema_cls, data: Optional[dict] = None, *, source: str = "dict", overrides=()):
    """Build ``schema_cls`` from nested data (as read from YAML) and ``(flag, nested data)`` command-line
    overrides, with all checks."""
    defaults, sections = schema_cls(), [f.name for f in dataclasses.fields(schema_cls)]
    components = [name for name in sections if isinstance(getattr(defaults, name), Component)]
    cfg = OmegaConf.create({name: dump_config(getattr(defaults, name)) if name in components
                            else OmegaConf.structured(getattr(defaults, name)) for name in sections})
    built = {}
    for where, layer in [(source, {k: v for k, v in (data or {}).items() if v is not None}), *overrides]:
        try:
            for name, value in layer.items():
                if name not in sections:
                    raise ConfigError(f"Unknown section {name!r}.{_hint(sections, name)} Fix: use one of: "
                                      f"{', '.join(sections)}.")
                if not isinstance(value, dict):
                    raise ConfigError(f"section {name!r} must be a mapping of its fields, got {value!r}.")
                if name in components and value.get(TARGET, cfg[name][TARGET]) != cfg[name][TARGET]:
                    cfg[name] = {}                     # a new _target_ (YAML only) starts from no arguments
            _check_layer(layer, defaults)
            cfg = OmegaConf.merge(cfg, layer)
            built.update({name: _component(OmegaConf.to_container(cfg[name]), name) for name in components})
        except OmegaConfBaseException as err:
            raise ConfigError(f"{where}: {_explain(err, defaults)}") from None
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
    for name in sections:
        try:
            built.setdefault(name, OmegaConf.to_object(cfg[name]))
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{name}: {' '.join(str(err).split())}") from None
    for name, section in built.items():
        _refuse_nan(dump_config(section), [name], defaults)
    config = schema_cls(**built)
    for section in [*built.values(), config]:
        if callable(getattr(section, "validate", None)):
            section.validate()
    return config


def parse_config(schema_cls, yaml_path=None, argv: Optional[Sequence[str]] = None):
    """``[CONFIG.yaml] [--section.field=value | --section.field value | --bool.flag ...]`` -> a checked
    ``schema_cls``. ``yaml_path``: a YAML file read as if given first on the command line (argv may then
    name none). ``--help`` lists every field."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(config_help(schema_cls))
        raise SystemExit(0)
    path, overrides = _parse_argv(schema_cls(), ([] if yaml_path is None else [str(yaml_path)]) + argv)
    return build_config(schema_cls, load_yaml(path) if path else {}, overrides=overrides,
                        source=f"YAML file {path!r}" if path else "defaults")


def given_keys(schema_cls, yaml_path=None, argv: Sequence[str] = ()) -> dict:
    """``{"section.field": layer}`` for every field the YAML file (layer 1) or a flag (layer 2) sets, as
    ``parse_config`` reads the same arguments: what the user asked for, as opposed to defaults and the
    launch environment. A script uses it to refuse an option whose switch is off, unless the switch was
    turned off in a later layer (a flag disabling what the YAML file configures)."""
    path, overrides = _parse_argv(schema_cls(), ([] if yaml_path is None else [str(yaml_path)]) + list(argv))
    layers = [(1, load_yaml(path) if path else {})] + [(2, layer) for _, layer in overrides]
    given = {}
    for index, layer in layers:
        for section, fields in layer.items():
            for name in fields if isinstance(fields, dict) else ():
                given[f"{section}.{name}"] = index
    return given


def load_config(schema_cls, path):
    """A YAML file written by ``save_config`` back into ``schema_cls``."""
    return build_config(schema_cls, load_yaml(path), source=f"YAML file {str(path)!r}")


# ---------------------------------------------------------------------------------------------- output
def dump_config(value):
    """Plain nested data of a config (components as ``{_target_: ..., **kwargs}``)."""
    if isinstance(value, Component):
        return {TARGET: value.target, **dump_config(value.kwargs)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: dump_config(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): dump_config(v) for k, v in value.items()}
    return [dump_config(v) for v in value] if isinstance(value, (list, tuple)) else value


def save_config(cfg, path) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(dump_config(cfg), handle, sort_keys=False)


def format_config(cfg) -> str:
    return f"# {type(cfg).__name__}\n{yaml.safe_dump(dump_config(cfg), sort_keys=False, width=100).rstrip()}"


def config_help(schema_cls) -> str:
    """Every ``--section.field`` flag with its type and default."""
    lines = [f"Options for {schema_cls.__name__} (usage: [CONFIG.yaml] [--section.field=value ...]):"]
    for name, default in vars(schema_cls()).items():
        lines.append(f"\n  {name}:")
        if isinstance(default, Component):
            lines.append(f"    {TARGET} = {default.target}   (set in YAML only)")
            lines += [f"    --{name}.{k}  (default {v!r})" for k, v in dump_config(default.kwargs).items()]
            continue
        hints = typing.get_type_hints(type(default))
        lines += [f"    --{name}.{f.name}  {_type_name(hints[f.name])}  (default {dump_config(default_of(f))!r})"
                  for f in dataclasses.fields(default)]
    return "\n".join(lines)
