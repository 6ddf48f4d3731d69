"""The latent memory bank: builder (keys + content caches), store (memory-mapped shards), index (top-k),
append (growing a bank while it is read)."""

from elasticmem.bank.builder import BuildResult, build_bank, resolve_cache_dtype
from elasticmem.bank.encoding import encode_batch
from elasticmem.bank.index import KeyIndex, SearchResult, build_index
from elasticmem.bank.store import Bank, BankError

__all__ = [
    "Bank", "BankError", "BuildResult", "KeyIndex", "SearchResult",
    "build_bank", "build_index", "encode_batch", "resolve_cache_dtype",
]
