"""Settings of accelerate's experiment trackers (``train.trackers``) for a training run.

accelerate starts each tracker with ``init_kwargs[name]``. Weights & Biases gets the run's config,
its folder (``train.output_dir``, beside metrics.jsonl, unless ``WANDB_DIR`` says otherwise) and
its mode: what ``WANDB_MODE`` says when set, else offline when no API key is known (neither
``WANDB_API_KEY`` nor a ``~/.netrc`` login to the W&B host), so a run never waits on a login
prompt or a network it does not have; ``wandb sync DIR/wandb/offline-run-*`` uploads it later.
A resumed run continues the same W&B run: its id is kept in ``train.output_dir/wandb_run_id``.
When training returns, finished or stopped, the run's files are complete (:func:`close_trackers`).
"""

from __future__ import annotations

import netrc
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

WANDB_HOST = "https://api.wandb.ai"
RUN_ID_FILE = "wandb_run_id"


def wandb_run_id(output_dir: str | Path) -> str:
    """The W&B run id of the training run in ``output_dir``: made by its first start, read back
    by every resume. Every process calls this; the first to create the file wins (``O_EXCL``) and
    all read its id, so the ranks never disagree."""
    path = Path(output_dir) / RUN_ID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(uuid.uuid4().hex[:12])
    for _ in range(100):  # another process may have created it and not yet written its 12 characters
        run_id = path.read_text().strip()
        if run_id:
            return run_id
        time.sleep(0.05)
    raise RuntimeError(f"{path} is empty: delete it to start a new W&B run")


def wandb_logged_in(env: dict[str, str] | None = None) -> bool:
    """Whether W&B has an API key: ``WANDB_API_KEY``, or a ``~/.netrc`` entry for its host
    (``WANDB_BASE_URL``, default api.wandb.ai), which ``wandb login`` writes."""
    env = os.environ if env is None else env
    if env.get("WANDB_API_KEY"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL") or WANDB_HOST).hostname
    path = Path(env.get("NETRC") or Path.home() / ".netrc")
    try:
        auth = netrc.netrc(str(path)).authenticators(host) if path.is_file() else None
    except (netrc.NetrcParseError, OSError):  # a broken file logs nobody in
        return False
    return bool(auth and auth[2])  # the password is the API key


def tracker_init_kwargs(cfg, env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """``init_kwargs`` for ``Accelerator.init_trackers`` under ``cfg.train.trackers``."""
    from elasticmem.utils.configuration import to_dict

    env = os.environ if env is None else env
    kwargs: dict[str, dict[str, Any]] = {}
    if "wandb" in cfg.train.trackers:
        wb: dict[str, Any] = {"config": to_dict(cfg), "name": Path(cfg.train.output_dir).name,
                              "id": wandb_run_id(cfg.train.output_dir), "resume": "allow"}
        if not env.get("WANDB_DIR"):
            wb["dir"] = str(cfg.train.output_dir)
        if not env.get("WANDB_MODE") and not wandb_logged_in(env):
            wb["mode"] = "offline"
        kwargs["wandb"] = wb
    return kwargs


def close_trackers(trackers: list[str]) -> None:
    """Wait until every tracker's files are written; call after ``Accelerator.end_training``.

    ``wandb.Run.finish`` returns before wandb's service process has flushed the run's
    ``run-*.wandb`` file: right after it the file can still hold only its 7-byte header (seen in 1
    of 5 offline runs here). ``wandb.teardown`` waits for that process to exit, so a run read, synced
    or copied as soon as training returns is whole. It would run at interpreter exit anyway, which a
    job killed after training, or a caller that goes on in the same process, does not reach.
    """
    if "wandb" in trackers and "wandb" in sys.modules:
        import wandb

        wandb.teardown()
