import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


@pytest.fixture(scope="module")
def hyperacc_cache(tmp_path_factory):
    """A private HYPERACC_CACHE for one test module (the default corpus and tokenizer go there)."""
    cache = str(tmp_path_factory.mktemp("hyperacc_cache"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYPERACC_CACHE", cache)
        yield cache
