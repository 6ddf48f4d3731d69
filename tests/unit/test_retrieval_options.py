"""Retrieval options that depart from the paper, against independent computations (tiny model, CPU).

Key variants chosen at bank build (``bank.key``), the matching query modes
(``memory.retrieval=mean|layer_mean|prompt``), refusal of a bank whose keys do not fit the
model's query states, and the learned query/key map (``memory.retrieval_map``).

    pytest tests/unit/test_retrieval_options.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_examples

from elasticmem.backbone import load_backbone
from elasticmem.bank import Bank, BankError, build_bank
from elasticmem.config import BankConfig, ChunkingConfig, LoraConfig, MemoryConfig, BackboneConfig
from elasticmem.data.schema import write_examples
from elasticmem.model.budget_policy import BudgetPolicyConfig
from elasticmem.model.elasticmem import ElasticMem
from elasticmem.model.projector import ProjectorConfig
from elasticmem.model.retrieval_map import RetrievalMapError, load_retrieval_map
from elasticmem.warmup.retrieval_map import MapTrainConfig, info_nce, train_map
from elasticmem.warmup.retrieval_map import main as map_main

ROOT = Path(__file__).resolve().parents[2]
CHUNKING = ChunkingConfig(max_tokens=48, truncation_side="right", add_special_tokens=True)
LAYERS = [0, 1, -1]  # tiny model: 2 layers, hidden_states has 3 entries
F = torch.nn.functional


def fresh_backbone():
    """A new tiny backbone (peft mutates the one a model wraps); same weights every time."""
    return load_backbone(BackboneConfig(name_or_path="tiny", device="cpu"))


@pytest.fixture(scope="module")
def ref():
    return fresh_backbone()


@pytest.fixture(scope="module")
def examples():
    return make_examples(4)


@pytest.fixture(scope="module")
def banks(tmp_path_factory, ref, examples):
    """One bank per key variant, same chunks."""
    out = {}
    for variant in ("last", "mean", "layer_mean", "prompt"):
        d = tmp_path_factory.mktemp(f"bank_{variant}")
        cfg = BankConfig(dir=str(d), n_cache=8, batch_size=5, shard_rows=7, key=variant, key_layers=LAYERS)
        build_bank({"train": examples}, ref, CHUNKING, cfg, torch.float32, show_progress=False)
        out[variant] = Bank.open(d, expect_fingerprint=ref.fingerprint)
    return out


def _hidden(backbone, ids: list[int]) -> tuple[torch.Tensor, ...]:
    """Every layer's states of one sequence alone, plain transformers: ([L, d], ...)."""
    with torch.no_grad():
        out = backbone.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


def _ids(backbone, text: str) -> list[int]:
    return backbone.tokenizer(text, add_special_tokens=CHUNKING.add_special_tokens, truncation=True,
                              max_length=CHUNKING.max_tokens)["input_ids"]


def _ref_key(backbone, text: str, variant: str, n_tokens: int | None = None,
             template: str = BankConfig().key_template) -> torch.Tensor:
    """The key of ``text`` by the definitions in BankConfig.key, recomputed from scratch."""
    if variant == "prompt":
        if n_tokens is not None and n_tokens >= CHUNKING.max_tokens:  # a capped chunk: what the bank holds
            text = backbone.tokenizer.decode(_ids(backbone, text), skip_special_tokens=True)
        ids = backbone.tokenizer(template.replace("{text}", text), add_special_tokens=True)["input_ids"]
        return F.normalize(_hidden(backbone, ids)[-1][-1], dim=-1)
    hs = _hidden(backbone, _ids(backbone, text))
    if variant == "last":
        v = hs[-1][-1]
    elif variant == "mean":
        v = hs[-1].mean(0)
    else:  # layer_mean: skip position 0 (unless it is the only one), normalise per layer, average
        v = sum(F.normalize(hs[l][1:].mean(0) if hs[l].shape[0] > 1 else hs[l][0], dim=-1) for l in LAYERS) / len(LAYERS)
    return F.normalize(v, dim=-1)


