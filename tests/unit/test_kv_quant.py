"""Quantized and ragged per-layer KV banks (bank.kv_dtype int8 / int4, bank.hidden_cache; issue 55).

    OMP_NUM_THREADS=1 pytest tests/unit/test_kv_quant.py

- dequantized states equal an independent numpy computation of the scheme (keys per channel over
  each chunk, values per token in groups), and lie within its bound of the float16 states;
- on SmolLM2's own states (when cached) the errors are those measured in ``elasticmem.bank.quant``;
- a converted float16 bank (ragged, or padded as built before issue 55) holds the tensors a build
  at that dtype writes, byte for byte, and a crash during a conversion leaves the old bank;
- a read at another dtype than the bank's is refused, naming both;
- the model's KV content path over int8 / int4 banks scores answers close to the float16 bank's;
- the manifest's bytes per chunk are the shards' size over the chunks, and the stored slots are
  exactly min(L - 1, n_cache, max_budget) a chunk (no padding, nothing past the budget), with no
  hidden-state cache for a reader of KV; banks built before keep loading.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import ROOT, requires_smollm2
from safetensors import safe_open
from test_elasticmem import lengthened, memory_cfg, tiny_backbone

import elasticmem.bank.builder as builder_mod
import elasticmem.bank.convert as convert_mod
from elasticmem.bank import Bank, BankError, build_bank
from elasticmem.bank.convert import convert_bank
from elasticmem.bank.kv_store import KVFormat, encode_rows, read_slots, slot_offsets, split_rows, zero_rows
from elasticmem.config import BankConfig, ChunkingConfig
from elasticmem.data.synthetic import SyntheticConfig, generate
from elasticmem.model.elasticmem import ElasticMem
from elasticmem.model.memory_content import kv_memories
from elasticmem.utils.configuration import ConfigError

N_CACHE = 6
GROUP = 8  # the tiny model's heads are 16 wide
CHUNKING = ChunkingConfig(max_tokens=32)


@pytest.fixture(scope="module")
def examples():
    data = generate(SyntheticConfig(variant="tiny", num_histories=6, num_facts=5, num_options=4), seed=0)
    return lengthened([ex for split in data.values() for ex in split])  # chunks longer and shorter than N_CACHE


def _build(path, examples, memory=None, padded=False, **kw) -> Bank:
    cfg = BankConfig(dir=str(path), n_cache=N_CACHE, shard_rows=8, kv_cache=True, kv_group_size=GROUP, **kw)
    with pytest.MonkeyPatch.context() as mp:
        if padded:  # the layout of banks built before issue 55: padded float, hidden cache
            mp.setattr(builder_mod, "storage_of", lambda cfg, memory=None: (True, None))
        build_bank({"all": examples}, tiny_backbone(), CHUNKING, cfg, torch.float32, show_progress=False,
                   memory=memory)
    return Bank.open(path)


@pytest.fixture(scope="module")
def banks(tmp_path_factory, examples):
    root = tmp_path_factory.mktemp("kvq")
    return {dtype: _build(root / dtype, examples, kv_dtype=dtype) for dtype in ("float16", "int8", "int4")}


def _shard_tensors(bank: Bank) -> list[dict[str, torch.Tensor]]:
    out = []
    for s in bank.shards:
        with safe_open(str(bank.root / s.file), framework="pt") as f:
            out.append({n: f.get_tensor(n).clone() for n in f.keys()})
    return out


# --------------------------------------------------------------------------- the scheme, in numpy


def _np_codes(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Asymmetric min-max: the read-back values (float32) and the float16 scale, per element."""
    qmax = 2 ** bits - 1
    scale = ((hi - lo) / np.float32(qmax)).astype(np.float16).astype(np.float32)
    lo = lo.astype(np.float16).astype(np.float32)
    q = np.clip(np.round((x - lo) / np.where(scale > 0, scale, np.float32(1))), 0, qmax)
    return lo + q * scale, np.broadcast_to(scale, x.shape)


