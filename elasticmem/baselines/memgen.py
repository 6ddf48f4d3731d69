"""MemGen (Zhang et al. 2025, arXiv:2509.24704) as a baseline: a memory weaver and a memory trigger
around a frozen reasoner, trained by this framework's GRPO loop on the same task reward.

One trajectory for query q (settings in ``MemGenConfig``):

1. the history the weaver reads: the top-Z chunks of q's bank group found by
   ``memory.retrieval`` with the reasoner frozen (``memgen.history=retrieved``), or nothing;
2. prompt insertion: the weaver (the base LM with its own LoRA adapter) reads
   ``W_in([history; prompt; suffix]) ++ LN(Q_p) * s_p`` (input embeddings mapped into the
   weaver, then K_p learned query latents) and its last K_p final states, mapped back by
   ``W_out``, are inserted before the answer: the reasoner reads ``[prompt][suffix][K_p latents]``;
3. while answering, after each generated token that ends with a delimiter (at most
   ``max_insertions`` times) the trigger (an MLP over the reasoner's final state at that token)
   draws invoke / skip; invoking runs the weaver on everything the reasoner has read so far
   (history first) with K_i inference queries and inserts K_i more latents.

The reasoner never changes (its forward passes run with the adapter disabled); GRPO trains the
weaver (adapter, queries, LayerNorms, scales, maps) through the answer log-probs and the trigger
through its decisions' log-probs, which take the place of ElasticMem's budget decisions in the
loss (``Trajectories.logp_budget`` / ``mask``: one unit per decision point, budget 0 or K_i).
``sample`` records every action's log-probability; ``score`` recomputes them all with gradients
(the weaver once per insertion round, the reasoner in one forward pass).

Differences from the released code, on purpose: the maps start as the identity and the query
scales at the input embeddings' RMS (released: random maps, scale 1), so an untrained weaver
starts from the reasoner's own embedding space instead of noise; the trigger reads the
reasoner's state instead of running a second LoRA copy of the model. The weaver and trigger are
trained together by default (``memgen.train_parts``); the released two stages are config values.
The prompt, retrieval, bank and answer decoding are ElasticMem's (this class extends it), so the
comparison differs only in how memory reaches the reasoner.

Test with::

    pytest tests/unit/test_memgen.py
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from elasticmem.bank.index import KeyIndex
from elasticmem.bank.store import Bank
from elasticmem.config import ConfigError, MemGenConfig, MemoryConfig
from elasticmem.data.schema import Example
from elasticmem.model.checkpoint import CONFIG_FILE, FORMAT_VERSION
from elasticmem.model.elasticmem import ElasticMem
from elasticmem.model.trajectories import ScoreOutput, Trajectories

WEIGHTS_FILE = "memgen.safetensors"
"""Weaver queries, LayerNorms, scales and maps, and the trigger (the adapter is saved by peft)."""


@dataclass
class MemGenTrajectories(Trajectories):
    """``Trajectories`` whose Z slots are the trigger's decision points (see the module docstring):
    ``mask`` a decision was offered, ``budgets`` latents inserted there (0 or K_i), ``logp_budget``
    / ``entropy_budget`` the trigger's; ``rows`` -1. The history the weaver read is apart."""

    memory_rows: torch.Tensor = None
    """[N, Z'] bank rows whose text the weaver read, rank order (-1 = none)."""
    memory_scores: torch.Tensor = None
    """[N, Z'] their retrieval scores."""
    decision_pos: torch.Tensor = None
    """[N, D] answer index t of each decision point (after answer token t), -1 where none."""
    history_tokens: torch.Tensor = None
    """[N] tokens of history text the weaver read (the reasoner reads none of them)."""

    def memories(self, i: int) -> list[tuple[int, float, int | None, int]]:
        rows, scores = self.memory_rows[i].tolist(), self.memory_scores[i].tolist()
        return [(int(r), float(s), None, 0) for r, s in zip(rows, scores) if r >= 0]


