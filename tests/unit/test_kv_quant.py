"""Quantized and ragged per-layer KV banks (bank.kv_dtype int8 / int4, bank.hidden_cache; issue 55).

    OMP_NUM_THREADS=1 pytest tests/unit/test_kv_quant.py

- dequantized states equal an independent numpy computation of the scheme (keys per channel over
  each chunk, or over runs of bank.kv_key_group slots, at their own width with bank.kv_key_dtype;
  values per token in groups), and lie within its bound of the float16 states; a run's key ranges
  are never wider than the chunk's, and int8 keys over int4 values store the int8 bank's keys;
- on SmolLM2's own states (when cached) the errors are those measured in ``elasticmem.bank.quant``;
- a converted float16 bank (ragged, or padded as built before issue 55) holds the tensors a build
  with that scheme writes, byte for byte, and a crash during a conversion leaves the old bank;
- a read with another scheme (dtype, bank.kv_key_group, bank.kv_key_dtype) than the bank's is
  refused, naming both;
- the model's KV content path over int8 / int4 banks scores answers close to the float16 bank's;
- the manifest's bytes per chunk are the shards' size over the chunks, and the stored slots are
  exactly min(L - 1, n_cache, max_budget) a chunk (no padding, nothing past the budget), with no
  hidden-state cache for a reader of KV; banks built before keep loading.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys

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
from elasticmem.bank.kv_store import (KVFormat, encode_rows, quant_tensors, read_slots, slot_offsets, split_rows,
                                      zero_rows)
from elasticmem.config import BankConfig, ChunkingConfig, KVScheme, load_config
from elasticmem.data.synthetic import SyntheticConfig, generate
from elasticmem.model.elasticmem import ElasticMem
from elasticmem.model.memory_content import kv_memories
from elasticmem.utils.configuration import ConfigError

N_CACHE = 6
GROUP = 8  # the tiny model's heads are 16 wide
KEY_GROUP = 4  # bank.kv_key_group: two runs a row, the second partial (5, 6 slots) or empty (<= 4)
QUANTIZED = {"int8": KVScheme("int8", group_size=GROUP), "int4": KVScheme("int4", group_size=GROUP),
             "int8-k": KVScheme("int8", key_group=KEY_GROUP, group_size=GROUP),
             "int4-k": KVScheme("int4", key_group=KEY_GROUP, group_size=GROUP),
             "k8v4": KVScheme("int4", "int8", group_size=GROUP),
             "k8v4-k": KVScheme("int4", "int8", KEY_GROUP, GROUP)}
"""The quantized banks of the ``banks`` fixture by name (``k8v4``: bank.kv_key_dtype=int8 over int4 values;
``-k``: key runs of KEY_GROUP slots)."""
CHUNKING = ChunkingConfig(max_tokens=32)


@pytest.fixture(scope="module")
def examples():
    data = generate(SyntheticConfig(variant="tiny", num_histories=6, num_facts=5, num_options=4), seed=0)
    return lengthened([ex for split in data.values() for ex in split])  # chunks longer and shorter than N_CACHE


def settings(scheme: KVScheme) -> dict[str, object]:
    """The BankConfig fields that build ``scheme``."""
    return {"kv_dtype": scheme.dtype, "kv_key_dtype": scheme.key_dtype, "kv_key_group": scheme.key_group}


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
    out = {"float16": _build(root / "float16", examples, kv_dtype="float16")}
    for name, scheme in QUANTIZED.items():
        out[name] = _build(root / name, examples, **settings(scheme))
    return out


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


def np_quantize(chunk: np.ndarray, bits: int, group: int, key_group: int = 0,
                key_bits: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One chunk's stored slots [c, layers, 2, H, hd] (float16) as the scheme reads them back
    (float32), and each element's scale: keys per channel over the chunk's slots (or over runs of
    ``key_group`` slots from the oldest) at ``key_bits`` (default ``bits``), values per slot in
    groups of ``group`` channels at ``bits``."""
    x = chunk.astype(np.float32)
    k, v = x[:, :, 0], x[:, :, 1]
    runs = [k[a:a + key_group] for a in range(0, len(k), key_group)] if key_group else [k]
    k_hat, k_scale = (np.concatenate(z) for z in zip(*[
        _np_codes(r, r.min(0, keepdims=True), r.max(0, keepdims=True), key_bits or bits) for r in runs]))
    c, layers, H, hd = v.shape
    vg = v.reshape(c, layers, H, hd // group, group)
    v_hat, v_scale = _np_codes(vg, vg.min(-1, keepdims=True), vg.max(-1, keepdims=True), bits)
    return (np.stack([k_hat, v_hat.reshape(v.shape)], 2),
            np.stack([k_scale, v_scale.reshape(v.shape)], 2))


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_dequantized_states_equal_a_numpy_computation_within_the_bound(banks, name):
    scheme, f16, q = QUANTIZED[name], banks["float16"], banks[name]
    bits = scheme.value_bits
    rows = torch.arange(f16.num_chunks)
    lens = f16.kv_lengths(rows)
    assert torch.equal(q.kv_lengths(rows), lens) and int(lens.max()) == N_CACHE and int(lens.min()) < N_CACHE
    ref16, got = f16.gather_kv(rows), q.gather_kv(rows)
    assert got.dtype == torch.float16
    for r, c in zip(rows.tolist(), lens.tolist()):
        x = ref16[r, N_CACHE - c:].numpy()
        want, scale = np_quantize(x, bits, GROUP, scheme.key_group, scheme.key_bits)
        mine = got[r, N_CACHE - c:].float().numpy()
        np.testing.assert_array_equal(mine, want.astype(np.float16).astype(np.float32))
        # the bound: half a step, plus the float16 rounding of the value read back
        err = np.abs(mine - x.astype(np.float32))
        assert (err <= 0.5 * scale * (1 + 2 ** -8) + np.abs(x.astype(np.float32)) * 2 ** -10 + 1e-7).all()
        assert not got[r, :N_CACHE - c].any()  # nothing where no state is stored
    # int4 reads back coarser than int8, and both differ from the float16 states
    rel = [float((got[..., i, :, :].float() - ref16[..., i, :, :].float()).norm() / ref16[..., i, :, :].float().norm())
           for i in (0, 1)]
    assert all(0 < r < (0.02 if b == 8 else 0.2) for r, b in zip(rel, (scheme.key_bits, bits))), rel


def test_key_runs_are_stored_per_row_and_never_wider_than_the_chunks_range(banks):
    """bank.kv_key_group: ``kv_kscale`` / ``kv_kmin`` hold ceil(slots / G) runs a row, zeros past the
    row's last slot, and a run's minimum is no lower and its step no coarser than its chunk's (float16
    rounding is monotone, so exactly); the values are stored as without runs."""
    chunk, runs = _shard_tensors(banks["int4"]), _shard_tensors(banks["int4-k"])
    for a, b in zip(chunk, runs):
        assert b["kv_kscale"].shape == (a["kv_kscale"].shape[0], -(-N_CACHE // KEY_GROUP), *a["kv_kscale"].shape[1:])
        for r, n in enumerate(b["kv_len"].tolist()):
            used = -(-n // KEY_GROUP)
            assert not b["kv_kscale"][r, used:].any() and not b["kv_kmin"][r, used:].any()
            assert (b["kv_kscale"][r, :used] <= a["kv_kscale"][r]).all()
            assert (b["kv_kmin"][r, :used] >= a["kv_kmin"][r]).all()
        for name in ("kv_slots_codes", "kv_slots_vscale", "kv_slots_vmin"):  # the values are stored alike
            assert torch.equal(a[name][:, :, 1] if name.endswith("codes") else a[name],
                               b[name][:, :, 1] if name.endswith("codes") else b[name]), name


def test_int8_keys_over_int4_values_store_the_int8_banks_keys_and_the_int4_banks_values(banks):
    """bank.kv_key_dtype=int8 with kv_dtype=int4: two codes tensors (keys 1 byte, values half a byte a
    channel), each equal to what the one-width banks store for its half, and the same key ranges as int8."""
    int8, int4, mixed = (_shard_tensors(banks[n]) for n in ("int8", "int4", "k8v4"))
    for a, b, m in zip(int8, int4, mixed):
        assert "kv_slots_codes" not in m and m["kv_slots_kcodes"].shape[-1] == 2 * m["kv_slots_vcodes"].shape[-1]
        assert torch.equal(m["kv_slots_kcodes"], a["kv_slots_codes"][:, :, 0])
        assert torch.equal(m["kv_slots_vcodes"], b["kv_slots_codes"][:, :, 1])
        for name, like in (("kv_kscale", a), ("kv_kmin", a), ("kv_slots_vscale", b), ("kv_slots_vmin", b)):
            assert torch.equal(m[name], like[name]), name


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
    x = encode_rows(window, counts, KVFormat(KVScheme("float16"), 64))["kv_slots"].float()
    # measured on these 8 chunks: int8 0.0025 / 0.0048, int4 0.043 / 0.081, int4 at kv_key_group 16
    # 0.030 / 0.081, int8 keys over int4 values 0.0025 / 0.081
    for scheme, bound_k, bound_v in ((KVScheme("int8"), 0.003, 0.0055), (KVScheme("int4"), 0.05, 0.09),
                                     (KVScheme("int4", key_group=16), 0.034, 0.09),
                                     (KVScheme("int4", "int8"), 0.003, 0.09)):
        fmt = KVFormat(scheme, 64)
        block = encode_rows(window, counts, fmt)
        rows = torch.arange(len(ids))
        y = read_slots(block.__getitem__, slot_offsets(block["kv_len"]), rows, counts, fmt, 64).float()
        rel = [float((y[:, :, i] - x[:, :, i]).norm() / x[:, :, i].norm()) for i in (0, 1)]
        assert rel[0] < bound_k and rel[1] < bound_v, (scheme, rel)


# --------------------------------------------------------------------------- conversion


@pytest.mark.parametrize("name", ["int8", "int4", "int4-k", "k8v4"])
@pytest.mark.parametrize("source", ["ragged", "padded"])
def test_a_converted_float16_bank_equals_a_bank_built_with_that_scheme(tmp_path, examples, banks, name, source):
    scheme, built = QUANTIZED[name], banks[name]
    src = _build(tmp_path / "src", examples, padded=source == "padded")
    assert ("kv" in _shard_tensors(src)[0]) == (source == "padded")
    converted = convert_bank(src.root, scheme)
    assert converted.kv_format.scheme == scheme
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
    # the build of the converted bank's config finds it done; a float16 one, or one with the keys'
    # other width or ranges, is refused, naming both storages
    cfg = BankConfig(dir=str(src.root), n_cache=N_CACHE, shard_rows=8, kv_cache=True, kv_group_size=GROUP)
    mine = dataclasses.replace(cfg, **settings(scheme))
    other = (dataclasses.replace(mine, kv_key_dtype="same") if scheme.key_dtype != "same"
             else dataclasses.replace(mine, kv_key_group=KEY_GROUP - scheme.key_group))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder_mod, "encode_shard", lambda *a, **k: pytest.fail("nothing to encode"))
        done = build_bank({"all": examples}, tiny_backbone(), CHUNKING, mine, torch.float32, show_progress=False)
        assert done.status == "already built"
        for asked in (cfg, other):
            want = re.escape(f"stored as {converted.kv_format.describe()}, but the config asks for "
                             f"{KVFormat(asked.kv_scheme(), N_CACHE).describe()}")
            with pytest.raises(BankError, match=want):
                build_bank({"all": examples}, tiny_backbone(), CHUNKING, asked, torch.float32, show_progress=False)


def test_a_crash_during_a_conversion_leaves_the_old_bank(tmp_path, examples):
    src = _build(tmp_path / "src", examples)
    rows = torch.arange(src.num_chunks)
    before, manifest = src.gather_kv(rows), (src.root / "manifest.json").read_text()

    def crash(*a, **k):
        raise KeyboardInterrupt("killed before the commit")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(convert_mod, "_checkpoint", crash)
        with pytest.raises(KeyboardInterrupt):
            convert_bank(src.root, KVScheme("int4", group_size=GROUP))
    assert (src.root / "manifest.json").read_text() == manifest
    again = Bank.open(src.root, verify=True)
    assert again.kv_format.dtype == "float16" and torch.equal(again.gather_kv(rows), before)
    assert convert_bank(src.root, KVScheme("int4", group_size=GROUP)).kv_format.dtype == "int4"  # a later one completes


# --------------------------------------------------------------------------- reading


def test_a_read_at_another_dtype_is_refused(banks):
    with pytest.raises(BankError, match=r"stores its per-layer keys and values as int8 .* but float16 was asked: "
                                        r"set bank.kv_dtype=int8 to read it"):
        Bank.open(banks["int8"].root, expect_kv=KVScheme("float16"))
    with pytest.raises(BankError, match=r"as float16 .* but int4 \(keys per channel .* was asked"):
        kv_memories(banks["float16"], torch.tensor([[0]]), torch.tensor([[2]]), kv=KVScheme("int4"))
    assert Bank.open(banks["int4"].root, expect_kv=QUANTIZED["int4"]).kv_format.dtype == "int4"


@pytest.mark.parametrize("name,asked,setting", [
    ("int4-k", KVScheme("int4"), f"bank.kv_key_group={KEY_GROUP}"),
    ("int8", KVScheme("int8", key_group=KEY_GROUP), "bank.kv_key_group=0"),
    ("k8v4", KVScheme("int4"), "bank.kv_key_dtype=int8"),
    ("int4", KVScheme("int4", "int8"), "bank.kv_key_dtype=same"),
    ("k8v4", KVScheme("int8"), "bank.kv_dtype=int4 bank.kv_key_dtype=int8"),
])
def test_a_read_with_another_scheme_is_refused(banks, name, asked, setting):
    """bank.kv_key_group and bank.kv_key_dtype are held like bank.kv_dtype: a bank is read with the
    scheme it was built with, and the error says what to set (and how to convert)."""
    stored = re.escape(banks[name].kv_format.describe())
    with pytest.raises(BankError, match=rf"as {stored}, but {re.escape(asked.describe())} was asked: "
                                        rf"set {setting} to read it, or convert it"):
        Bank.open(banks[name].root, expect_kv=asked)
    with pytest.raises(BankError, match=f"set {setting} to read it"):
        kv_memories(banks[name], torch.tensor([[0]]), torch.tensor([[2]]), kv=asked)


def test_a_read_with_the_banks_scheme_is_let_through(banks):
    for name, scheme in QUANTIZED.items():
        assert Bank.open(banks[name].root, expect_kv=scheme).kv_format.scheme == scheme
    # the value groups are not held (no reader was, before these fields); a float bank has no
    # ranges nor codes, so the integer settings drop out of a float reader's scheme
    assert Bank.open(banks["int4"].root, expect_kv=KVScheme("int4", group_size=2 * GROUP)).kv_format
    assert BankConfig(kv_dtype="float16", kv_key_group=KEY_GROUP).kv_scheme() == KVScheme("float16")
    assert BankConfig(kv_dtype="int4", kv_key_dtype="int4", kv_group_size=GROUP).kv_scheme() == QUANTIZED["int4"]
    assert Bank.open(banks["float16"].root, expect_kv=BankConfig(kv_key_group=KEY_GROUP).kv_scheme()).kv_format
    with pytest.raises(ValueError, match="kv_key_dtype=int8 needs an integer kv_dtype"):
        BankConfig(kv_dtype="float16", kv_key_dtype="int8")
    # the manifest records the keys' runs and width only when not the default: banks built before
    # read as they did, and a record without them reads as the default
    assert banks["int4-k"].kv["key_group"] == KEY_GROUP and banks["k8v4"].kv["key_dtype"] == "int8"
    assert not {"key_group", "key_dtype"} & set(banks["int4"].kv)
    assert KVFormat.of({"kv": banks["int4"].kv, "n_cache": N_CACHE}).scheme == QUANTIZED["int4"]


def test_a_config_holds_a_bank_to_its_scheme_only_when_it_reads_kv():
    """Config.kv_scheme_read: what the trainers and the warm-ups open a bank with (Bank.open(expect_kv=...))."""
    k8v4 = ["bank.kv_dtype=int4", "bank.kv_key_dtype=int8", "bank.kv_key_group=16"]
    assert load_config(None, [*k8v4, "memory.content=kv"]).kv_scheme_read == KVScheme("int4", "int8", 16)
    assert load_config(None, [*k8v4, "memory.content=hidden"]).kv_scheme_read is None
    with pytest.raises(ConfigError, match="kv_key_dtype=int8 needs an integer kv_dtype"):
        load_config(None, ["bank.kv_key_dtype=int8"])


# measured 1.4e-5, 8.4e-5, 9.0e-5 on the tiny random model (k8v4's values are int4's)
@pytest.mark.parametrize("dtype,tol", [("int8", 2e-4), ("int4", 1e-3), ("k8v4", 1e-3)])
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


def _kv_bytes(bank: Bank, scheme: KVScheme) -> int:
    """The per-layer KV tensors' bytes by the scheme's formula over the stored slots: a float16 slot
    2 bytes a value; an integer one its keys' and values' codes at their widths plus a float16 scale
    and minimum per GROUP value channels, and a chunk ceil(N_CACHE / key_group) key ranges (one
    without runs) of a float16 scale and minimum per channel."""
    kv = bank.kv
    channels = kv["layers"] * kv["kv_heads"] * kv["head_dim"]  # of a slot's keys, and of its values
    slots = int(bank.kv_lengths(torch.arange(bank.num_chunks)).sum())
    if not scheme.quantized:
        per_slot, per_chunk = 2 * channels * 2, 0
    else:
        per_slot = channels * (scheme.key_bits + scheme.value_bits) // 8 + channels // GROUP * 2 * 2
        runs = -(-N_CACHE // scheme.key_group) if scheme.key_group else 1
        per_chunk = channels * 2 * 2 * runs
    return slots * per_slot + bank.num_chunks * (per_chunk + 4)  # + kv_len (int32)


@pytest.fixture
def bank_bytes(monkeypatch):
    """benchmarks/bank_bytes.py, the planner of docs/cluster.md."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bank_bytes

    yield bank_bytes
    sys.modules.pop("bank_bytes", None)


@pytest.mark.parametrize("name", ["float16", *QUANTIZED])
def test_bytes_per_chunk_in_the_manifest_are_the_files_size_and_the_planners(banks, bank_bytes, name):
    bank = banks[name]
    scheme = bank.kv_format.scheme
    per = bank.manifest["build"]["bytes_per_chunk"]
    files = sum((bank.root / s.file).stat().st_size for s in bank.shards)
    headers = files - per["total"] * bank.num_chunks
    assert 0 < headers < 2000 * len(bank.shards), (files, per)
    n, d = bank.num_chunks, bank.hidden_size
    assert per["keys"] * n == n * d * 4 and per["cache"] * n == n * (N_CACHE * d * 4 + 4)
    assert abs(per["kv"] * n - _kv_bytes(bank, scheme)) <= n  # whole bytes
    # the planner's count, chunk by chunk (its kv_len included)
    kv, lens = bank.kv, bank.kv_lengths(torch.arange(n)).tolist()
    plan = {c: bank_bytes.kv_bytes_per_chunk(kv["layers"], kv["kv_heads"], kv["head_dim"], scheme, c, N_CACHE)
            for c in set(lens)}
    assert sum(plan[c] for c in lens) == _kv_bytes(bank, scheme)
    # the planner's estimate for a built bank at each storage: this bank's own bytes at its own
    (at,) = bank_bytes.bank_at_schemes(str(bank.root), N_CACHE, {name: scheme})
    assert at["bytes"] == _kv_bytes(bank, scheme) + n * d * 4


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


@pytest.mark.parametrize("name", ["int4", "int4-k", "k8v4"])
def test_appends_forgetting_and_compaction_keep_a_quantized_bank(tmp_path, examples, name):
    """Appended shards are stored as the bank is (int4, ragged, no hidden cache for a KV reader; keys'
    ranges per chunk or per run, at int4 or int8), and a compaction merges them and zeroes exactly the
    deleted rows' slots and key ranges."""
    from elasticmem.bank.append import SessionAdd, append_sessions, compact
    from elasticmem.bank.forget import forget_rows
    from elasticmem.data.schema import Turn

    memory = memory_cfg(content="kv", policy={"max_budget": N_CACHE})
    bank = _build(tmp_path / "b", examples, memory=memory, **settings(QUANTIZED[name]))
    assert bank.kv_format.scheme == QUANTIZED[name]
    bb = tiny_backbone()
    dec, tok, fp = bb.model.get_decoder(), bb.tokenizer, bb.fingerprint
    for i in range(3):
        turns = [Turn("user", f"the cat {i} sat on the mat " * (i + 1)), Turn("assistant", f"noted {i}")]
        bank = append_sessions(bank, [SessionAdd(f"new{i}", turns)], dec, tok, fp).bank
    assert bank.manifest["format_version"] == 3 and len(bank.manifest["chunk_files"]) == 3
    names = set(_shard_tensors(bank)[-1])
    assert "cache" not in names and set(quant_tensors(QUANTIZED[name]).values()) <= names
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
            for tensor, t in tensors.items():
                part = t[off[r]:off[r + 1]] if tensor.startswith("kv_slots") else t[r]
                assert tensor == "kv_len" or not part.any(), tensor


def test_zero_rows_zeroes_a_rows_slots_and_nothing_else():
    torch.manual_seed(0)
    window = torch.randn(4, 5, 2, 2, 2, 8)
    counts = torch.tensor([3, 0, 5, 2])
    block = encode_rows(window, counts, KVFormat(KVScheme("int8", group_size=4), 5))
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


def test_planner_bytes_follow_the_storage_format(bank_bytes):
    """benchmarks/bank_bytes.py: a float KV chunk takes positions x layers x 2 x heads x width x dtype bytes
    plus its float32 key and int32 slot count (counted independently here), int8 and int4 add only their
    scales and minima to codes of 1 and 1/2 byte a value (int8 keys over int4 values: 1 and 1/2), and the
    hidden-state variant is key + n_cache x d float16."""
    rows = {(r["model"], r["storage"]): r["bytes_per_chunk"] for r in bank_bytes.plan(90, 128, 20)}
    d, layers, heads, hd = 576, 30, 3, 64
    values, base = 89 * layers * 2 * heads * hd, 4 * d + 4  # the float32 key and the int32 kv_len
    assert rows[("SmolLM2-135M", "per-layer KV, float16")] == base + 2 * values
    assert rows[("SmolLM2-135M", "per-layer KV, float32")] == base + 4 * values
    assert rows[("SmolLM2-135M", "hidden states (n_cache 20, float16)")] == 4 * d + 2 * 20 * d
    value_ranges = 89 * layers * heads * (hd // 32) * 4  # a float16 scale and minimum per 32 channels a position
    key_range = layers * heads * hd * 4  # a float16 scale and minimum per channel
    for storage, per_value, runs in (("int8", 1.0, 1), ("int4", 0.5, 1), ("int4 values, int8 keys", 0.75, 1),
                                     # keys' ranges per run of 16 of the 128 positions a chunk may keep
                                     ("int4, kv_key_group 16", 0.5, 8)):
        overhead = rows[("SmolLM2-135M", f"per-layer KV, {storage}")] - base - per_value * values
        assert overhead == value_ranges + runs * key_range, storage