# --------------------------------------------------------------------------- bank keys


@pytest.mark.parametrize("variant", ["last", "mean", "layer_mean", "prompt"])
def test_keys_equal_reference_and_cache_is_the_papers(banks, ref, variant):
    bank, paper = banks[variant], banks["last"]
    chunks = bank.chunks()
    if variant == "prompt":
        assert max(c["n_tokens"] for c in chunks) == CHUNKING.max_tokens, "test data must hold a capped chunk"
    keys = bank.keys()
    for row, c in enumerate(chunks):
        expected = _ref_key(ref, c["text"], variant, c["n_tokens"])
        assert (keys[row] - expected).abs().max() < 1e-4, (variant, row)
    assert abs(float(keys.norm(dim=-1).mean()) - 1) < 1e-5
    # only the keys change: the content cache is the plain chunk's last N_c states in every variant
    ca, la = bank.gather(torch.arange(bank.num_chunks))
    cb, lb = paper.gather(torch.arange(paper.num_chunks))
    assert torch.equal(la, lb) and torch.allclose(ca, cb, atol=1e-5)
    assert [c["text"] for c in chunks] == [c["text"] for c in paper.chunks()]


def test_manifest_records_the_key_variant(banks):
    for variant, bank in banks.items():
        m = json.loads((bank.root / "manifest.json").read_text())
        expected = {"variant": variant}
        if variant == "layer_mean":
            expected["layers"] = LAYERS
        if variant == "prompt":
            expected["template"] = BankConfig().key_template
        assert m["key"] == expected and bank.key == expected and bank.key_variant == variant
    # the plan (what the bank encodes) differs per variant, so one folder cannot hold two
    plans = {b.manifest["build"]["plan_id"] for b in banks.values()}
    assert len(plans) == len(banks)


def test_bad_key_settings_refused(tmp_path, ref, examples):
    with pytest.raises(ValueError, match="key_layers"):
        build_bank({"train": examples}, ref, CHUNKING, BankConfig(dir=str(tmp_path / "a"), key="layer_mean",
                                                                  key_layers=[]), torch.float32, show_progress=False)
    with pytest.raises(ValueError, match=r"key_layers \[28\] out of range"):  # the SmolLM2 default on a 2-layer model
        build_bank({"train": examples}, ref, CHUNKING, BankConfig(dir=str(tmp_path / "c"), key="layer_mean",
                                                                  key_layers=[1, 28]), torch.float32,
                   show_progress=False)
    with pytest.raises(ValueError, match=r"\{text\}"):
        build_bank({"train": examples}, ref, CHUNKING, BankConfig(dir=str(tmp_path / "b"), key="prompt",
                                                                  key_template="no slot"), torch.float32,
                   show_progress=False)


# --------------------------------------------------------------------------- query states


def memory_cfg(**kw) -> MemoryConfig:
    base = dict(top_z=3, max_new_tokens=2, suffix_template="\n{options}\nAnswer:",
                lora=LoraConfig(r=4, alpha=8, dropout=0.0),
                policy=BudgetPolicyConfig(d_model=16, num_heads=2, num_layers=1, max_budget=4),
                projector=ProjectorConfig(hidden_size=32))
    base.update(kw)
    return MemoryConfig(**base)


def make_model(bank, **kw) -> ElasticMem:
    torch.manual_seed(0)
    model = ElasticMem(fresh_backbone(), memory_cfg(**kw), bank)
    with torch.no_grad():  # a non-zero adapter: the query modes must run with it disabled
        for n, p in model.lm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.2)
    return model.eval()