class Weaver(nn.Module):
    """The weaver's own parameters besides its LoRA adapter."""

    def __init__(self, d: int, prompt_latents: int, inference_latents: int, embed_rms: float) -> None:
        super().__init__()
        self.prompt_queries = nn.Parameter(torch.randn(prompt_latents, d))
        self.inference_queries = nn.Parameter(torch.randn(inference_latents, d))
        self.prompt_norm, self.inference_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.prompt_scale = nn.Parameter(torch.full((1,), embed_rms))
        self.inference_scale = nn.Parameter(torch.full((1,), embed_rms))
        self.to_weaver, self.to_reasoner = nn.Linear(d, d), nn.Linear(d, d)
        for lin in (self.to_weaver, self.to_reasoner):
            nn.init.eye_(lin.weight)
            nn.init.zeros_(lin.bias)

    def queries(self, kind: str) -> torch.Tensor:
        """[K, d] the query latents of ``kind`` ('prompt' or 'inference') after LayerNorm and scale."""
        if kind == "prompt":
            return self.prompt_norm(self.prompt_queries) * self.prompt_scale
        return self.inference_norm(self.inference_queries) * self.inference_scale


class Trigger(nn.Module):
    """Invoke / skip logits [n, 2] (float32) from the reasoner's final state [n, d] at a decision point."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, 2))
        nn.init.zeros_(self.net[-1].weight)  # starts at invoke / skip with probability 1/2 each
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # the state in the weights' dtype (DeepSpeed's bf16 mode casts them), the decision in float32
        return self.net(h.to(self.net[0].weight.dtype)).float()


def _left_pad(seqs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequences [L_i, d] -> embeds [n, L, d] (left-padded with zeros), mask [n, L], positions [n, L]."""
    L = max(s.shape[0] for s in seqs)
    d, ref = seqs[0].shape[1], seqs[0]
    embeds = ref.new_zeros(len(seqs), L, d)
    mask = torch.zeros(len(seqs), L, dtype=torch.long, device=ref.device)
    for i, s in enumerate(seqs):
        if s.shape[0]:
            embeds[i, L - s.shape[0]:] = s
            mask[i, L - s.shape[0]:] = 1
    return embeds, mask, (mask.cumsum(-1) - 1).clamp(min=0)


