"""mkdocs hook: adds the generated reference pages (docs/gen_reference.py) to the build.

The pages are generated in memory on every build (`mkdocs build`, `mkdocs serve`) and never written into
``docs/``, so there is no stale copy to commit or to forget: what the site shows is what the code says now.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from mkdocs.structure.files import File

_spec = importlib.util.spec_from_file_location("gen_reference", Path(__file__).with_name("gen_reference.py"))
gen_reference = importlib.util.module_from_spec(_spec)
sys.modules["gen_reference"] = gen_reference      # dataclasses look their module up there
_spec.loader.exec_module(gen_reference)


def on_files(files, config):
    for path, text in gen_reference.generate().items():
        files.append(File.generated(config, path, content=text))
    return files