@pytest.mark.parametrize("mode", ["mean", "layer_mean", "prompt"])
def test_query_states_are_the_bank_key_function_on_the_question(banks, ref, examples, mode):
    model = make_model(banks[mode], retrieval=mode)
    batch = examples[:5]
    prompts = [model.encode_texts(ex)[0] for ex in batch]
    a, logp, h = model._query_states(prompts, [ex.question for ex in batch], 2, True)
    assert (a == -1).all() and (logp == 0).all() and h.shape == (10, ref.hidden_size)
    for i, ex in enumerate(batch):
        if mode == "prompt":
            ids = ref.tokenizer(MemoryConfig().query_template.replace("{question}", ex.question))["input_ids"]
            expected = F.normalize(_hidden(ref, ids)[-1][-1], dim=-1)
        else:
            expected = _ref_key(ref, ex.question, mode)
        for g in range(2):
            assert (h[2 * i + g] - expected).abs().max() < 1e-4, (mode, i)
    # and the search is the plain cosine top-Z of those states over the group's keys
    rows, scores = model.retrieve(batch)
    for i, ex in enumerate(batch):
        lo, hi = banks[mode].group_rows(ex.group)
        s = banks[mode].keys(lo, hi) @ F.normalize(h[2 * i], dim=-1)
        top = torch.topk(s, min(3, hi - lo))
        assert rows[i, : top.indices.numel()].tolist() == (top.indices + lo).tolist()
        assert torch.allclose(scores[i, : top.indices.numel()], top.values, atol=1e-5)


def test_bank_and_model_key_variants_must_agree(banks):
    with pytest.raises(BankError, match="has 'mean' keys.*memory.retrieval=frozen expects 'last' keys"):
        ElasticMem(fresh_backbone(), memory_cfg(retrieval="frozen"), banks["mean"])
    with pytest.raises(BankError, match="has 'last' keys.*memory.retrieval=prompt expects 'prompt' keys"):
        ElasticMem(fresh_backbone(), memory_cfg(retrieval="prompt"), banks["last"])
    with pytest.raises(BankError, match="expects 'layer_mean' keys"):
        ElasticMem(fresh_backbone(), memory_cfg(retrieval="control", key="layer_mean"), banks["last"])
    with pytest.raises(BankError, match="takes its layers from a layer_mean bank"):
        ElasticMem(fresh_backbone(), memory_cfg(retrieval="layer_mean", key="mean"), banks["mean"])
    # memory.key allows a deliberate cross pairing; the paper's modes keep working on paper banks
    ElasticMem(fresh_backbone(), memory_cfg(retrieval="frozen", key="mean"), banks["mean"])
    ElasticMem(fresh_backbone(), memory_cfg(retrieval="control"), banks["last"])
    # a model that retrieves nothing (the no-memory control, top_z 0) never compares them
    ElasticMem(fresh_backbone(), memory_cfg(retrieval="layer_mean", top_z=0), banks["last"])


# --------------------------------------------------------------------------- learned map


def test_info_nce_equals_explicit_sum():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 5, generator=g), torch.randn(7, 5, generator=g)
    positives, ranges, t = [[0], [3, 4], [6]], [(0, 3), (2, 6), (0, 7)], 0.1
    got = info_nce(q, k, positives, ranges, t)
    total = 0.0
    for i in range(3):
        lo, hi = ranges[i]
        s = {j: float(F.cosine_similarity(q[i], k[j], dim=0)) / t for j in range(lo, hi)}
        z = sum(torch.tensor(v).exp() for v in s.values())
        total += -torch.log(sum(torch.tensor(s[j]).exp() for j in positives[i]) / z)
    assert torch.allclose(got, total / 3, atol=1e-5)
    # negatives='all': every key is a candidate
    got_all = info_nce(q, k, positives, None, t)
    assert torch.allclose(got_all, info_nce(q, k, positives, [(0, 7)] * 3, t))