def np_quantize(chunk: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """One chunk's stored slots [c, layers, 2, H, hd] (float16) as the scheme reads them back
    (float32), and each element's scale: keys per channel over the chunk's slots, values per slot
    in groups of ``group`` channels."""
    x = chunk.astype(np.float32)
    k, v = x[:, :, 0], x[:, :, 1]
    k_hat, k_scale = _np_codes(k, k.min(0, keepdims=True), k.max(0, keepdims=True), bits)
    c, layers, H, hd = v.shape
    vg = v.reshape(c, layers, H, hd // group, group)
    v_hat, v_scale = _np_codes(vg, vg.min(-1, keepdims=True), vg.max(-1, keepdims=True), bits)
    return (np.stack([k_hat, v_hat.reshape(v.shape)], 2),
            np.stack([k_scale, v_scale.reshape(v.shape)], 2))


@pytest.mark.parametrize("dtype,bits", [("int8", 8), ("int4", 4)])
def test_dequantized_states_equal_a_numpy_computation_within_the_bound(banks, dtype, bits):
    f16, q = banks["float16"], banks[dtype]
    rows = torch.arange(f16.num_chunks)
    lens = f16.kv_lengths(rows)
    assert torch.equal(q.kv_lengths(rows), lens) and int(lens.max()) == N_CACHE and int(lens.min()) < N_CACHE
    ref16, got = f16.gather_kv(rows), q.gather_kv(rows)
    assert got.dtype == torch.float16
    for r, c in zip(rows.tolist(), lens.tolist()):
        x = ref16[r, N_CACHE - c:].numpy()
        want, scale = np_quantize(x, bits, GROUP)
        mine = got[r, N_CACHE - c:].float().numpy()
        np.testing.assert_array_equal(mine, want.astype(np.float16).astype(np.float32))
        # the bound: half a step, plus the float16 rounding of the value read back
        err = np.abs(mine - x.astype(np.float32))
        assert (err <= 0.5 * scale * (1 + 2 ** -8) + np.abs(x.astype(np.float32)) * 2 ** -10 + 1e-7).all()
        assert not got[r, :N_CACHE - c].any()  # nothing where no state is stored
    # int4 reads back coarser than int8, and both differ from the float16 states
    rel = (got.float() - ref16.float()).norm() / ref16.float().norm()
    assert 0 < rel < (0.02 if bits == 8 else 0.2)


@requires_smollm2
def test_smollm2_states_quantize_with_the_measured_errors(smollm2_backbone):
    """The errors of ``elasticmem.bank.quant``'s table (keys / values, relative Frobenius), on the
    persona chunks of the quickstart's kind, through the bank's own write and read functions."""
    from elasticmem.bank.builder import collect_groups
    from elasticmem.bank.encoding import encode_batch
    from elasticmem.data.chunking import chunk_history, tokenize_chunks

    data = generate(SyntheticConfig(num_histories=6, num_sessions=2, num_facts=4, num_filler=0), seed=0)
    chunks = [c for g, ex in collect_groups(data).items() for c in chunk_history(ex.history, g)][:8]
    ids = tokenize_chunks([c.text for c in chunks], smollm2_backbone.tokenizer, 128, "right", True)
    with torch.inference_mode():
        *_, window = encode_batch(smollm2_backbone.model.get_decoder(), ids, 64,
                                  smollm2_backbone.tokenizer.pad_token_id, kv=True)
    counts = torch.tensor([min(64, len(i) - 1) for i in ids])
    x = encode_rows(window, counts, KVFormat("float16", 64))["kv_slots"].float()
    # measured on these 8 chunks: int8 0.0025 / 0.0048, int4 0.043 / 0.081
    for dtype, bound_k, bound_v in (("int8", 0.003, 0.0055), ("int4", 0.05, 0.09)):
        fmt = KVFormat(dtype, 64, group_size=32)
        block = encode_rows(window, counts, fmt)
        rows = torch.arange(len(ids))
        y = read_slots(block.__getitem__, slot_offsets(block["kv_len"]), rows, counts, fmt, 64).float()
        rel = [float((y[:, :, i] - x[:, :, i]).norm() / x[:, :, i].norm()) for i in (0, 1)]
        assert rel[0] < bound_k and rel[1] < bound_v, (dtype, rel)


# --------------------------------------------------------------------------- conversion


@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("source", ["ragged", "padded"])
def test_a_converted_float16_bank_equals_a_bank_built_at_that_dtype(tmp_path, examples, banks, dtype, source):
    src = _build(tmp_path / "src", examples, padded=source == "padded")
    assert ("kv" in _shard_tensors(src)[0]) == (source == "padded")
    converted = convert_bank(src.root, dtype, GROUP)
    built = banks[dtype]
    assert converted.kv == built.kv and converted.manifest["format_version"] == built.manifest["format_version"]
    assert converted.manifest["build"]["plan_id"] == built.manifest["build"]["plan_id"]
    mine, theirs = _shard_tensors(converted), _shard_tensors(built)
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    rows = torch.arange(built.num_chunks)
    assert torch.equal(converted.gather_kv(rows), built.gather_kv(rows))
    assert {p.name for p in src.root.glob("shard-*")} == {s.file for s in converted.shards}  # old shards gone
    # the build of the converted bank's config finds it done, and a float16 one is refused
    cfg = BankConfig(dir=str(src.root), n_cache=N_CACHE, shard_rows=8, kv_cache=True, kv_group_size=GROUP)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder_mod, "encode_shard", lambda *a, **k: pytest.fail("nothing to encode"))
        done = build_bank({"all": examples}, tiny_backbone(), CHUNKING, dataclasses.replace(cfg, kv_dtype=dtype),
                          torch.float32, show_progress=False)
        assert done.status == "already built"
        with pytest.raises(BankError, match=f"stored as {dtype}.*asks for float16"):
            build_bank({"all": examples}, tiny_backbone(), CHUNKING, cfg, torch.float32, show_progress=False)


def test_a_crash_during_a_conversion_leaves_the_old_bank(tmp_path, examples):
    src = _build(tmp_path / "src", examples)
    rows = torch.arange(src.num_chunks)
    before, manifest = src.gather_kv(rows), (src.root / "manifest.json").read_text()

    def crash(*a, **k):
        raise KeyboardInterrupt("killed before the commit")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(convert_mod, "_checkpoint", crash)
        with pytest.raises(KeyboardInterrupt):
            convert_bank(src.root, "int4", GROUP)
    assert (src.root / "manifest.json").read_text() == manifest
    again = Bank.open(src.root, verify=True)
    assert again.kv_format.dtype == "float16" and torch.equal(again.gather_kv(rows), before)
    assert convert_bank(src.root, "int4", GROUP).kv_format.dtype == "int4"  # a later conversion completes


# --------------------------------------------------------------------------- reading


def test_a_read_at_another_dtype_is_refused(banks):
    with pytest.raises(BankError, match=r"stores its per-layer keys and values as int8 .* but float16 was asked"):
        Bank.open(banks["int8"].root, expect_kv_dtype="float16")
    with pytest.raises(BankError, match=r"as float16 .* but int4 was asked"):
        kv_memories(banks["float16"], torch.tensor([[0]]), torch.tensor([[2]]), kv_dtype="int4")
    assert Bank.open(banks["int4"].root, expect_kv_dtype="int4").kv_format.dtype == "int4"


@pytest.mark.parametrize("dtype,tol", [("int8", 2e-4), ("int4", 1e-3)])  # measured 1.4e-5, 8.4e-5
def test_the_models_kv_path_over_a_quantized_bank_scores_close_to_float16(banks, examples, dtype, tol):
    torch.manual_seed(0)
    ref = ElasticMem(tiny_backbone(), memory_cfg(content="kv", policy={"max_budget": N_CACHE}), banks["float16"])
    batch = examples[:4]
    traj = ref.sample(batch, group_size=2)
    assert int(traj.memory_tokens.sum()) > 0
    with torch.no_grad():  # an adapter that sharpens attention: the reader's answers then hang on the keys
        for n, p in ref.lm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.5)
    model = ElasticMem(tiny_backbone(), memory_cfg(content="kv", policy={"max_budget": N_CACHE}), banks[dtype])
    model.load_state_dict(ref.state_dict())
    ref.eval(), model.eval()
    with torch.no_grad():
        a, b = ref.score(traj).logp_answer, model.score(traj).logp_answer
    diff = float((a - b).abs().max())
    assert 0 < diff < tol, diff
    # the pieces the path reads are the dequantized states, on the device asked
    pieces, counts = kv_memories(banks[dtype], traj.rows[:1], traj.budgets[:1], device=torch.device("cpu"))
    lens = banks[dtype].kv_lengths(traj.rows[:1].clamp(min=0).reshape(-1)).reshape(traj.rows[:1].shape)
    assert [p.kv.shape[0] for p in pieces[0]] == [int(c) for c in counts[0] if c > 0]
    assert torch.equal(counts, torch.where(traj.rows[:1] >= 0, torch.minimum(traj.budgets[:1], lens),
                                           torch.zeros_like(lens)))


