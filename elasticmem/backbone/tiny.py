"""The tiny model built in code: a word-piece tokenizer and a random Qwen2, deterministic by seed.

For tests (``backbone.name_or_path: tiny``, no download) and, in a released model's decoder
shape (``RANDOM_MODELS``), for benchmarks at a real model's scale.
"""

from __future__ import annotations

import string

import torch

from elasticmem.config import BackboneConfig, TinyModelConfig


def _tiny_words(vocabulary: str = "synthetic") -> list[str]:
    from elasticmem.data.synthetic_tables import VOCABULARY

    words = ["User", "Assistant", "user", "assistant", "system", *VOCABULARY]
    if vocabulary == "alfworld":
        from elasticmem.data.alfworld_vocabulary import ALFWORLD_WORDS

        words += ALFWORLD_WORDS
    elif vocabulary != "synthetic":
        raise ValueError(f"backbone.tiny.vocabulary must be 'synthetic' or 'alfworld', got {vocabulary!r}")
    return words


def build_tiny_tokenizer(char_fallback: bool = True, vocabulary: str = "synthetic"):
    """A small word-piece tokenizer: task words, then single characters as fallback.

    Newlines are real tokens (the separator between injected memories is the
    embedding of "\\n"); spaces are dropped. With ``char_fallback`` any ASCII text
    tokenizes without <unk> (an unknown word falls back to characters); without
    it the vocabulary is the task words and punctuation only. ``vocabulary``
    'alfworld' adds ALFWorld's words (``elasticmem.data.alfworld_vocabulary``) after the
    synthetic task's, which keep their ids.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = list(string.ascii_letters + string.digits + string.punctuation) if char_fallback else []
    vocab: dict[str, int] = {}
    for tok in [*specials, "\n", *_tiny_words(vocabulary), *string.punctuation, *chars, *("##" + c for c in chars)]:
        vocab.setdefault(tok, len(vocab))
    tk = Tokenizer(models.WordPiece(vocab=vocab, unk_token="<unk>", max_input_chars_per_word=100))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[ \t\r]+"), behavior="removed"),
            pre_tokenizers.Split(Regex(r"\n|[^\w\n]"), behavior="isolated"),
        ]
    )
    tk.decoder = decoders.WordPiece(prefix="##")
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        bos_token=None,
    )
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tok


# Decoder shapes of released models, for random stand-ins (``random_shape``): benchmarks and GPU
# memory sizing at a real model's scale with no download. Only the vocabulary (and with it the
# embedding and the LM head) is the tiny tokenizer's, a few hundred rows instead of ~150k.
RANDOM_SHAPES: dict[str, dict[str, int]] = {
    "qwen2.5-3b": dict(hidden_size=2048, num_layers=36, num_heads=16, num_kv_heads=2, intermediate_size=11008),
    "qwen2.5-7b": dict(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944),
}


def random_shape(name: str, seed: int = 0) -> TinyModelConfig:
    """``backbone.tiny`` shaped like the released model ``name`` (a key of ``RANDOM_SHAPES``)."""
    if name not in RANDOM_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(sorted(RANDOM_SHAPES))}")
    return TinyModelConfig(**RANDOM_SHAPES[name], max_position_embeddings=32768, seed=seed)


RANDOM_MODELS = tuple(f"{shape}-random" for shape in RANDOM_SHAPES)
"""Model names for random stand-ins (benchmarks, the GPU check): ``SHAPE-random``."""


def named_model_config(name: str, device: str = "auto") -> BackboneConfig:
    """``name`` as ``backbone.name_or_path``, or a ``RANDOM_MODELS`` name: the tiny model built in
    that released model's decoder shape (random weights, no download)."""
    if name in RANDOM_MODELS:
        return BackboneConfig(name_or_path="tiny", tiny=random_shape(name.removesuffix("-random")), device=device)
    return BackboneConfig(name_or_path=name, device=device)


def build_tiny_model(cfg: TinyModelConfig, tokenizer) -> torch.nn.Module:
    """A random Qwen2ForCausalLM; the same ``cfg.seed`` gives the same weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = Qwen2ForCausalLM(config)
    return model
