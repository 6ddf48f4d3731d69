"""The latent memory bank against independent computations (tiny random model, CPU).

    pytest tests/unit/test_bank.py
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np
import pytest
import torch
from conftest import make_examples

from elasticmem.bank import Bank, BankError, build_bank, build_index
from elasticmem.bank import builder as builder_mod
from elasticmem.config import BankConfig, ChunkingConfig, IndexConfig
from elasticmem.data.chunking import chunk_history
from elasticmem.data.schema import SchemaError

CHUNKING = ChunkingConfig(max_tokens=48, truncation_side="right", add_special_tokens=True)


def _build(tmp_path, backbone, name="bank", examples=None, **bank_kw):
    cfg = BankConfig(dir=str(tmp_path / name), **{"n_cache": 8, "batch_size": 5, "shard_rows": 7, **bank_kw})
    ex = examples if examples is not None else make_examples(4)
    res = build_bank({"train": ex}, backbone, CHUNKING, cfg, torch.float32, show_progress=False)
    return res, Bank.open(cfg.dir, expect_fingerprint=backbone.fingerprint)


def _reference_states(backbone, text):
    """hidden_states[-1] of one chunk alone, with plain transformers (no padding, no batching)."""
    tok = backbone.tokenizer
    ids = tok(text, add_special_tokens=CHUNKING.add_special_tokens, truncation=True,
              max_length=CHUNKING.max_tokens, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = backbone.model(input_ids=ids, output_hidden_states=True)
    return out.hidden_states[-1][0]  # [L, d]


def test_keys_and_caches_equal_reference(tmp_path, tiny_backbone):
    ex = make_examples(4)
    _, bank = _build(tmp_path, tiny_backbone, examples=ex)
    n_cache = bank.n_cache
    lengths = [c["n_tokens"] for c in bank.chunks()]
    assert min(lengths) < n_cache < max(lengths), "test data must cover chunks shorter and longer than N_c"
    cache, cache_len = bank.gather(torch.arange(bank.num_chunks))
    keys = bank.keys()
    assert keys.dtype == torch.float32 and cache.dtype == torch.float32 and cache_len.dtype == torch.int32
    for row, rec in enumerate(bank.chunks()):
        H = _reference_states(tiny_backbone, rec["text"])
        L = H.shape[0]
        assert rec["n_tokens"] == L
        ref_key = H[-1] / H[-1].norm()
        assert (keys[row] - ref_key).abs().max() < 1e-4
        c = min(L, n_cache)
        assert cache_len[row] == c
        assert (cache[row, n_cache - c :] - H[L - c :]).abs().max() < 1e-4  # right-aligned valid states
        assert (cache[row, : n_cache - c] == 0).all()  # zeros elsewhere


def test_rows_follow_groups_and_chunks(tmp_path, tiny_backbone):
    ex = make_examples(3)
    _, bank = _build(tmp_path, tiny_backbone, examples=ex)
    expected = []
    for g in ["g0", "g1", "g2"]:
        history = next(e.history for e in ex if e.group == g)
        start = len(expected)
        expected += [c.text for c in chunk_history(history, g)]
        assert bank.group_rows(g) == (start, len(expected))
    assert [c["text"] for c in bank.chunks()] == expected
    assert [c["row"] for c in bank.chunks()] == list(range(len(expected)))


def test_independent_of_batch_size_and_sharding(tmp_path, tiny_backbone):
    _, a = _build(tmp_path, tiny_backbone, "a", batch_size=1, shard_rows=1000)
    _, b = _build(tmp_path, tiny_backbone, "b", batch_size=16, shard_rows=3)
    assert len(b.shards) > 1
    assert torch.allclose(a.keys(), b.keys(), atol=1e-5)
    ca, la = a.gather(torch.arange(a.num_chunks))
    cb, lb = b.gather(torch.arange(b.num_chunks))
    assert torch.equal(la, lb) and torch.allclose(ca, cb, atol=1e-5)


def test_manifest_contract(tmp_path, tiny_backbone):
    _, bank = _build(tmp_path, tiny_backbone)
    m = json.loads((bank.root / "manifest.json").read_text())
    for key in ("format_version", "encoder", "hidden_size", "n_cache", "cache_dtype", "num_chunks",
                "tokenization", "shards", "groups", "groups_sha256", "key"):
        assert key in m
    assert m["key"] == {"variant": "last"} and bank.key == {"variant": "last"}  # the paper's key (the default)
    # groups_sha256: per group, sha256 of its chunk texts in row order, recomputable from chunks.jsonl alone
    texts = [json.loads(line)["text"] for line in (bank.root / "chunks.jsonl").open()]
    assert m["groups_sha256"] == {
        g: hashlib.sha256(json.dumps(texts[a:b], ensure_ascii=False).encode()).hexdigest()
        for g, (a, b) in m["groups"].items()}
    assert m["encoder"]["fingerprint"] == tiny_backbone.fingerprint
    assert m["tokenization"] == dataclasses.asdict(CHUNKING)
    assert sum(s["rows"] for s in m["shards"]) == m["num_chunks"]
    from safetensors import safe_open

    with safe_open(str(bank.root / m["shards"][0]["file"]), "pt") as f:
        assert set(f.keys()) == {"keys", "cache", "cache_len"}
        assert f.get_slice("cache").get_shape()[1:] == [m["n_cache"], m["hidden_size"]]
    assert not (bank.root / ".build").exists()


def _brute_force(keys: np.ndarray, q: np.ndarray, k: int, offset: int = 0):
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    s = qn @ keys.T
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(s, order, 1), order + offset


@pytest.mark.parametrize("index_type", ["torch", "flat", "ivf"])
def test_search_equals_brute_force(tmp_path, tiny_backbone, index_type):
    _, bank = _build(tmp_path, tiny_backbone, examples=make_examples(6))
    cfg = IndexConfig(type=index_type, nlist=4, nprobe=4)  # nprobe == nlist: IVF visits all cells, exact
    index = build_index(bank, cfg)
    keys = bank.keys().numpy()
    q = np.random.default_rng(0).normal(size=(9, keys.shape[1])).astype(np.float32)
    res = index.search(torch.from_numpy(q), 5)
    s, r = _brute_force(keys, q, 5)
    assert np.array_equal(res.rows.numpy(), r)
    assert np.allclose(res.scores.numpy(), s, atol=1e-5)
    # Restricted to a group, with k larger than some groups: pad with -1 / -inf.
    groups = [f"g{i % 6}" for i in range(9)]
    res = index.search(torch.from_numpy(q), 8, groups=groups)
    for i, g in enumerate(groups):
        a, b = bank.group_rows(g)
        s, r = _brute_force(keys[a:b], q[i : i + 1], 8, offset=a)
        n = min(8, b - a)
        assert np.array_equal(res.rows[i, :n].numpy(), r[0])
        assert np.allclose(res.scores[i, :n].numpy(), s[0], atol=1e-5)
        assert (res.rows[i, n:] == -1).all() and torch.isinf(res.scores[i, n:]).all()


def test_hnsw_recall_and_group_filter(tmp_path, tiny_backbone):
    _, bank = _build(tmp_path, tiny_backbone, examples=make_examples(6))
    index = build_index(bank, IndexConfig(type="hnsw", hnsw_m=16, ef_search=64))
    keys = bank.keys().numpy()
    q = keys[::3] + 0.01 * np.random.default_rng(1).normal(size=keys[::3].shape).astype(np.float32)
    res = index.search(torch.from_numpy(q), 3)
    _, r = _brute_force(keys, q, 3)
    recall = np.mean([len(set(a) & set(b)) / 3 for a, b in zip(res.rows.numpy(), r)])
    assert recall >= 0.95
    assert (bank.root / "index.faiss").is_file()  # saved for reuse
    res = index.search(torch.from_numpy(q), 3, groups=["g2"] * len(q))
    a, b = bank.group_rows("g2")
    valid = res.rows[res.rows >= 0]
    assert len(valid) > 0 and ((valid >= a) & (valid < b)).all()


def test_resume_after_interruption_equals_uninterrupted(tmp_path, tiny_backbone, monkeypatch):
    _, full = _build(tmp_path, tiny_backbone, "full")
    real_write = builder_mod._write_shard
    calls = []

    def crash_after_two(out, i, tensors, plan_id, process=0):
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated crash")
        calls.append(i)
        return real_write(out, i, tensors, plan_id, process)

    monkeypatch.setattr(builder_mod, "_write_shard", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        _build(tmp_path, tiny_backbone, "resumed")
    root = tmp_path / "resumed"
    assert not (root / "manifest.json").exists()
    with pytest.raises(BankError, match="unfinished build"):
        Bank.open(root)
    (root / "shard-00003.safetensors.tmp999").write_bytes(b"half a shard")  # debris of a crash mid-write
    monkeypatch.setattr(builder_mod, "_write_shard", real_write)
    encoded = []
    monkeypatch.setattr(builder_mod, "encode_shard", lambda *a, **k: encoded.append(1) or _encode(*a, **k))
    res, resumed = _build(tmp_path, tiny_backbone, "resumed")
    assert res.status == "resumed" and len(encoded) == len(full.shards) - 2
    assert [s.sha256 for s in resumed.shards] == [s.sha256 for s in full.shards]  # byte-identical shards
    assert resumed.manifest["groups"] == full.manifest["groups"]
    assert resumed.groups_sha256 == full.groups_sha256 is not None
    assert not list(root.glob("*.tmp*"))
    res, _ = _build(tmp_path, tiny_backbone, "resumed")
    assert res.status == "already built"


_encode = builder_mod.encode_shard


def test_refuses_other_encoder_and_other_bank(tmp_path, tiny_backbone):
    from elasticmem.backbone import load_backbone
    from elasticmem.config import BackboneConfig, TinyModelConfig

    _, bank = _build(tmp_path, tiny_backbone)
    other = load_backbone(BackboneConfig(name_or_path="tiny", device="cpu", tiny=TinyModelConfig(seed=1)))
    assert other.fingerprint != tiny_backbone.fingerprint
    with pytest.raises(BankError, match="encoded by 'tiny'.*fingerprint"):
        Bank.open(bank.root, expect_fingerprint=other.fingerprint)
    with pytest.raises(BankError, match="already holds a different bank.*overwrite"):
        _build(tmp_path, other)
    res, rebuilt = _build(tmp_path, other, overwrite=True)
    assert res.status == "built" and rebuilt.fingerprint == other.fingerprint


def test_rerun_records_fingerprints_in_an_older_bank(tmp_path, tiny_backbone, monkeypatch):
    """A bank built before manifests had groups_sha256: building it again records them, encoding nothing."""
    _, bank = _build(tmp_path, tiny_backbone)
    manifest = json.loads((bank.root / "manifest.json").read_text())
    expected = manifest.pop("groups_sha256")
    (bank.root / "manifest.json").write_text(json.dumps(manifest))
    assert Bank.open(bank.root).groups_sha256 is None
    monkeypatch.setattr(builder_mod, "encode_shard", lambda *a, **k: pytest.fail("nothing to encode"))
    res, again = _build(tmp_path, tiny_backbone)
    assert res.status == "already built" and again.groups_sha256 == expected
    assert [s.sha256 for s in again.shards] == [s.sha256 for s in bank.shards]


def test_older_bank_without_key_record_has_the_paper_key(tmp_path, tiny_backbone, monkeypatch):
    """Banks built before manifests recorded ``key`` hold the paper's keys: they open as 'last', and
    building them again with bank.key=last finds them finished; another key variant is another bank."""
    _, bank = _build(tmp_path, tiny_backbone)
    manifest = json.loads((bank.root / "manifest.json").read_text())
    assert manifest.pop("key") == {"variant": "last"}
    (bank.root / "manifest.json").write_text(json.dumps(manifest))
    assert Bank.open(bank.root).key == {"variant": "last"} and Bank.open(bank.root).key_variant == "last"
    monkeypatch.setattr(builder_mod, "encode_shard", lambda *a, **k: pytest.fail("nothing to encode"))
    res, again = _build(tmp_path, tiny_backbone)
    assert res.status == "already built" and [s.sha256 for s in again.shards] == [s.sha256 for s in bank.shards]
    with pytest.raises(BankError, match="already holds a different bank"):
        _build(tmp_path, tiny_backbone, key="mean")


@pytest.mark.parametrize("layer", [1, 0])
def test_content_layer_caches_that_layers_states_and_keeps_final_keys(tmp_path, tiny_backbone, monkeypatch, layer):
    """bank.content_layer: the cache equals hidden_states[layer] of each chunk alone; the keys stay
    the final layer's (the paper's), the manifest records the layer and the paper's bank is another bank."""
    _, paper = _build(tmp_path, tiny_backbone, "paper")
    _, bank = _build(tmp_path, tiny_backbone, content_layer=layer)
    assert paper.content_layer == -1 and "content_layer" not in paper.manifest
    assert bank.content_layer == layer and bank.manifest["content_layer"] == layer
    assert torch.allclose(bank.keys(), paper.keys(), atol=1e-6)
    cache, cache_len = bank.gather(torch.arange(bank.num_chunks))
    tok = tiny_backbone.tokenizer
    for row, rec in enumerate(bank.chunks()):
        ids = tok(rec["text"], add_special_tokens=CHUNKING.add_special_tokens, truncation=True,
                  max_length=CHUNKING.max_tokens, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            H = tiny_backbone.model(input_ids=ids, output_hidden_states=True).hidden_states[layer][0]
        c = int(cache_len[row])
        assert torch.allclose(cache[row, bank.n_cache - c:], H[H.shape[0] - c:], atol=1e-4)
    monkeypatch.setattr(builder_mod, "encode_shard", lambda *a, **k: pytest.fail("nothing to encode"))
    assert _build(tmp_path, tiny_backbone, content_layer=layer)[0].status == "already built"
    with pytest.raises(BankError, match="already holds a different bank"):
        _build(tmp_path, tiny_backbone, content_layer=-1)


def test_content_layer_out_of_range_is_refused(tmp_path, tiny_backbone):
    n = tiny_backbone.model.config.num_hidden_layers
    with pytest.raises(ValueError, match=r"bank.content_layer \[%d\] out of range" % (n + 1)):
        _build(tmp_path, tiny_backbone, content_layer=n + 1)


def test_truncated_and_corrupted_shards_refused(tmp_path, tiny_backbone):
    _, bank = _build(tmp_path, tiny_backbone)
    shard = bank.root / bank.shards[1].file
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # same size, altered content: only the hash check sees it
    shard.write_bytes(bytes(data))
    Bank.open(bank.root)  # normal opening stays cheap: no hashing
    with pytest.raises(BankError, match=r"shard-00001.safetensors is corrupted: sha256"):
        Bank.open(bank.root, verify=True)
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(BankError, match=r"shard-00001.safetensors is \d+ bytes but the manifest records"):
        Bank.open(bank.root)
    shard.unlink()
    with pytest.raises(BankError, match="is missing"):
        Bank.open(bank.root)


def test_group_history_conflict_and_empty_input(tmp_path, tiny_backbone):
    ex = make_examples(2)
    bad = dataclasses.replace(ex[1], id="other", history=ex[2].history)  # group g0 with g1's history
    with pytest.raises(SchemaError, match="group 'g0' has a different history"):
        _build(tmp_path, tiny_backbone, examples=[ex[0], bad])
    with pytest.raises(SchemaError, match="no examples"):
        _build(tmp_path, tiny_backbone, examples=[])


def test_open_is_memory_mapped(tmp_path):
    """Opening a large bank and reading a few rows does not load it into RAM."""
    from elasticmem.bank.builder import _write_shard

    root = tmp_path / "big"
    (root / ".build").mkdir(parents=True)
    rows, n_cache, d = 4000, 20, 576  # 184 MB of float32 cache
    rec = _write_shard(root, 0, {"keys": torch.zeros(rows, d), "cache": torch.ones(rows, n_cache, d),
                                 "cache_len": torch.full((rows,), n_cache, dtype=torch.int32)}, "p")
    manifest = {"format_version": 1, "encoder": {"name_or_path": "x", "fingerprint": "f"}, "hidden_size": d,
                "n_cache": n_cache, "cache_dtype": "float32", "num_chunks": rows, "tokenization": {},
                "shards": [rec], "groups": {"all": [0, rows]}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    os.posix_fadvise(os.open(root / rec["file"], os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)

    def rss_mb():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6

    before = rss_mb()
    bank = Bank.open(root)
    cache, _ = bank.gather([5, 3999])
    assert cache.shape == (2, n_cache, d) and (cache == 1).all()
    assert rss_mb() - before < 40


def test_gpu_search_is_refused_where_it_cannot_run(tmp_path, tiny_backbone):
    """``index.gpu``: clear errors for the torch index, for HNSW and for a faiss without GPUs
    (tests/gpu/test_gpu.py checks GPU search itself on a CUDA machine)."""
    import faiss

    _, bank = _build(tmp_path, tiny_backbone)
    with pytest.raises(ValueError, match="FAISS indexes"):
        build_index(bank, IndexConfig(type="torch", gpu=True))
    with pytest.raises(ValueError, match="no HNSW"):
        build_index(bank, IndexConfig(type="hnsw", gpu=True, save=False))
    if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
        pytest.skip("this faiss sees a GPU")
    with pytest.raises(ValueError, match="needs faiss-gpu"):
        build_index(bank, IndexConfig(type="flat", gpu=True))
