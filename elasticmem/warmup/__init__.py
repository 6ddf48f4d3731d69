"""Optional supervised stages before GRPO (DESIGN.md section 3): each reuses bank, model and data.

- ``reading``: the supervised reading warm-up before GRPO (teacher forcing on the gold answer
  with the memories injected, xRAG's reconstruction stage; ``warmup.*``, then
  ``train.init_from``), a departure from the paper's GRPO-only recipe;
- ``retrieval_map``: a query/key map for the cosine top-Z, trained contrastively on
  (question state, evidence chunk key) pairs of the training split (a departure from the
  paper, ``memory.retrieval_map``).
"""
