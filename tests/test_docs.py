"""The documentation site (docs/, mkdocs.yml): its generated reference is complete, its snippets run, it builds.

Snippets: every ```python block of a docs page carries a marker on the line before it --
``<!-- test: run -->`` (run here, each in a process of its own in an empty directory, offline, like
test_readme's README sections; one launch forks them all from a process that imported the third-party
libraries once, see tests/snippet_runs.py), ``<!-- test: run, slow -->`` (the same in the slow set),
``<!-- test: run, repo -->`` (run from the repository root, for snippets that read the repository's files), or
``<!-- test: fragment -->`` (a piece of a program: names defined elsewhere, paths of your own). An unmarked
block fails `test_every_python_block_is_marked`, so no new snippet goes untested by accident.
"""
import dataclasses
import importlib.util
import json
import re
import subprocess
import sys

import pytest

from dist_utils import REPO, _env
from snippet_runs import DOCS, MARKED, assert_ran, docs_snippets, pages

snippets = docs_snippets


def _param(page, index, options, code):
    marks = [pytest.mark.slow] if "slow" in options else []
    return pytest.param(code, "repo" in options, id=f"{page}#{index}", marks=marks)


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_reference"] = module          # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- (1) the generated reference
def test_config_reference_lists_every_field(gen):
    page = gen.config_page()
    documented = [(doc.cls, doc.name) for doc in gen.config_fields()]
    for cls in gen.CONFIG_CLASSES:
        fields = [f.name for f in dataclasses.fields(cls)]
        assert [name for owner, name in documented if owner == cls.__name__] == fields
        assert sorted(gen.FIELD_NOTES[cls.__name__]) == sorted(fields), (
            f"docs/reference_notes.py FIELD_NOTES[{cls.__name__!r}] must have one note per field")
        section = page.split(f"## {cls.__name__}\n", 1)[1].split("\n## ", 1)[0]
        for name in fields:
            assert len(re.findall(rf"^\| `{name}` \|", section, flags=re.M)) == 2, f"{cls.__name__}.{name} missing"
    for doc in gen.config_fields():     # every field the environment can set shows its variable
        if doc.env:
            assert f"`{doc.env}`" in page


def test_example_flags_page_lists_every_flag(gen):
    import typing

    from hyperacc.tools.cli_config import Component

    schema = gen.train_config()
    page, hints = gen.example_page(), typing.get_type_hints(schema)
    for section in dataclasses.fields(schema):
        assert f"## `{section.name}`" in page
        if isinstance(section.default_factory(), Component):
            continue
        for field in dataclasses.fields(hints[section.name]):
            assert f"| `--{section.name}.{field.name}` |" in page, f"--{section.name}.{field.name} missing"


def test_accelerator_reference_lists_every_member(gen):
    import hyperacc

    public = sorted(name for name in dir(hyperacc.Accelerator) if not name.startswith("_"))
    groups = gen.accelerator_members()
    listed = [name for names in groups.values() for name in names]
    assert sorted(listed) == public and len(listed) == len(set(listed))
    page = gen.accelerator_page()
    for name in public:
        assert re.search(rf"^\| \[?`{re.escape(name)}[`(]", page, flags=re.M), f"Accelerator.{name} missing"
    assert set(groups["not_supported"]) == set(hyperacc.accelerator.NOT_SUPPORTED)
    assert {"step_end", "mesh", "dp_rank", "dp_size", "step_loss"} <= set(groups["own"])


def test_accelerator_instance_attributes_are_documented(gen, tmp_path):
    """A real Accelerator's public instance attributes are all on the page (hyperacc's or accelerate's)."""
    code = ("import json, hyperacc\nacc = hyperacc.Accelerator()\n"
            "print(json.dumps(sorted(k for k in vars(acc) if not k.startswith('_'))))\nacc.end_training()\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    attrs = gen.instance_attributes()
    documented = set(attrs["hyperacc"]) | set(attrs["accelerate"])
    missing = set(json.loads(proc.stdout.strip().splitlines()[-1])) - documented
    assert not missing, f"instance attributes missing from the reference: {sorted(missing)}"
    assert sorted(gen.INSTANCE_NOTES) == attrs["hyperacc"], "docs/reference_notes.py INSTANCE_NOTES: one per attribute"


def test_accelerate_keywords_and_errors_are_listed(gen):
    from hyperacc import errors

    assert sorted(gen.KEYWORD_NOTES) == sorted(gen.accelerate_keywords()), (
        "docs/reference_notes.py KEYWORD_NOTES must have one note per accelerate.Accelerator keyword")
    page = gen.accelerate_page()
    for name in gen.accelerate_keywords():
        assert f"| `{name}` | yes |" in page, f"accelerate keyword {name} is not accepted or not listed"
    classes = {name for name, obj in vars(errors).items() if isinstance(obj, type) and issubclass(obj, Exception)
               and obj.__module__ == errors.__name__}
    assert {klass.__name__ for klass, _ in gen.error_classes()} == classes
    assert all(module for _, module in gen.error_classes()), "every error names the module that raises it"
    errors_page = gen.errors_page()
    for name in classes:
        assert f"| `{name}` |" in errors_page


def test_example_flags_parse(gen):
    """A wrong example flag is an error naming it (the build runs this check on every page generation)."""
    gen.check_flags(gen.config_fields())
    bad = dataclasses.replace(gen.config_fields()[0], flag="--parallel.dp_shard_sise=4")
    with pytest.raises(ValueError, match="dp_shard_sise"):
        gen.check_flags([bad])


# --------------------------------------------------------------------------- (2) the snippets
def test_every_python_block_is_marked():
    unmarked = []
    for page in pages():
        text = page.read_text()
        if text.count("```python") != len(MARKED.findall(text)):
            unmarked.append(page.relative_to(DOCS).as_posix())
    assert not unmarked, ("python blocks without a <!-- test: run|fragment --> marker on the line before: "
                          f"{unmarked}")
    assert len(snippets()) >= 10


@pytest.mark.parametrize("code, in_repo", [_param(*snippet) for snippet in snippets()])
def test_docs_snippet_runs(code, in_repo, tmp_path_factory):
    assert_ran(tmp_path_factory, code, in_repo)        # one launch for every snippet (tests/snippet_runs.py)


# --------------------------------------------------------------------------- (3) the build
def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("mkdocs/mkdocstrings are not installed: `make docs` (or pip install -e '.[docs]') installs them")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, env=_env({"NO_MKDOCS_2_WARNING": "1"}), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-5000:]
    built = tmp_path / "site"
    assert (built / "reference" / "config" / "index.html").is_file()
    assert "dp_shard_size" in (built / "reference" / "config" / "index.html").read_text()
