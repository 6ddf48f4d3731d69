"""GRPO for ElasticMem: group advantages and the clipped policy loss (pure functions), and the
trainer. The rewards it optimises are the tasks' (``elasticmem.data.rewards``)."""
