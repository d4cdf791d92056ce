"""The runnable python snippets of the README and the docs site, and their runs.

Every snippet this session runs -- the docs pages' ``<!-- test: run -->`` blocks (``run, slow`` ones with
HYPERACC_SLOW_TESTS=1), the README's "A custom loop" section and the first block of docs/guides/weights.md
(tests/test_weights.py runs it by default) -- runs in ONE launch of tests/scripts/run_snippets.py, each in a
process and an empty directory of its own (forked from one that imported the third-party libraries once,
never hyperacc), the first time a test asks; tests/test_docs.py, test_readme.py and test_weights.py read
their snippets' results here.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys

from conftest import SLOW
from dist_utils import REPO, _env

DOCS = REPO / "docs"
README = (REPO / "README.md").read_text()
README_SECTIONS = ["A custom loop"]
WEIGHTS_PAGE = DOCS / "guides" / "weights.md"
MARKED = re.compile(r"<!-- test: (?P<how>[^>]*?) -->\n```python\n(?P<code>.*?)```", re.S)


def pages():
    return sorted(DOCS.rglob("*.md"))


def docs_snippets():
    """(page, index, options, code) of every docs block marked to run."""
    found = []
    for page in pages():
        for index, match in enumerate(MARKED.finditer(page.read_text())):
            options = [word.strip() for word in match.group("how").split(",")]
            if options[0] == "run":
                found.append((page.relative_to(DOCS).as_posix(), index, set(options[1:]), match.group("code")))
    return found


def readme_block(heading: str) -> str:
    """The first python block of the README section ``heading``."""
    match = re.search(rf"^###? {re.escape(heading)}\n(.*?)(?=^###? |\Z)", README, flags=re.S | re.M)
    assert match, f"README has no section '## {heading}'"
    blocks = re.findall(r"```python\n(.*?)```", match.group(1), flags=re.S)
    assert blocks, f"section '{heading}' has no python snippet"
    return blocks[0]


def weights_snippet() -> str:
    return re.findall(r"```python\n(.*?)```", WEIGHTS_PAGE.read_text(), flags=re.S)[0]


def wanted():
    """(code, run from the repository root?) of every snippet this session runs, in order, once each."""
    runs = [(code, "repo" in options) for _, _, options, code in docs_snippets() if SLOW or "slow" not in options]
    runs += [(readme_block(heading), False) for heading in README_SECTIONS] + [(weights_snippet(), False)]
    return list(dict.fromkeys(runs))


_RESULTS: dict = {}


def _shared_root(tmp_path_factory):
    """Where the one launch runs: under pytest-xdist the directory every worker of this session shares (the
    parent of the workers' own base temp), so that test_docs, test_readme and test_weights on two workers
    read one launch (it ran once per worker before: 14 s of CPU twice); else a temp directory of its own."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "snippets"
        root.mkdir(exist_ok=True)
        return root
    return tmp_path_factory.mktemp("snippets")


def snippet_results(tmp_path_factory) -> dict:
    """{(code, in_repo): (exit code, stdout, stderr)} of `wanted()`, launched on the first call (of any worker)."""
    if not _RESULTS:
        root, specs = _shared_root(tmp_path_factory), []
        with open(root / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)        # the first worker launches; the others wait and read
            for n, (code, in_repo) in enumerate(wanted()):
                folder = root / str(n)
                folder.mkdir(exist_ok=True)
                (folder / "snippet.py").write_text(code)
                specs.append(f"{folder / 'snippet.py'}:{REPO}" if in_repo else str(folder / "snippet.py"))
            if not (root / "codes.json").is_file():
                subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "run_snippets.py"),
                                str(root / "codes.json.tmp"), *specs], cwd=root, env=_env(), check=True,
                               timeout=300 * len(specs))
                os.replace(root / "codes.json.tmp", root / "codes.json")
        codes = json.loads((root / "codes.json").read_text())
        assert list(codes) == specs, codes
        for key, spec in zip(wanted(), specs):
            path = spec.split(":")[0]
            _RESULTS[key] = (codes[spec], open(path + ".stdout").read(), open(path + ".stderr").read())
    return _RESULTS


def assert_ran(tmp_path_factory, code: str, in_repo: bool = False) -> None:
    returncode, stdout, stderr = snippet_results(tmp_path_factory)[(code, in_repo)]
    assert returncode == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"
