"""The ElasticMem model: one ``nn.Module`` holding the LoRA reasoner, budget policy and projector.

Its methods are the trajectory's steps, each reading the same state (the LoRA reasoner and its
adapter switch, the bank, the policy and projector); the steps' parts are plain functions in their
own modules: the query state (step 1) in ``query_state.py``, the bank's checks, recent/given/included
rows and the key-like query ids in ``retrieval.py``, the fixed budget modes in ``budget_modes.py``,
the memories' soft tokens, KV pieces and text embeddings in ``memory_content.py``, the rollout and
teacher forcing in ``rollout.py`` (their token bookkeeping in ``token_counts.py``), the scoring
and reconstruction log-probs in ``scoring.py``, saving and loading in ``checkpoint.py``, activation
checkpointing in ``activation_checkpointing.py``; those that call back into the model name what
they use in ``steps.py``. Its records are in ``trajectories.py``, the prompt's text in
``prompt.py``, generation and token log-probabilities in ``generation.py``.

A trajectory for query q (DESIGN.md section 1 items 2-5, 8):

1. the reasoner reads prompt(q) and draws a retrieval-control token a; the query
   state h is its final-layer state at a (other retrieval modes: the last prompt
   token with or without the adapter, or MiniLM on the question);
2. cosine top-Z of h over the keys of q's bank group;
3. the budget policy draws b_j in {min..B_max} per retrieved memory;
4. the last min(b_j, c_j) valid cached states of memory j are projected into
   input-embedding space;
5. the answer y is generated from ``[prompt][a][Z_1][sep]...[Z_Z][sep][suffix]``.

``sample`` (G trajectories per query) and ``greedy`` record every action and
its log-probability; ``score`` recomputes all log-probabilities with gradients
in one forward pass, for the GRPO loss. The G trajectories of one query share
one forward pass over its prompt.

Bad input, handled:
- a bank encoded by another model: refused (``BankError``) at construction;
- Z larger than a group: the group's chunks are used, missing slots are masked
  (budget 0, no soft tokens), and a warning is printed once per model;
- budgets above a chunk's cache length: only the ``cache_len`` valid states are
  injected (never padding); ``token counts`` report what was injected;
- an empty answer (EOS first): the answer text is "" and the EOS token is its
  one scored unit, so the trajectory still gets a log-probability and reward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from elasticmem.bank.append import AppendResult, SessionAdd, append_sessions
from elasticmem.bank.index import KeyIndex, build_index
from elasticmem.bank.store import Bank, BankError
from elasticmem.config import IndexConfig, MemoryConfig
from elasticmem.data.schema import Example
from elasticmem.model import checkpoint, query_state, rollout, scoring
from elasticmem.model.activation_checkpointing import enable_checkpointing
from elasticmem.model.budget_modes import fixed_budgets, is_fixed_mode
from elasticmem.model.budget_policy import BudgetPolicy, BudgetSample
from elasticmem.model.generation import decoding_config, eos_token_ids, generate_answers, token_logps
from elasticmem.model.injection import Assembled, Layout, assemble
from elasticmem.model.memory_content import (chunk_ids, forget_chunk_ids, kv_memories, projected_memories,
                                             text_memories)
from elasticmem.model.projector import Projector
from elasticmem.model.prompt import encode_prompt
from elasticmem.model.retrieval import build_mapped_index, check_bank, given_rows, include_rows, recent_rows
from elasticmem.model.token_counts import per_trajectory
from elasticmem.model.trajectories import ScoreOutput, Trajectories


class ElasticMem(nn.Module):
    """LoRA reasoner + budget policy + projector over a read-only bank."""

    def __init__(self, backbone, cfg: MemoryConfig, bank: Bank, index: KeyIndex | None = None):
        super().__init__()
        from peft import LoraConfig, get_peft_model

        check_bank(cfg, bank, backbone.fingerprint)
        self.cfg = cfg
        self.tokenizer = backbone.tokenizer
        self.backbone_name = backbone.name_or_path
        self.fingerprint = backbone.fingerprint
        self.bank = bank
        self.index = index if index is not None else build_index(bank, IndexConfig(type="torch"))
        self.mapped_index = build_mapped_index(cfg, bank, backbone.fingerprint)  # f_q(h) vs f_k(keys), exact
        lora = cfg.lora
        self.lm = get_peft_model(
            backbone.model,
            LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                       target_modules=list(lora.target_modules), task_type="CAUSAL_LM"),
        )
        device = next(self.lm.parameters()).device
        self.semantic = None
        d_query = backbone.hidden_size
        if cfg.retrieval == "semantic":
            from elasticmem.model.semantic import SemanticRetriever

            self.semantic = SemanticRetriever(bank, cfg.semantic_model)
            d_query = self.semantic.dim
        self.policy = BudgetPolicy(cfg.policy, d_query).to(device)
        self.rotary = None
        projector_cfg = cfg.projector
        if cfg.content == "kv":
            # the reader attends to the memories' own keys and values: nothing to project (also
            # when this model reads them as text, so that its checkpoint loads the same)
            projector_cfg = dataclasses.replace(cfg.projector, variant="identity")
            if cfg.injection == "latent" and cfg.top_z > 0:
                from elasticmem.bank.kv import rotary_module

                if bank.kv is None:
                    raise BankError(f"memory.content=kv reads per-layer keys and values, which bank {bank.root} "
                                    f"does not hold: build it with bank.kv_cache=true")
                self.rotary = rotary_module(backbone.model.get_decoder())
        self.projector = Projector(projector_cfg, backbone.hidden_size).to(device)
        self.sep_ids = self.tokenizer(cfg.separator, add_special_tokens=False)["input_ids"]
        self.eos_ids = eos_token_ids(self.base, self.tokenizer)
        self._warned: set[str] = set()
        self._checkpointing: dict | None = None  # torch.utils.checkpoint's kwargs once enabled
        self._adapter_disabled = False  # inside _decoder(disable_adapter=True)
        self._chunk_tokens: dict[int, list[int]] = {}  # bank row -> token ids (text injection)
        self._recent: dict[str, list[int]] = {}  # group -> rows (retrieval 'recent')

    # ------------------------------------------------------------------ parts

    @property
    def device(self) -> torch.device:
        return next(self.lm.parameters()).device

    @property
    def budget_levels(self) -> int:
        """The largest budget one decision can give (the histogram's width in the training logs)."""
        return self.cfg.policy.max_budget

    @property
    def base(self) -> nn.Module:
        """The causal LM with LoRA layers injected (adapter on unless disabled)."""
        return self.lm.get_base_model()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)

    def encode_texts(self, ex: Example) -> tuple[list[int], list[int]]:
        """Token ids of prompt(q) and suffix(u) for one example (``encode_prompt``)."""
        return encode_prompt(self.tokenizer, self.cfg, ex)

    @contextlib.contextmanager
    def _decoder(self, disable_adapter: bool = False):
        """The block runs the reasoner, or with ``disable_adapter`` the frozen base model (LoRA off)."""
        if not disable_adapter:
            yield
            return
        before, self._adapter_disabled = self._adapter_disabled, True
        try:
            with self.lm.disable_adapter():
                yield
        finally:
            self._adapter_disabled = before

    def _forward_hidden(self, **kw) -> tuple[torch.Tensor, object]:
        """Final-layer states (after the final norm) [N, L, d] and the KV cache."""
        out = self.base.get_decoder()(**kw)
        return out.last_hidden_state, out.cache

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.base.get_output_embeddings()(h).float()

    def _token_logps(self, h: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """log softmax(logits(h) / temperature)[target] for states ``h`` [..., d] and ``targets`` [...]
        -> [...] float32 (``token_logps``; its chunks are recomputed in backward under activation
        checkpointing)."""
        d = h.shape[-1]
        out = token_logps(self.base.get_output_embeddings(), h.reshape(-1, d), targets.to(h.device).reshape(-1),
                          temperature, recompute=self._checkpointing)
        return out.reshape(targets.shape)

    def enable_activation_checkpointing(self, reentrant: bool = False) -> None:
        """Recompute the decoder layers' activations in backward instead of keeping them
        (``train.gradient_checkpointing``), and the logits of ``_token_logps``' chunks
        (``activation_checkpointing.enable_checkpointing``; ``reentrant`` for DeepSpeed ZeRO-3)."""
        self._checkpointing = enable_checkpointing(self.base, reentrant, self._same_adapter_state,
                                                   kv_cache=self.rotary is not None)

    def _same_adapter_state(self, checkpoint_func):
        """``checkpoint_func`` (``checkpoint_func(function, *args)``) whose recomputation runs with
        the adapter as the forward pass had it: a pass of the frozen base model (warm-up
        reconstruction, MemGen's reasoner) is recomputed in backward, after its
        ``_decoder(disable_adapter=True)`` block has exited, and would otherwise run with LoRA on."""
        def run(function, *args, **kwargs):
            off = self._adapter_disabled

            def replay(*a, **kw):
                with self._decoder(disable_adapter=off and not self._adapter_disabled):
                    return function(*a, **kw)

            return checkpoint_func(replay, *args, **kwargs)

        return run

    # ------------------------------------------------------------------ step 1: query states

    def _query_states(self, prompts: list[list[int]], questions: list[str], G: int, greedy: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Control tokens [B*G], their log-probs [B*G] and query states [B*G, d_h] (``query_state``)."""
        return query_state.query_states(self, prompts, questions, G, greedy)

    # ------------------------------------------------------------------ steps 2-4

    def _retrieve(self, h: torch.Tensor, groups: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        Z = self.cfg.top_z
        if Z == 0:  # the no-memory control: nothing retrieved, nothing injected
            empty = torch.zeros(len(groups), 0)
            return empty.long(), empty, empty.bool()
        if self.cfg.retrieval == "recent":
            rows = recent_rows(self.bank, groups, Z, self.cfg.recent_max_tokens, self._recent)
            return rows, torch.zeros(rows.shape), rows >= 0
        if self.semantic is not None:
            res = self.semantic.search(h, Z, groups)
        elif self.mapped_index is not None:
            res = self.mapped_index.search(h, Z, groups)
        else:
            res = self.index.search(h, Z, groups)
        mask = res.rows >= 0
        if not mask.all():
            small = sorted({g for g, m in zip(groups, mask) if not m.all()})
            self._warn_once("small_group", f"top_z={Z} is larger than the number of chunks of {len(small)} bank "
                            f"group(s) (e.g. {small[0]!r}); using the chunks that exist (missing slots are masked; "
                            f"said once)")
        scores = torch.where(mask, res.scores, torch.zeros_like(res.scores))
        return res.rows, scores, mask

    def _allocate(self, h, rows, scores, mask, greedy: bool, budgets: torch.Tensor | None = None):
        """Sample budgets (``budgets`` None) or score given ones; Z = 0 gives empty results."""
        if rows.shape[1] == 0 or self.cfg.injection == "text":  # nothing for the policy to decide
            empty = torch.zeros(rows.shape, device=self.device)
            return BudgetSample(empty.long(), empty, empty) if budgets is None else (empty, empty)
        args = (h, self._policy_inputs(h, rows), scores.to(self.device), mask.to(self.device))
        if budgets is None:
            return self.policy.sample(*args, greedy=greedy)
        return self.policy.log_prob(*args, budgets.to(self.device))

    def _budgets(self, mode: str, h, rows, scores, mask, greedy: bool, generator: torch.Generator | None = None,
                 evidence: Sequence[set[int]] | None = None):
        """Budgets [N, Z], their log-probs and entropies: 'policy' (the policy's, argmax if
        ``greedy``), 'max' (max_budget each), 'uniform' (a draw in 1..max_budget each), 'oracle'
        (max_budget for the rows in ``evidence[i]``, 0 for the others) or a simple rule ('topK',
        'gap' at ``memory.policy.score_gap``: ``fixed_budgets``). In greedy mode
        ``memory.policy.token_cap`` applies to every mode: the policy cuts its lowest-value
        memories first, 'max' shares the cap out evenly, the others keep their memories by rank."""
        if mode == "policy":
            bs = self._allocate(h, rows, scores, mask, greedy)
            return bs.budgets.cpu(), bs.log_prob.cpu(), bs.entropy.cpu()
        if not is_fixed_mode(mode):
            raise ValueError(f"budgets must be 'policy', 'max', 'uniform', 'oracle', 'gap' or 'topK', got {mode!r}")
        cap = self.cfg.policy.token_cap if greedy else None
        b = fixed_budgets(mode, rows, mask, self.cfg.policy.max_budget, cap, generator, evidence,
                          scores=scores.cpu(), score_gap=self.cfg.policy.score_gap)
        zeros = torch.zeros(rows.shape)
        return b, zeros, zeros

    def _policy_inputs(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        keys = self.semantic.gather_keys(rows) if self.semantic is not None else self.bank.gather_keys(rows)
        return keys.to(self.device)

    def _soft_tokens(self, rows: torch.Tensor, budgets: torch.Tensor) -> tuple[list[list], torch.Tensor]:
        """Projected soft tokens per trajectory (memories with 0 tokens left out) and counts [N, Z]
        (``KVPiece``s under memory.content=kv; token embeddings under memory.injection=text)."""
        if self.cfg.injection == "text":
            return text_memories(self.base.get_input_embeddings(), self._chunk_ids, rows, self.device)
        if self.rotary is not None:
            return kv_memories(self.bank, rows, budgets, self.device)  # dequantized on the model's device
        return projected_memories(self.bank, self.projector, rows, budgets, self.device)

    def _assemble(self, layouts: Sequence[Layout]) -> Assembled:
        """``assemble`` with this model's embedding, separator and (KV memories) rotary embedding."""
        eager = getattr(self.base.config, "_attn_implementation", None) == "eager"
        return assemble(self.base.get_input_embeddings(), layouts, self.sep_ids, self.rotary, additive=eager)

    def _chunk_ids(self, row: int) -> list[int]:
        return chunk_ids(self.bank, self.tokenizer, self._chunk_tokens, row)

    # ------------------------------------------------------------------ live memory

    def refresh_bank(self, bank: Bank | None = None) -> bool:
        """Search and read the newest snapshot of the bank (``bank``, or its folder's current
        manifest): rows appended since, by this process or another, become retrievable. Returns
        whether anything changed. ``bank`` may also be another bank of the same encoder and keys
        (indexed anew)."""
        new = self.bank.refresh() if bank is None else bank
        if new is self.bank:
            return False
        if new.fingerprint != self.bank.fingerprint or new.key != self.bank.key:
            raise BankError(f"bank {new.root} does not match the model's bank {self.bank.root} (other encoder or keys)")
        self.index = self.index.refresh(new)
        if self.mapped_index is not None:
            self.mapped_index.refresh(new)
        if self.semantic is not None:
            self.semantic.refresh(new)
        self._recent.clear()  # a group's latest chunks change with appends
        forget_chunk_ids(self._chunk_tokens, self.bank, new)
        self.bank = new
        return True

    @torch.no_grad()
    def remember(self, items: Sequence[SessionAdd], batch_size: int = 16) -> AppendResult:
        """Append sessions to the bank (``elasticmem.bank.append``), encoded by the frozen base
        model (the adapter off, as the bank builder encodes), and search the grown bank from now on."""
        with self._decoder(disable_adapter=True):
            result = append_sessions(self.bank, items, self.base.get_decoder(), self.tokenizer, self.fingerprint,
                                     batch_size=batch_size)
        self.refresh_bank(result.bank)
        return result

    # ------------------------------------------------------------------ public API

    @torch.no_grad()
    def query_states(self, batch: Sequence[Example], greedy: bool = True) -> torch.Tensor:
        """Step 1 only: each example's query state h [B, d_h] (the retrieval mode's; ``greedy``: from
        the argmax control token), as the rollout searches the bank with it."""
        texts = [self.encode_texts(ex) for ex in batch]
        return self._query_states([t[0] for t in texts], [ex.question for ex in batch], 1, greedy)[2]

    @torch.no_grad()  # also keeps its cached forward passes out of activation checkpointing in train mode
    def retrieve(self, batch: Sequence[Example], greedy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-2 only (query state and top-Z search; no budgets, no generation), as in a rollout.

        Returns the retrieved rows [B, Z] (rank order, -1 where the group had fewer than Z
        chunks) and their cosine scores [B, Z] (0 there); one query state per example, from the
        argmax control token (``greedy``) or one sampled at the control temperature.
        """
        *_, rows, scores, _ = self._query_and_retrieve(batch, 1, greedy)
        return rows, scores

    def _query_and_retrieve(self, batch: Sequence[Example], G: int, greedy: bool,
                            texts: list[tuple[list[int], list[int]]] | None = None):
        """Steps 1-2 of a rollout: prompt ids, suffix ids, groups [N], a, log pi(a), h, rows, scores, mask.
        ``texts``: the batch's ``encode_texts``, when the caller has them already."""
        texts = texts if texts is not None else [self.encode_texts(ex) for ex in batch]
        prompts, suffixes = [t[0] for t in texts], [t[1] for t in texts]
        a, logp_a, h = self._query_states(prompts, [ex.question for ex in batch], G, greedy)
        groups = per_trajectory([ex.group for ex in batch], G)
        rows, scores, mask = self._retrieve(h, groups)
        return prompts, suffixes, groups, a, logp_a, h, rows, scores, mask

    @torch.no_grad()
    def sample(self, batch: Sequence[Example], group_size: int = 4, temperature: float = 1.0) -> Trajectories:
        """G = ``group_size`` sampled trajectories per example (control token, budgets, answer)."""
        return self._rollout(batch, group_size, temperature, greedy=False)

    @torch.no_grad()
    def greedy(self, batch: Sequence[Example], include_rows: Sequence[set[int]] | None = None,
               budgets: str = "policy", memo: dict | None = None, memories: Sequence[set[int]] | None = None,
               evidence: Sequence[set[int]] | None = None) -> Trajectories:
        """One deterministic trajectory per example: argmax control token and budgets, greedy answer.

        ``include_rows`` and ``budgets`` ('max': max_budget each; 'oracle': max_budget for the
        rows of ``evidence[i]``, 0 for the others) as in ``teacher_forced``; ``memories``: per
        example, exactly these bank rows (ordered by score) instead of the retrieved ones. They
        measure reading apart from retrieval and budgets (``elasticmem.apps.ladder``).
        ``memo``: a dict kept by the caller across calls; an example whose prompt and group were
        seen before reuses that call's control token, memories and budgets (all greedy, so equal)
        instead of recomputing them: an agent episode, whose query is its objective at every
        step, retrieves once (its retrieval time is then 0)."""
        return self._rollout(batch, 1, 1.0, greedy=True, include_rows=include_rows, budgets=budgets, memo=memo,
                             memories=memories, evidence=evidence)

    @torch.no_grad()
    def teacher_forced(
        self,
        batch: Sequence[Example],
        answers: Sequence[Sequence[int]],
        include_rows: Sequence[set[int]] | None = None,
        budgets: str = "policy",
        generator: torch.Generator | None = None,
    ) -> Trajectories:
        """One trajectory per example whose answer is a given target, for supervised training.

        Retrieval as in a greedy rollout (argmax control token); ``include_rows``: per example,
        bank rows (its evidence) put among the retrieved memories in place of the lowest-ranked
        others, then all ordered by their cosine to h as retrieval orders them (an example with
        more such rows than Z keeps the Z best-scored). ``budgets``: 'policy' (the policy's
        samples), 'max' (max_budget each), 'uniform' (a uniform draw in 1..max_budget each) or
        'oracle' (max_budget for the ``include_rows``, 0 for the others).
        ``answers``: target token ids (the end-of-turn token included where it should be
        learnt). ``score`` of the result gives the target's log-probs with gradients
        (``logp_answer`` here is 0: nothing was sampled).
        """
        return rollout.teacher_forced(self, batch, answers, include_rows, budgets, generator)

    def reconstruction_logps(
        self, rows: torch.Tensor, budgets: torch.Tensor, prompt: Sequence[int], suffix: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of each chunk's own text after its soft tokens, read by the frozen LM (adapter off).

        ``rows``: [n] bank rows; ``budgets``: [n] soft tokens each (>= 1). Each sequence is
        ``prompt [soft tokens] sep suffix`` followed by the chunk's tokens and the end-of-text
        token, the target (xRAG's first stage). Returns (log-probs [n, T], mask [n, T]), with
        gradients to the projector only.
        """
        return scoring.reconstruction_logps(self, rows, budgets, prompt, suffix)

    def _given(self, h: torch.Tensor, memories: Sequence[set[int]]):
        """``retrieval.given_rows``: rows, scores and mask [N, Z'] of exactly the ``memories``, ranked."""
        return given_rows(h, memories, lambda rows: self._policy_inputs(h, rows))

    def _include(self, h, rows, scores, mask, include: Sequence[set[int]] | None):
        """``rows`` with each example's ``include`` rows in place of its lowest-ranked others, by
        score (``retrieval.include_rows``); unchanged for retrieval='recent'."""
        if self.cfg.retrieval == "recent":
            return rows, scores, mask
        other_space = self.mapped_index is not None or self.semantic is not None
        return include_rows(h, rows, scores, mask, include, self.bank, other_space)

    def _rollout(self, batch: Sequence[Example], G: int, temperature: float, greedy: bool,
                 include_rows: Sequence[set[int]] | None = None, budgets: str = "policy",
                 memo: dict | None = None, memories: Sequence[set[int]] | None = None,
                 evidence: Sequence[set[int]] | None = None) -> Trajectories:
        """``rollout.rollout``: G trajectories per example, sampled or greedy."""
        return rollout.rollout(self, batch, G, temperature, greedy, include_rows, budgets, memo, memories,
                               evidence)

    def _is_eos(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.isin(ids, torch.tensor(self.eos_ids, dtype=ids.dtype))

    def generation_config(self, temperature: float, greedy: bool):
        """``decoding_config`` of this model's settings and tokenizer."""
        return decoding_config(self.cfg, self.tokenizer, self.eos_ids, temperature, greedy)

    def _generate(self, batch_in, temperature: float, greedy: bool):
        """``generate_answers`` with this model's decoder and settings."""
        return generate_answers(self.lm, self.base, self.generation_config(temperature, greedy), batch_in,
                                self.eos_ids, self.tokenizer.pad_token_id, temperature, greedy)

    def forward(self, traj: Trajectories) -> ScoreOutput:
        """``score``: the training forward pass (so DDP/DeepSpeed wrappers see a forward call)."""
        return self.score(traj)

    def score(self, traj: Trajectories) -> ScoreOutput:
        """Log-probs of every recorded action under the current parameters, in one forward pass.

        Gradients reach the LoRA adapter (control token and answer), the projector (soft
        tokens are inputs of the answer) and the budget policy (its own log-probs); with
        ``detach_policy_inputs=False`` also the adapter through h.
        """
        return scoring.score(self, traj)

    def trajectory_layouts(self, traj: Trajectories, answers: Sequence[Sequence[int]]) -> list[Layout]:
        """Each trajectory's input as recorded ([prompt, a, its memories' soft tokens, suffix]),
        with ``answers[i]`` as the answer tokens to read."""
        return scoring.trajectory_layouts(self, traj, answers)

    # ------------------------------------------------------------------ persistence

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.named_parameters() if p.requires_grad}

    def save_pretrained(self, out: str | Path) -> None:
        """LoRA adapter, budget policy, projector and config JSON (``checkpoint.save_pretrained``)."""
        checkpoint.save_pretrained(self, out)

    @classmethod
    def from_pretrained(cls, path: str | Path, backbone, bank: Bank, index: KeyIndex | None = None) -> "ElasticMem":
        """Rebuild a saved model on ``backbone`` (which must be the one it was trained on)."""
        return checkpoint.from_pretrained(cls, path, backbone, bank, index)

    def _load_adapter(self, path: Path) -> None:
        """The LoRA adapter saved by ``save_pretrained`` in ``path`` (unknown weights refused)."""
        checkpoint.load_adapter(self.lm, path, self.device)

    def load_weights(self, path: str | Path) -> None:
        """Load the trained parts (adapter, policy, projector) saved by ``save_pretrained`` into this model."""
        checkpoint.load_weights(self, path)
