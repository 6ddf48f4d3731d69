"""The command line: ``elasticmem-serve`` / ``python -m elasticmem.serve`` (flags for every limit).

The package's docstring (``elasticmem/serve/__init__.py``) describes the server and its API.
"""

import argparse
import dataclasses
import logging
import sys
import typing
from typing import Any, Callable

from elasticmem.serve.app import create_app
from elasticmem.serve.auth import KeysFileError, load_api_keys
from elasticmem.serve.settings import INSTALL_HINT, Batching, Limits

log = logging.getLogger("elasticmem.serve")

def _optional_int(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


_optional_int.__name__ = "int"  # its metavar: INT (or the word none)


def _limit_flags() -> list[tuple[str, str, Callable[[str], Any], Any, str]]:
    """(field, --flag, type, default, doc) of every ``Limits`` field: the flags are the dataclass."""
    from elasticmem.utils.configuration import field_docs

    docs, hints = field_docs(Limits), typing.get_type_hints(Limits)
    out = []
    for f in dataclasses.fields(Limits):
        flag = "--max-new-tokens-limit" if f.name == "max_new_tokens" else "--" + f.name.replace("_", "-")
        tp = {int: int, float: float}.get(hints[f.name], _optional_int)
        out.append((f.name, flag, tp, f.default, docs.get(f.name, "")))
    return out


def _parser() -> argparse.ArgumentParser:
    from elasticmem.utils.configuration import command_name

    p = argparse.ArgumentParser(prog=command_name("python -m elasticmem.serve"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="a trained checkpoint folder (e.g. runs/train/x/final); none = untrained parts")
    p.add_argument("--bank", required=True, help="the bank folder; created empty when it does not exist")
    p.add_argument("--config", help="a YAML preset (default: the checkpoint's saved config.yaml)")
    p.add_argument("--system", default="elasticmem", choices=["elasticmem", "text_rag", "no_memory"],
                   help="how memories reach the model: latent (elasticmem), as text (text_rag), or not at all")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-keys", metavar="FILE", help="JSON/YAML: key -> {tenant, groups}; without it: open server")
    p.add_argument("--max-batch", type=int, default=Batching.max_batch, help="most questions in one forward")
    p.add_argument("--batch-window-ms", type=float, default=Batching.window_ms,
                   help="how long the first request of a batch waits for others")
    p.add_argument("--no-batching", action="store_true", help="one request per forward (max batch 1, no window)")
    p.add_argument("--open-docs", action="store_true",
                   help="serve /openapi.json and /docs without an API key (default: they need one, as the API does)")
    limits = p.add_argument_group("limits", "each help says the status a request over it gets; docs/serving.md")
    for name, flag, tp, default, doc in _limit_flags():
        limits.add_argument(flag, dest=name, type=tp, default=default, metavar=tp.__name__.upper(),
                            help=f"{' '.join(doc.split())} (default: {default})")
    p.add_argument("--model-name", help="the model id reported by /v1/models and chat completions")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true", help="no line per request")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. backbone.device=cpu")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        print(f"elasticmem.serve needs FastAPI and uvicorn ({e.name or e} is not installed): {INSTALL_HINT}",
              file=sys.stderr)
        return 2
    args = _parser().parse_intermixed_args(argv)
    for name, flag, _, _, _ in _limit_flags():
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            print(f"{flag} must be > 0", file=sys.stderr)
            return 2
    if args.max_batch < 1 or args.batch_window_ms < 0:
        print("--max-batch must be >= 1 and --batch-window-ms >= 0", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keys = None
    if args.api_keys:
        try:
            keys = load_api_keys(args.api_keys)
        except KeysFileError as e:
            print(f"elasticmem.serve: {e}", file=sys.stderr)
            return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from elasticmem.bank.store import BankError
    from elasticmem.live import LiveMemory

    batching = Batching.off() if args.no_batching else Batching(args.max_batch, args.batch_window_ms)
    try:  # batch_size: one worker batch is one forward pass, not split again by LiveMemory
        live = LiveMemory.load(checkpoint=args.checkpoint, bank=args.bank, config=args.config,
                               overrides=list(args.overrides), system=args.system,
                               batch_size=batching.max_batch,
                               **({"max_turn_chars": args.max_turn_chars} if args.max_turn_chars else {}))
    except (ValueError, OSError, BankError) as e:  # a bad config key or preset (ConfigError), checkpoint or bank
        print(f"elasticmem.serve: cannot load the memory: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    limits = Limits(**{name: getattr(args, name) for name, *_ in _limit_flags()})
    app = create_app(live, keys, limits, batching, args.model_name, open_docs=args.open_docs)
    log.info("serving %s memory from %s on http://%s:%d (%s tenants)", live.system, args.bank, args.host, args.port,
             len({k.tenant for k in keys.values()}) if keys else "no")
    # one process: the model and the bank live in it (uvicorn workers would each load their own)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=not args.no_access_log,
                workers=1, limit_concurrency=limits.limit_concurrency, timeout_keep_alive=limits.timeout_keep_alive_s)
    return 0
