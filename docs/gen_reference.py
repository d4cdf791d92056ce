"""Writes the generated reference pages of the documentation from the code itself.

Why generated: a reference copied by hand drifts the day a field, an environment variable or a member
is added. Every list on these pages is read from the objects the library runs with:

- the configuration fields, their defaults and environment variables from the dataclasses
  (`hyperacc.config.settings`: ``dataclasses.fields`` and each field's ``metadata``), the example's
  flag from the section of ``examples/config_schema.py``'s ``TrainConfig`` that holds the class, and the
  ``accelerate launch`` config-file key from accelerate's own launcher source (which variable it exports
  for which option);
- every public member of `hyperacc.Accelerator` from the class (``dir``), sorted into hyperacc's own,
  accelerate's overridden by hyperacc, the unsupported ones (`hyperacc.accelerator.compat.NOT_SUPPORTED`)
  and accelerate's inherited unchanged; the instance attributes from the constructors' source;
- accelerate's constructor keywords from ``inspect.signature(accelerate.Accelerator)``;
- the error catalogue from `hyperacc.errors`.

What is written by hand here is only what code cannot say: one line of meaning per configuration field
and per accelerate keyword, and an example value. ``tests/test_docs.py`` checks that those notes cover
exactly the fields and keywords that exist, and every example flag is parsed by the example's own parser
when the page is generated (a wrong flag fails the build).

Used by ``docs/hooks.py`` (``mkdocs build``/``serve`` add the pages without writing them to ``docs/``) and
runnable alone: ``python docs/gen_reference.py OUT_DIR`` writes them for reading.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _path in (str(REPO), str(REPO / "docs")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import accelerate  # noqa: E402
from reference_notes import FIELD_NOTES, INSTANCE_NOTES, KEYWORD_NOTES  # noqa: E402

import hyperacc  # noqa: E402
from hyperacc import errors  # noqa: E402
from hyperacc.accelerator import checkpointing, compat, facade  # noqa: E402
from hyperacc.config import settings  # noqa: E402
from hyperacc.tools.cli_config import Component  # noqa: E402

CONFIG_CLASSES = (settings.ParallelConfig, settings.FSDPConfig, settings.CheckpointConfig)

# The environment prefix each class's __post_init__ passes to `settings.resolve` for fields that have no
# variable of their own (`resolve(self, prefix=...)`).
ENV_PREFIX = {settings.CheckpointConfig: settings.CHECKPOINT_ENV_PREFIX}

ACCELERATE_DOCS = "https://huggingface.co/docs/accelerate/package_reference/accelerator"

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


# --------------------------------------------------------------------------- Accelerator members
def _owner(name: str):
    """The first class in Accelerator's MRO that defines ``name``."""
    return next(klass for klass in hyperacc.Accelerator.__mro__ if name in vars(klass))


def accelerator_members() -> dict:
    """Every public member of hyperacc.Accelerator, sorted into four groups (each name in exactly one)."""
    groups = {"own": [], "overridden": [], "not_supported": [], "inherited": []}
    for name in sorted(n for n in dir(hyperacc.Accelerator) if not n.startswith("_")):
        owner = _owner(name)
        if name in compat.NOT_SUPPORTED:
            groups["not_supported"].append(name)
        elif owner.__module__.startswith("hyperacc"):
            groups["overridden" if hasattr(accelerate.Accelerator, name) else "own"].append(name)
        else:
            groups["inherited"].append(name)
    return groups


def _self_assignments(source: str) -> set:
    """Public names assigned as ``self.<name> = ...`` (not ``self.<name>.<attr> = ...``) in a piece of source."""
    names = set()
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for sub in target.elts if isinstance(target, ast.Tuple) else [target]:
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self"
                        and not sub.attr.startswith("_")):
                    names.add(sub.attr)
    return names


