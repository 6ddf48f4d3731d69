"""HTTP serving throughput: ElasticMem vs text RAG, request batching on vs off, at several concurrencies.

    python -m elasticmem.backbone fetch smollm2                     # once
    python benchmarks/serve.py --out runs/bench/serve.json         # SmolLM2 on CPU, c = 1, 8, 32 (~5 min, 2 cores)
    python benchmarks/serve.py --requests 16 --concurrency 1,8 --systems elasticmem    # a quick look
    python benchmarks/serve.py --config configs/tiny.yaml backbone.tiny.char_fallback=true   # the tiny model

Starts the real server (``python -m elasticmem.serve``, one process, ``--threads 1`` and
``OMP_NUM_THREADS=1``) once per (system, batching) pair: ``elasticmem`` (latent memories) and
``text_rag`` (the same retrieved chunks as text, the same bank), each with batching on
(``--max-batch``, ``--batch-window-ms``) and off (``--no-batching``: one question per forward).
Every server starts from a copy of one bank, filled once through ``POST /v1/memory/{group}`` with the
first ``--sessions`` sessions of the first ``--conversations`` LoCoMo conversations (one group each;
``../shared/data/locomo10.json``), and answers the same questions, those conversations' own LoCoMo
questions, in the same order: ``--requests`` ``POST /v1/ask`` per concurrency level (at least the
concurrency; each asks for ``--max-new-tokens`` 5, DESIGN.md's QA answer length), sent by that many
httpx clients in this process, each sending its next request when its last one is answered.
Before the measured levels each server answers one request alone and then ``--max-batch`` at once
with batching on (warm-up, not measured: first calls pay for allocation).

Prints, per server and level, requests/s (requests / wall time of the level), p50 / p95 of the
client-side latency and the mean number of questions per forward (the server's /metrics), then the
ratios measured in this run: batching on / off (requests/s and p50) per system and level, and
ElasticMem / text RAG per batching mode and level. ``--out`` writes all of it as JSON. The model
is untrained unless ``--checkpoint`` names one: the costs of every part are the real ones (budgets
are then the untrained policy's). The benchmark process itself uses a second core for the clients.

Results: benchmarks/README.md, section ``serve.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path
from _bench import REPO, write_json  # noqa: E402

from elasticmem.utils.common import free_port  # noqa: E402

LOCOMO = REPO.parent / "shared" / "data" / "locomo10.json"


def _exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit, so that each ``finally: srv.stop()`` stops its server.

    By default the signal (``timeout``, ``kill``, a scheduler) ends the benchmark at once and the
    server child lives on, holding its port and a core that the next measurement then shares.
    """
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


class ServerProcess:
    """``python -m elasticmem.serve`` in a child process, its output in a log file; stopped on SIGTERM too."""

    def __init__(self, args: argparse.Namespace, bank: Path, system: str, batching: bool, log: Path,
                 extra: list[str] | tuple[str, ...] = ()) -> None:
        _exit_on_sigterm()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "elasticmem.serve", "--config", args.config, "--bank", str(bank),
               "--system", system, "--port", str(self.port), "--threads", str(args.server_threads),
               "--no-access-log", "--log-level", "warning", "--max-queue", "4096"]
        if args.checkpoint:
            cmd += ["--checkpoint", args.checkpoint]
        cmd += ["--max-batch", str(args.max_batch), "--batch-window-ms", str(args.batch_window_ms)] if batching \
            else ["--no-batching"]
        cmd += [*extra, "backbone.device=cpu", *args.overrides]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.server_threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONPATH=str(REPO))
        self.t0 = time.perf_counter()
        with open(log, "w") as out:  # a file, not a pipe: a full pipe would stall the server
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300.0) -> float:
        import httpx

        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.perf_counter() - self.t0
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def locomo_workload(path: Path, conversations: int, sessions: int,
                    max_new_tokens: int = 0) -> tuple[list[tuple[str, list[dict]]], list[dict]]:
    """(group, turns) sessions to preload and the ask requests: the conversations' own questions."""
    from elasticmem.data.locomo import ADVERSARIAL, read_locomo
    from elasticmem.data.sources import SkipLog

    convs = read_locomo(path, SkipLog(skip_invalid=True))[:conversations]
    preload, asks = [], []
    for conv in convs:
        group = f"locomo/{conv.sample_id}"
        for session in conv.history[:sessions]:
            preload.append((group, [t.to_json() for t in session]))
        asks += [{"group": group, "question": qa.question} for qa in conv.qa if qa.category != ADVERSARIAL]
    if max_new_tokens:
        asks = [{**a, "max_new_tokens": max_new_tokens} for a in asks]
    # interleave the conversations' questions, so every batch mixes groups as real traffic would
    by_group: dict[str, list[dict]] = {}
    for a in asks:
        by_group.setdefault(a["group"], []).append(a)
    mixed = [q for row in zip(*by_group.values()) for q in row]
    return preload, mixed


