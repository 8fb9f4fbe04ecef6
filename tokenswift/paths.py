"""Where tokenswift keeps what it makes once: converted models, calibrations."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$TOKENSWIFT_CACHE``, or ``~/.cache/tokenswift``: converted models in ``models/``,
    calibrations in ``calibration/``."""
    return Path(os.environ.get("TOKENSWIFT_CACHE", Path.home() / ".cache" / "tokenswift"))