def instance_attributes() -> dict:
    """{"hyperacc": names hyperacc's constructor sets, "accelerate": names accelerate's sets}, from source."""
    ours = _self_assignments(inspect.getsource(facade.Accelerator.__init__))
    ours |= _self_assignments(inspect.getsource(checkpointing.CheckpointingMixin))
    ours -= set(dir(hyperacc.Accelerator))          # properties with setters are documented as members
    theirs = _self_assignments(inspect.getsource(accelerate.Accelerator)) - ours - set(dir(hyperacc.Accelerator))
    return {"hyperacc": sorted(ours), "accelerate": sorted(theirs)}




def _member_kind(name: str) -> str:
    attr = inspect.getattr_static(hyperacc.Accelerator, name)
    if isinstance(attr, property):
        return "property"
    if isinstance(attr, (staticmethod, classmethod)) or callable(attr):
        return "method"
    return "attribute"


def _signature(name: str) -> str:
    """``(a, b=1, *args)``: parameter names and defaults, no annotations (a table cell, not the API page)."""
    try:
        signature = inspect.signature(getattr(hyperacc.Accelerator, name))
    except (TypeError, ValueError):
        return ""
    params = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values() if p.name != "self"]
    return str(signature.replace(parameters=params, return_annotation=inspect.Signature.empty))


