"""Group-restricted search as an exact matrix product on a chosen device (elasticmem.bank.index).

    pytest tests/unit/test_index_device.py

Restricted searches must equal a brute-force reference computed here with torch (normalise,
matmul, stable sort over the group's rows: equal scores by ascending row) and the FAISS flat
index filtered to the group (the path restricted searches took before), for groups of one and
of several row segments, k larger than a group (-1 / -inf padding), mixed batches of groups and
None, keys split into several blocks, exact ties, and an enclosing autocast. The FAISS GPU copy
is made only by an unrestricted search. The device runs are 'cpu' here and also 'cuda' where
torch sees a GPU.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from elasticmem.bank import index as index_mod
from elasticmem.bank.index import TorchIndex, build_index
from elasticmem.config import IndexConfig

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class FakeBank:
    """What the indexes read of a Bank: keys by row range, the groups' row segments, no deleted row."""

    deleted = ()

    def __init__(self, keys: torch.Tensor, groups: dict[str, tuple[tuple[int, int], ...]]):
        self._k, self.groups = keys, groups
        self.num_chunks, self.hidden_size = keys.shape
        self.root, self.manifest = Path("/nonexistent/bank"), {}

    def keys(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        return self._k[start : self.num_chunks if end is None else end]

    def group_segments(self, g: str) -> tuple[tuple[int, int], ...]:
        return self.groups[g]

    def group_row_ids(self, g: str) -> torch.Tensor:
        return torch.cat([torch.arange(a, b) for a, b in self.groups[g]])

    def extends(self, other) -> bool:
        return False

    def live_segments(self) -> tuple[tuple[int, int], ...]:
        return ((0, self.num_chunks),)


GROUPS = {
    "a": ((0, 40), (100, 130), (250, 260)),  # three segments (a group appended to twice)
    "b": ((40, 100),),
    "c": ((130, 133),),  # 3 rows: smaller than k
    "d": ((133, 250), (260, 300)),
}


def _bank(seed: int = 0, n: int = 300, d: int = 24) -> FakeBank:
    g = torch.Generator().manual_seed(seed)
    return FakeBank(F.normalize(torch.randn(n, d, generator=g), dim=-1), GROUPS)


def _queries(bank: FakeBank, n: int, seed: int = 1) -> torch.Tensor:
    # not normalised: the index normalises them
    return 3 * torch.randn(n, bank.hidden_size, generator=torch.Generator().manual_seed(seed))


def _four_hot(n: int, d: int, value: float, seed: int) -> torch.Tensor:
    """Rows with 4 entries +-value and zeros elsewhere."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(n, d)
    pos = torch.rand(n, d, generator=g).argsort(dim=1)[:, :4]
    out.scatter_(1, pos, value * (2 * torch.randint(0, 2, (n, 4), generator=g).float() - 1))
    return out


def _tied_bank_and_queries(nq: int, n: int = 300, d: int = 24) -> tuple[FakeBank, torch.Tensor]:
    """Keys and queries whose cosines are multiples of 1/4 and exact in float32 whatever the order
    of the sums (keys: 4 entries +-1/2, unit norm; queries: 4 entries +-1, norm 2, so normalised
    exactly): many exact ties, also across the k-th place, and the same scores on every device."""
    return FakeBank(_four_hot(n, d, 0.5, seed=0), GROUPS), _four_hot(nq, d, 1.0, seed=1)


def _reference(bank: FakeBank, q: torch.Tensor, k: int, groups) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force, written independently of the index: [Q, k] scores and rows, -inf / -1 padded."""
    qn = F.normalize(q.float(), dim=-1)
    scores, rows = torch.full((len(q), k), float("-inf")), torch.full((len(q), k), -1, dtype=torch.long)
    for i in range(len(q)):
        ids = torch.arange(bank.num_chunks) if groups[i] is None else bank.group_row_ids(groups[i])
        s = qn[i] @ bank.keys()[ids].T
        s, order = torch.sort(s, descending=True, stable=True)  # ids ascending: ties by row
        n = min(k, len(ids))
        scores[i, :n], rows[i, :n] = s[:n], ids[order[:n]]
    return scores, rows


def _faiss_flat_filtered(bank: FakeBank, q: torch.Tensor, k: int, groups) -> tuple[torch.Tensor, torch.Tensor]:
    """What restricted flat searches returned before: IndexFlatIP with an ID filter per query."""
    import faiss

    index = faiss.IndexFlatIP(bank.hidden_size)
    index.add(bank.keys().numpy())
    qn = F.normalize(q.float(), dim=-1).numpy()
    scores, rows = torch.full((len(q), k), float("-inf")), torch.full((len(q), k), -1, dtype=torch.long)
    for i, g in enumerate(groups):
        params = None if g is None else faiss.SearchParameters(sel=faiss.IDSelectorBatch(bank.group_row_ids(g).numpy()))
        D, I = index.search(qn[i : i + 1], k, params=params)
        r = torch.from_numpy(I[0]).long()
        scores[i], rows[i] = torch.where(r >= 0, torch.from_numpy(D[0]), float("-inf")), r
    return scores, rows


def _check(res, want_scores, want_rows, atol=1e-6):
    assert torch.equal(res.rows, want_rows)
    assert torch.equal(torch.isinf(res.scores), torch.isinf(want_scores))
    fin = torch.isfinite(want_scores)
    torch.testing.assert_close(res.scores[fin], want_scores[fin], atol=atol, rtol=0)


def _indexes(bank, device):
    return {"torch": TorchIndex(bank, device=device),
            "flat": build_index(bank, IndexConfig(type="flat"), device=device),
            "ivf": build_index(bank, IndexConfig(type="ivf", nlist=4, nprobe=1, save=False), device=device)}


MIXED = ["a", "b", None, "c", "a", "d", None, "c", "b", "a", "d", "c"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("small_blocks", [False, True])
def test_restricted_search_equals_brute_force_and_faiss_flat(device, small_blocks, monkeypatch):
    """Mixed batch (several groups and None), groups of 1-3 segments, k=8 > the 3 rows of 'c'."""
    if small_blocks:  # 7 keys per block: each group is searched in several blocks, then merged
        monkeypatch.setattr(index_mod, "BLOCK_BYTES", 7 * 4 * 24)
    bank = _bank()
    q = _queries(bank, len(MIXED))
    want = _reference(bank, q, 8, MIXED)
    flat = _faiss_flat_filtered(bank, q, 8, MIXED)
    _check(SearchLike(*flat), *want, atol=1e-5)  # the reference agrees with FAISS (no exact ties here)
    for name, index in _indexes(bank, device).items():
        res = index.search(q, 8, MIXED)
        if name == "ivf":  # its unrestricted searches are approximate (nprobe 1 of 4 cells)
            keep = torch.tensor([g is not None for g in MIXED])
            _check(SearchLike(res.scores[keep], res.rows[keep]), want[0][keep], want[1][keep])
        else:
            _check(res, *want, atol=1e-5 if name == "flat" else 1e-6)
        restricted = [i for i, g in enumerate(MIXED) if g is not None]
        assert torch.equal(res.rows[restricted], flat[1][restricted]), name  # == the FAISS filtered path
        torch.testing.assert_close(res.scores[restricted], flat[0][restricted], atol=1e-5, rtol=0)
        c = [i for i, g in enumerate(MIXED) if g == "c"]
        assert (res.rows[c, 3:] == -1).all() and torch.isneginf(res.scores[c, 3:]).all()


class SearchLike:
    def __init__(self, scores, rows):
        self.scores, self.rows = scores, rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("small_blocks", [False, True])
def test_exact_ties_go_by_row(device, small_blocks, monkeypatch):
    """Equal scores are ordered by ascending row, and a tie across the k-th place keeps its lowest
    rows, whatever the blocks and the device."""
    if small_blocks:
        monkeypatch.setattr(index_mod, "BLOCK_BYTES", 5 * 4 * 24)
    bank, q = _tied_bank_and_queries(len(MIXED))
    want = _reference(bank, q, 20, MIXED)
    assert (want[0][:, 19] == want[0][:, 18]).sum() >= 6, "test data: ties at the cut"
    for name, index in _indexes(bank, device).items():
        res = index.search(q, 20, MIXED)
        restricted = torch.tensor([g is not None for g in MIXED])
        if name == "torch":  # the torch index is exact unrestricted too
            restricted[:] = True
        assert torch.equal(res.rows[restricted], want[1][restricted]), name
        assert torch.equal(res.scores[restricted], want[0][restricted]), name


def test_top_keeps_the_lowest_columns_of_a_tie_at_the_cut():
    s = torch.tensor([[0.5, 1.0, 0.5, 0.2, 0.5, 1.0, 0.5],
                      [3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0],
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    vals, cols = index_mod._top(s, 4)
    assert cols.tolist() == [[1, 5, 0, 2], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert vals.tolist() == [[1.0, 1.0, 0.5, 0.5], [3.0, 2.0, 1.0, 0.0], [0.0] * 4]


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_does_not_change_restricted_search(device):
    """The product runs outside any enclosing autocast (training runs under accelerate's)."""
    bank = _bank(d=256, n=300)
    q = _queries(bank, len(MIXED))
    index = build_index(bank, IndexConfig(type="flat"), device=device)
    want = _reference(bank, q, 8, MIXED)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        res = index.search(q, 8, MIXED)
    _check(res, *want, atol=1e-5)


def test_device_setting_and_faiss_gpu_copy_made_only_for_unrestricted_search(monkeypatch):
    bank = _bank()
    assert build_index(bank, IndexConfig(type="flat")).device == torch.device("cpu")
    assert build_index(bank, IndexConfig(type="torch"), device="cpu").device == torch.device("cpu")
    index = build_index(bank, IndexConfig(type="flat"), gpu_device=3)
    # as with bank.index.gpu (this faiss has no GPU: its 'GPU copy' is the CPU index)
    index.cfg = dataclasses.replace(index.cfg, gpu=True)
    made = []
    monkeypatch.setattr(index, "_to_gpu", lambda dev: made.append(dev) or index.index)
    q = _queries(bank, 4)
    index.search(q, 5, ["a", "b", "c", "d"])
    index.search(q, 5, ["a"] * 4)
    assert made == [] and index.gpu_index is None  # every query restricted: no GPU copy
    res = index.search(q, 5, ["a", None, "c", None])
    index.search(q, 5)
    assert made == [3]  # made once, on gpu_device, by the first unrestricted search
    _check(res, *_reference(bank, q, 5, ["a", None, "c", None]), atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_appended_bank_groups_of_several_segments(tmp_path, tiny_backbone, device):
    """A real bank grown by an append: its groups hold two row segments."""
    from conftest import make_examples

    from elasticmem.bank import Bank, build_bank
    from elasticmem.bank.append import SessionAdd, append_sessions
    from elasticmem.config import BankConfig, ChunkingConfig

    ex = make_examples(4, seed=3)
    hist = {e.group: e.history for e in ex}
    first = [dataclasses.replace(e, history=e.history[:1]) for e in ex]
    cfg = BankConfig(dir=str(tmp_path / "b"), n_cache=4, batch_size=5, shard_rows=7)
    build_bank({"train": first}, tiny_backbone, ChunkingConfig(max_tokens=48), cfg, torch.float32,
               show_progress=False)
    bank = append_sessions(Bank.open(cfg.dir), [SessionAdd(g, t, s) for g, h in hist.items()
                                                for s, t in enumerate(h) if s >= 1],
                           tiny_backbone.model.get_decoder(), tiny_backbone.tokenizer, tiny_backbone.fingerprint,
                           batch_size=3).bank
    several = [g for g in bank.groups if len(bank.group_segments(g)) > 1]
    assert several, "test data: a group appended to"
    groups = [sorted(bank.groups)[i % len(bank.groups)] for i in range(7)] + [several[0], None]
    q = torch.randn(len(groups), bank.hidden_size, generator=torch.Generator().manual_seed(0))
    want = _reference(bank, q, 6, groups)
    for index in (TorchIndex(bank, device=device), build_index(bank, IndexConfig(type="flat"), device=device)):
        _check(index.search(q, 6, groups), *want, atol=1e-5)
