"""Small helpers shared across the package."""

from __future__ import annotations

import hashlib
from pathlib import Path


def require(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok``: config validation reads as a list of rules."""
    if not ok:
        raise ValueError(message)


def sha256_file(path: str | Path, bufsize: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(bufsize):
            h.update(b)
    return h.hexdigest()