def accelerator_page() -> str:
    groups, attrs = accelerator_members(), instance_attributes()
    total = sum(len(v) for v in groups.values())
    out = ["# Accelerator members", "",
           "<!-- generated by docs/gen_reference.py from hyperacc.Accelerator: do not edit -->", "",
           f"`hyperacc.Accelerator` is a subclass of `accelerate.Accelerator` (accelerate {accelerate.__version__} "
           f"here). Its {total} public members, generated from the class: hyperacc's own "
           f"({len(groups['own'])}), accelerate's with hyperacc's implementation ({len(groups['overridden'])}), "
           f"accelerate's that raise `NotImplementedError` ({len(groups['not_supported'])}) and accelerate's "
           f"inherited unchanged ({len(groups['inherited'])}). The full docstrings of hyperacc's members are "
           "[below](#docstrings).", ""]

    def table(names, doc_of):
        rows = ["| member | kind | what |", "|---|---|---|"]
        for name in names:
            kind = _member_kind(name)
            rows.append(f"| `{name}{_signature(name) if kind == 'method' else ''}` | {kind} | "
                        f"{_cell(_first_paragraph(doc_of(name)))} |")
        return rows

    def hyperacc_doc(name):
        """hyperacc's docstring, else accelerate's (an override that keeps accelerate's meaning)."""
        owner = _owner(name)
        own = vars(owner)[name] if owner.__module__.startswith("hyperacc") else None
        own = getattr(own, "__func__", own)                  # staticmethod -> its function
        if own is not None and own.__doc__:                  # its own docstring, not one inherited from accelerate
            return inspect.cleandoc(own.__doc__)
        doc = inspect.getdoc(getattr(accelerate.Accelerator, name, None)) or ""
        return "accelerate's: " + _hf_links(doc) if doc else ""

    out += ["## hyperacc's own", ""] + table(groups["own"], hyperacc_doc) + [""]
    out += ["## accelerate's, implemented by hyperacc", "",
            "Same name and arguments as accelerate's; what differs is said in the [guide for accelerate "
            "users](../guides/from-accelerate.md).", ""] + table(groups["overridden"], hyperacc_doc) + [""]
    out += ["## Not supported", "", "Each raises `NotImplementedError` naming the member and why "
            "(`hyperacc.accelerator.NOT_SUPPORTED`).", "", "| member | why |", "|---|---|"]
    out += [f"| `{name}` | {_cell(compat.NOT_SUPPORTED[name])} |" for name in groups["not_supported"]] + [""]
    out += ["## accelerate's, inherited unchanged", "",
            f"Their meaning is accelerate's: see [accelerate's reference]({ACCELERATE_DOCS}).", "",
            "| member | kind | accelerate's summary |", "|---|---|---|"]
    for name in groups["inherited"]:
        doc = _first_paragraph(inspect.getdoc(getattr(accelerate.Accelerator, name, None)) or "")
        doc = _hf_links(doc)
        out.append(f"| [`{name}`]({ACCELERATE_DOCS}#accelerate.Accelerator.{name}) | {_member_kind(name)} | "
                   f"{_cell(doc)} |")
    out += ["", "## Instance attributes", "",
            "Set by the constructor (read them; the configs are resolved copies, so changing them after "
            "construction changes nothing).", "", "| attribute | what |", "|---|---|"]
    out += [f"| `{name}` | {_cell(INSTANCE_NOTES.get(name, ''))} |" for name in attrs["hyperacc"]]
    out += ["", "accelerate's own instance attributes keep their meaning: "
            + ", ".join(f"`{name}`" for name in attrs["accelerate"]) + ".", "",
            "## Docstrings", "",
            "::: hyperacc.accelerator.facade.Accelerator", "    options:", "      show_root_heading: false",
            "      show_root_toc_entry: false", "      show_bases: true", "",
            "::: hyperacc.accelerator.checkpointing.CheckpointingMixin", "    options:",
            "      show_root_heading: true", "", "::: hyperacc.accelerator.facade.prepare", "    options:",
            "      show_root_heading: true", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------- accelerate keyword mapping
def accelerate_keywords() -> list:
    return [name for name in inspect.signature(accelerate.Accelerator.__init__).parameters if name != "self"]


def accelerate_page() -> str:
    ours = inspect.signature(hyperacc.Accelerator.__init__).parameters
    out = ["# accelerate keyword mapping", "",
           "<!-- generated by docs/gen_reference.py from accelerate.Accelerator's signature and "
           "hyperacc/accelerator/compat.py: do not edit -->", "",
           f"Every keyword of `accelerate.Accelerator` (accelerate {accelerate.__version__}) and what "
           "`hyperacc.Accelerator` does with it. An accelerate script runs unchanged but for its import line; "
           "the translation is `hyperacc.accelerator.compat`.", "",
           "| accelerate keyword | accepted | what hyperacc does |", "|---|---|---|"]
    for name in accelerate_keywords():
        accepted = "yes" if name in ours else "**no**"
        out.append(f"| `{name}` | {accepted} | {_cell(KEYWORD_NOTES.get(name, '(no note)'))} |")
    own = [name for name in ours if name != "self" and name not in accelerate_keywords()]
    out += ["", "## hyperacc's own keywords", "",
            "Keyword-only; they win over accelerate's equivalents: " + ", ".join(f"`{n}`" for n in own) + ".", "",
            "## From the `accelerate launch` environment", "",
            "Unset fields come from the variables `accelerate launch` exports for its config file "
            "(`FSDP_*`, `PARALLELISM_CONFIG_*`, `ACCELERATE_MIXED_PRECISION`, `ACCELERATE_DYNAMO_*`) and from "
            "hyperacc's own `HYPERACC_*` variables:", "",
            "| environment variable | accelerate config file | hyperacc field |", "|---|---|---|"]
    for d in config_fields():
        if d.env:
            key = f"`{d.accelerate_key}`" if d.accelerate_key else "(environment only)"
            out.append(f"| `{d.env}` | {key} | `{d.cls}.{d.name}` |")
    out += ["", "`gradient_accumulation_steps` also comes from `ACCELERATE_GRADIENT_ACCUMULATION_STEPS`, as in "
            "accelerate. accelerate's own switches `ACCELERATE_USE_FSDP`, `ACCELERATE_USE_PARALLELISM_CONFIG`, "
            "`ACCELERATE_USE_DEEPSPEED` and `ACCELERATE_USE_MEGATRON_LM` are hidden from accelerate's constructor "
            "(hyperacc reads their settings itself); DeepSpeed and Megatron-LM are refused.", "",
            "## Members that raise", "",
            "| member | why |", "|---|---|"]
    out += [f"| `{name}` | {_cell(why)} |" for name, why in compat.NOT_SUPPORTED.items()]
    out += ["", "## Ready-made config files", "",
            "`accelerate launch --config_file accelerate_configs/<file>`; each file's own header comment:", "",
            "| file | machines | processes (all machines) | what |", "|---|---|---|---|"]
    out += [f"| `{name}` | {machines} | {procs} | {_cell(what)} |" for name, machines, procs, what in launch_configs()]
    out += ["", "::: hyperacc.accelerator.compat", "    options:", "      show_root_heading: true",
            "      members: [fsdp_config_from_plugin, parallel_config_from_accelerate, resolve_configs, "
            "refuse_unsupported_plugins]", ""]
    return "\n".join(out)


def launch_configs() -> list:
    """(file, machines, processes, the header comment's first sentence) for every accelerate_configs/*.yaml."""
    import yaml

    rows = []
    for path in sorted((REPO / "accelerate_configs").glob("*.yaml")):
        text = path.read_text()
        header = []
        for line in text.splitlines():
            if not line.startswith("#"):
                break
            header.append(line.lstrip("# ").strip())
        data = yaml.safe_load(text) or {}
        what = " ".join(header).split(". ")[0].rstrip(".") + "." if header else ""
        rows.append((path.name, data.get("num_machines", 1), data.get("num_processes", 1), what))
    return rows


# --------------------------------------------------------------------------- errors
def error_classes() -> list:
    """(class, the module that raises it) for every exception class in hyperacc.errors, in source order."""
    source = inspect.getsource(errors)
    found, module = [], None
    for line in source.splitlines():
        comment = re.match(r"# -{5,} (hyperacc[\w.]*)", line)
        if comment:
            module = comment.group(1)
        klass = re.match(r"class (\w+)\(", line)
        if klass and isinstance(getattr(errors, klass.group(1), None), type):
            found.append((getattr(errors, klass.group(1)), module))
    return found


def errors_page() -> str:
    out = ["# Error catalogue", "",
           "<!-- generated by docs/gen_reference.py from hyperacc/errors.py: do not edit -->", "",
           _first_paragraph(errors.__doc__), "",
           "Every class is importable from `hyperacc.errors`. *Every rank* marks the errors that a decision "
           "taken on rank 0 re-raises as the same class on every rank, so each rank can catch it by type.", "",
           "| error | base | raised by | every rank | what it means |", "|---|---|---|---|---|"]
    for klass, module in error_classes():
        base = klass.__bases__[0].__name__
        forwarded = "yes" if klass.__name__ in errors._FORWARDED else ""
        out.append(f"| `{klass.__name__}` | `{base}` | `{module}` | {forwarded} | "
                   f"{_cell(_first_paragraph(klass.__doc__))} |")
    out += ["", "Besides these, hyperacc raises the builtin classes where they say it all (`ValueError` for a bad "
            "argument, `FileNotFoundError` for a missing checkpoint, `NotImplementedError` for an accelerate "
            "feature it does not support); every message names the problem and a fix that works where you are. "
            "What is refused, when, and with which error: [Guarantees](../guarantees.md#fails-closed).", ""]
    return "\n".join(out)


PAGES = {
    "reference/config.md": config_page,
    "reference/accelerator.md": accelerator_page,
    "reference/accelerate.md": accelerate_page,
    "reference/errors.md": errors_page,
    "reference/example-flags.md": example_page,
}


def generate() -> dict:
    """{docs path: markdown} for every generated page."""
    return {path: make() for path, make in PAGES.items()}


if __name__ == "__main__":
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "site-reference")
    for rel, text in generate().items():
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (out_dir / rel).write_text(text)
        print(out_dir / rel)