# --------------------------------------------------------------------------- what is stored


def _kv_bytes(bank: Bank, bits: int | None, width: int) -> int:
    """The per-layer KV tensors' bytes by the scheme's formula over the stored slots."""
    kv = bank.kv
    values = kv["layers"] * 2 * kv["kv_heads"] * kv["head_dim"]  # a slot's keys and values
    slots = int(bank.kv_lengths(torch.arange(bank.num_chunks)).sum())
    if bits is None:
        per_slot, per_chunk = values * width, 0
    else:
        per_slot = values * bits // 8 + kv["layers"] * kv["kv_heads"] * kv["head_dim"] // GROUP * 2 * 2
        per_chunk = kv["layers"] * kv["kv_heads"] * kv["head_dim"] * 2 * 2
    return slots * per_slot + bank.num_chunks * (per_chunk + 4)  # + kv_len (int32)


@pytest.mark.parametrize("dtype,bits,width", [("float16", None, 2), ("int8", 8, 0), ("int4", 4, 0)])
def test_bytes_per_chunk_in_the_manifest_are_the_files_size(banks, dtype, bits, width):
    bank = banks[dtype]
    per = bank.manifest["build"]["bytes_per_chunk"]
    files = sum((bank.root / s.file).stat().st_size for s in bank.shards)
    headers = files - per["total"] * bank.num_chunks
    assert 0 < headers < 2000 * len(bank.shards), (files, per)
    n, d = bank.num_chunks, bank.hidden_size
    assert per["keys"] * n == n * d * 4 and per["cache"] * n == n * (N_CACHE * d * 4 + 4)
    assert abs(per["kv"] * n - _kv_bytes(bank, bits, width)) <= n  # rounded to whole bytes a chunk


