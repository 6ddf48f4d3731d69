"""Settings of accelerate's experiment trackers (``train.trackers``) for a training run.

accelerate starts each tracker with ``init_kwargs[name]``. Weights & Biases gets the run's config,
its folder (``train.output_dir``, beside metrics.jsonl, unless ``WANDB_DIR`` says otherwise) and
its mode: what ``WANDB_MODE`` says when set, else offline when no API key is known (neither
``WANDB_API_KEY`` nor a ``~/.netrc`` login to the W&B host), so a run never waits on a login
prompt or a network it does not have; ``wandb sync DIR/wandb/offline-run-*`` uploads it later.
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

WANDB_HOST = "https://api.wandb.ai"


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
        wb: dict[str, Any] = {"config": to_dict(cfg), "name": Path(cfg.train.output_dir).name}
        if not env.get("WANDB_DIR"):
            wb["dir"] = str(cfg.train.output_dir)
        if not env.get("WANDB_MODE") and not wandb_logged_in(env):
            wb["mode"] = "offline"
        kwargs["wandb"] = wb
    return kwargs