async def _drive(url: str, requests: list[dict], concurrency: int, headers: dict[str, str] | None = None,
                 timeout: float = 600.0) -> tuple[float, list[float], list[dict]]:
    """Send ``requests`` with ``concurrency`` clients (``headers`` on each, e.g. an API key; ``timeout``
    seconds for each); wall seconds, each request's latency and the server's per-stage seconds of each answer."""
    import httpx

    latencies: list[float] = []
    stages: list[dict] = []
    todo = iter(requests)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, headers=headers) as client:

        async def one_client() -> None:
            for body in todo:  # a shared iterator: each client takes the next request when free
                t = time.perf_counter()
                r = await client.post("/v1/ask", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"/v1/ask answered {r.status_code}: {r.text[:500]}")
                latencies.append(time.perf_counter() - t)
                stages.append(r.json()["latency"])

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        return time.perf_counter() - t0, latencies, stages


def _metrics(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/metrics", timeout=30).json()["model"]


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v), max(1, math.ceil(q * len(v)))) - 1]  # nearest rank: a latency that happened


def preload_bank(args: argparse.Namespace, bank: Path, sessions: list[tuple[str, list[dict]]], log: Path) -> dict:
    """Fill ``bank`` through the HTTP API, a few sessions per request (what a client would do)."""
    import httpx

    srv = ServerProcess(args, bank, "elasticmem", True, log)
    try:
        start = srv.wait_ready()
        t0 = time.perf_counter()
        added = 0
        with httpx.Client(base_url=srv.url, timeout=600) as c:
            for group, turns in sessions:
                r = c.post(f"/v1/memory/{group}", json={"turns": turns})
                if r.status_code != 200:
                    raise RuntimeError(f"preload: {r.status_code} {r.text[:500]}")
                added += r.json()["added"]
            groups = sorted({g for g, _ in sessions})
            per_group = {g: len(c.get(f"/v1/memory/{g}").json()["chunks"]) for g in groups}
        wall = time.perf_counter() - t0
    finally:
        srv.stop()
    return {"startup_s": start, "sessions": len(sessions), "chunks": added, "chunks_per_group": per_group,
            "wall_s": wall, "chunks_per_s": added / wall}


