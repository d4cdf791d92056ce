"""The configuration half of the generated reference: fields of hyperacc's configs and the example's flags.

Read from the dataclasses (`hyperacc.config.settings`: ``dataclasses.fields`` and each field's ``metadata``),
the example's schema (``examples/config_schema.py``) and accelerate's launcher source (which variable it
exports for which config-file option). Used by ``docs/gen_reference.py``, which assembles the pages.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _path in (str(REPO), str(REPO / "docs")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from reference_notes import FIELD_NOTES  # noqa: E402

from hyperacc.config import settings  # noqa: E402
from hyperacc.tools.cli_config import Component  # noqa: E402

CONFIG_CLASSES = (settings.ParallelConfig, settings.FSDPConfig, settings.CheckpointConfig)

# The environment prefix each class's __post_init__ passes to `settings.resolve` for fields that have no
# variable of their own (`resolve(self, prefix=...)`).
ENV_PREFIX = {settings.CheckpointConfig: settings.CHECKPOINT_ENV_PREFIX}


# --------------------------------------------------------------------------- small helpers
def _first_paragraph(doc: str | None) -> str:
    """The first paragraph of a docstring, joined into one line (a table cell)."""
    if not doc:
        return ""
    paragraph = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _inner_type(annotation) -> str:
    """``Optional[List[str]]`` -> ``List[str]``: every field is Optional only because None means 'unset'."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    match = re.fullmatch(r"Optional\[(.*)\]", text)
    return match.group(1) if match else text


def _python_value(example: str, type_text: str) -> str:
    if type_text == "bool":
        return "True" if example == "true" else "False"
    if type_text in ("int", "float"):
        return example
    if type_text.startswith("List"):
        return repr([name.strip() for name in example.split(",")])
    return repr(example)


def _hf_links(doc: str) -> str:
    """accelerate's docstrings link with HF doc-builder's ``[`~utils.Name`]``: shown as code here."""
    return re.sub(r"\[`?~?([\w.]+)`?\]", r"`\1`", doc)


