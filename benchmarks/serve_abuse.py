"""Load and abuse benchmark of the memory server (issue 40): throughput, a flooding tenant, append and compaction.

    OMP_NUM_THREADS=1 python benchmarks/serve_abuse.py --config configs/tiny.yaml --flood-baseline \\
        --out runs/bench/serve_abuse.json backbone.tiny.char_fallback=true  # the tiny random model (~7 min, 2 cores)
    OMP_NUM_THREADS=1 python benchmarks/serve_abuse.py --scenario flood --flood-requests 3 --flood-timeout-s 120 \
        memory.retrieval_map=null             # SmolLM2 (the default preset, no trained map), flood only (~8 min)
    OMP_NUM_THREADS=1 python benchmarks/serve_abuse.py --config configs/tiny.yaml --clients 1,2 --requests 4 \\
        --flood-requests 4 --append-sizes 1000 --append-repeats 3 --compaction-rows 100 backbone.tiny.char_fallback=true
                                                                        # the smoke test's scale (seconds)

Loopback only, bounded in requests and time. ``--scenario`` (comma-separated, default ``all``) picks:

- ``load``: one real server (``python -m elasticmem.serve`` started by ``benchmarks/serve.py``'s
  ``ServerProcess``: ``--threads 1``, ``OMP_NUM_THREADS=1``, batching on, an ``--api-keys`` file of
  two tenants ``a`` and ``b``), its bank filled through ``POST /v1/memory/{group}`` with
  ``--sessions`` short synthetic sessions in each of 4 groups per tenant; then ``--requests``
  ``POST /v1/ask`` (``max_new_tokens`` 5; at least the client count) at each of ``--clients``
  (1, 4, 16) concurrent clients of tenant ``b``, each sending its next request when its last one is
  answered (serve.py's ``_drive``). Reported: requests/s (requests / wall time) and the p50 / p95 /
  p99 client-side latency (nearest rank).
- ``flood``: on the same server, tenant ``b``'s one well-behaved client (in a process of its own, as
  another tenant's client would be: in the benchmark's event loop its timer would also count the
  flooding clients' work) sends ``--flood-requests`` small questions one after the other, first
  alone (unloaded), then while tenant ``a`` floods:
  ``--tenant-max-in-flight`` + ``--flood-extra`` concurrent clients, each sending at once again
  whatever it was answered (no back-off, except ``--flood-backoff-ms`` after a 429/413, so
  that the flooder's own client loop does not take the 2 cores from the server). All but
  ``--flood-oversize-clients`` of them send the maximal accepted question: ``--max-question-chars``
  characters, ``--max-choices`` options of ``--max-choice-chars`` characters and the largest
  ``max_new_tokens`` the server allows, shrunk in proportion until the server accepts its prompt
  tokens (its 413 names the count; only the accepted probe is computed, once, before measuring);
  the others send requests over the limits (a body over ``--max-body-bytes``, 413 on its
  Content-Length, and the unshrunk question, 413 on its prompt tokens), in turn. Reported: b's
  p50 / p95 / p99 unloaded and flooded and their ratios (the acceptance: flooded p95 at most 2x
  unloaded), and a's requests by outcome: answered (200), refused (by status: 429 over its
  in-flight or queue limit, 413 over a size limit) and unfinished (in flight when b's last request
  was answered; they are cancelled, so the server drops or discards them): sent = answered +
  refused + unfinished. A b request not answered within ``--flood-timeout-s`` ends the flood; b's
  flooded figures are then that timeout, and the ratios lower bounds (``ratios_are_lower_bounds``).
  ``--flood-repeats N`` measures the pair (alone, flooded) N times on the same server: one run's
  ratio on a shared 2-core machine moves with whatever else runs, so the acceptance figure is the
  median of the N p95 ratios, reported with each of them (``flood_runs``; ``flood`` is the median run).
- ``append``: in this process, without the server (``benchmarks/bank_append.py``'s
  ``measure_append``): a bank of the tiny random model (hidden size 64, float32; any preset's
  server uses the same append code) filled by appends of ``--fill-batch`` synthetic one-chunk
  sessions over 32 groups to each of ``--append-sizes`` (1k, 10k, 100k) rows, then
  ``--append-repeats`` one-session appends timed at each size (median; every append fsyncs).
  Reported: the medians and the ratio last / first (the acceptance: 100k / 1k at most 1.5).
- ``compaction`` (with ``append``): ``bank_append.measure_compaction``: an empty tiny bank grown by
  ``--compaction-rows`` one-session appends (what a server adding one session per request does),
  counting the bytes written by ``_compact`` (at ``_atomic_write_bytes``) and by the appends, over
  the bytes of the shard and chunk files the final manifest names (the acceptance: compaction
  writes at most 2 bytes per byte kept). The default 4500 rows passes ``COMPACT_ROWS`` (4096), so
  rows go through both merge levels. The same ratio over the whole ``append`` run (mostly large
  fill appends) is reported too.

Prints a table per scenario and the acceptance figures; ``--out`` writes all of it as JSON, with
the load average before and after (other work on the machine shows there).

Results: benchmarks/README.md, section ``serve_abuse.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import write_json  # noqa: E402
from serve import ServerProcess, _drive, _pct  # noqa: E402

KEYS = {"sk-bench-a-0123456789": {"tenant": "a", "groups": ["a/*"]},
        "sk-bench-b-9876543210": {"tenant": "b", "groups": ["b/*"]}}
KEY_A, KEY_B = KEYS
GROUPS = 4
"""Memory groups per tenant."""
WORDS = "cat dog sun box cup hat key map pen bed car egg fox owl".split()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _stats(lat: list[float], wall: float | None = None) -> dict:
    out = {"requests": len(lat), "p50_s": _pct(lat, 0.50), "p95_s": _pct(lat, 0.95), "p99_s": _pct(lat, 0.99),
           "mean_s": statistics.mean(lat)}
    if wall is not None:
        out.update(wall_s=wall, requests_per_s=len(lat) / wall)
    return out


def _questions(n: int, start: int = 0) -> list[dict]:
    return [{"group": f"b/g{(start + i) % GROUPS}", "max_new_tokens": 5,
             "question": f"What did I say about the {WORDS[(start + i) % len(WORDS)]}?"} for i in range(n)]


def preload(url: str, sessions: int) -> int:
    """``sessions`` synthetic sessions (bank_append's) in each group of both tenants, through the API."""
    import httpx

    from bank_append import _session

    added = 0
    for key in KEYS:
        tenant = KEYS[key]["tenant"]
        with httpx.Client(base_url=url, timeout=600, headers=_auth(key)) as c:
            for i in range(sessions * GROUPS):
                r = c.post(f"/v1/memory/{tenant}/g{i % GROUPS}", json={"turns": [t.to_json() for t in _session(i)]})
                if r.status_code != 200:
                    raise RuntimeError(f"preload: {r.status_code} {r.text[:500]}")
                added += r.json()["added"]
    return added


def load(url: str, args: argparse.Namespace) -> list[dict]:
    asyncio.run(_drive(url, _questions(1), 1, _auth(KEY_B)))  # warm-up, not measured: one alone, one batch
    asyncio.run(_drive(url, _questions(args.max_batch, 1), args.max_batch, _auth(KEY_B)))
    levels = []
    for c in args.clients:
        n = max(args.requests, c)
        wall, lat, _ = asyncio.run(_drive(url, _questions(n), c, _auth(KEY_B)))
        levels.append({"clients": c, **_stats(lat, wall)})
        print(f"  load c={c:<3d} {n:4d} requests {n / wall:7.2f} req/s  p50 {levels[-1]['p50_s']:.3f} s  "
              f"p95 {levels[-1]['p95_s']:.3f} s  p99 {levels[-1]['p99_s']:.3f} s", file=sys.stderr, flush=True)
    return levels


def _text(chars: int, seed: int) -> str:
    words = (WORDS[(seed + i) % len(WORDS)] for i in range(chars))
    return " ".join(words)[:chars]


def maximal_ask(url: str, args: argparse.Namespace) -> tuple[dict, dict, list[dict]]:
    """Tenant a's maximal accepted question (and the probes' outcomes), and the over-limit one."""
    import httpx

    def body(scale: float) -> dict:
        return {"group": "a/g0", "max_new_tokens": args.max_new_tokens_limit,
                "question": _text(max(1, int(args.max_question_chars * scale)), 0),
                "choices": [_text(max(1, int(args.max_choice_chars * scale)), k + 1) for k in range(args.max_choices)]}

    over, scale, probes = body(1.0), 1.0, []
    with httpx.Client(base_url=url, timeout=600, headers=_auth(KEY_A)) as c:
        for _ in range(12):
            b = body(scale)
            t0 = time.perf_counter()
            r = c.post("/v1/ask", json=b)
            probes.append({"scale": scale, "status": r.status_code, "s": time.perf_counter() - t0})
            if r.status_code == 200:
                return b, over, probes
            m = re.search(r"the prompt is (\d+) tokens", r.text)
            if r.status_code != 413 or not m:
                raise RuntimeError(f"probing the maximal question: {r.status_code} {r.text[:500]}")
            scale *= 0.98 * args.max_prompt_tokens / int(m.group(1))
    raise RuntimeError(f"no accepted maximal question after {len(probes)} probes: {probes}")


def _b_client(url: str, n: int, timeout: float) -> tuple[float, list[float], list[dict]] | None:
    """Tenant b's well-behaved client, in a process of its own: its latencies then do not include
    the flooding clients' work in the benchmark's event loop (a tenant's client is not the other
    tenant's). None when one of its requests waited longer than ``timeout``."""
    import httpx

    try:
        return asyncio.run(_drive(url, _questions(n, 1), 1, _auth(KEY_B), timeout=timeout))
    except httpx.TimeoutException:
        return None


async def _b_measured(url: str, args: argparse.Namespace) -> tuple[float, list[float], list[dict]] | None:
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return await asyncio.get_running_loop().run_in_executor(pool, _b_client, url, args.flood_requests,
                                                                args.flood_timeout_s)


async def flood(url: str, args: argparse.Namespace, maximal: dict, over: dict) -> dict:
    import httpx

    big = json.dumps(over).encode()
    oversize = b'{"group": "a/g0", "question": "' + b"x" * args.max_body_bytes + b'"}'  # over on Content-Length
    counts = {"sent": 0, "answered": 0, "refused": {}, "unfinished": 0}
    stop = asyncio.Event()
    n_clients = args.tenant_max_in_flight + args.flood_extra
    limits = httpx.Limits(max_connections=n_clients, max_keepalive_connections=n_clients)

    async def flooder(a: httpx.AsyncClient, k: int) -> None:
        turn = 0
        while not stop.is_set():
            if k < args.flood_oversize_clients:
                kw = {"content": oversize, "headers": {"Content-Type": "application/json"}} if turn % 2 == 0 \
                    else {"content": big, "headers": {"Content-Type": "application/json"}}
            else:
                kw = {"json": maximal}
            turn += 1
            counts["sent"] += 1
            try:
                r = await a.post("/v1/ask", **kw)
            except asyncio.CancelledError:
                counts["unfinished"] += 1
                raise
            except httpx.TransportError as e:  # the server closed a connection it refused early
                counts["refused"][type(e).__name__] = counts["refused"].get(type(e).__name__, 0) + 1
                continue
            if r.status_code == 200:
                counts["answered"] += 1
            else:
                counts["refused"][str(r.status_code)] = counts["refused"].get(str(r.status_code), 0) + 1
                await asyncio.sleep(args.flood_backoff_ms / 1000)

    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits, headers=_auth(KEY_A)) as a:
        tasks = [asyncio.ensure_future(flooder(a, k)) for k in range(n_clients)]
        try:
            await asyncio.sleep(args.flood_ramp_s)  # a's queue fills before b measures
            measured = await _b_measured(url, args)
            # None: one of b's requests waited longer than the bound: say so
            b = _stats(measured[1], measured[0]) if measured else {"requests": 0, "timed_out_s": args.flood_timeout_s}
        finally:
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {"b": b, "a": counts, "a_clients": n_clients}


