"""Backbones: the tiny random model, loading from a folder, fingerprints, clear errors; SmolLM2 when cached.

    pytest tests/unit/test_backbone.py
"""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import requires_smollm2
from elasticmem.backbone import build_tiny_tokenizer, convert_gguf, load_backbone, model_fingerprint
from elasticmem.config import ModelConfig, TinyModelConfig


def _tiny(seed=0, **kw):
    return load_backbone(ModelConfig(name_or_path="tiny", device="cpu", tiny=TinyModelConfig(seed=seed, **kw)))


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


def test_local_folder_roundtrip_keeps_fingerprint(tmp_path):
    a = _tiny(0)
    a.model.save_pretrained(tmp_path / "m")
    a.tokenizer.save_pretrained(tmp_path / "m")
    b = load_backbone(ModelConfig(name_or_path=str(tmp_path / "m"), device="cpu"))
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
        load_backbone(ModelConfig(name_or_path="./nope", device="cpu"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_backbone(ModelConfig(name_or_path=str(tmp_path / "empty"), device="cpu"))
    with pytest.raises(FileNotFoundError, match="python -m elasticmem.backbone fetch smollm2"):
        load_backbone(ModelConfig(name_or_path="smollm2", device="cpu", cache_dir=str(tmp_path / "cache")))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_backbone(ModelConfig(name_or_path=str(tmp_path / "x.gguf"), device="cpu"))
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
