"""GRPO for ElasticMem: rewards, group advantages and the clipped policy loss (pure functions)."""
