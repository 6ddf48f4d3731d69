"""Where elasticmem keeps models and caches: ``$ELASTICMEM_HOME`` (default ``~/.cache/elasticmem``)."""

from __future__ import annotations

import os
from pathlib import Path


def elasticmem_home() -> Path:
    home = os.environ.get("ELASTICMEM_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "elasticmem"


def models_home(cache_dir: str | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    return elasticmem_home() / "models"
