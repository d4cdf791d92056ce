"""The runnable snippet of docs/checkpoint.md runs (resume is bitwise exact) in a fresh process."""
import re

from dist_utils import REPO, run_python


def test_checkpoint_doc_snippet_runs(tmp_path):
    text = (REPO / "docs" / "checkpoint.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    script = tmp_path / "snippet.py"
    script.write_text(code)
    run_python(script, timeout=300)
