"""Backbones: the tiny random model, loading from a folder, fingerprints and their cache, clear errors;
SmolLM2 when cached.

    pytest tests/unit/test_backbone.py
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings

import pytest
import torch
from conftest import requires_smollm2, smollm2_dir

import elasticmem.backbone.cli as backbone_cli
import elasticmem.backbone.fingerprint as fingerprint_mod
from elasticmem.backbone import build_tiny_tokenizer, convert_gguf, load_backbone, model_fingerprint
from elasticmem.config import BackboneConfig, TinyModelConfig


def _tiny(seed=0, **kw):
    return load_backbone(BackboneConfig(name_or_path="tiny", device="cpu", tiny=TinyModelConfig(seed=seed, **kw)))


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """The fingerprint cache under tmp_path, on, and a counter of calls to the weight hashing."""
    home = tmp_path / "home"
    monkeypatch.setenv("ELASTICMEM_HOME", str(home))
    monkeypatch.delenv("ELASTICMEM_FINGERPRINT_CACHE", raising=False)
    calls = []
    real = fingerprint_mod.model_fingerprint

    def counting(model, tokenizer):
        calls.append(1)
        return real(model, tokenizer)

    monkeypatch.setattr(fingerprint_mod, "model_fingerprint", counting)
    return home, calls


def _save(bb, path, dtype=None):
    model = bb.model if dtype is None else bb.model.to(dtype)
    model.save_pretrained(path)
    bb.tokenizer.save_pretrained(path)
    return str(path)


def _load(path, **kw):
    return load_backbone(BackboneConfig(name_or_path=str(path), device="cpu", **kw))


def _source(path, **kw):
    """Where the fingerprint of a fresh load came from."""
    return _load(path, **kw).fingerprint_source


def test_tiny_is_deterministic_by_seed():
    a, b, c = _tiny(0), _tiny(0), _tiny(1)
    for (n, p), (_, q) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(p, q), n
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert a.model.config.model_type == "qwen2" and a.hidden_size == 64
    assert not any(p.requires_grad for p in a.model.parameters())


def test_fingerprint_sees_config_weights_and_tokenizer():
    a = _tiny(0)
    assert _tiny(0, num_layers=3).fingerprint != a.fingerprint
    model = a.model
    with torch.no_grad():
        p = next(model.parameters())
        p[0, 0] += 1e-3
        changed = model_fingerprint(model, a.tokenizer)
        p[0, 0] -= 1e-3
    assert changed != a.fingerprint
    tok = build_tiny_tokenizer()
    tok.add_tokens(["zebra"])
    assert model_fingerprint(model, tok) != a.fingerprint


def test_local_folder_roundtrip_keeps_fingerprint(tmp_path, cache_home):
    a = _tiny(0)
    a.model.save_pretrained(tmp_path / "m")
    a.tokenizer.save_pretrained(tmp_path / "m")
    b = load_backbone(BackboneConfig(name_or_path=str(tmp_path / "m"), device="cpu"))
    assert b.fingerprint == a.fingerprint
    ids = a.tokenizer("User:\nc cat", return_tensors="pt")["input_ids"]
    assert b.tokenizer("User:\nc cat", return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    assert torch.equal(a.model(ids).logits, b.model(ids).logits)


def test_tiny_tokenizer_covers_text():
    tok = build_tiny_tokenizer()
    ids = tok("User:\nHello, Zanzibar! 42\n\nAssistant:\nok", add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.convert_tokens_to_ids("\n") in ids
    assert tok("recall cat", add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids(w) for w in
                                                                        ("recall", "cat")]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")


def test_errors_are_clear(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="model path not found: ./nope"):
        load_backbone(BackboneConfig(name_or_path="./nope", device="cpu"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_backbone(BackboneConfig(name_or_path=str(tmp_path / "empty"), device="cpu"))
    with pytest.raises(FileNotFoundError, match="python -m elasticmem.backbone fetch smollm2"):
        load_backbone(BackboneConfig(name_or_path="smollm2", device="cpu", cache_dir=str(tmp_path / "cache")))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_backbone(BackboneConfig(name_or_path=str(tmp_path / "x.gguf"), device="cpu"))
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if the package were not installed
    with pytest.raises(ImportError, match="needs the 'gguf' package: pip install gguf"):
        convert_gguf(fake, tmp_path / "out")


@requires_smollm2
def test_smollm2_from_cache(smollm2_backbone):
    bb = smollm2_backbone
    cfg = bb.model.config
    assert type(bb.model).__name__ == "LlamaForCausalLM"
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (576, 30)
    assert abs(sum(p.numel() for p in bb.model.parameters()) / 1e6 - 134.5) < 0.5
    assert getattr(cfg, "quantization_config", None) is None
    assert bb.tokenizer.chat_template
    ids = bb.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    out = bb.model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in bb.tokenizer.decode(out[0, ids.shape[1]:])


# --------------------------------------------------------------------------- fingerprint cache


def test_second_load_of_a_folder_takes_the_fingerprint_from_the_cache(tmp_path, cache_home):
    home, calls = cache_home
    a = _tiny(0)
    folder = _save(a, tmp_path / "m")
    first = _load(folder)
    assert first.fingerprint == a.fingerprint and first.fingerprint_source == "computed"
    assert len(calls) == 2  # the tiny model (never cached) and the first folder load
    assert len(list((home / "fingerprints").glob("*.json"))) == 1
    second = _load(folder)
    assert second.fingerprint == first.fingerprint and second.fingerprint_source == "cache"
    assert len(calls) == 2  # no weight was hashed
    # the cached value is what the full computation gives on the loaded model
    assert fingerprint_mod.FINGERPRINT_CACHE_FORMAT
    assert model_fingerprint(second.model, second.tokenizer) == a.fingerprint


def test_changed_files_invalidate_the_cached_fingerprint(tmp_path, cache_home):
    home, calls = cache_home
    a, b = _tiny(0), _tiny(1)
    folder = _save(a, tmp_path / "m")  # (saving sets config.architectures: hash after it)
    fa = model_fingerprint(a.model, a.tokenizer)  # the real function, not the counting one
    weights = tmp_path / "m" / "model.safetensors"
    assert _load(folder).fingerprint == fa
    n = len(calls)
    assert _source(folder) == "cache" and len(calls) == n

    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, same bytes
    again = _load(folder)
    assert again.fingerprint == fa and again.fingerprint_source == "computed" and len(calls) == n + 1

    _save(b, tmp_path / "m")  # other weights, same shapes: same file size
    fb = model_fingerprint(b.model, b.tokenizer)
    assert weights.stat().st_size == st.st_size
    changed = _load(folder)
    assert changed.fingerprint == fb != fa
    assert changed.fingerprint_source == "computed" and len(calls) == n + 2

    # rewritten in place, same size, mtime put back: the ctime still changes
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor
    time.sleep(0.05)  # past the kernel's timestamp tick
    with open(weights, "r+b") as f:
        f.write(data)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns, weights.stat().st_ino) == \
        (st.st_size, st.st_mtime_ns, st.st_ino)
    flipped = _load(folder)
    assert flipped.fingerprint not in (fa, fb) and flipped.fingerprint_source == "computed"
    assert flipped.fingerprint == model_fingerprint(flipped.model, flipped.tokenizer)

    (tmp_path / "m" / "tokenizer_config.json").write_text(
        (tmp_path / "m" / "tokenizer_config.json").read_text() + "\n")  # any file of the folder counts
    assert _source(folder) == "computed"


def test_fingerprint_cache_key_follows_dtype_only_when_it_rounds(tmp_path, cache_home):
    home, calls = cache_home
    a = _tiny(0)
    f32 = _save(a, tmp_path / "f32")  # stored float32
    x = _load(f32, dtype="float32")
    y = _load(f32, dtype="bfloat16")  # rounded: another fingerprint, another key
    assert x.fingerprint != y.fingerprint and y.fingerprint_source == "computed"
    assert x.weights_key["weights_as"] == "stored" and y.weights_key["weights_as"] == "bfloat16"
    bf16 = _save(_tiny(0), tmp_path / "bf16", torch.bfloat16)  # stored bfloat16: exact in float32 and bfloat16
    p = _load(bf16, dtype="bfloat16")
    assert p.fingerprint and p.fingerprint_source == "computed"
    q = _load(bf16, dtype="float32")
    assert q.fingerprint == p.fingerprint and q.fingerprint_source == "cache"
    assert model_fingerprint(q.model, q.tokenizer) == q.fingerprint
    r = _load(bf16, dtype="float16")  # bf16 -> fp16 rounds
    assert r.fingerprint == model_fingerprint(r.model, r.tokenizer) and r.fingerprint_source == "computed"
    assert r.fingerprint != p.fingerprint


def test_fingerprint_cache_off_refresh_corrupt_and_unwritable(tmp_path, cache_home, monkeypatch, capsys):
    home, calls = cache_home
    a = _tiny(0)
    folder = _save(a, tmp_path / "m")
    monkeypatch.setenv("ELASTICMEM_FINGERPRINT_CACHE", "off")
    off = _load(folder)
    assert off.fingerprint == a.fingerprint and off.fingerprint_source.startswith("computed (cache off")
    assert not (home / "fingerprints").exists()

    monkeypatch.delenv("ELASTICMEM_FINGERPRINT_CACHE")
    backbone_cli.main(["info", folder])
    info = json.loads(capsys.readouterr().out)
    assert (info["fingerprint"], info["fingerprint_source"]) == (a.fingerprint, "computed")
    backbone_cli.main(["info", folder])
    assert json.loads(capsys.readouterr().out)["fingerprint_source"] == "cache"
    n = len(calls)
    backbone_cli.main(["info", folder, "--recompute"])
    info = json.loads(capsys.readouterr().out)
    assert info["fingerprint_source"] == "computed (refresh)" and info["fingerprint"] == a.fingerprint
    assert len(calls) == n + 1
    monkeypatch.delenv("ELASTICMEM_FINGERPRINT_CACHE")  # set by --recompute

    entry = next((home / "fingerprints").glob("*.json"))
    body = json.loads(entry.read_text())
    entry.write_text(json.dumps({**body, "fingerprint": "sha256:" + "0" * 64, "key": {**body["key"], "folder": "/x"}}))
    forged = _load(folder)  # an entry whose key is not the key of its name is not used
    assert forged.fingerprint == a.fingerprint and forged.fingerprint_source == "computed"
    entry.write_text('{"fingerprint": "sha')  # a torn write (cannot happen: tmp + rename) is a miss
    assert _load(folder).fingerprint == a.fingerprint
    assert json.loads(entry.read_text())["fingerprint"] == a.fingerprint  # and is rewritten

    monkeypatch.setenv("ELASTICMEM_HOME", str(tmp_path / "m" / "config.json"))  # a file: cannot mkdir below it
    with pytest.warns(UserWarning, match="could not write the fingerprint cache"):
        ro = _load(folder)
        assert ro.fingerprint == a.fingerprint and ro.fingerprint_source.startswith("computed (cache not written")
    monkeypatch.setenv("ELASTICMEM_FINGERPRINT_CACHE", "sometimes")
    with pytest.raises(ValueError, match="use on, off or refresh"):
        _load(folder).fingerprint


def test_uncacheable_loads_always_hash(tmp_path, cache_home):
    from safetensors.torch import load_file, save_file

    home, calls = cache_home
    a = _tiny(0)
    assert a.weights_key is None and "tiny" in a.fingerprint_source
    folder = _save(a, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    state = load_file(weights)
    del state["model.norm.weight"]  # initialised at load, not from the files
    save_file(state, weights, metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            bb = _load(folder)
            assert bb.weights_key is None
            assert bb.fingerprint_source == "computed (not cacheable: some weights were not in the checkpoint)"
    assert not (home / "fingerprints").exists()


def test_concurrent_cache_writers_and_readers_never_see_a_partial_entry(tmp_path, cache_home):
    key = {"format": 1, "folder": str(tmp_path), "files": [["x", 1, 2, 3, 4]] * 300}
    value = "sha256:" + "ab" * 32
    seen, errors = [], []

    def write():
        try:
            for _ in range(20):
                fingerprint_mod.write_cached_fingerprint(key, value)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def read():
        for _ in range(100):
            seen.append(fingerprint_mod.read_cached_fingerprint(key))

    fingerprint_mod.write_cached_fingerprint(key, value)
    threads = [threading.Thread(target=f) for f in (write, write, write, read, read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and set(seen) == {value}
    assert [p.name for p in fingerprint_mod.fingerprint_cache_dir().iterdir()] == [
        fingerprint_mod.fingerprint_cache_path(key).name]  # no tmp file left


def test_hub_id_fingerprint_is_cached_by_its_snapshot(tmp_path, cache_home, monkeypatch):
    import huggingface_hub.constants

    home, calls = cache_home
    src = _save(_tiny(0), tmp_path / "src")
    repo = tmp_path / "hub" / "models--acme--tiny"  # the HF cache layout: refs, snapshots of symlinks, blobs
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    for f in sorted(os.listdir(src)):
        os.replace(os.path.join(src, f), repo / "blobs" / f)
        os.symlink(os.path.join("..", "..", "blobs", f), snap / f)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    first = _load("acme/tiny")
    assert first.weights_key["folder"] == str(snap.resolve()) and first.fingerprint_source == "computed"
    second = _load("acme/tiny")
    assert (second.fingerprint, second.fingerprint_source) == (first.fingerprint, "cache")
    assert model_fingerprint(second.model, second.tokenizer) == first.fingerprint
    os.utime(repo / "blobs" / "model.safetensors")  # the blob behind the symlink counts
    assert _source("acme/tiny") == "computed"


SMOLLM2_DIR = smollm2_dir()  # before cache_home moves $ELASTICMEM_HOME


@requires_smollm2
def test_smollm2_folder_fingerprint_from_cache_equals_full(cache_home):
    home, calls = cache_home
    first = _load(SMOLLM2_DIR)
    fp = first.fingerprint
    second = _load(SMOLLM2_DIR)
    assert (second.fingerprint, second.fingerprint_source) == (fp, "cache")
    assert len(calls) == 1 and model_fingerprint(second.model, second.tokenizer) == fp


def _spy_from_pretrained(monkeypatch) -> list[dict]:
    """Record the keyword arguments of every AutoModelForCausalLM.from_pretrained call."""
    from transformers import AutoModelForCausalLM

    calls: list[dict] = []
    real = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_folder_loads_straight_onto_its_device_with_the_weights_of_a_host_load(tmp_path, monkeypatch, dtype):
    """A model folder is loaded with a one-device ``device_map`` (each weight copied to the device
    as it is read, not the whole model into host memory first) and gives exactly the parameters
    and buffers, values and dtypes, of the host load then ``.to(device, dtype)``."""
    from transformers import AutoModelForCausalLM

    folder = _save(_tiny(0), tmp_path / "m")
    as_dtype = getattr(torch, dtype)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=as_dtype).to("cpu", as_dtype)
    calls = _spy_from_pretrained(monkeypatch)
    got = _load(folder, dtype=dtype).model
    assert len(calls) == 1 and calls[0]["device_map"] == {"": torch.device("cpu")}
    ref = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    new = {**dict(got.named_parameters()), **dict(got.named_buffers())}
    assert sorted(new) == sorted(ref) and any("inv_freq" in n for n in ref)
    for name, t in ref.items():
        assert new[name].dtype == t.dtype and new[name].device == t.device and torch.equal(new[name], t), name


def test_under_zero3_the_folder_is_loaded_without_a_device_map(tmp_path, monkeypatch):
    """DeepSpeed ZeRO-3 refuses a device_map (it places the weights itself): none is passed then."""
    import transformers.integrations

    folder = _save(_tiny(0), tmp_path / "m")
    monkeypatch.setattr(transformers.integrations, "is_deepspeed_zero3_enabled", lambda: True)
    calls = _spy_from_pretrained(monkeypatch)
    _load(folder)
    assert len(calls) == 1 and "device_map" not in calls[0]


def test_processes_that_miss_the_cache_together_hash_the_weights_once(tmp_path, cache_home, monkeypatch):
    """The processes of a launch ask for the fingerprint of a cold cache at the same moment: one
    hashes the weights and writes the entry, the others wait for it and read it. (Threads here:
    each opens the lock file itself, and flock treats separate opens as separate owners, as it
    does separate processes.)"""
    home, calls = cache_home
    bb = _load(_save(_tiny(0), tmp_path / "m"))
    counting = fingerprint_mod.model_fingerprint

    def slow(model, tokenizer):  # long enough that every thread misses the cache without the lock
        time.sleep(0.5)
        return counting(model, tokenizer)

    monkeypatch.setattr(fingerprint_mod, "model_fingerprint", slow)
    writes = []
    real_write = fingerprint_mod.write_cached_fingerprint
    monkeypatch.setattr(fingerprint_mod, "write_cached_fingerprint", lambda k, v: writes.append(v) or real_write(k, v))
    results: list[tuple[str, str]] = []
    threads = [threading.Thread(target=lambda: results.append(fingerprint_mod.cached_fingerprint(
        bb.model, bb.tokenizer, bb.weights_key))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = model_fingerprint(bb.model, bb.tokenizer)
    assert len(calls) == 1 and len(writes) == 1
    assert sorted(results) == sorted([(expected, "computed")] + [(expected, "cache")] * 3)
    assert [p.name for p in (home / "fingerprints").glob("*.json")] == [
        fingerprint_mod.fingerprint_cache_path(bb.weights_key).name]
