"""What the benchmark scripts of this folder share: the repository root, logging, medians, the
process's memory counters and the JSON report. Not an entry point: the scripts import it.

A script run as ``python benchmarks/X.py`` has this folder on ``sys.path`` already (its own
folder); loaded by path (tests use ``importlib.util.spec_from_file_location``) it has not, so each
script puts its folder there first::

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path
    from _bench import REPO, log  # noqa: E402

Importing this module puts the repository root on ``sys.path`` as well, so that ``elasticmem``
and the root scripts import from this checkout without an install.
"""

from __future__ import annotations

import json
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def log(msg: str) -> None:
    """Progress and tables on stdout, flushed: a stage log of gpu_check.py keeps them in order
    with what the libraries print."""
    print(msg, flush=True)


def med(xs: Sequence[float]) -> float:
    """The median; NaN for no values (a system skipped, a phase never timed)."""
    return float(statistics.median(xs)) if xs else float("nan")


def cpu_name() -> str:
    """The CPU's model name for a run's header (``platform`` often says only ``x86_64``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def status_kb(field: str) -> int:
    """A field of ``/proc/self/status`` in kB (Linux): ``VmRSS`` now, ``VmHWM`` the peak since the
    process started or since ``5`` was written to ``/proc/self/clear_refs``."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def commit() -> str | None:
    """HEAD of this checkout (uncommitted changes are not seen); None outside a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def write_json(path: str | Path, report: dict[str, Any], script: str, argv: Sequence[str] | None) -> None:
    """Write a run's report to ``path`` (its folder made), led by the command and the commit that
    made it, as the results files under docs/results/ record them. ``script`` is the caller's
    ``__file__``, ``argv`` its ``main``'s (None: the command line's)."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["python", f"benchmarks/{Path(script).name}", *args])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": command, "commit": commit(), **report}, indent=1, default=str))