class MemGen(ElasticMem):
    """Weaver + trigger over a frozen reasoner; ElasticMem's prompt, retrieval and bank."""

    def __init__(self, backbone, cfg: MemoryConfig, memgen: MemGenConfig, bank: Bank, index: KeyIndex | None = None):
        if cfg.retrieval in ("control", "query_only"):
            raise ConfigError(f"MemGen's reasoner is frozen, so its history is found without an adapter: "
                              f"memory.retrieval={cfg.retrieval} would search with the weaver's adapter; set "
                              f"memory.retrieval=frozen (or semantic, mean, prompt, layer_mean, recent)")
        super().__init__(backbone, cfg, bank, index)
        self.policy = self.projector = None  # ElasticMem's parts: not MemGen's
        self.memgen = memgen
        d, device = backbone.hidden_size, self.device
        rms = float(self.base.get_input_embeddings().weight.detach().float().pow(2).mean().sqrt())
        self.weaver = Weaver(d, memgen.prompt_latents, memgen.inference_latents, rms).to(device)
        self.trigger = Trigger(d, memgen.trigger_hidden).to(device)
        vocab = self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))])
        ends = tuple(memgen.delimiters)
        self.delimiter_ids = torch.tensor([i for i, t in enumerate(vocab) if t and t.endswith(ends)], dtype=torch.long)
        self._freeze()

    def _freeze(self) -> None:
        """Only ``memgen.train_parts`` train (the reasoner never does)."""
        weaver_on, mg = "weaver" in self.memgen.train_parts, self.memgen
        self._adapter_params = [p for name, p in self.lm.named_parameters() if "lora_" in name]
        for p in self._adapter_params:
            p.requires_grad_(weaver_on)
        self.weaver.requires_grad_(weaver_on)
        self.trigger.requires_grad_("trigger" in mg.train_parts and mg.trigger == "learned")

    @contextlib.contextmanager
    def _decoder(self, disable_adapter: bool = False):
        with super()._decoder(disable_adapter):
            yield
        # peft turns requires_grad back on for the adapter it re-enables (per decoded token: no walk
        # over the model here, only the cached adapter parameters, and only when they are frozen)
        if disable_adapter and "weaver" not in self.memgen.train_parts:
            for p in self._adapter_params:
                p.requires_grad_(False)

    @property
    def budget_levels(self) -> int:
        return self.memgen.inference_latents

    # ------------------------------------------------------------------ the weaver

    def _embed(self, ids: Sequence[int]) -> torch.Tensor:
        return self.base.get_input_embeddings()(torch.as_tensor(list(ids), dtype=torch.long, device=self.device))

    def _history_ids(self, rows: torch.Tensor) -> list[list[int]]:
        """Per row of ``rows`` [n, Z]: the retrieved chunks' tokens, each followed by the separator."""
        return [[t for r in row if r >= 0 for t in self._chunk_ids(int(r)) + self.sep_ids] for row in rows.tolist()]

    def _weave(self, contexts: Sequence[torch.Tensor], kind: str) -> torch.Tensor:
        """Latents [n, K, d] (float32) from reasoner-space input embeddings ``contexts`` [L_i, d]."""
        q = self.weaver.queries(kind)
        K = q.shape[0]
        if K == 0:
            return q.new_zeros(len(contexts), 0, q.shape[1])
        dtype = self.base.get_input_embeddings().weight.dtype
        own = self.weaver.to_weaver.weight.dtype  # float32, or bf16 when DeepSpeed casts the whole model
        emb, mask, pos = _left_pad([self.weaver.to_weaver(c.to(own)) for c in contexts])
        emb = torch.cat([emb, q.expand(len(contexts), -1, -1)], 1).to(dtype)
        start = mask.sum(-1, keepdim=True)
        pos = torch.cat([pos, start + torch.arange(K, device=mask.device)], 1)
        mask = torch.cat([mask, torch.ones(len(contexts), K, dtype=mask.dtype, device=mask.device)], 1)
        H, _ = self._forward_hidden(inputs_embeds=emb, attention_mask=mask, position_ids=pos, use_cache=False)
        return self.weaver.to_reasoner(H[:, -K:].to(own)).float()

    # ------------------------------------------------------------------ rollouts

    @torch.no_grad()
    def sample(self, batch: Sequence[Example], group_size: int = 4, temperature: float = 1.0) -> MemGenTrajectories:
        """G = ``group_size`` sampled trajectories per example (trigger decisions and answer)."""
        return self._memgen_rollout(batch, group_size, temperature, greedy=False)

    @torch.no_grad()
    def greedy(self, batch: Sequence[Example], include_rows=None, budgets: str = "policy",
               memo: dict | None = None, memories=None, evidence=None) -> MemGenTrajectories:
        """One deterministic trajectory per example (argmax decisions, greedy answer). ``memo`` is
        accepted for the harness's interface and unused; ``include_rows``, ``budgets``, ``memories``
        and ``evidence`` are ElasticMem's."""
        if include_rows is not None or budgets != "policy" or memories is not None or evidence is not None:
            raise ValueError("MemGen has no budgets to force and no retrieved memories to replace")
        return self._memgen_rollout(batch, 1, 1.0, greedy=True)

    @torch.no_grad()
    def teacher_forced(self, batch: Sequence[Example], answers: Sequence[Sequence[int]],
                       include_rows: Sequence[set[int]] | None = None, budgets: str = "policy",
                       generator: torch.Generator | None = None) -> MemGenTrajectories:
        """One trajectory per example whose answer is a given target: the weaver's supervised stage
        (MemGen's weaver SFT; ``python -m elasticmem.warmup.reading train.system=memgen``).

        The history is retrieved as in a rollout; ``include_rows`` puts each example's evidence
        rows among it as ElasticMem's ``teacher_forced`` does. The weaver inserts K_p latents at
        the prompt and, unless ``memgen.trigger=never``, K_i more after every delimiter of the
        target (at most ``max_insertions``), as a rollout whose trigger invoked at each would: the
        trigger is not trained here (its decisions are not offered: ``mask`` is False), GRPO
        trains it. ``budgets`` and ``generator`` are ElasticMem's (MemGen has no budgets to draw).
        ``score`` of the result gives the target's log-probs with gradients to the weaver.
        """
        if len(answers) != len(batch):
            raise ValueError(f"{len(batch)} examples but {len(answers)} answers")
        mg = self.memgen
        texts = [self.encode_texts(ex) for ex in batch]
        h, rows, scores = self._history(batch, texts, include_rows)
        delim, eos = set(self.delimiter_ids.tolist()), set(self.eos_ids)
        decisions = []
        for a in answers:
            # a rollout offers a decision after a delimiter that is neither its last token nor an end
            at = [t for t in range(len(a) - 1) if a[t] in delim and a[t] not in eos] if mg.trigger != "never" else []
            decisions.append([(t, 1, 0.0, 0.0) for t in at[: mg.max_insertions]])
        hist_tokens = torch.tensor([len(ids) for ids in self._history_ids(rows)])
        return self._trajectories(batch, texts, 1, h, rows, scores, hist_tokens, [list(a) for a in answers], None,
                                  decisions, offered=False, greedy=False, temperature=1.0)

    def _decide(self, h: torch.Tensor, greedy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decisions [n] (1 = invoke), their log-probs [n] and the distributions' entropies [n]."""
        n = h.shape[0]
        if self.memgen.trigger == "always":
            return torch.ones(n, dtype=torch.long), torch.zeros(n), torch.zeros(n)
        logp = torch.log_softmax(self.trigger(h), -1)
        d = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1).squeeze(1)
        return d.cpu(), logp.gather(1, d[:, None]).squeeze(1).cpu(), -(logp.exp() * logp).sum(-1).cpu()

    def _memgen_rollout(self, batch: Sequence[Example], G: int, temperature: float, greedy: bool) -> MemGenTrajectories:
        if not batch:
            raise ValueError("empty batch")
        if G < 1 or temperature <= 0:
            raise ValueError(f"group_size must be >= 1 and temperature > 0, got {G} and {temperature}")
        t0 = time.perf_counter()
        texts = [self.encode_texts(ex) for ex in batch]
        h, rows, scores = self._history(batch, texts)
        hist = [self._embed(ids) for ids in self._history_ids(rows)]
        ctx = [self._embed(p + s) for p, s in texts]
        t1 = time.perf_counter()
        lat_p = self._weave([torch.cat([a, c]) for a, c in zip(hist, ctx)], "prompt")  # the adapter on: the weaver
        t2 = time.perf_counter()
        rep = lambda xs: [x for x in xs for _ in range(G)]  # noqa: E731
        seq = [[c, lp.to(c.dtype)] for c, lp in zip(rep(ctx), rep(list(lat_p)))]
        answer, logp_ans, decisions = self._decode(rep(hist), seq, temperature, greedy)
        t3 = time.perf_counter()
        traj = self._trajectories(batch, texts, G, h, rows, scores, torch.tensor([x.shape[0] for x in hist]), answer,
                                  None if greedy else logp_ans, decisions, offered=True, greedy=greedy,
                                  temperature=temperature)
        traj.timings = {"retrieval": t1 - t0, "policy": t2 - t1, "generation": t3 - t2}
        return traj

    def _history(self, batch: Sequence[Example], texts, include_rows: Sequence[set[int]] | None = None):
        """The history the weaver reads: (query states h [B, d], rows [B, Z'] (-1 = none), scores
        [B, Z']) from ``memory.retrieval`` with the reasoner frozen, ``include_rows`` put among
        them; no rows with ``memgen.history=none`` or Z = 0."""
        if self.memgen.history == "retrieved" and self.cfg.top_z > 0:
            *_, h, rows, scores, mask = self._query_and_retrieve(batch, 1, True, texts)
            rows, scores, _ = self._include(h, rows, scores, mask, include_rows)
            return h, rows, scores
        rows = torch.zeros(len(batch), 0, dtype=torch.long)
        return torch.zeros(len(batch), self.bank.hidden_size), rows, torch.zeros(rows.shape)

    def _trajectories(self, batch: Sequence[Example], texts, G: int, h: torch.Tensor, rows: torch.Tensor,
                      scores: torch.Tensor, history_tokens: torch.Tensor, answers: list[list[int]],
                      logps: list[list[float]] | None, decisions: list[list[tuple]], *, offered: bool, greedy: bool,
                      temperature: float) -> MemGenTrajectories:
        """``MemGenTrajectories`` of G trajectories per example of ``batch`` (example-major): the
        answers (token lists) with their log-probs (None: 0) and per trajectory the insertion
        points ``(answer index, invoke, log-prob, entropy)``; ``offered``: they were the trigger's
        decisions (a rollout), not placed by teacher forcing. ``h``, ``rows``, ``scores`` and
        ``history_tokens`` are per example."""
        mg, N = self.memgen, len(batch) * G
        rep = lambda xs: [x for x in xs for _ in range(G)]  # noqa: E731
        T = max(1, max(len(a) for a in answers))
        answer_ids = torch.full((N, T), self.tokenizer.pad_token_id, dtype=torch.long)
        answer_mask = torch.zeros(N, T, dtype=torch.bool)
        logp = torch.zeros(N, T)
        for i, a in enumerate(answers):
            answer_ids[i, : len(a)] = torch.tensor(a, dtype=torch.long)
            answer_mask[i, : len(a)] = True
            if logps is not None:
                logp[i, : len(a)] = torch.tensor(logps[i])
        D = max([len(d) for d in decisions] + [0])
        pos = torch.full((N, D), -1, dtype=torch.long)
        budgets = torch.zeros(N, D, dtype=torch.long)
        lp_d, ent_d = torch.zeros(N, D), torch.zeros(N, D)
        for i, ds in enumerate(decisions):
            for j, (t, dec, lp, ent) in enumerate(ds):
                pos[i, j], budgets[i, j], lp_d[i, j], ent_d[i, j] = t, dec * mg.inference_latents, lp, ent
        memory_tokens = budgets.sum(-1) + mg.prompt_latents
        task = torch.tensor([len(p) + len(s) for p, s in texts]).repeat_interleave(G)
        eos = self._is_eos(answer_ids) & answer_mask
        return MemGenTrajectories(
            example_ids=rep([ex.id for ex in batch]), query_index=torch.arange(len(batch)).repeat_interleave(G),
            prompt_ids=rep([p for p, _ in texts]), suffix_ids=rep([s for _, s in texts]),
            groups=rep([ex.group for ex in batch]),
            control=torch.full((N,), -1, dtype=torch.long),
            rows=torch.full((N, D), -1, dtype=torch.long), scores=torch.zeros(N, D), mask=(pos >= 0) & offered,
            budgets=budgets, soft_counts=budgets.clone(), answer_ids=answer_ids, answer_mask=answer_mask,
            answers=[self.tokenizer.decode(ids[m], skip_special_tokens=True).strip()
                     for ids, m in zip(answer_ids, answer_mask & ~eos)],
            logp_control=torch.zeros(N), logp_budget=lp_d, entropy_budget=ent_d, logp_answer=logp,
            query_state=h.float().cpu().repeat_interleave(G, 0),
            answer_temperature=1.0 if greedy else temperature, control_temperature=1.0, greedy=greedy,
            num_tokens=task + memory_tokens + answer_mask.sum(-1), memory_tokens=memory_tokens,
            budget_actions=offered and mg.trigger == "learned",
            memory_rows=rows.repeat_interleave(G, 0), memory_scores=scores.float().repeat_interleave(G, 0),
            decision_pos=pos, history_tokens=history_tokens.repeat_interleave(G),
        )

    def _decode(self, hist: list[torch.Tensor], seq: list[list[torch.Tensor]], temperature: float, greedy: bool):
        """Token-by-token answers of the frozen reasoner with trigger decisions and inference insertions.

        ``seq[i]``: trajectory i's reasoner input so far (embeddings pieces; extended in place).
        Returns answers (token lists, up to and including EOS), their log-probs, and per
        trajectory the decisions ``(answer index, invoke, log-prob, entropy)``.

        Rows advance together: a step feeds every row its new token, then, if any row invoked
        the weaver, K_i more positions, which are masked out in the rows that did not (their
        positions do not advance), so each row computes what it would alone.
        """
        mg, N, device = self.memgen, len(seq), self.device
        T, K = self.cfg.max_new_tokens, mg.inference_latents
        eos_ids = torch.tensor(self.eos_ids, device=device)
        delim = self.delimiter_ids.to(device)
        with self._decoder(disable_adapter=True):
            emb, mask, pos = _left_pad([torch.cat(s) for s in seq])
            H, cache = self._forward_hidden(inputs_embeds=emb, attention_mask=mask, position_ids=pos, use_cache=True)
        logits = self._logits(H[:, -1])
        nxt = mask.sum(-1)  # [N] next position id of each row
        done = torch.zeros(N, dtype=torch.bool, device=device)
        # per step, on the device: the tokens [N], their log-probs [N] and which rows were still
        # answering; moved to the host once, after the loop (no per-token, per-row syncs)
        steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        decisions: list[list[tuple]] = [[] for _ in range(N)]
        inserted = torch.zeros(N, dtype=torch.long, device=device)
        for t in range(T):
            lp = torch.log_softmax(logits / temperature, -1)
            tok = lp.argmax(-1) if greedy else torch.multinomial(lp.exp(), 1).squeeze(1)
            tok = torch.where(done, torch.full_like(tok, self.tokenizer.pad_token_id), tok)
            steps.append((tok, lp.gather(1, tok[:, None]).squeeze(1), ~done))
            done = done | torch.isin(tok, eos_ids)
            if t == T - 1 or bool(done.all()):
                break
            e = self.base.get_input_embeddings()(tok)[:, None]
            for i in range(N):
                seq[i].append(e[i])
            mask = torch.cat([mask, torch.ones(N, 1, dtype=mask.dtype, device=device)], 1)
            with self._decoder(disable_adapter=True):
                H, cache = self._forward_hidden(inputs_embeds=e, attention_mask=mask, position_ids=nxt[:, None],
                                                cache=cache, use_cache=True)
            nxt = nxt + 1
            logits = self._logits(H[:, -1])
            offer = ~done & torch.isin(tok, delim) & (inserted < mg.max_insertions)
            if mg.trigger == "never" or not bool(offer.any()):
                continue
            rows_ = offer.nonzero().reshape(-1)
            dec, lp_d, ent = self._decide(H[rows_, -1], greedy)
            for k, i in enumerate(rows_.tolist()):
                decisions[i].append((t, int(dec[k]), float(lp_d[k]), float(ent[k])))
            invoke = rows_[dec.to(device).bool()]
            if invoke.numel() == 0:
                continue
            inserted[invoke] += 1
            lat = self._weave([torch.cat([hist[i]] + seq[i]) for i in invoke.tolist()], "inference")
            block = H.new_zeros(N, K, H.shape[-1]).to(e.dtype)
            block[invoke] = lat.to(e.dtype)
            on = torch.zeros(N, K, dtype=mask.dtype, device=device)
            on[invoke] = 1
            mask = torch.cat([mask, on], 1)
            with self._decoder(disable_adapter=True):
                H2, cache = self._forward_hidden(inputs_embeds=block, attention_mask=mask,
                                                 position_ids=nxt[:, None] + torch.arange(K, device=device),
                                                 cache=cache, use_cache=True)
            logits[invoke] = self._logits(H2[invoke, -1])
            nxt[invoke] += K
            for k, i in enumerate(invoke.tolist()):
                seq[i].append(block[i])
        toks, lps, alive = (torch.stack(x, 1).cpu() for x in zip(*steps))  # [N, steps] each
        answers = [row[keep].tolist() for row, keep in zip(toks, alive)]
        logps = [row[keep].tolist() for row, keep in zip(lps, alive)]
        return answers, logps, decisions

    # ------------------------------------------------------------------ scoring

    def score(self, traj: MemGenTrajectories) -> ScoreOutput:
        """Log-probs of the recorded decisions and answer tokens under the current parameters."""
        mg, device, N = self.memgen, self.device, len(traj)
        emb = self.base.get_input_embeddings()
        hist = [self._embed(ids) for ids in self._history_ids(traj.memory_rows)]
        ctx = [self._embed(p + s) for p, s in zip(traj.prompt_ids, traj.suffix_ids)]
        lengths = traj.answer_mask.sum(-1).tolist()
        answers = [traj.answer_ids[i, : lengths[i]].to(device) for i in range(N)]
        invoked = [[int(t) for t, b in zip(traj.decision_pos[i].tolist(), traj.budgets[i].tolist()) if t >= 0 and b > 0]
                   for i in range(N)]
        lat_p = self._weave([torch.cat([a, c]) for a, c in zip(hist, ctx)], "prompt")
        seq = [[c, lp.to(c.dtype)] for c, lp in zip(ctx, lat_p)]
        done = [0] * N  # answer tokens already appended per trajectory
        # answer-token t is predicted from the position before it, in unpadded coordinates
        pred: list[list[int]] = [[] for _ in range(N)]
        for i in range(N):
            pred[i].append(sum(x.shape[0] for x in seq[i]) - 1)
        for k in range(max([len(v) for v in invoked] + [0])):
            who = [i for i in range(N) if len(invoked[i]) > k]
            for i in who:  # the answer up to and including the delimiter of the k-th insertion
                t = invoked[i][k]
                seq[i].append(emb(answers[i][done[i] : t + 1]))
                done[i] = t + 1
            lat = self._weave([torch.cat([hist[i]] + seq[i]) for i in who], "inference")
            for j, i in enumerate(who):
                seq[i].append(lat[j].to(ctx[i].dtype))
        full, pos_tok = [], []
        for i in range(N):
            pieces, cursor, out_pos = [seq[i][0], seq[i][1]], sum(x.shape[0] for x in seq[i][:2]), []
            # rebuild in order: [ctx][lat_p] then answer pieces with their latents
            ins = iter(seq[i][2:])
            t_done = 0
            for t_ins in invoked[i]:
                piece = next(ins)
                pieces.append(piece)
                out_pos += list(range(cursor, cursor + piece.shape[0]))
                cursor += piece.shape[0]
                t_done = t_ins + 1
                lat = next(ins)
                pieces.append(lat)
                cursor += lat.shape[0]
                pred[i].append(cursor - 1)  # the token after an insertion is read off its last latent
            rest = emb(answers[i][t_done:])
            pieces.append(rest)
            out_pos += list(range(cursor, cursor + rest.shape[0]))
            full.append(torch.cat(pieces))
            pos_tok.append(out_pos)  # position of answer token t
        embeds, mask, pos = _left_pad(full)
        with self._decoder(disable_adapter=True):
            H, _ = self._forward_hidden(inputs_embeds=embeds, attention_mask=mask, position_ids=pos, use_cache=False)
        L, T = embeds.shape[1], traj.answer_ids.shape[1]
        src = torch.zeros(N, T, dtype=torch.long)
        for i in range(N):
            pad = L - full[i].shape[0]
            after = {t: p for t, p in zip(invoked[i], pred[i][1:])}
            for t in range(lengths[i]):
                p = pred[i][0] if t == 0 else after.get(t - 1, pos_tok[i][t - 1])
                src[i, t] = p + pad
        src = src.to(device)
        logp = self._token_logps(H[torch.arange(N, device=device)[:, None], src], traj.answer_ids,
                                 traj.answer_temperature)
        logp = torch.where(traj.answer_mask.to(device), logp, torch.zeros_like(logp))
        D = traj.decision_pos.shape[1]
        lp_d = torch.zeros(N, D, device=device)
        ent_d = torch.zeros(N, D, device=device)
        if D and mg.trigger == "learned":
            at = torch.zeros(N, D, dtype=torch.long)
            for i in range(N):
                pad = L - full[i].shape[0]
                for j, t in enumerate(traj.decision_pos[i].tolist()):
                    if t >= 0:
                        at[i, j] = pos_tok[i][t] + pad
            lg = torch.log_softmax(self.trigger(H[torch.arange(N, device=device)[:, None], at.to(device)]), -1)
            dec = (traj.budgets > 0).long().to(device)
            dm = traj.mask.to(device)
            lp_d = torch.where(dm, lg.gather(-1, dec[..., None]).squeeze(-1), lp_d)
            ent_d = torch.where(dm, -(lg.exp() * lg).sum(-1), ent_d)
        return ScoreOutput(torch.zeros(N, device=device), lp_d, ent_d, logp, None)

    # ------------------------------------------------------------------ persistence

    def save_pretrained(self, out: str | Path) -> None:
        """The weaver's LoRA adapter (peft), ``memgen.safetensors`` and the config JSON."""
        from safetensors.torch import save_file

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.lm.save_pretrained(out / "adapter", save_embedding_layers=False)
        state = {f"weaver.{k}": v for k, v in self.weaver.state_dict().items()}
        state.update({f"trigger.{k}": v for k, v in self.trigger.state_dict().items()})
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, out / WEIGHTS_FILE)
        meta = {"format_version": FORMAT_VERSION, "system": "memgen", "memory": asdict(self.cfg),
                "memgen": asdict(self.memgen),
                "backbone": {"name_or_path": self.backbone_name, "fingerprint": self.fingerprint},
                "bank": {"fingerprint": self.bank.fingerprint, "dir": str(self.bank.root)}}
        (out / CONFIG_FILE).write_text(json.dumps(meta, indent=1))

    @classmethod
    def from_pretrained(cls, path: str | Path, backbone, bank: Bank, index: KeyIndex | None = None) -> "MemGen":
        """Rebuild a saved MemGen model on ``backbone`` (which must be the one it was trained on)."""
        from elasticmem.utils.configuration import from_dict

        path = Path(path)
        mg = saved_memgen_config(path)
        if mg is None:
            raise ValueError(f"{path} holds an ElasticMem model, not a MemGen one")
        meta = json.loads((path / CONFIG_FILE).read_text())
        if meta["backbone"]["fingerprint"] != backbone.fingerprint:
            raise ValueError(f"{path} was trained on {meta['backbone']['name_or_path']!r}, but the backbone given is "
                             f"{backbone.name_or_path!r}")
        model = cls(backbone, from_dict(MemoryConfig, meta["memory"]), mg, bank, index)
        model.load_weights(path)
        return model

    def load_weights(self, path: str | Path) -> None:
        """Load a ``save_pretrained`` folder's adapter, weaver and trigger into this model."""
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f"{path} is not a saved MemGen model ({WEIGHTS_FILE} missing)")
        self._load_adapter(path)
        state = load_file(str(path / WEIGHTS_FILE), device=str(self.device))
        for name, part in (("weaver", self.weaver), ("trigger", self.trigger)):
            part.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(name + ".")})


def saved_memgen_config(path: str | Path) -> MemGenConfig | None:
    """The ``MemGenConfig`` of a saved model folder, or None when it holds an ElasticMem model."""
    from elasticmem.utils.configuration import from_dict

    f = Path(path) / CONFIG_FILE
    if not f.is_file():
        raise FileNotFoundError(f"{path} is not a saved model ({CONFIG_FILE} missing)")
    meta = json.loads(f.read_text())
    return from_dict(MemGenConfig, meta["memgen"]) if meta.get("system") == "memgen" else None
