"""The README: it starts with the two commands, its custom-loop snippet runs (in a fresh process in an empty
directory), it stays one screen's purpose (<= 200 lines) and its links point at files that exist.

The snippets that used to live in the README moved to the documentation site (docs/); tests/test_docs.py runs
them from there."""
import re
import subprocess
import sys

import pytest

from dist_utils import REPO, _env

README = (REPO / "README.md").read_text()
SECTIONS = ["A custom loop"]


def first_python_block(heading: str) -> str:
    match = re.search(rf"^###? {re.escape(heading)}\n(.*?)(?=^###? |\Z)", README, flags=re.S | re.M)
    assert match, f"README has no section '## {heading}'"
    blocks = re.findall(r"```python\n(.*?)```", match.group(1), flags=re.S)
    assert blocks, f"section '{heading}' has no python snippet"
    return blocks[0]


def test_readme_starts_with_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, flags=re.S).group(1)
    assert [line.split()[:2] for line in first_block.strip().splitlines()] == [["make", "demo"], ["make", "test"]]


@pytest.mark.parametrize("heading", SECTIONS)
def test_readme_snippet_runs(heading, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(first_python_block(heading))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{heading}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_readme_is_one_screen_of_purpose_with_working_links():
    assert len(README.splitlines()) <= 200, "README.md: keep it <= 200 lines; details go to docs/"
    links = [target for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README) if "://" not in target]
    assert links, "README has no links into docs/"
    missing = [target for target in links if not (REPO / target).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
