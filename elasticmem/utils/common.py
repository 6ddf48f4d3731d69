"""Small helpers shared across the package."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path


def require(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok``: config validation reads as a list of rules."""
    if not ok:
        raise ValueError(message)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now (the OS picks it), for a server or a
    process group's rendezvous."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def sha256_file(path: str | Path, bufsize: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(bufsize):
            h.update(b)
    return h.hexdigest()
