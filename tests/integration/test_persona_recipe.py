"""scripts/persona_recipe.sh on the tiny mechanism preset: one seed, the recipe and its no-memory
control, the seed's reading ladder with the cost dial, the summary; a piece whose time is up stops
with exit 75 and the same command continues; a finished run redoes nothing. (Pooling several seeds'
ladders: tests/integration/test_ladder.py.)

    pytest tests/integration/test_persona_recipe.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import locomo_file

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "persona_recipe.sh"
OVERRIDES = ["data.synthetic.num_histories=16", "warmup.steps=3", "train.max_steps=2", "train.save_every=0",
             "train.eval_split=", "train.batch_size=4", "train.group_size=2", "eval.limit=8", "eval.batch_size=8"]

pytestmark = pytest.mark.slow


def run(out: Path, **env_) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "CONFIG": "configs/tiny_mechanism.yaml", "SEEDS": "0", "MAP": "0",
           "ARMS": "elasticmem no_memory", "CAPS": "2", "ELASTICMEM_VENV": sys.prefix, "OMP_NUM_THREADS": "1",
           **env_}
    return subprocess.run(["bash", str(SCRIPT), *OVERRIDES], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_runs_in_pieces_to_a_summary_over_seeds_and_redoes_nothing(tmp_path):
    out = tmp_path / "recipe"
    p = run(out, PIECE_SECONDS="0")
    assert p.returncode == 75 and "run the same command again" in p.stderr
    assert not (out / "data").exists()
    p = run(out)
    assert p.returncode == 0, p.stderr[-3000:]
    for s in (0,):
        em = yaml.safe_load((out / f"s{s}/elasticmem/train/config.yaml").read_text())
        assert em["seed"] == s and em["train"]["init_from"] == str(out / f"s{s}/elasticmem/warmup/final")
        assert em["data"]["dir"] == str(out / "data") and em["bank"]["dir"] == str(out / "bank")
        nm = yaml.safe_load((out / f"s{s}/no_memory/train/config.yaml").read_text())
        assert nm["memory"]["top_z"] == 0 and nm["warmup"]["budget_weight"] == 0
        ladder = json.loads((out / f"s{s}/ladder/ladder.json").read_text())
        from elasticmem.apps.ladder import RUNGS, _applies

        # tiny_mechanism: Z = 4; no text arm (ARMS has none): the latent rungs only
        assert set(ladder["rungs"]) == {r.name for r in RUNGS if _applies(r, 4) and not r.text}
        assert len(ladder["cost_dial"]) == 1 and len(ladder["rules"]["cost_dial"]) == 1
        res = json.loads((out / f"s{s}/ladder/no_memory_trained/results.json").read_text())
        assert res["num_examples"] == 8 and res["avg_memory_tokens"] == 0
    summary = (out / "summary.md").read_text()
    for name in ("latent_learned - latent_uniform", "latent_learned - no_memory_trained"):
        assert name in summary
    assert summary.count("## Reading ladder") == 1
    again = run(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[recipe] seed" not in again.stderr  # every stage was done: none ran again


def test_locomo_script_is_the_recipe_on_locomo(tmp_path):
    """scripts/locomo_mc10.sh: LoCoMo MC-10 prepared as the recipe's data stage (OUT/data), the recipe's
    stages on it (here the tiny preset's bank and its no-memory arm, trained and evaluated), then the full
    context as a reference; without LOCOMO it refuses to start."""
    script = ROOT / "scripts" / "locomo_mc10.sh"
    env = {**os.environ, "ELASTICMEM_VENV": sys.prefix, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", str(script)], cwd=ROOT, env={k: v for k, v in env.items() if k != "LOCOMO"},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "set LOCOMO" in p.stderr
    locomo, out = locomo_file(tmp_path, per_conv=3), tmp_path / "locomo"  # 4 MC questions a conversation
    # a preset that lists comparison variants, as configs/locomo_mc10.yaml does: an arm's evaluation is still one system
    preset = yaml.safe_load((ROOT / "configs" / "tiny_mechanism.yaml").read_text())
    preset.setdefault("eval", {})["variants"] = {"elasticmem": [], "text_rag": ["eval.system=text_rag"]}
    (tmp_path / "preset.yaml").write_text(yaml.safe_dump(preset))
    env |= {"LOCOMO": str(locomo), "OUT": str(out), "CONFIG": str(tmp_path / "preset.yaml"), "MAP": "0",
            "ARMS": "no_memory"}
    p = subprocess.run(["bash", str(script), *OVERRIDES], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    stats = json.loads((out / "data" / "stats.json").read_text())
    assert stats["dataset"] == "locomo-mc10" and stats["inputs"][0]["path"] == str(locomo)
    test_ids = {json.loads(line)["id"] for line in (out / "data" / "test.jsonl").read_text().splitlines()}
    assert len(test_ids) == 8
    nm = yaml.safe_load((out / "s0/no_memory/train/config.yaml").read_text())
    assert nm["data"]["dir"] == str(out / "data") and nm["memory"]["top_z"] == 0
    for name, system in (("s0/ladder/no_memory_trained", "no_memory"), ("full_context", "full_context")):
        rows = [json.loads(line) for line in (out / name / "predictions.jsonl").read_text().splitlines()]
        assert {r["id"] for r in rows} == test_ids, name
        assert yaml.safe_load((out / name / "config.yaml").read_text())["eval"]["system"] == system
