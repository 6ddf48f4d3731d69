"""Data: the shared example schema, chunking, and the dataset loaders.

* ``schema``: ``Example`` / ``Turn`` and the JSONL reader/writer (DESIGN.md section 2).
* ``chunking``: histories to memory chunks and tokens.
* ``synthetic``: the generated task (no download).
* ``locomo``, ``longmemeval``, ``personamem``: the real benchmarks, from files the user
  downloaded; ``sources`` holds what they share (streaming readers, splits, errors, stats);
  ``hub`` reads their inputs through Hugging Face ``datasets`` (Hub ids, saved datasets, folders).
* ``prepare``: ``python -m elasticmem.data.prepare DATASET ...`` (docs/datasets.md).

Only the schema is imported here, so ``import elasticmem.data`` stays light.
"""

from elasticmem.data.schema import SPLITS, Example, SchemaError, Turn, load_split, read_examples, write_examples

__all__ = ["SPLITS", "Example", "SchemaError", "Turn", "load_split", "read_examples", "write_examples"]
