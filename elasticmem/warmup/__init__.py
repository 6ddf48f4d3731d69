"""Optional supervised stages before GRPO (DESIGN.md section 3): each reuses bank, model and data.

- ``retrieval_map``: a query/key map for the cosine top-Z, trained contrastively on
  (question state, evidence chunk key) pairs of the training split (a departure from the
  paper, ``memory.retrieval_map``).
"""
