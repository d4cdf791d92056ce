"""The README: it starts with the two commands, its custom-loop snippet runs (in a process and an empty
directory of its own, tests/snippet_runs.py), it stays one screen's purpose (<= 200 lines) and its links
point at files that exist.

The snippets that used to live in the README moved to the documentation site (docs/); tests/test_docs.py runs
them from there."""
import re

import pytest

from dist_utils import REPO
from snippet_runs import README, README_SECTIONS as SECTIONS, assert_ran
from snippet_runs import readme_block as first_python_block


def test_readme_starts_with_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, flags=re.S).group(1)
    assert [line.split()[:2] for line in first_block.strip().splitlines()] == [["make", "demo"], ["make", "test"]]


@pytest.mark.parametrize("heading", SECTIONS)
def test_readme_snippet_runs(heading, tmp_path_factory):
    # in a process and an empty directory of its own, in the one launch of every snippet (tests/snippet_runs.py)
    assert_ran(tmp_path_factory, first_python_block(heading))


def test_readme_is_one_screen_of_purpose_with_working_links():
    assert len(README.splitlines()) <= 200, "README.md: keep it <= 200 lines; details go to docs/"
    links = [target for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README) if "://" not in target]
    assert links, "README has no links into docs/"
    missing = [target for target in links if not (REPO / target).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
