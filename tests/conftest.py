import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _no_plugins(monkeypatch):
    """Tests see the built-ins only, unless a test installs plugins itself."""
    monkeypatch.setenv("TOKENSWIFT_DISABLE_PLUGINS", "all")