def test_train_map_finds_a_hidden_linear_relation():
    """Keys are a fixed random rotation of their questions plus noise: cosine without the map is
    near chance, a trained linear map retrieves almost perfectly."""
    from elasticmem.warmup.retrieval_map import recall_any

    g = torch.Generator().manual_seed(0)
    d, n_groups, per = 16, 6, 20
    rot = torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    base = torch.randn(n_groups * per, d, generator=g)
    keys = base @ rot + 0.05 * torch.randn(n_groups * per, d, generator=g)
    queries, positives, ranges = base.clone(), [[i] for i in range(len(base))], [
        (i // per * per, i // per * per + per) for i in range(len(base))]
    before = recall_any(None, queries, positives, ranges, keys, (1,))[1]
    rmap = train_map(queries, positives, ranges, keys,
                     MapTrainConfig(kind="linear", epochs=60, lr=1e-2, batch_size=32))
    after = recall_any(rmap, queries, positives, ranges, keys, (1,))[1]
    assert before < 0.4 and after > 0.9


@pytest.mark.parametrize("kind,residual", [("standardize", False), ("linear", False), ("linear", True),
                                           ("mlp", False), ("mlp", True)])
def test_mapped_search_equals_brute_force_cosine(banks, ref, examples, tmp_path, kind, residual):
    bank = banks["mean"]
    g = torch.Generator().manual_seed(1)
    n = 12
    queries = torch.randn(n, ref.hidden_size, generator=g)
    ranges = [bank.group_rows(examples[i % len(examples)].group) for i in range(n)]
    positives = [[lo + int(torch.randint(0, hi - lo, (1,), generator=g))] for lo, hi in ranges]
    rmap = train_map(queries, positives, ranges, bank.keys().clone(),
                     MapTrainConfig(kind=kind, d_out=8, hidden=12, epochs=2, batch_size=4, residual=residual))
    if kind != "standardize":  # training moved the net away from its (zero, for residual) start
        assert rmap.query.weight.abs().sum() > 0 if kind == "linear" else rmap.query[-1].weight.abs().sum() > 0
    path = rmap.save(tmp_path / "m.safetensors", "mean", bank.key,
                     {"name_or_path": ref.name_or_path, "fingerprint": ref.fingerprint})
    model = make_model(bank, retrieval="mean", retrieval_map=str(path))
    batch = examples[:6]
    prompts = [model.encode_texts(ex)[0] for ex in batch]
    h = model._query_states(prompts, [ex.question for ex in batch], 1, True)[2]
    rows, scores = model.retrieve(batch)
    # brute force from the file's tensors alone
    from safetensors.torch import load_file

    t = load_file(str(path))

    def f(x, side):
        x = (x - t[f"{side}_mean"]) / t[f"{side}_std"]
        y = x
        if kind == "linear":
            y = x @ t[f"{side}.weight"].T + t[f"{side}.bias"]
        elif kind == "mlp":
            y = F.gelu(x @ t[f"{side}.0.weight"].T + t[f"{side}.0.bias"])
            y = y @ t[f"{side}.3.weight"].T + t[f"{side}.3.bias"]
        return F.normalize(x + y if residual else y, dim=-1)

    K = f(bank.keys(), "key")
    for i, ex in enumerate(batch):
        lo, hi = bank.group_rows(ex.group)
        s = K[lo:hi] @ f(h[i], "query")
        top = torch.topk(s, min(3, hi - lo))
        assert rows[i, : top.indices.numel()].tolist() == (top.indices + lo).tolist()
        assert torch.allclose(scores[i, : top.indices.numel()], top.values, atol=1e-5)
    loaded, meta = load_retrieval_map(path)
    assert meta["kind"] == kind and meta["retrieval"] == "mean" and meta["key"] == bank.key
    assert loaded.residual == residual and loaded.d_out == (8 if kind != "standardize" and not residual else ref.hidden_size)


def test_retrieval_map_refused_for_other_mode_key_or_encoder(banks, ref, tmp_path):
    bank = banks["mean"]
    keys = bank.keys().clone()
    rmap = train_map(keys[:4], [[0], [1], [2], [3]], [(0, bank.num_chunks)] * 4, keys,
                     MapTrainConfig(kind="standardize"))
    enc = {"name_or_path": ref.name_or_path, "fingerprint": ref.fingerprint}
    path = rmap.save(tmp_path / "m.safetensors", "mean", bank.key, enc)
    with pytest.raises(RetrievalMapError, match="maps 'mean' query states but memory.retrieval is 'frozen'"):
        make_model(bank, retrieval="frozen", key="mean", retrieval_map=str(path))
    with pytest.raises(RetrievalMapError, match="trained on keys"):
        make_model(banks["last"], retrieval="mean", key="last", retrieval_map=str(path))
    other = rmap.save(tmp_path / "o.safetensors", "mean", bank.key, {"name_or_path": "x", "fingerprint": "sha256:0"})
    with pytest.raises(RetrievalMapError, match="not of this backbone"):
        make_model(bank, retrieval="mean", retrieval_map=str(other))
    with pytest.raises(RetrievalMapError, match="not found"):
        make_model(bank, retrieval="mean", retrieval_map=str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="has none"):
        ElasticMem(fresh_backbone(), memory_cfg(retrieval="semantic", retrieval_map=str(path)), bank)


def test_cli_trains_on_the_train_split_only(tmp_path, ref, capsys):
    """The command reads the training questions' evidence, writes a map the model accepts, and
    refuses a bank without the split's conversations."""
    from elasticmem.data.synthetic import SyntheticConfig, generate

    data = generate(SyntheticConfig(variant="tiny", num_histories=12, num_facts=3, num_options=4), seed=0)
    for split, exs in data.items():
        write_examples(tmp_path / "data" / f"{split}.jsonl", exs)
    assert all(ex.extra.get("evidence") for ex in data["train"])
    bank_dir = tmp_path / "bank"
    build_bank({"train": data["train"]}, ref, ChunkingConfig(max_tokens=32),
               BankConfig(dir=str(bank_dir), key="layer_mean", key_layers=LAYERS), torch.float32,
               show_progress=False)
    common = ["backbone.name_or_path=tiny", "backbone.device=cpu", f"data.dir={tmp_path / 'data'}", f"bank.dir={bank_dir}",
              "memory.retrieval=layer_mean", "memory.lora.r=4", "memory.policy.d_model=16",
              "memory.policy.num_heads=2", "memory.projector.hidden_size=32"]
    out = tmp_path / "map.safetensors"
    assert map_main(["--out", str(out), "--kind", "linear", "--dim", "16", "--epochs", "3", *common]) == 0
    _, meta = load_retrieval_map(out)
    assert meta["train"]["splits"] == ["train"] and meta["train"]["groups"] == sorted({e.group for e in data["train"]})
    assert meta["train"]["pairs"] == len(data["train"]) and meta["retrieval"] == "layer_mean"
    assert meta["key"] == {"variant": "layer_mean", "layers": LAYERS}
    model = make_model(Bank.open(bank_dir), retrieval="layer_mean", retrieval_map=str(out), top_z=4)  # accepted
    assert map_main(["--out", str(out), "--split", "val", *common]) == 2
    assert "lacks" in capsys.readouterr().err

    # benchmarks/retrieval.py: the bank's own mode by default, a row per map, the model's retrieval
    import importlib.util

    from elasticmem.config import Config
    from elasticmem.eval.retrieval import evidence_rows, recall_at_k
    from elasticmem.utils.configuration import load

    spec = importlib.util.spec_from_file_location("bench_retrieval", ROOT / "benchmarks" / "retrieval.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.default_modes(str(bank_dir)) == ["random", "layer_mean", "semantic"]
    cfg = load(Config, None, common)
    exs = data["train"][:10]
    res = bench.measure(cfg, exs, ["layer_mean"], (1, 2, 4), log=lambda s: None, maps=[str(out)])
    assert list(res["modes"]) == ["layer_mean", "layer_mean+map[map]"] and res["bank_key"] == meta["key"]
    bank = Bank.open(bank_dir)
    expected = recall_at_k(torch.cat([model.retrieve(exs[i:i + 4])[0] for i in range(0, 10, 4)]),
                           [evidence_rows(ex, bank) for ex in exs], (1, 2, 4))
    got = res["modes"]["layer_mean+map[map]"]
    assert {k: got[k] for k in expected if k != "n_no_evidence"} == {k: v for k, v in expected.items()
                                                                       if k != "n_no_evidence"}
    assert bench.format_table(res).splitlines()[2].split()[0] == "layer_mean+map[map]"
