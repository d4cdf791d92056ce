"""The README's runnable snippets run, each in a fresh process in an empty directory."""
import re
import subprocess
import sys

import pytest

from dist_utils import REPO, _env

README = (REPO / "README.md").read_text()
SECTIONS = ["Quick start", "Coming from accelerate", "The micro-batch dataloader", "Checkpoints",
            "Configuration: YAML + typed command-line overrides", "Step metrics", "Precision recipes",
            "Replica guard", "Fine-tuning with LoRA", "Compiling the blocks (`FSDPConfig.compile`)",
            "Using hyperacc under Trainer / TRL", "Instruction data", "Iterable and streaming datasets", "Architecture"]


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