def _default_text(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


# --------------------------------------------------------------------------- configuration fields
def train_config():
    """The example's schema, ``examples/config_schema.py``'s TrainConfig (loaded by path: examples/ is no package)."""
    module = sys.modules.get("config_schema")
    if module is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location("config_schema", REPO / "examples" / "config_schema.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["config_schema"] = module
        spec.loader.exec_module(module)
    return module.TrainConfig


def example_sections() -> dict:
    """{config class: the section of the example's TrainConfig that holds it} (examples/config_schema.py)."""
    TrainConfig = train_config()
    hints = typing.get_type_hints(TrainConfig)
    return {hints[f.name]: f.name for f in dataclasses.fields(TrainConfig) if hints[f.name] in CONFIG_CLASSES}


def environment_variable(cls, field: dataclasses.Field) -> str | None:
    """The variable `settings.resolve` reads for ``field``: its own, else the class's prefix + NAME."""
    if field.metadata.get("env"):
        return field.metadata["env"]
    prefix = ENV_PREFIX.get(cls)
    return prefix + field.name.upper() if prefix else None


def accelerate_config_keys() -> dict:
    """{environment variable: accelerate config-file key} read from accelerate's launcher, which exports
    ``current_env["VAR"] = ... args.<option> ...`` for every option of a config file."""
    from accelerate.utils import launch

    source = inspect.getsource(launch)
    keys = {}
    for var, prefix_var, option in re.findall(
            r'current_env\[(?:"(\w+)"|prefix \+ "(\w+)")\]\s*=\s*[^\n]*?\bargs\.(\w+)', source):
        name = var or "PARALLELISM_CONFIG_" + prefix_var
        section = next((s for p, s in (("fsdp_", "fsdp_config"), ("parallelism_config_", "parallelism_config"),
                                       ("dynamo_", "dynamo_config")) if option.startswith(p)), None)
        keys.setdefault(name, f"{section}.{option}" if section else option)
    if "ACCELERATE_MIXED_PRECISION" in source:
        keys.setdefault("ACCELERATE_MIXED_PRECISION", "mixed_precision")
    if "ACCELERATE_DYNAMO_BACKEND" in source:     # exported from the parsed enum, not from args directly
        keys.setdefault("ACCELERATE_DYNAMO_BACKEND", "dynamo_config.dynamo_backend")
    return keys


@dataclasses.dataclass
class FieldDoc:
    cls: str
    name: str
    type: str
    default: str
    env: str | None
    accelerate_key: str | None
    flag: str
    python: str
    meaning: str


def config_fields() -> list:
    """One FieldDoc per field of the three configuration classes, in declaration order."""
    sections, accel_keys, docs = example_sections(), accelerate_config_keys(), []
    for cls in CONFIG_CLASSES:
        notes = FIELD_NOTES[cls.__name__]
        for field in dataclasses.fields(cls):
            example, meaning = notes.get(field.name, ("", "(no note: add one to docs/gen_reference.py)"))
            type_text = _inner_type(field.type)
            env = environment_variable(cls, field)
            docs.append(FieldDoc(cls=cls.__name__, name=field.name, type=type_text,
                                 default=_default_text(settings.default_of(field)), env=env,
                                 accelerate_key=accel_keys.get(env) if env else None,
                                 flag=f"--{sections[cls]}.{field.name}={example}",
                                 python=f"{cls.__name__}({field.name}={_python_value(example, type_text)})",
                                 meaning=meaning))
    return docs


def check_flags(docs) -> None:
    """Every example flag parses with the example's own parser (examples/config_schema.py's TrainConfig)."""
    from hyperacc.tools.cli_config import parse_config

    for doc in docs:
        try:
            parse_config(train_config(), argv=[doc.flag])
        except Exception as err:       # noqa: BLE001 - re-raised with the flag that failed
            raise ValueError(f"docs/gen_reference.py: the example flag {doc.flag} does not parse: {err}") from err


def config_page() -> str:
    docs = config_fields()
    check_flags(docs)
    out = ["# Configuration fields", "",
           "<!-- generated by docs/gen_reference.py from hyperacc/config/settings.py and "
           "examples/config_schema.py: do not edit -->", "",
           "Every field of `hyperacc.ParallelConfig`, `FSDPConfig` and `CheckpointConfig`, generated from the "
           "dataclasses. Each field is *unset* (`None`) until the config is built; then it takes, lowest first: "
           "its default ← its environment variable (what `accelerate launch` exports for its config file) ← "
           "an explicit value (a Python argument, or YAML/`--section.field` flags through "
           "`hyperacc.tools.cli_config`). Explicit beats the environment field by field.", "",
           "Each row gives the same setting three ways: the example's flag (`examples/train_qwen.py`), the "
           "Python argument, and the environment variable (booleans: `true`/`false`, lists: comma-separated).", ""]
    for cls in CONFIG_CLASSES:
        rows = [d for d in docs if d.cls == cls.__name__]
        out += [f"## {cls.__name__}", "", _first_paragraph(cls.__doc__), "",
                "| field | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{d.name}` | `{_cell(d.type)}` | `{_cell(d.default)}` | {_cell(d.meaning)} |" for d in rows]
        out += ["", f"Setting a `{cls.__name__}` field, e.g.:", "",
                "| field | example flag | Python | environment variable | accelerate config file |",
                "|---|---|---|---|---|"]
        for d in rows:
            env = f"`{d.env}`" if d.env else "—"
            key = f"`{d.accelerate_key}`" if d.accelerate_key else "—"
            out.append(f"| `{d.name}` | `{_cell(d.flag)}` | `{_cell(d.python)}` | {env} | {key} |")
        out.append("")
    out += ["## Where each value comes from", "",
            "One resolver, `hyperacc.config.resolve`, fills every unset field when the config is built: "
            "a value given in Python, YAML or on the command line is never `None`, so it wins over the "
            "environment by construction. `CheckpointConfig` also records which fields were *given* (an "
            "argument or its variable): the defaults alone never make a loop save (see "
            "[Checkpoints](../guides/checkpoints.md#when-it-saves-checkpointconfig)).", ""]
    return "\n".join(out)


def _flag_default(value) -> str:
    if isinstance(value, bool) or value is None:
        return "null" if value is None else str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) if value else "[]"
    return "{}" if value == {} else str(value)


def example_page() -> str:
    """Every flag of examples/train_qwen.py: one table per TrainConfig section, from the dataclasses."""
    schema = train_config()
    hints = typing.get_type_hints(schema)
    out = ["# The example's flags", "",
           "<!-- generated by docs/gen_reference.py from examples/config_schema.py: do not edit -->", "",
           "Every `--section.field=value` flag of `examples/train_qwen.py`, generated from its schema "
           "(`examples/config_schema.py`'s `TrainConfig`); the same keys go in its YAML file. How values are "
           "parsed and checked: [YAML and command-line configuration](../guides/config-cli.md). "
           "`python examples/train_qwen.py --help` prints the same list.", ""]
    for section in dataclasses.fields(schema):
        cls = hints[section.name]
        out += [f"## `{section.name}`", ""]
        if cls in CONFIG_CLASSES:
            anchor = cls.__name__.lower()
            out += [f"`hyperacc.{cls.__name__}`: every field with its environment variable and meaning is in the "
                    f"[configuration reference](config.md#{anchor}).", ""]
        default = section.default_factory()
        if isinstance(default, Component):             # a callable and its keyword arguments
            out += [f"A component: `_target_` (a dotted import path, changed in the YAML file only) and its keyword "
                    f"arguments. Default: `_target_: {default.target}` with "
                    + ", ".join(f"`{k}: {_flag_default(v)}`" for k, v in default.kwargs.items()) + ".", ""]
            continue
        if cls not in CONFIG_CLASSES:
            out += [inspect.cleandoc(cls.__doc__ or ""), ""]
        out += ["| flag | type | default |", "|---|---|---|"]
        for field in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[field.name]
            type_text = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
            value = _default_text(settings.default_of(field)) if cls in CONFIG_CLASSES else _flag_default(
                getattr(default, field.name))
            out.append(f"| `--{section.name}.{field.name}` | `{_cell(type_text)}` | `{_cell(value)}` |")
        out.append("")
    return "\n".join(out)