def run_server(args: argparse.Namespace, bank: Path, system: str, batching: bool, asks: list[dict],
               log: Path) -> dict:
    srv = ServerProcess(args, bank, system, batching, log)
    try:
        startup = srv.wait_ready()
        warm = args.max_batch if batching else 1  # the shapes this server will run
        asyncio.run(_drive(srv.url, asks[:1], 1))
        asyncio.run(_drive(srv.url, asks[1:1 + warm], warm))
        levels = []
        offset = 1 + warm
        for c in args.concurrency:
            n = max(args.requests, c)
            reqs = [asks[(offset + i) % len(asks)] for i in range(n)]
            before = _metrics(srv.url)
            wall, lat, stages = asyncio.run(_drive(srv.url, reqs, c))
            after = _metrics(srv.url)
            batches = after["batches_run"] - before["batches_run"]
            level = {"concurrency": c, "requests": n, "wall_s": wall, "requests_per_s": n / wall,
                     "p50_s": _pct(lat, 0.50), "p95_s": _pct(lat, 0.95), "mean_s": statistics.mean(lat),
                     "mean_batch": (after["asks_answered"] - before["asks_answered"]) / max(batches, 1),
                     # the server's own split of an answer's time (a batch's shared evenly; "total" = its batch)
                     "server_stage_mean_s": {k: statistics.mean(st.get(k, 0.0) for st in stages)
                                             for k in ("retrieval", "policy", "generation", "total")}}
            levels.append(level)
            print(f"  {system:10s} batching {'on ' if batching else 'off'} c={c:<3d} {n:4d} requests "
                  f"{level['requests_per_s']:6.2f} req/s  p50 {level['p50_s']:6.2f} s  p95 {level['p95_s']:6.2f} s  "
                  f"batch {level['mean_batch']:.2f}", file=sys.stderr, flush=True)
    finally:
        srv.stop()
    return {"system": system, "batching": batching, "startup_s": startup, "levels": levels}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/quickstart.yaml", help="preset (default: SmolLM2, Z=4, 10 tokens)")
    p.add_argument("--checkpoint", help="a trained checkpoint (default: untrained parts)")
    p.add_argument("--requests", type=int, default=8, help="requests per level (at least the concurrency)")
    p.add_argument("--max-new-tokens", type=int, default=5,
                   help="answer length sent with every question (DESIGN.md: 5 for QA); 0 = the preset's")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts")
    p.add_argument("--systems", default="elasticmem,text_rag", help="comma-separated: elasticmem, text_rag")
    p.add_argument("--batching", default="on,off", help="comma-separated: on, off")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--batch-window-ms", type=float, default=5.0)
    p.add_argument("--server-threads", type=int, default=1, help="torch / OpenMP threads of each server")
    p.add_argument("--locomo", default=str(LOCOMO), help="locomo10.json")
    p.add_argument("--conversations", type=int, default=2, help="LoCoMo conversations preloaded (one group each)")
    p.add_argument("--sessions", type=int, default=3, help="sessions preloaded per conversation")
    p.add_argument("--workdir", help="banks and server logs (default: a temporary folder, removed after)")
    p.add_argument("--out", help="also write the figures as JSON here")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every server")
    args = p.parse_intermixed_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    systems = args.systems.split(",")
    modes = [m == "on" for m in args.batching.split(",")]
    if any(s not in ("elasticmem", "text_rag", "no_memory") for s in systems) or not modes:
        p.error("--systems takes elasticmem, text_rag, no_memory; --batching takes on, off")

    t_start = time.perf_counter()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        sessions, asks = locomo_workload(Path(args.locomo), args.conversations, args.sessions, args.max_new_tokens)
        master = work / "bank-preloaded"
        shutil.rmtree(master, ignore_errors=True)
        pre = preload_bank(args, master, sessions, work / "preload.log")
        print(f"preloaded {pre['chunks']} chunks ({pre['sessions']} sessions, groups {pre['chunks_per_group']}) "
              f"in {pre['wall_s']:.1f} s through POST /v1/memory ({pre['chunks_per_s']:.1f} chunks/s); "
              f"{len(asks)} questions; config {args.config} {' '.join(args.overrides)}", file=sys.stderr)
        runs = []
        for system in systems:
            for batching in modes:
                bank = work / f"bank-{system}-{'on' if batching else 'off'}"
                shutil.rmtree(bank, ignore_errors=True)
                shutil.copytree(master, bank)
                runs.append(run_server(args, bank, system, batching, asks,
                                       work / f"{system}-{'on' if batching else 'off'}.log"))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    table = {(r["system"], r["batching"], lv["concurrency"]): lv for r in runs for lv in r["levels"]}
    print("\n| system | batching | concurrency | requests | req/s | p50 s | p95 s | questions per forward |")
    print("|---|---|---|---|---|---|---|---|")
    for (system, batching, c), lv in table.items():
        print(f"| {system} | {'on' if batching else 'off'} | {c} | {lv['requests']} | {lv['requests_per_s']:.2f} | "
              f"{lv['p50_s']:.2f} | {lv['p95_s']:.2f} | {lv['mean_batch']:.2f} |")
    ratios: dict[str, dict[str, float]] = {}
    lines = []
    for c in args.concurrency:
        for system in systems:
            on, off = table.get((system, True, c)), table.get((system, False, c))
            if on and off:
                r = {"requests_per_s": on["requests_per_s"] / off["requests_per_s"], "p50": on["p50_s"] / off["p50_s"]}
                ratios[f"{system} batching on/off c={c}"] = r
                lines.append(f"{system} batching on / off, c={c}: {r['requests_per_s']:.2f}x req/s, "
                             f"{r['p50']:.2f}x p50")
        for batching in modes:
            e, t = table.get(("elasticmem", batching, c)), table.get(("text_rag", batching, c))
            if e and t:
                r = {"requests_per_s": e["requests_per_s"] / t["requests_per_s"], "p50": e["p50_s"] / t["p50_s"]}
                ratios[f"elasticmem/text_rag batching {'on' if batching else 'off'} c={c}"] = r
                lines.append(f"ElasticMem / text RAG, batching {'on' if batching else 'off'}, c={c}: "
                             f"{r['requests_per_s']:.2f}x req/s, {r['p50']:.2f}x p50")
    print("\n" + "\n".join(lines))
    total = time.perf_counter() - t_start
    print(f"\ntotal {total:.0f} s", file=sys.stderr)
    if args.out:
        write_json(args.out, {"args": vars(args), "preload": pre, "runs": runs, "ratios": ratios, "total_s": total},
                   __file__, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
