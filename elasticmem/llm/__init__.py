"""Text generation shared by the text-memory baselines and the agent.

``client``: the LLM backends (a local transformers model, any OpenAI-compatible server) behind one
protocol, and ``StructuredLLM``, which validates and retries JSON answers; ``structured``: the
JSON schema language those answers are checked against, and its token-level matcher.
"""
