"""The load and abuse benchmark (benchmarks/serve_abuse.py) at its smallest scale, on the tiny model.

    OMP_NUM_THREADS=1 python -m pytest -q tests/integration/test_serve_bench.py     # ~40 s on 2 loaded cores

Runs the benchmark once as its README says (a real server process, every scenario: load at 1 and
2 clients, tenant a flooding while tenant b measures (twice), appends at 1k rows, compaction over 100
one-session appends) and checks that its JSON has every section with sane values: the requests of
every level and of b answered, latency percentiles ordered (p50 <= p95 <= p99), the flooder's
requests adding up (sent = answered + refused + unfinished, some of them admitted, some refused
with 429 and some with 413), and the append and compaction figures positive, with the acceptance ratios computed from
them. It checks the benchmark reports, not the acceptance figures (which a loaded 2-core machine
cannot promise). A second test terminates the benchmark (SIGTERM) and checks that its server child
stops with it. Skips, saying why, without the ``serve`` extra, like tests/integration/test_serve.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, live_children, proc_stat
from serve_support import require_serve_extra


def _ordered(s: dict) -> None:
    assert 0 < s["p50_s"] <= s["p95_s"] <= s["p99_s"], s


@pytest.mark.slow
def test_serve_abuse_benchmark_smallest_scale(tmp_path):
    require_serve_extra()
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "benchmarks/serve_abuse.py", "--config", "configs/tiny.yaml", "--clients", "1,2",
           "--requests", "4", "--flood-requests", "4", "--append-sizes", "1000", "--append-repeats", "3",
           "--compaction-rows", "100", "--tenant-max-in-flight", "8", "--tenant-max-queued", "8", "--max-batch", "4",
           "--flood-extra", "2", "--flood-ramp-s", "0.5", "--flood-repeats", "2", "--workdir", str(tmp_path / "work"),
           "--out", str(out),
           "backbone.tiny.char_fallback=true"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = json.loads(out.read_text())

    load = d["server"]["load"]
    assert [lv["clients"] for lv in load] == [1, 2]
    for lv in load:
        assert lv["requests"] == 4 and lv["requests_per_s"] > 0
        _ordered(lv)

    f = d["server"]["flood"]
    for name in ("b_unloaded", "b_flooded"):
        assert f[name]["requests"] == 4
        _ordered(f[name])
    assert f["p95_ratio"] == f["b_flooded"]["p95_s"] / f["b_unloaded"]["p95_s"]
    runs = d["server"]["flood_runs"]  # two floods; the reported one and the acceptance are the (lower) median
    assert len(runs) == 2 and f["p95_ratio"] == min(r["p95_ratio"] for r in runs)
    assert d["acceptance"]["flood_p95_ratio"]["runs"] == [r["p95_ratio"] for r in runs]
    assert d["acceptance"]["flood_p95_ratio"]["value"] == f["p95_ratio"]
    a = f["a"]
    assert a["sent"] == a["answered"] + sum(a["refused"].values()) + a["unfinished"], a
    # a's admitted maximal requests reach the model (answered, or still running when b is done: b's
    # short ones run between their decoding steps), the rest are refused
    assert a["answered"] + a["unfinished"] > 0, a
    assert a["refused"].get("429", 0) > 0 and a["refused"].get("413", 0) > 0, a
    assert f["a_clients"] == 8 + 2
    m = f["maximal_request"]
    assert m["max_new_tokens"] == 256 and m["probes"][-1]["status"] == 200

    ap, co = d["append"], d["compaction"]
    assert [s["rows"] for s in ap["sizes"]] == [1000] and ap["sizes"][0]["appends"] == 3
    assert ap["sizes"][0]["rows_after"] == 1000 + 3 + 1
    assert 0 < ap["sizes"][0]["median_s"] <= ap["sizes"][0]["p90_s"] and ap["ratio_last_first"] == 1.0
    assert co["rows"] == 100 and co["bytes_kept"] > 0 and co["bytes_appended"] > 0
    assert co["compaction_per_kept"] == co["bytes_compaction"] / co["bytes_kept"] >= 0
    assert set(d["acceptance"]) == {"flood_p95_ratio", "append_ratio", "compaction_per_kept"}
    assert "| clients | requests | req/s |" in r.stdout and "tenant a:" in r.stdout


def _alive(pid: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[1] != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc")
def test_a_terminated_benchmark_stops_its_server(tmp_path):
    """SIGTERM (``timeout``, ``kill``) to the benchmark stops its server child too, not only the benchmark."""
    require_serve_extra()
    cmd = [sys.executable, "benchmarks/serve_abuse.py", "--config", "configs/tiny.yaml", "--scenario", "load",
           "--clients", "1", "--requests", "100000", "--workdir", str(tmp_path / "work"),
           "--out", str(tmp_path / "bench.json"), "backbone.tiny.char_fallback=true"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    bench = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    servers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not servers and bench.poll() is None and time.monotonic() < deadline:
            servers = list(live_children(bench.pid))
            time.sleep(0.2)
        assert servers, "the benchmark started no server"
        time.sleep(1.0)
        bench.send_signal(signal.SIGTERM)
        bench.wait(90)
        deadline = time.monotonic() + 30
        while any(map(_alive, servers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, servers)), "the server outlived its terminated benchmark"
    finally:
        for pid in [bench.pid, *servers]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        bench.wait()