def test_a_kv_reader_gets_no_hidden_cache_no_padding_and_nothing_past_its_budget(tmp_path, examples):
    budget = N_CACHE - 2
    bank = _build(tmp_path / "kv", examples, memory=memory_cfg(content="kv", policy={"max_budget": budget}),
                  kv_dtype="int4")
    assert bank.manifest["hidden_cache"] is False and bank.manifest["format_version"] == 3
    assert bank.kv_format.slots == budget and bank.kv["slots"] == budget
    names = set(_shard_tensors(bank)[0])
    assert "cache" not in names and "cache_len" in names
    rows = torch.arange(bank.num_chunks)
    lens = torch.tensor([bank.chunk(r)["n_tokens"] - 1 for r in rows.tolist()]).clamp(max=budget)
    assert torch.equal(bank.kv_lengths(rows), lens)
    stored = torch.cat([t["kv_len"] for t in _shard_tensors(bank)])
    assert torch.equal(stored.long(), lens)  # exactly the readable slots: no padding
    assert bank.manifest["build"]["bytes_per_chunk"]["cache"] == 4  # cache_len only
    with pytest.raises(BankError, match="holds no hidden-state cache"):
        bank.gather(rows[:2])
    hidden = _build(tmp_path / "hidden", examples, memory=memory_cfg(content="hidden"), kv_dtype="int4")
    assert "cache" in _shard_tensors(hidden)[0] and hidden.kv_format.slots == N_CACHE  # max_budget 8 > N_CACHE
    with pytest.raises(ConfigError, match="memory.content=hidden reads the hidden-state cache"):
        _build(tmp_path / "no", examples, memory=memory_cfg(content="hidden"), hidden_cache="false")


def test_a_bank_built_before_reads_as_it_did(tmp_path, examples, banks, capsys):
    old = _build(tmp_path / "old", examples, padded=True, kv_dtype="float16")
    manifest = json.loads((old.root / "manifest.json").read_text())
    assert manifest["format_version"] == 1 and set(manifest["kv"]) == {"layers", "kv_heads", "head_dim", "dtype"}
    assert "hidden_cache" not in manifest and "kv" in _shard_tensors(old)[0]
    rows = torch.arange(old.num_chunks)
    assert torch.equal(old.gather_kv(rows), banks["float16"].gather_kv(rows))
    assert old.manifest["build"]["plan_id"] == banks["float16"].manifest["build"]["plan_id"]
    # a preset's build run again over it (now storing ragged KV, no hidden cache) keeps it, and says so
    cfg = BankConfig(dir=str(old.root), n_cache=N_CACHE, shard_rows=8, kv_cache=True, kv_group_size=GROUP)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder_mod, "encode_shard", lambda *a, **k: pytest.fail("nothing to encode"))
        done = build_bank({"all": examples}, tiny_backbone(), CHUNKING, cfg, torch.float32, show_progress=False,
                          memory=memory_cfg(content="kv", policy={"max_budget": N_CACHE}))
    assert done.status == "already built" and "note: " in capsys.readouterr().err
    assert json.loads((old.root / "manifest.json").read_text()) == manifest


