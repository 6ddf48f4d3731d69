"""The model card (``README.md``) of every saved checkpoint folder, as peft and transformers write one.

A Hugging Face model card is a Markdown file with YAML front matter (``library_name``,
``base_model``, ``tags``: what the Hub indexes), then prose. Ours says what the folder holds, the
base model it only works with, the run's whole config, the data, the metrics logged at the
step it was saved, and the lines that load it. ``write_model_card`` writes it;
``write_run_card`` gathers those facts from a run (its config, ``metrics.jsonl``, the data's
``stats.json``) for the GRPO trainer and the reading warm-up, which call it on every save.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

CARD_FILE = "README.md"

_STAGES = {
    "grpo": ("GRPO", "trained with GRPO from task reward (`elasticmem-train`)"),
    "warmup": ("reading warm-up", "trained by the supervised reading warm-up (`elasticmem-warmup`)"),
}


def _json(obj: Any) -> str:
    # metrics.jsonl writes NaN as json.dumps does (grad_norm of a skipped step): kept as is, so the
    # card's block reads back equal to the logged row
    return json.dumps(obj, indent=1, sort_keys=False)


def load_snippet(load_path: str, config_path: str, bank_dir: str, system: str) -> str:
    """The Python lines that load this checkpoint (a test runs them)."""
    if system == "memgen":  # LiveMemory answers with ElasticMem and its text baselines only
        return (f"from elasticmem.config import Config\n"
                f"from elasticmem.systems import build_system\n"
                f"from elasticmem.utils.configuration import load\n\n"
                f"cfg = load(Config, {config_path!r}, [\"eval.system=memgen\", {'eval.checkpoint=' + load_path!r},\n"
                f"                                      {'bank.dir=' + bank_dir!r}])\n"
                f"model = build_system(cfg).model   # a MemGen over the base model\n")
    return (f"from elasticmem.live import LiveMemory\n\n"
            f"mem = LiveMemory.load({load_path!r}, bank={bank_dir!r}, config={config_path!r})\n"
            f"# mem.add(\"alice\", [{{\"role\": \"user\", \"content\": \"My cat is called Miso.\"}}])\n"
            f"# print(mem.ask(\"alice\", \"What is my cat called?\", max_new_tokens=16).text)\n")


def write_model_card(folder: str | Path, *, base_model: str, config: dict[str, Any], data: dict[str, Any],
                     metrics: dict[str, Any] | None, step: int, stage: str = "grpo", load_path: str | None = None,
                     config_path: str | None = None, evaluation: dict[str, Any] | None = None) -> Path:
    """Write ``folder/README.md``; returns its path.

    ``config``: the run's config as a dict (``configuration.to_dict``); ``data``: ``{"dir", "splits":
    {split: questions}}``; ``metrics``: the row of ``metrics.jsonl`` logged last at or before
    ``step`` (None: nothing logged yet); ``stage``: 'grpo' or 'warmup'; ``load_path``: where the
    folder will be read from (a checkpoint is written into a temporary folder and renamed);
    ``config_path``: the saved config.yaml the loading lines name; ``evaluation``: a held-out
    evaluation logged at this step, if any.
    """
    folder = Path(folder)
    load_path = str(load_path or folder)
    config_path = str(config_path or Path(load_path) / "config.yaml")
    system = config.get("train", {}).get("system", "elasticmem")
    bank_dir = str(config.get("bank", {}).get("dir", ""))
    name, how = _STAGES[stage]
    front = {"library_name": "elasticmem", "base_model": base_model,
             "tags": ["elasticmem", "grpo" if stage == "grpo" else "reading-warmup", "lora",
                      *(["memgen"] if system == "memgen" else [])]}
    relative = not Path(load_path).is_absolute()
    splits = data.get("splits") or {}
    parts = [
        "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n",
        f"# {system} checkpoint: {name}, step {step}\n",
        f"The trained parts of an {'ElasticMem' if system != 'memgen' else 'ElasticMem (MemGen baseline)'} "
        f"model, {how}: the LoRA adapter of the reasoner (`adapter/`), "
        + ("the weaver and trigger (`memgen.safetensors`)" if system == "memgen" else
           "the budget policy (`budget_policy.safetensors`) and the projector (`projector.safetensors`)")
        + ", and `elasticmem_config.json` (the memory settings and the base model's fingerprint). "
        "The base model's weights are not here: they are loaded from the base model below and must match "
        "its fingerprint. The latent memory bank is a separate folder (`bank.dir`).\n",
        "## Base model\n",
        f"`{base_model}` (`backbone.name_or_path`), dtype `{config.get('backbone', {}).get('dtype')}`.\n",
        "## Data\n",
        f"`data.dir`: `{data.get('dir')}`"
        + (" (" + ", ".join(f"{s} {n} questions" for s, n in splits.items()) + ")" if splits else "")
        + f"; the memory bank: `{bank_dir}`.\n",
        f"## Metrics at save (step {step})\n",
        ("The row of `metrics.jsonl` logged last at or before this step:\n\n```json\n" + _json(metrics) + "\n```\n")
        if metrics is not None else "No metrics were logged before this save.\n",
    ]
    if evaluation is not None:
        parts.append("Held-out evaluation at this step:\n\n```json\n" + _json(evaluation) + "\n```\n")
    eval_cmd = (f"elasticmem-eval --config {config_path} checkpoint={load_path} bank.dir={bank_dir}"
                + (" system=memgen" if system == "memgen" else ""))
    parts += [
        "## How to load\n",
        ("Paths are relative to the folder the run was started in.\n\n" if relative else "")
        + "```python\n" + load_snippet(load_path, config_path, bank_dir, system) + "```\n",
        "Evaluate it (greedy, on `eval.split`; `--help` lists every key):\n\n```bash\n" + eval_cmd + "\n```\n",
        "## Config\n",
        "The run's whole config (`elasticmem-train --config FILE` takes it as is):\n\n```yaml\n"
        + yaml.safe_dump(config, sort_keys=False, default_flow_style=None, width=100) + "```\n",
    ]
    path = folder / CARD_FILE
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))
    return path


def logged_rows(metrics_path: str | Path, step: int) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The training row logged last at or before ``step`` in ``metrics_path`` and the evaluation
    row of exactly ``step`` (``{"step", "eval"}``), each None when there is none."""
    row = ev = None
    p = Path(metrics_path)
    if not p.is_file():
        return None, None
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("step", math.inf) > step:
            continue
        if "eval" in r:
            ev = r["eval"] if r["step"] == step else ev
        else:
            row = r
    return row, ev


def data_summary(data_dir: str | Path) -> dict[str, Any]:
    """``{"dir", "splits": {split: questions}}`` from the prepared data's stats.json (splits {} without it)."""
    stats = Path(data_dir) / "stats.json"
    splits: dict[str, int] = {}
    if stats.is_file():
        s = json.loads(stats.read_text()).get("splits", {})
        splits = {k: v["examples"] for k, v in s.items() if isinstance(v, dict) and "examples" in v}
    return {"dir": str(data_dir), "splits": splits}


def write_run_card(folder: str | Path, cfg, step: int, metrics_path: str | Path, *, stage: str = "grpo",
                   load_path: str | Path | None = None, config_path: str | Path | None = None) -> Path:
    """``write_model_card`` with the facts of the run ``cfg`` (a ``Config``) at ``step``."""
    from elasticmem.utils.configuration import to_dict

    metrics, evaluation = logged_rows(metrics_path, step)
    return write_model_card(folder, base_model=cfg.backbone.name_or_path, config=to_dict(cfg),
                            data=data_summary(cfg.data.dir), metrics=metrics, step=step, stage=stage,
                            load_path=str(load_path) if load_path is not None else None,
                            config_path=str(config_path) if config_path is not None else None,
                            evaluation=evaluation)
