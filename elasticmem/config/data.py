"""Settings of the data: the splits, the synthetic task (its pool sizes, its fact types and
``SyntheticConfig``), the prepared dataset, chunking, and the memory bank with its index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

from elasticmem.utils.common import require as _require


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
# The persona_shift variant's per-side sizes (the smaller half of each pool; elasticmem.data.synthetic_shift_tables
# checks them the same way).
SYNTHETIC_SHIFT_STYLES = ("chat", "third_person", "named")
SYNTHETIC_SHIFT_KINDS = 12
SYNTHETIC_SHIFT_SIDE_POOL = 15
SYNTHETIC_SHIFT_SIDE_NAMES = 40
SYNTHETIC_SHIFT_SIDE_RELATIONS = 20
SYNTHETIC_SHIFT_SIDE_FILLER = 12
SYNTHETIC_SHIFT_FIELDS = ("surface_split", "surface_seed", "train_styles", "eval_styles")
"""SyntheticConfig fields only the persona_shift variant reads (stats.json leaves them out for the other
variants while they hold their defaults, so those variants' files stay as they were)."""


def synthetic_fact_types(question_types: Sequence[str], num_facts: int) -> list[str]:
    """The question type of each fact of a persona history: the types in turn."""
    return [question_types[i % len(question_types)] for i in range(num_facts)]


@dataclass
class SyntheticConfig:
    """Knobs of the synthetic memory task (see elasticmem.data.synthetic)."""

    variant: Literal["persona", "tiny", "persona_shift"] = "persona"
    """'persona': realistic multi-session chats with single_hop, multi_hop and
    knowledge_update questions. 'tiny': one session of "{letter} {key}" turns and
    "recall {key}" questions, small enough for a tiny random model to learn by RL.
    'persona_shift': the persona task in three dialogue styles whose val and test splits
    use sentence templates, question forms, names, relations and values that the
    training split never uses (elasticmem.data.synthetic_shift; docs/data.md)."""
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
    surface_split: bool = True
    """persona_shift: the training split draws every template part, name, relation, value
    and small-talk line from one half of the tables and val/test from the other half
    (disjoint surface forms). False: every split draws from both halves (the control)."""
    surface_seed: int = 0
    """persona_shift: seeds the hash that splits the tables into the two halves (the same
    halves for every data ``seed``)."""
    train_styles: list[str] = field(default_factory=lambda: list(SYNTHETIC_SHIFT_STYLES))
    """persona_shift: dialogue styles of the training histories, one drawn per history:
    'chat' (user/assistant, first-person questions: "Which city did I move to?"),
    'third_person' (the same chat with a named user, questions about that name), 'named'
    (two named people talking, facts of either, questions about either)."""
    eval_styles: list[str] = field(default_factory=lambda: list(SYNTHETIC_SHIFT_STYLES))
    """persona_shift: dialogue styles of the val and test histories (e.g. ['named'] with
    train_styles ['chat', 'third_person'] holds a style out)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first setting that cannot work."""
        _require(self.variant in ("persona", "tiny", "persona_shift"),
                 f"variant must be 'persona', 'tiny' or 'persona_shift', got {self.variant!r}")
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
        elif self.variant == "persona":
            self._validate_persona()
        else:
            self._validate_shift()

    def _validate_tiny(self) -> None:
        _require(1 <= self.num_keys <= SYNTHETIC_TINY_KEYS,
                 f"num_keys must be in 1..{SYNTHETIC_TINY_KEYS} (the built-in keys), got {self.num_keys}")
        _require(self.num_facts <= self.num_keys,
                 f"num_facts ({self.num_facts}) must be <= num_keys ({self.num_keys}): "
                 "each turn of a tiny history needs its own key")

    def _validate_persona(self) -> None:
        unknown = [t for t in self.question_types if t not in SYNTHETIC_QUESTION_TYPES]
        _require(not unknown, f"unknown question type(s) {unknown}; valid: {list(SYNTHETIC_QUESTION_TYPES)}")
        _require(len(self.question_types) >= 1,
                 f"question_types must not be empty; valid: {list(SYNTHETIC_QUESTION_TYPES)}")
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

    def _validate_shift(self) -> None:
        for key in ("train_styles", "eval_styles"):
            styles = getattr(self, key)
            _require(len(styles) >= 1 and set(styles) <= set(SYNTHETIC_SHIFT_STYLES),
                     f"{key} must be a non-empty list of {list(SYNTHETIC_SHIFT_STYLES)}, got {styles}")
        unknown = [t for t in self.question_types if t not in SYNTHETIC_QUESTION_TYPES]
        _require(len(self.question_types) >= 1 and not unknown,
                 f"question_types must be a non-empty list of {list(SYNTHETIC_QUESTION_TYPES)}, got {self.question_types}")
        _require(self.num_distractors >= self.num_options - 1,
                 f"num_distractors ({self.num_distractors}) must be >= num_options - 1 "
                 f"({self.num_options - 1}) so every wrong option appears in the history")
        _require(self.num_facts <= SYNTHETIC_SHIFT_KINDS,
                 f"num_facts ({self.num_facts}) must be <= {SYNTHETIC_SHIFT_KINDS}, the number of fact kinds")
        pool = SYNTHETIC_SHIFT_SIDE_POOL
        _require(self.num_distractors + 2 <= pool,
                 f"num_distractors ({self.num_distractors}) must be <= {pool - 2}: a fact needs num_distractors + 2 "
                 f"distinct values and the smallest half of a value pool (persona_shift) has {pool}")
        _require(self.num_distractors <= SYNTHETIC_SHIFT_SIDE_RELATIONS,
                 f"num_distractors ({self.num_distractors}) must be <= {SYNTHETIC_SHIFT_SIDE_RELATIONS} (relations a side)")
        _require(self.num_sessions >= 1, f"num_sessions must be >= 1, got {self.num_sessions}")
        types = synthetic_fact_types(self.question_types, self.num_facts)
        _require("knowledge_update" not in types or self.num_sessions >= 2,
                 "knowledge_update needs num_sessions >= 2 (the old value goes in an earlier session)")
        people = types.count("multi_hop") * (self.num_distractors + 1)
        _require(people <= min(SYNTHETIC_SHIFT_SIDE_RELATIONS, SYNTHETIC_SHIFT_SIDE_NAMES - 2),
                 f"{types.count('multi_hop')} multi_hop facts x (num_distractors + 1) = {people} linked people, more "
                 f"than the {SYNTHETIC_SHIFT_SIDE_RELATIONS} relations a side has; lower num_distractors or num_facts")
        _require(0 <= self.num_filler <= SYNTHETIC_SHIFT_SIDE_FILLER,
                 f"num_filler must be in 0..{SYNTHETIC_SHIFT_SIDE_FILLER} (persona_shift), got {self.num_filler}")


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


KV_INT_BITS = {"int8": 8, "int4": 4}
"""Code width of each integer ``bank.kv_dtype`` / ``bank.kv_key_dtype`` (``elasticmem.bank.quant``)."""


@dataclass(frozen=True)
class KVScheme:
    """How a bank stores each chunk's per-layer keys and values, as one value: ``bank.kv_dtype``,
    ``bank.kv_key_dtype``, ``bank.kv_key_group`` and ``bank.kv_group_size`` (``BankConfig.kv_scheme``).
    The manifest's ``kv`` record holds it (``elasticmem.bank.kv_store.KVFormat``), a build or a
    conversion writes it, and a reader is held to it (``Bank.open(expect_kv=...)``,
    ``Bank.require_kv``). Normalized at construction, so that two spellings of one storage compare
    equal: a float dtype keeps no ranges (its other fields are 'same', 0, 0, as a float16 bank
    built with ``bank.kv_key_group=16`` stores exactly what one without does), and keys at the
    values' width are ``key_dtype='same'``."""

    dtype: str = "float16"
    """The values' storage (and the keys', unless ``key_dtype`` says otherwise)."""
    key_dtype: str = "same"
    """The keys' code width when it differs from the values' ('int8' with dtype int4: K8V4)."""
    key_group: int = 0
    """Stored slots that share the keys' per-channel ranges, from a chunk's oldest (0: all of them)."""
    group_size: int = 32
    """Value channels that share a scale and minimum (0 for a float dtype)."""

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:  # the dataclass is frozen: normalize once, here
            object.__setattr__(self, name, value)

        if self.key_dtype == self.dtype:
            put("key_dtype", "same")
        if not self.quantized:
            _require(self.key_dtype == "same", f"kv_key_dtype={self.key_dtype} needs an integer kv_dtype "
                     f"(int8 or int4), got kv_dtype={self.dtype}: float states have no codes to widen")
            put("key_group", 0)
            put("group_size", 0)
            return
        _require(self.key_dtype == "same" or self.key_dtype in KV_INT_BITS,
                 f"kv_key_dtype must be 'same' or one of {tuple(KV_INT_BITS)}, got {self.key_dtype!r}")
        _require(self.group_size >= 1, f"kv_group_size must be >= 1, got {self.group_size}")
        _require(self.key_group >= 0, f"kv_key_group must be >= 0 (0: a key range per chunk), got {self.key_group}")

    @property
    def quantized(self) -> bool:
        """Whether the states are stored as integer codes (int8 / int4 values)."""
        return self.dtype in KV_INT_BITS

    @property
    def key_bits(self) -> int | None:
        """The keys' code width (None: a float dtype)."""
        return KV_INT_BITS.get(self.dtype if self.key_dtype == "same" else self.key_dtype)

    @property
    def value_bits(self) -> int | None:
        """The values' code width (None: a float dtype)."""
        return KV_INT_BITS.get(self.dtype)

    def held(self) -> dict[str, object]:
        """The settings a reader must share with the bank it reads (``Bank.require_kv``): all but
        ``bank.kv_group_size``, which no reader was held to before these fields (a bank built with
        other value groups keeps being read as it was)."""
        return {"bank.kv_dtype": self.dtype, "bank.kv_key_dtype": self.key_dtype, "bank.kv_key_group": self.key_group}

    def how(self) -> str:
        """E.g. 'keys int8 per channel over each chunk, values per token in groups of 32' ('' for a
        float dtype): what ``describe`` and the manifest's readers say."""
        if not self.quantized:
            return ""
        width = "" if self.key_dtype == "same" else f" {self.key_dtype}"
        over = f"runs of {self.key_group} slots" if self.key_group else "each chunk"
        return f"keys{width} per channel over {over}, values per token in groups of {self.group_size}"

    def describe(self) -> str:
        """E.g. 'int4 (keys int8 per channel over each chunk, values per token in groups of 32)'."""
        return f"{self.dtype} ({self.how()})" if self.quantized else self.dtype


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
    rotary position embeddings. Size: layers x 2 x KV heads x head width values a stored position
    (SmolLM2-135M: 11,520, 20x its hidden state); a chunk of L tokens stores min(L - 1, n_cache,
    memory.policy.max_budget) positions (its first, the attention sink, and those no budget can
    read are left out). The build prints and records its bytes per chunk (docs/bank.md)."""
    kv_dtype: Literal["float16", "bfloat16", "float32", "int8", "int4"] = "float16"
    """Storage dtype of the per-layer keys and values (kv_cache). 'int8' and 'int4' quantize the
    float16 states in the KIVI layout: keys per channel over each chunk (or runs of kv_key_group
    positions; at kv_key_dtype's width when set), values per token in groups of kv_group_size
    channels (elasticmem.bank.quant: measured errors and why), int4 two codes a byte; they are
    dequantized on the reader's device when read. SmolLM2-135M, a chunk of 40 tokens: 0.90 MB
    float16, 0.50 MB int8, 0.28 MB int4 (0.35 MB with kv_key_group=16, 0.39 MB with
    kv_key_dtype=int8, the most accurate int4 setting: docs/bank.md, which to choose). A bank is
    read at the dtype it was built with (another is refused); build_bank.py --convert turns a
    float16 bank into int8/int4 without encoding it again."""
    kv_group_size: int = 32
    """int8/int4 kv_dtype: value channels that share a scale and minimum (must divide the head
    width). 32 costs 1 bit a value; 16 lowers the error of values a little at 2 bits a value."""
    kv_key_group: int = 0
    """int8/int4 kv_dtype: stored positions of a chunk whose keys share a per-channel scale and
    minimum, in runs from the chunk's oldest; 0 = all of the chunk's (KIVI, as banks were built
    before). 16 cuts int4's next-token KL by 37 % (0.0054 -> 0.0034 nats, SmolLM2) for 1 bit a
    value more (5.9 bits with the scales, against 4.85; a chunk keeps ceil(slots / 16) key ranges):
    0.35 MB a 40-token chunk against 0.28 (elasticmem.bank.quant). A bank is read with the setting
    it was built with (another is refused); build_bank.py --convert re-stores a float16 bank with
    it."""
    kv_key_dtype: Literal["same", "int8", "int4"] = "same"
    """int8/int4 kv_dtype: the keys' code width when it differs from the values' ('same': kv_dtype's,
    as banks were built before). kv_dtype=int4 with kv_key_dtype=int8 (K8V4) is int4's most accurate
    setting measured: the next-token KL after one chunk read as KV drops 5x (0.0054 -> 0.0012 nats,
    top-1 agreement 0.982 -> 0.997, SmolLM2) for 6.85 bits a value with the scales (int4: 4.85,
    kv_key_group=16: 5.9): 0.39 MB a 40-token chunk (int4 0.28, int8 0.50, float16 0.90). Why the
    keys: a reader's error follows the keys' (their outlier channels share one range per chunk), not
    the values' (elasticmem.bank.quant). Only with an integer kv_dtype; a bank is read with the
    setting it was built with (another is refused); build_bank.py --convert re-stores a float16
    bank with it."""
    hidden_cache: Literal["auto", "true", "false"] = "auto"
    """Store the content cache of hidden states (``cache`` in the shards). Only the projector path
    reads it: memory.content=hidden and the projector's warm-up (warmup.align_steps); retrieval
    does not (the keys are their own tensor), nor memory.content=kv, nor text injection. 'auto':
    stored unless the bank is built for a reader of per-layer KV (kv_cache with
    memory.content=kv). A bank built without it refuses memory.content=hidden with a clear
    error; banks built before this option all hold it."""
    dist_timeout_s: float = 1800.0
    """Seconds a process of a multi-process build (``accelerate launch build_bank.py``) waits at a
    barrier for the others before the build is aborted (the process group's timeout; PyTorch's
    NCCL default is 600): the others wait while one process fills the model's fingerprint cache,
    writes the chunk list and the manifest, or encodes its last shard."""

    def __post_init__(self) -> None:
        if isinstance(self.hidden_cache, bool):  # BankConfig(hidden_cache=False) from Python
            self.hidden_cache = "true" if self.hidden_cache else "false"
        _require(self.kv_group_size >= 1, f"kv_group_size must be >= 1, got {self.kv_group_size}")
        _require(self.kv_key_group >= 0, f"kv_key_group must be >= 0 (0: a key range per chunk), got "
                 f"{self.kv_key_group}")
        self.kv_scheme()  # kv_key_dtype only with an integer kv_dtype (KVScheme's checks)
        if self.part:
            k, sep, n = self.part.partition("/")
            _require(sep == "/" and k.isdigit() and n.isdigit() and int(k) < int(n),
                     f"part must be 'K/N' with 0 <= K < N (e.g. '0/4'), got {self.part!r}")
            _require(not self.overwrite, "part and overwrite together would let each part wipe the others' "
                     "shards: delete the folder first instead")

    def kv_scheme(self) -> KVScheme:
        """How this config stores per-layer keys and values (kv_cache), as the one value a build,
        a conversion and a reader's check take (the integer settings drop out for a float kv_dtype)."""
        return KVScheme(self.kv_dtype, self.kv_key_dtype, self.kv_key_group, self.kv_group_size)

    def part_index(self) -> tuple[int, int] | None:
        """(K, N) of ``part`` (validated at construction), or None for the whole build."""
        return tuple(map(int, self.part.split("/"))) if self.part else None