def test_appends_forgetting_and_compaction_keep_a_quantized_bank(tmp_path, examples):
    """Appended shards are stored as the bank is (int4, ragged, no hidden cache for a KV reader), and
    a compaction merges them and zeroes exactly the deleted rows' slots."""
    from elasticmem.bank.append import SessionAdd, append_sessions, compact
    from elasticmem.bank.forget import forget_rows
    from elasticmem.data.schema import Turn

    memory = memory_cfg(content="kv", policy={"max_budget": N_CACHE})
    bank = _build(tmp_path / "b", examples, memory=memory, kv_dtype="int4")
    bb = tiny_backbone()
    dec, tok, fp = bb.model.get_decoder(), bb.tokenizer, bb.fingerprint
    for i in range(3):
        turns = [Turn("user", f"the cat {i} sat on the mat " * (i + 1)), Turn("assistant", f"noted {i}")]
        bank = append_sessions(bank, [SessionAdd(f"new{i}", turns)], dec, tok, fp).bank
    assert bank.manifest["format_version"] == 3 and len(bank.manifest["chunk_files"]) == 3
    names = set(_shard_tensors(bank)[-1])
    assert "cache" not in names and "kv_slots_codes" in names
    rows = torch.arange(bank.num_chunks)
    before = bank.gather_kv(rows)
    gone = [2, bank.num_chunks - 2]
    forget_rows(bank.root, gone)
    purged = compact(bank.root, target_rows=3)
    assert len(purged.shards) == len(bank.shards) - 2  # the three appended shards were merged
    survivors = torch.tensor([r for r in rows.tolist() if r not in gone])
    assert torch.equal(purged.gather_kv(survivors), before[survivors])
    for s, tensors in zip(purged.shards, _shard_tensors(purged)):
        off = slot_offsets(tensors["kv_len"])
        for r in (r - s.start for r in gone if s.start <= r < s.start + s.rows):
            assert int(off[r + 1] - off[r]) > 0
            for name, t in tensors.items():
                part = t[off[r]:off[r + 1]] if name.startswith("kv_slots") else t[r]
                assert name == "kv_len" or not part.any(), name


def test_zero_rows_zeroes_a_rows_slots_and_nothing_else():
    torch.manual_seed(0)
    window = torch.randn(4, 5, 2, 2, 2, 8)
    counts = torch.tensor([3, 0, 5, 2])
    block = encode_rows(window, counts, KVFormat("int8", 5, group_size=4))
    rows = split_rows(block)
    zero_rows(block, 2, 3)
    for r, row in enumerate(split_rows(block)):
        for name, t in row.items():
            if name == "kv_len":
                assert torch.equal(t, rows[r][name])
            elif r == 2:
                assert not t.any(), name
            else:
                assert torch.equal(t, rows[r][name]), (r, name)


def test_planner_bytes_follow_the_storage_format(monkeypatch):
    """benchmarks/bank_bytes.py: a float KV chunk takes positions x layers x 2 x heads x width x dtype bytes
    plus its float32 key and int32 slot count (counted independently here), int8 and int4 add only their scales and minima
    to codes of 1 and 1/2 byte a value, and the hidden-state variant is key + n_cache x d float16."""
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bank_bytes

    rows = {(r["model"], r["storage"]): r["bytes_per_chunk"] for r in bank_bytes.plan(90, 128, 20)}
    d, layers, heads, hd = 576, 30, 3, 64
    values, base = 89 * layers * 2 * heads * hd, 4 * d + 4  # the float32 key and the int32 kv_len
    assert rows[("SmolLM2-135M", "per-layer KV, float16")] == base + 2 * values
    assert rows[("SmolLM2-135M", "per-layer KV, float32")] == base + 4 * values
    assert rows[("SmolLM2-135M", "hidden states (n_cache 20, float16)")] == 4 * d + 2 * 20 * d
    for dt, per_value in (("int8", 1.0), ("int4", 0.5)):
        overhead = rows[("SmolLM2-135M", f"per-layer KV, {dt}")] - base - per_value * values
        # values: a float16 scale and minimum per 32 channels of each position; keys: per channel of each chunk
        assert overhead == 89 * layers * heads * (hd // 32) * 4 + layers * heads * hd * 4
    sys.modules.pop("bank_bytes", None)
