"""Provenance of evaluation outputs: which code, which config and which inputs made a results file.

    python -m pytest -q tests/unit/test_provenance.py

Every ``results.json`` the evaluation writes (``elasticmem.eval.runner.finalize``) and every
``ladder.json`` (``elasticmem.apps.ladder.ladder_data``) holds a ``provenance`` object:

- ``code``: :func:`git_state` of the repository holding this package (found from the package's
  own file, not the working directory): ``commit`` (``git rev-parse HEAD``) and ``dirty``
  (``git status --porcelain`` non-empty: the commit alone does not say what ran), or both null
  with a ``reason`` when the package is not a git checkout (an installed wheel) or git is missing;
- ``config_sha256``: :func:`config_sha256` of the resolved config dataclass (as the CLI resolves
  it: file, overrides and variant applied), null with ``config_reason`` when none was given;
- ``bank_manifest``, ``retrieval_map``, ``checkpoint``: :func:`file_entry` / :func:`tree_entry`
  content hashes of what the evaluation read (null when it read none, e.g. no
  ``memory.retrieval_map``); a path that is set but absent gets ``sha256: null`` and a ``reason``;
- ``predictions_sha256``: the sha256 of the ``predictions.jsonl`` the figures were computed from.

Hashes are hex sha256 digests (what ``sha256sum`` prints), files read in 1 MB blocks; a
checkpoint folder is hashed whole (:func:`tree_sha256`): LoRA adapter, policy and projector are a
few MB, and a step checkpoint's ``trainer_state/`` (optimizer moments of those same weights, about
twice their size) is small enough to include, so nothing is skipped. Everything here is a pure
function of the files and the config it is given, apart from the ``git`` calls.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

from elasticmem.utils.common import sha256_file

BLOCK = 1 << 20
"""Files are hashed in 1 MB blocks."""

PACKAGE_DIR = Path(__file__).resolve().parents[1]
"""The ``elasticmem`` package folder: its repository is the code that ran."""


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of the bytes of ``path`` (read in :data:`BLOCK` blocks)."""
    return sha256_file(path, bufsize=BLOCK)


def tree_sha256(root: str | Path) -> tuple[str, int]:
    """``(digest, files)``: the hex sha256 of a folder's content and how many files it holds.

    The digest is over the folder's files sorted by relative POSIX path, one line
    ``"<relative path>\\0<file sha256>\\n"`` each (UTF-8): it changes when a file's bytes, name
    or presence change, and not with timestamps or the order the file system lists them in.
    """
    root = Path(root)
    files = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for rel, p in files:
        h.update(f"{rel}\0{file_sha256(p)}\n".encode())
    return h.hexdigest(), len(files)


def canonical_json(obj: Any) -> str:
    """``obj`` as JSON with sorted keys, no spaces, non-ASCII kept, non-JSON values (paths) as str."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def config_sha256(cfg: Any) -> str:
    """Hex sha256 of the canonical JSON (:func:`canonical_json`) of a config dataclass (or a dict)."""
    data = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type) else cfg
    return hashlib.sha256(canonical_json(data).encode()).hexdigest()


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          timeout=60).stdout


def git_state(package_dir: str | Path = PACKAGE_DIR) -> dict[str, Any]:
    """``{"repo", "commit", "dirty", "reason"}`` of the git checkout holding ``package_dir``.

    The checkout is the one whose work tree tracks ``package_dir/__init__.py``, so a package
    installed into a virtual environment that happens to sit inside some other repository is
    not credited to that repository's commit. ``dirty``: ``git status --porcelain`` lists
    anything (modified, staged or untracked files). Not a checkout, or no git: ``commit`` and
    ``dirty`` are null and ``reason`` says why; otherwise ``reason`` is null.
    """
    package_dir = Path(package_dir).resolve()
    try:
        top = Path(_git(package_dir, "rev-parse", "--show-toplevel").strip())
        # raises when the package's own file is not tracked by that work tree
        _git(top, "ls-files", "--error-unmatch", str((package_dir / "__init__.py").relative_to(top)))
        commit = _git(top, "rev-parse", "HEAD").strip()
        dirty = bool(_git(top, "status", "--porcelain").strip())
    except FileNotFoundError:
        return {"repo": None, "commit": None, "dirty": None, "reason": "git is not installed"}
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, ValueError) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
        return {"repo": None, "commit": None, "dirty": None,
                "reason": f"{package_dir} is not a git checkout of the package ({detail[0] if detail else e})"}
    return {"repo": str(top), "commit": commit, "dirty": dirty, "reason": None}


def file_entry(path: str | Path | None) -> dict[str, Any] | None:
    """``{"path", "sha256", "reason"}`` of one input file; None when no path is set. A path
    that names no file gets ``sha256: null`` and the reason."""
    if path is None or str(path) == "":
        return None
    p = Path(path)
    if not p.is_file():
        return {"path": str(path), "sha256": None, "reason": "not a file" if p.exists() else "does not exist"}
    return {"path": str(path), "sha256": file_sha256(p), "reason": None}


def tree_entry(path: str | Path | None) -> dict[str, Any] | None:
    """:func:`file_entry` of a file, or of a folder ``{"path", "sha256", "files", "hash", "reason"}``
    with its :func:`tree_sha256` (``hash`` says which of the two the digest is)."""
    if path is None or str(path) == "":
        return None
    p = Path(path)
    if p.is_dir():
        digest, n = tree_sha256(p)
        return {"path": str(path), "sha256": digest, "files": n, "reason": None,
                "hash": "sha256 over the sorted (relative path, file sha256) of its files"}
    entry = file_entry(path)
    assert entry is not None
    return {**entry, "hash": "sha256 of the file"}


def evaluation_provenance(cfg: Any = None, *, bank_dir: str | Path | None = None,
                          predictions: str | Path | None = None) -> dict[str, Any]:
    """The ``provenance`` object of one evaluation's ``results.json`` (see the module docstring).

    ``cfg``: the resolved config dataclass (``elasticmem.config.Config``) or None;
    ``memory.retrieval_map`` and ``eval.checkpoint`` are read from it. ``bank_dir``: the bank
    the system read (None = it read none, e.g. A-Mem); ``predictions``: the ``predictions.jsonl``.
    """
    memory = getattr(cfg, "memory", None)
    evaluation = getattr(cfg, "eval", None)
    manifest = None if bank_dir is None else file_entry(Path(bank_dir) / "manifest.json")
    return {
        "code": git_state(),
        "config_sha256": None if cfg is None else config_sha256(cfg),
        "config_reason": "no config was given to the evaluation" if cfg is None else None,
        "config_hash": "sha256 of the resolved config as canonical JSON (sorted keys, no spaces)",
        "bank_manifest": manifest,
        "retrieval_map": file_entry(getattr(memory, "retrieval_map", None)),
        "checkpoint": tree_entry(getattr(evaluation, "checkpoint", None)),
        "predictions_sha256": None if predictions is None else file_sha256(predictions),
    }


__all__ = ["BLOCK", "canonical_json", "config_sha256", "evaluation_provenance", "file_entry", "file_sha256",
           "git_state", "tree_entry", "tree_sha256"]
