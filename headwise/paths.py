"""Where headwise keeps what it makes on a machine: assembled model files, prepared
weights, tokenizers, compiled C kernels, calibration results."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$HEADWISE_CACHE_DIR, else ~/.cache/headwise."""
    return Path(os.environ.get("HEADWISE_CACHE_DIR") or Path.home() / ".cache" / "headwise")
