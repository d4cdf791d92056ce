"""Writes the generated reference pages of the documentation from the code itself.

Why generated: a reference copied by hand drifts the day a field, an environment variable or a member
is added. Every list on these pages is read from the objects the library runs with:

- (``docs/gen_config.py``) the configuration fields, their defaults and environment variables from the dataclasses
  (`hyperacc.config.settings`: ``dataclasses.fields`` and each field's ``metadata``), the example's
  flag from the section of ``examples/config_schema.py``'s ``TrainConfig`` that holds the class, and the
  ``accelerate launch`` config-file key from accelerate's own launcher source (which variable it exports
  for which option); every flag of the example from its schema;
- every public member of `hyperacc.Accelerator` from the class (``dir``), sorted into hyperacc's own,
  accelerate's overridden by hyperacc, the unsupported ones (`hyperacc.accelerator.compat.NOT_SUPPORTED`)
  and accelerate's inherited unchanged; the instance attributes from the constructors' source;
- accelerate's constructor keywords from ``inspect.signature(accelerate.Accelerator)``;
- the error catalogue from `hyperacc.errors`.

What is written by hand (``docs/reference_notes.py``) is only what code cannot say: one line of meaning per
configuration field, accelerate keyword and instance attribute, and an example value. ``tests/test_docs.py`` checks that those notes cover
exactly the fields and keywords that exist, and every example flag is parsed by the example's own parser
when the page is generated (a wrong flag fails the build).

Used by ``docs/hooks.py`` (``mkdocs build``/``serve`` add the pages without writing them to ``docs/``) and
runnable alone: ``python docs/gen_reference.py OUT_DIR`` writes them for reading.
"""
from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _path in (str(REPO), str(REPO / "docs")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import accelerate  # noqa: E402
from gen_config import (  # noqa: E402,F401 - the config half; re-exported for tests/test_docs.py
    CONFIG_CLASSES, _cell, _first_paragraph, _hf_links, check_flags, config_fields, config_page, example_page,
    train_config)
from reference_notes import FIELD_NOTES, INSTANCE_NOTES, KEYWORD_NOTES  # noqa: E402,F401

import hyperacc  # noqa: E402
from hyperacc import errors  # noqa: E402
from hyperacc.accelerator import checkpointing, compat, facade  # noqa: E402

ACCELERATE_DOCS = "https://huggingface.co/docs/accelerate/package_reference/accelerator"


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
        comment = re.match(r"# -{5,} (?:raised by )?(hyperacc[\w.]*)", line)
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
