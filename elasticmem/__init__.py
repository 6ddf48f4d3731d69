"""elasticmem: latent memory for LLM agents with elastic per-memory budgets, trained with GRPO."""

__version__ = "0.1.0"
