"""Every saved checkpoint folder (GRPO steps, GRPO final, warm-up checkpoint and final) carries a
model card, README.md, as peft / transformers checkpoints do: its front matter is Hugging Face's,
its metrics are the logged row of its step, its config is the run's, and its loading lines run
and load exactly the saved weights.

    OMP_NUM_THREADS=1 python -m pytest tests/integration/test_model_card.py -q
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_train import _cfg, _metrics, tiny_setup  # noqa: F401  (fixture)

from elasticmem.utils import checkpointing as ckpt


def _card(folder: Path) -> tuple[dict, dict[str, list[str]], str]:
    """(front matter, fenced blocks by language in order, body) of ``folder/README.md``."""
    text = (folder / "README.md").read_text()
    m = re.match(r"---\n(.*?)\n---\n(.*)", text, re.S)
    assert m, f"{folder}/README.md has no front matter"
    blocks: dict[str, list[str]] = {}
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", m.group(2), re.S):
        blocks.setdefault(lang, []).append(body)
    return yaml.safe_load(m.group(1)), blocks, m.group(2)


def _same_row(card_row: dict, logged: dict) -> None:
    # json text, not ==: a NaN (grad_norm of a skipped step) is equal to itself only as text
    assert json.dumps(card_row, sort_keys=True) == json.dumps(logged, sort_keys=True)


def _loaded_equals_saved(snippet: str, folder: Path) -> None:
    """Run the card's Python lines; the model they load holds the folder's weights, bit for bit."""
    from peft import get_peft_model_state_dict

    ns: dict = {}
    exec(compile(snippet, f"{folder}/README.md", "exec"), ns)  # noqa: S102  (the card's own lines)
    model = ns["mem"].model if "mem" in ns else ns["model"]  # LiveMemory's, or MemGen's through build_system
    got = {f"adapter:{k}": v for k, v in get_peft_model_state_dict(model.lm, save_embedding_layers=False).items()}
    saved = {f"adapter:{k}": v for k, v in load_file(str(folder / "adapter/adapter_model.safetensors")).items()}
    if "mem" in ns:
        got.update({f"budget_policy:{k}": v for k, v in model.policy.state_dict().items()})
        got.update({f"projector:{k}": v for k, v in model.projector.state_dict().items()})
        for name in ("budget_policy", "projector"):
            saved.update({f"{name}:{k}": v for k, v in load_file(str(folder / f"{name}.safetensors")).items()})
    else:
        got.update({f"memgen:{part}.{k}": v for part in ("weaver", "trigger")
                    for k, v in getattr(model, part).state_dict().items()})
        saved.update({f"memgen:{k}": v for k, v in load_file(str(folder / "memgen.safetensors")).items()})
    assert got.keys() == saved.keys()
    assert all(torch.equal(got[k].cpu(), saved[k]) for k in saved)


def _eval_command_is_valid(blocks: dict[str, list[str]], folder: Path) -> None:
    from elasticmem.config import Config
    from elasticmem.utils.configuration import load

    cmd = shlex.split(blocks["bash"][0])
    assert cmd[:2] == ["elasticmem-eval", "--config"] and f"checkpoint={folder}" in cmd
    from elasticmem.apps.evaluate import _expand  # checkpoint=, system=: the command line's short keys

    load(Config, cmd[2], _expand(cmd[3:]))  # every key exists and every value has its type


def _check(folder: Path, cfg, row: dict, stage_tag: str, *more_tags: str) -> None:
    front, blocks, body = _card(folder)
    assert front == {"library_name": "elasticmem", "base_model": cfg.backbone.name_or_path,
                     "tags": ["elasticmem", stage_tag, "lora", *more_tags]}
    _same_row(json.loads(blocks["json"][0]), row)
    from elasticmem.utils.configuration import to_dict

    assert yaml.safe_load(blocks["yaml"][0]) == to_dict(cfg)
    assert f"`{cfg.data.dir}` (train 960 questions, val 120 questions, test 120 questions)" in body
    _eval_command_is_valid(blocks, folder)
    _loaded_equals_saved(blocks["python"][0], folder)


@pytest.fixture(scope="module")
def grpo_run(tiny_setup, tmp_path_factory):
    """(config, run folder) of 2 tiny GRPO steps with a checkpoint after each."""
    from elasticmem.grpo.trainer import train

    out = tmp_path_factory.mktemp("card") / "run"
    cfg = _cfg(tiny_setup, out, "train.max_steps=2", "train.save_every=1", "train.eval_split=")
    train(cfg)
    return cfg, out


def test_every_grpo_checkpoint_has_a_model_card(grpo_run):
    cfg, out = grpo_run
    rows = {r["step"]: r for r in _metrics(out)}
    folders = [*ckpt.list_checkpoints(out / "checkpoints"), out / "final"]
    assert [p.name for p in folders] == ["step_000001", "step_000002", "final"]
    for folder in folders:
        step = 2 if folder.name == "final" else int(folder.name.split("_")[1])
        _check(folder, cfg, rows[step], "grpo")
    # the two steps' cards differ where the runs did: not one card copied around
    assert _card(folders[0])[1]["json"] != _card(folders[1])[1]["json"]


@pytest.mark.parametrize("bad", ["metrics", "config", "weights"])
def test_the_card_checks_can_fail(grpo_run, tmp_path, bad):
    """A card with another step's metrics, another config, or loading lines that load other weights
    is caught by ``_check``."""
    import shutil

    from elasticmem.model.card import write_run_card

    cfg, out = grpo_run
    final = tmp_path / "final"
    shutil.copytree(out / "final", final)
    if bad == "metrics":
        write_run_card(final, cfg, 1, out / "metrics.jsonl", config_path=out / "config.yaml")
    elif bad == "config":
        write_run_card(final, _cfg(Path(cfg.data.dir).parent, out, "train.max_steps=3"), 2, out / "metrics.jsonl",
                       config_path=out / "config.yaml")
    else:  # the card names the step-1 checkpoint
        write_run_card(final, cfg, 2, out / "metrics.jsonl", load_path=out / "checkpoints/step_000001",
                       config_path=out / "config.yaml")
        (final / "README.md").write_text((final / "README.md").read_text().replace(
            f"checkpoint={out}/checkpoints/step_000001", f"checkpoint={final}"))
    with pytest.raises(AssertionError) as caught:
        _check(final, cfg, {r["step"]: r for r in _metrics(out)}[2], "grpo")
    # caught by the check meant for it, not by something else the change broke
    failed_in = {"metrics": "_same_row", "config": "_check", "weights": "_loaded_equals_saved"}[bad]
    assert caught.traceback[-1].name == failed_in, caught.traceback[-1].name


def test_memgen_checkpoint_card_loads_the_memgen_model(tiny_setup, tmp_path):
    """MemGen (train.system=memgen) is loaded through build_system, not LiveMemory: its card says so."""
    from elasticmem.grpo.trainer import train

    out = tmp_path / "memgen"
    cfg = _cfg(tiny_setup, out, "train.system=memgen", "memgen.prompt_latents=4", "memgen.inference_latents=2",
               "memgen.trigger_hidden=32", "train.max_steps=1", "train.save_every=0", "train.eval_split=")
    train(cfg)
    _check(out / "final", cfg, _metrics(out)[-1], "grpo", "memgen")
    assert "system=memgen" in _card(out / "final")[1]["bash"][0]


def test_warmup_checkpoint_and_final_have_a_model_card(tiny_setup, tmp_path):
    from elasticmem.warmup.reading import warmup

    out = tmp_path / "warmup"
    over = ["warmup.steps=2", "warmup.save_every=1", "warmup.eval_split=", "warmup.batch_size=4",
            f"warmup.output_dir={out}"]
    stopped = _cfg(tiny_setup, tmp_path / "unused", *over, "warmup.stop_after_steps=1")
    assert warmup(stopped)["stopped_at"] == 1
    (step1,) = ckpt.list_checkpoints(out / "checkpoints")
    _check(step1, stopped, _metrics(out)[0], "reading-warmup")
    cfg = _cfg(tiny_setup, tmp_path / "unused", *over)
    warmup(cfg)  # resumes to the end: final/ replaces the checkpoints
    _check(out / "final", cfg, _metrics(out)[-1], "reading-warmup")


def test_card_without_logged_metrics_says_so(tmp_path):
    from elasticmem.model.card import write_model_card

    path = write_model_card(tmp_path / "ck", base_model="org/model: v2", config={"bank": {"dir": "b"}},
                            data={"dir": "d"}, metrics=None, step=0)
    front, blocks, body = _card(path.parent)
    assert front["base_model"] == "org/model: v2"  # quoted by the YAML writer, not broken by the colon
    assert "No metrics were logged" in body and "json" not in blocks
