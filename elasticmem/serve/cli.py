"""The command line: ``elasticmem-serve`` / ``python -m elasticmem.serve``.

Every option is a field of ``ServeOptions`` (its ``batching`` and ``limits`` sections are
``Batching`` and ``Limits``), given as its flag or as ``serve.KEY=VALUE``: ``--port 8001`` is
``serve.port=8001``, ``--max-queue 64`` is ``serve.limits.max_queue=64``. The other ``key=value``
arguments override the model's config. The package's docstring (``elasticmem/serve/__init__.py``)
describes the server and its API.
"""

import argparse
import dataclasses
import logging
import sys
from dataclasses import dataclass, field
from typing import Literal

from elasticmem.serve.app import create_app
from elasticmem.serve.auth import KeysFileError, load_api_keys
from elasticmem.serve.settings import INSTALL_HINT, Batching, Limits
from elasticmem.utils.options import Flag, Options, command_name, option_keys, parse_options

log = logging.getLogger("elasticmem.serve")


@dataclass
class ServeOptions:
    """The server's options: ``serve.KEY=VALUE`` or the flag."""

    bank: str
    """The bank folder; created empty when it does not exist."""
    checkpoint: str | None = None
    """A trained checkpoint folder (e.g. runs/train/x/final); null = untrained parts."""
    config: str | None = None
    """A YAML preset; null = the checkpoint's saved config.yaml."""
    system: Literal["elasticmem", "text_rag", "no_memory"] = "elasticmem"
    """How memories reach the model: latent (elasticmem), as text (text_rag), or not at all."""
    host: str = "127.0.0.1"
    """The address to listen on (127.0.0.1: this machine only)."""
    port: int = 8000
    """The port to listen on."""
    api_keys: str | None = None
    """JSON/YAML file: key -> {tenant, groups}; null = an open server."""
    batching: Batching = field(default_factory=Batching)
    """How the worker groups concurrent requests into one forward."""
    no_batching: bool = False
    """One request per forward (max batch 1, no window; batching.max_batch_tokens, slice_ms and prefill_chunk still
    apply)."""
    open_docs: bool = False
    """Serve /openapi.json and /docs without an API key (by default they need one, as the API does)."""
    limits: Limits = field(default_factory=Limits)
    """Request limits; each says the status a request over it gets (docs/serving.md)."""
    model_name: str | None = None
    """The model id reported by /v1/models and chat completions."""
    threads: int = 0
    """Torch threads (0 = torch's default)."""
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    """Log level of the server and of uvicorn."""
    access_log: bool = True
    """A log line per request."""


# the flags these fields had before they were fields (a reused dataclass's names)
OPTIONS = Options("serve", ServeOptions, flags={
    "bank": Flag(metavar="DIR"), "checkpoint": Flag(metavar="DIR"), "config": Flag(metavar="PRESET"),
    "api_keys": Flag(metavar="FILE"), "batching.window_ms": "--batch-window-ms",
    "limits.max_new_tokens": "--max-new-tokens-limit"})


def parse_args(argv: list[str] | None = None) -> tuple[ServeOptions, list[str]]:
    """The server's options and the model's config overrides of a command line (exits 2 on an error)."""
    p = argparse.ArgumentParser(prog=command_name("python -m elasticmem.serve"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    opts, ns = parse_options(p, OPTIONS, argv, config=True, metavar="key=value",
                             help="config overrides, e.g. backbone.device=cpu (and serve.KEY=VALUE options)")
    return opts, ns.overrides


def _out_of_range(opts: ServeOptions) -> str | None:
    """What is wrong with the numbers of ``opts`` (their types are checked already), or None."""
    flags = option_keys(OPTIONS)
    for name, value in dataclasses.asdict(opts.limits).items():
        if value is not None and value <= 0:
            return f"{flags['serve.limits.' + name]} (serve.limits.{name}) must be > 0"
    b = opts.batching
    if b.max_batch < 1 or b.window_ms < 0:
        return "--max-batch must be >= 1 and --batch-window-ms >= 0"
    if (b.max_batch_tokens is not None and b.max_batch_tokens < 1) or (b.slice_ms or 0) < 0:
        return "--max-batch-tokens must be >= 1 (or none) and --slice-ms >= 0 (or none)"
    if b.prefill_chunk is not None and b.prefill_chunk < 1:
        return "--prefill-chunk must be >= 1 (or none)"
    return None


def main(argv: list[str] | None = None) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as e:
        print(f"elasticmem.serve needs FastAPI and uvicorn ({e.name or e} is not installed): {INSTALL_HINT}",
              file=sys.stderr)
        return 2
    opts, overrides = parse_args(argv)
    wrong = _out_of_range(opts)
    if wrong:
        print(wrong, file=sys.stderr)
        return 2
    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keys = None
    if opts.api_keys:
        try:
            keys = load_api_keys(opts.api_keys)
        except KeysFileError as e:
            print(f"elasticmem.serve: {e}", file=sys.stderr)
            return 2
    if opts.threads:
        import torch

        torch.set_num_threads(opts.threads)

    from elasticmem.bank.store import BankError
    from elasticmem.live import LiveMemory

    batching = opts.batching
    if opts.no_batching:
        batching = dataclasses.replace(Batching.off(), max_batch_tokens=batching.max_batch_tokens,
                                       slice_ms=batching.slice_ms, prefill_chunk=batching.prefill_chunk)
    limits = opts.limits
    try:  # batch_size: one worker batch is one forward pass, not split again by LiveMemory
        live = LiveMemory.load(checkpoint=opts.checkpoint, bank=opts.bank, config=opts.config,
                               overrides=overrides, system=opts.system, batch_size=batching.max_batch,
                               **({"max_turn_chars": limits.max_turn_chars} if limits.max_turn_chars else {}))
    except (ValueError, OSError, BankError) as e:  # a bad config key or preset (ConfigError), checkpoint or bank
        print(f"elasticmem.serve: cannot load the memory: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    app = create_app(live, keys, limits, batching, opts.model_name, open_docs=opts.open_docs)
    log.info("serving %s memory from %s on http://%s:%d (%s tenants)", live.system, opts.bank, opts.host, opts.port,
             len({k.tenant for k in keys.values()}) if keys else "no")
    # one process: the model and the bank live in it (uvicorn workers would each load their own)
    uvicorn.run(app, host=opts.host, port=opts.port, log_level=opts.log_level, access_log=opts.access_log,
                workers=1, limit_concurrency=limits.limit_concurrency, timeout_keep_alive=limits.timeout_keep_alive_s)
    return 0
