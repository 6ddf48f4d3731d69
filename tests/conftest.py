"""Shared fixtures: the tiny random backbone, hand-made examples, SmolLM2 when cached.

    pytest tests/            # whole suite (offline, CPU)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Under pytest-xdist (scripts/test.sh runs 2 workers) the cores are shared out among the workers:
# two 1-thread workers finish the suite sooner than one 2-thread process, because most tests are
# small-model work that a second thread barely speeds up.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


def launch_2() -> tuple[str, ...]:
    """Two CPU processes under accelerate (DDP over gloo; with ACCELERATE_USE_CPU=1, DESIGN.md section 4).

    Each call picks its own rendezvous port. Without one, accelerate checks whether 29500 is free and takes it;
    when the suite's two xdist workers launch at the same moment both see it free and one fails with EADDRINUSE
    (stop 52's CI run did).
    """
    from elasticmem.utils.common import free_port

    return (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()))


def proc_stat(pid: int) -> tuple[str, str, int] | None:
    """(name, state, parent pid) of a process from Linux's /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
    return name, rest[0], int(rest[1])


def live_children(pid: int) -> dict[int, str]:
    """{pid: name} of the live (not zombie) processes whose parent is ``pid``."""
    stats = {int(e): proc_stat(int(e)) for e in os.listdir("/proc") if e.isdigit()}
    return {p: st[0] for p, st in stats.items() if st is not None and st[2] == pid and st[1] != "Z"}


@pytest.fixture(scope="session")
def tiny_backbone():
    from elasticmem.backbone import load_backbone
    from elasticmem.config import BackboneConfig

    return load_backbone(BackboneConfig(name_or_path="tiny", device="cpu"))


def smollm2_dir() -> Path | None:
    from elasticmem.backbone import ALIASES, models_home

    p = models_home() / ALIASES["smollm2"]["dirname"]
    return p if (p / "config.json").is_file() else None


requires_smollm2 = pytest.mark.skipif(
    smollm2_dir() is None,
    reason="SmolLM2-135M-Instruct is not cached; run `python -m elasticmem.backbone fetch smollm2` (scripts/test.sh does)",
)


@pytest.fixture(scope="session")
def smollm2_backbone():
    if smollm2_dir() is None:
        pytest.skip("SmolLM2 not cached (python -m elasticmem.backbone fetch smollm2)")
    from elasticmem.backbone import load_backbone
    from elasticmem.config import BackboneConfig

    return load_backbone(BackboneConfig(name_or_path="smollm2", device="cpu"))


def make_examples(n_groups: int = 3, seed: int = 0, questions_per_group: int = 2):
    """Hand-made examples whose chunks span 1 to ~60 words (shorter and longer than any N_c used)."""
    import random

    from elasticmem.data.schema import Example, Turn

    rng = random.Random(seed)
    words = "cat dog sun box cup hat key map pen bed car egg fox owl".split()  # single tokens in the tiny vocab
    examples = []
    for g in range(n_groups):
        history = []
        for s in range(rng.randint(1, 3)):
            session = []
            for t in range(rng.randint(1, 5)):
                role = rng.choice(["user", "assistant", "user"])
                n = rng.choice([1, 2, 3, 8, 20, 60])
                date = "2024-05-01" if s == 1 else None  # dates only in some sessions: they add ~12 tokens
                session.append(Turn(role, " ".join(rng.choice(words) for _ in range(n)), date=date))
            history.append(session)
        for q in range(questions_per_group):
            examples.append(
                Example(id=f"g{g}-q{q}", source="test", group=f"g{g}", question="what did the cat do?",
                        choices=["sat", "ran", "slept", "ate"], answer_index=q % 4, question_type="t",
                        history=history)
            )
    return examples


def run_cli_here(script: str, args: list[str], capsys) -> tuple[int, str, str]:
    """A CLI script's ``main(args)`` (``script``: e.g. "evaluate.py" at the repo root) in this
    process, without a process start-up: exit code (argparse's SystemExit too), stdout, stderr."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{Path(script).stem}_cli", ROOT / script)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    capsys.readouterr()
    try:
        code = cli.main(args)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def one_thread():
    """Token-by-token decoding is several times slower with 2 threads on a loaded 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_ladder_checkpoint(root: Path, overrides: list[str]) -> Path:
    """The tiny mechanism preset's data and bank under ``overrides``, and an untrained checkpoint
    whose policy is perturbed so that its argmax gives uneven budgets (``root / "ckpt"``): what the
    reading ladder's tests evaluate."""
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import build_bank
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.data.synthetic import write_synthetic
    from elasticmem.systems import build_system

    cfg = load_config(ROOT / "configs/tiny_mechanism.yaml", overrides)
    write_synthetic(cfg.data.synthetic, cfg.seed, cfg.data.dir)
    examples = {s: load_split(cfg.data.dir, s) for s in ("train", "val", "test")}
    build_bank(examples, load_backbone(cfg.backbone), cfg.chunking, cfg.bank, torch.float32, show_progress=False)
    system = build_system(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in system.model.policy.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    system.model.save_pretrained(root / "ckpt")
    return root / "ckpt"


def load_script(name: str):
    """``scripts/NAME.py`` imported as a module (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# LoCoMo in locomo10.json's layout, small: tests/unit/test_data_locomo.py and the LoCoMo recipe's test
def locomo_turn(speaker: str, dia: str, text: str, **kw) -> dict:
    return {"speaker": speaker, "dia_id": dia, "text": text, **kw}


def locomo_conversation(sample_id: str, answers: list[tuple[int, object]], a: str = "Ann", b: str = "Bob") -> dict:
    conv = {
        "speaker_a": a, "speaker_b": b,
        "session_1_date_time": "1:00 pm on 1 May, 2023",
        "session_1": [locomo_turn(a, "D1:1", "I adopted a cat."), locomo_turn(b, "D1:2", "Nice!"),
                      locomo_turn(a, "D1:3", "Look.", img_url=["x"], blip_caption="a photo of a cat", query="cat")],
        "session_2_date_time": "2:00 pm on 9 May, 2023",
        "session_2": [locomo_turn(b, "D2:1", "How is the cat?"), locomo_turn(a, "D2:2", "Great.")],
        "session_3_date_time": "never happened",  # a date without a session, as in the real file
    }
    qa = []
    for i, (cat, ans) in enumerate(answers):
        q = {"question": f"{sample_id} question {i}?", "evidence": ["D1:1; D2:2"], "category": cat}
        if cat == 5:
            q["adversarial_answer"] = f"trap {i}"
        else:
            q["answer"] = ans
        qa.append(q)
    return {"sample_id": sample_id, "conversation": conv, "qa": qa, "event_summary": {}, "observation": {},
            "session_summary": {}}


def locomo_file(tmp_path: Path, n_conv: int = 10, per_conv: int = 12) -> Path:
    data = []
    for c in range(n_conv):
        answers = [((i % 4) + 1, f"answer {c}-{i}") for i in range(per_conv)] + [(5, None), (2, 2022)]
        data.append(locomo_conversation(f"conv-{c + 1}", answers))
    p = tmp_path / "locomo10.json"
    p.write_text(json.dumps(data, indent=1))
    return p