def run_server_scenarios(args: argparse.Namespace, work: Path) -> dict:
    import httpx

    keys = work / "keys.json"
    keys.write_text(json.dumps(KEYS))
    extra = ["--api-keys", str(keys), "--tenant-max-in-flight", str(args.tenant_max_in_flight),
             "--tenant-max-queued", str(args.tenant_max_queued)]
    srv = ServerProcess(args, work / "bank", "elasticmem", True, work / "server.log", extra)
    out: dict = {}
    try:
        out["startup_s"] = srv.wait_ready()
        t0 = time.perf_counter()
        out["preload"] = {"chunks": preload(srv.url, args.sessions), "wall_s": time.perf_counter() - t0}
        if "load" in args.scenario:
            out["load"] = load(srv.url, args)
        if "flood" in args.scenario:
            runs = [flood_figures(srv.url, args) for _ in range(args.flood_repeats)]
            out["flood_runs"] = [{k: r[k] for k in ("p50_ratio", "p95_ratio", "ratios_are_lower_bounds")}
                                 | {"b_unloaded_p95_s": r["b_unloaded"].get("p95_s"),
                                    "b_flooded_p95_s": r["b_flooded"].get("p95_s")} for r in runs]
            out["flood"] = sorted(runs, key=lambda r: r["p95_ratio"])[(len(runs) - 1) // 2]  # the median run
        out["server_metrics"] = httpx.get(f"{srv.url}/metrics", timeout=60).json()
    finally:
        srv.stop()
    if "flood" in args.scenario and args.flood_baseline:
        # the same flood on a server whose batches are neither token-bounded nor interrupted
        base = ServerProcess(args, work / "bank_baseline", "elasticmem", True, work / "server_baseline.log",
                             [*extra, "--max-batch-tokens", "none", "--slice-ms", "none"])
        try:
            base.wait_ready()
            preload(base.url, args.sessions)
            out["flood_baseline"] = flood_figures(base.url, args)
            out["flood_baseline"]["server_metrics"] = httpx.get(f"{base.url}/metrics", timeout=60).json()["model"]
        finally:
            base.stop()
    return out


def flood_figures(url: str, args: argparse.Namespace) -> dict:
    """Tenant b alone, then while tenant a floods, on the server at ``url``; the ratios."""
    maximal, over, probes = maximal_ask(url, args)
    alone = asyncio.run(_b_measured(url, args))  # measured as flooded: from b's own process
    fl = asyncio.run(flood(url, args, maximal, over))
    unloaded = _stats(alone[1], alone[0])
    return {
        "b_unloaded": unloaded, "b_flooded": fl["b"], "a": fl["a"], "a_clients": fl["a_clients"],
        # a timed-out request bounds the ratios from below: it waited at least --flood-timeout-s
        "p50_ratio": fl["b"].get("p50_s", args.flood_timeout_s) / unloaded["p50_s"],
        "p95_ratio": fl["b"].get("p95_s", args.flood_timeout_s) / unloaded["p95_s"],
        "ratios_are_lower_bounds": "timed_out_s" in fl["b"],
        "maximal_request": {"question_chars": len(maximal["question"]), "choices": len(maximal["choices"]),
                            "choice_chars": len(maximal["choices"][0]), "max_new_tokens": maximal["max_new_tokens"],
                            "body_bytes": len(json.dumps(maximal).encode()), "probes": probes}}


def main(argv: list[str] | None = None) -> int:
    from elasticmem.serve import Limits

    lim = Limits()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="all", help="comma-separated: load, flood, append (with compaction); all")
    p.add_argument("--config", default="configs/quickstart.yaml", help="preset (default: SmolLM2)")
    p.add_argument("--checkpoint", help="a trained checkpoint (default: untrained parts)")
    p.add_argument("--clients", default="1,4,16", help="load: comma-separated client counts")
    p.add_argument("--requests", type=int, default=48, help="load: requests per client count (at least the count)")
    p.add_argument("--sessions", type=int, default=4, help="sessions preloaded per group (4 groups per tenant)")
    p.add_argument("--flood-requests", type=int, default=24, help="flood: b's requests, alone and flooded")
    p.add_argument("--flood-extra", type=int, default=8, help="flood: a's clients beyond its in-flight limit")
    p.add_argument("--flood-oversize-clients", type=int, default=2, help="flood: a's clients sending over-limit requests")
    p.add_argument("--flood-backoff-ms", type=float, default=20.0, help="flood: a's pause after a refusal")
    p.add_argument("--flood-ramp-s", type=float, default=2.0, help="flood: seconds a floods before b measures")
    p.add_argument("--flood-timeout-s", type=float, default=600.0,
                   help="flood: b's wait for one answer; past it b stops and the ratios become lower bounds")
    p.add_argument("--flood-repeats", type=int, default=1,
                   help="flood: measure b alone and flooded this many times; the acceptance is their median p95 ratio")
    p.add_argument("--flood-baseline", action="store_true",
                   help="flood: also on a second server with --max-batch-tokens none --slice-ms none (batches "
                        "neither bounded nor interrupted), for comparison")
    p.add_argument("--tenant-max-in-flight", type=int, default=lim.tenant_max_in_flight, help="the server's limit")
    p.add_argument("--tenant-max-queued", type=int, default=lim.tenant_max_queued, help="the server's limit")
    p.add_argument("--append-sizes", default="1000,10000,100000", help="append: bank rows, comma-separated")
    p.add_argument("--append-repeats", type=int, default=40, help="append: timed one-session appends per size")
    p.add_argument("--fill-batch", type=int, default=5000, help="append: rows per append while filling")
    p.add_argument("--compaction-rows", type=int, default=4500, help="compaction: one-session appends from empty")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--batch-window-ms", type=float, default=5.0)
    p.add_argument("--server-threads", type=int, default=1, help="torch / OpenMP threads of the server (and appends)")
    p.add_argument("--workdir", help="bank, keys and server log (default: a temporary folder, removed after)")
    p.add_argument("--out", help="also write the figures as JSON here")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for the server")
    args = p.parse_intermixed_args(argv)
    args.scenario = {"load", "flood", "append"} if args.scenario == "all" else set(args.scenario.split(","))
    if args.scenario - {"load", "flood", "append"}:
        p.error("--scenario takes load, flood, append or all")
    if args.flood_repeats < 1:
        p.error("--flood-repeats must be at least 1")
    args.clients = [int(c) for c in args.clients.split(",")]
    args.append_sizes = [int(s) for s in args.append_sizes.split(",")]
    if max(args.clients + [args.max_batch]) > min(args.tenant_max_in_flight, args.tenant_max_queued):
        p.error("every --clients count and --max-batch must fit tenant b's --tenant-max-in-flight and "
                "--tenant-max-queued (the load is one well-behaved tenant; its requests must not be refused)")
    for f in ("max_question_chars", "max_choices", "max_choice_chars", "max_prompt_tokens", "max_body_bytes"):
        setattr(args, f, getattr(lim, f))  # the server's defaults: the maximal request is built from them
    args.max_new_tokens_limit = lim.max_new_tokens

    t_start = time.perf_counter()
    result: dict = {"args": {k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
                    "loadavg_before": os.getloadavg()}
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-abuse-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.scenario & {"load", "flood"}:
            shutil.rmtree(work / "bank", ignore_errors=True)
            result["server"] = run_server_scenarios(args, work)
        if "append" in args.scenario:
            import torch

            from bank_append import measure_append, measure_compaction

            torch.set_num_threads(args.server_threads)
            result["append"] = measure_append(args.append_sizes, repeats=args.append_repeats,
                                              fill_batch=args.fill_batch, folder=str(work / "append"))
            result["compaction"] = measure_compaction(args.compaction_rows, folder=str(work / "compaction"))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    result["loadavg_after"] = os.getloadavg()
    result["total_s"] = time.perf_counter() - t_start

    acc = result["acceptance"] = {}
    srv = result.get("server", {})
    if "load" in srv:
        print("\n| clients | requests | req/s | p50 s | p95 s | p99 s |\n|---|---|---|---|---|---|")
        for lv in srv["load"]:
            print(f"| {lv['clients']} | {lv['requests']} | {lv['requests_per_s']:.2f} | {lv['p50_s']:.3f} | "
                  f"{lv['p95_s']:.3f} | {lv['p99_s']:.3f} |")
    for key, title in (("flood", "tenant b (1 client)"),
                       ("flood_baseline", "tenant b, batches not bounded nor interrupted (baseline)")):
        if key not in srv:
            continue
        f = srv[key]
        print(f"\n| {title} | requests | p50 s | p95 s | p99 s |\n|---|---|---|---|---|")
        for name in ("b_unloaded", "b_flooded"):
            s = f[name]
            if "timed_out_s" in s:
                print(f"| {name[2:]} | timed out: no answer within {s['timed_out_s']:.0f} s | | | |")
            else:
                print(f"| {name[2:]} | {s['requests']} | {s['p50_s']:.3f} | {s['p95_s']:.3f} | {s['p99_s']:.3f} |")
        m, a = f["maximal_request"], f["a"]
        print(f"flooded / unloaded: p50 {'>= ' * f['ratios_are_lower_bounds']}{f['p50_ratio']:.2f}x, p95 "
              f"{'>= ' * f['ratios_are_lower_bounds']}{f['p95_ratio']:.2f}x (acceptance: p95 <= 2x)")
        print(f"tenant a: {f['a_clients']} clients, maximal question {m['question_chars']} chars + {m['choices']} x "
              f"{m['choice_chars']} chars, max_new_tokens {m['max_new_tokens']}; sent {a['sent']} = answered "
              f"{a['answered']} + refused {a['refused']} + unfinished {a['unfinished']}")
        if key == "flood":
            ratios = [r["p95_ratio"] for r in srv["flood_runs"]]
            if len(ratios) > 1:
                print(f"p95 ratio of each of {len(ratios)} floods: {', '.join(f'{r:.2f}x' for r in ratios)}; "
                      f"median {f['p95_ratio']:.2f}x, {sum(r <= 2.0 for r in ratios)} of {len(ratios)} at most 2x")
            acc["flood_p95_ratio"] = {"value": f["p95_ratio"], "limit": 2.0, "met": f["p95_ratio"] <= 2.0,
                                      "runs": ratios, "runs_met": sum(r <= 2.0 for r in ratios)}
    if "append" in result:
        ap, co = result["append"], result["compaction"]
        print("\n| bank rows | one append, median ms | p90 ms |\n|---|---|---|")
        for s in ap["sizes"]:
            print(f"| {s['rows']} | {s['median_s'] * 1e3:.1f} | {s['p90_s'] * 1e3:.1f} |")
        print(f"append {ap['sizes'][-1]['rows']} / {ap['sizes'][0]['rows']} rows: {ap['ratio_last_first']:.2f}x "
              f"(acceptance 100k / 1k <= 1.5x)")
        print(f"compaction: {co['appends']} one-session appends from empty wrote {co['bytes_appended']} bytes by "
              f"appending and {co['bytes_compaction']} by compaction ({co['compactions']} compactions); "
              f"{co['bytes_kept']} kept: {co['compaction_per_kept']:.2f} bytes per byte kept (acceptance <= 2); "
              f"whole append run: {ap['bytes_compaction'] / ap['bytes_kept']:.2f}")
        acc["append_ratio"] = {"value": ap["ratio_last_first"], "limit": 1.5, "met": ap["ratio_last_first"] <= 1.5}
        acc["compaction_per_kept"] = {"value": co["compaction_per_kept"], "limit": 2.0,
                                      "met": co["compaction_per_kept"] <= 2.0}
    print(f"\ntotal {result['total_s']:.0f} s; load average before {result['loadavg_before']}, "
          f"after {result['loadavg_after']}", file=sys.stderr)
    if args.out:
        write_json(args.out, result, __file__, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
