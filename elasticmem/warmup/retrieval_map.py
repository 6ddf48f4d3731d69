"""Training a learned query/key map for retrieval (``memory.retrieval_map``; a departure from the
paper). The map itself, its file and the index that uses it are ``elasticmem.model.retrieval_map``.

The paper retrieves by the plain cosine of the query state h and the bank keys k_i. On real
LoCoMo that is near chance with SmolLM2's own states (DESIGN.md section 4). This module trains
two small maps, ``f_q`` for query states and ``f_k`` for keys, and the model then ranks by
``cos(f_q(h), f_k(k_i))``. The bank is not re-encoded: ``f_k`` is applied to its stored keys
once, when the model is built.

Both maps first standardise their input per dimension (``(x - mean) / std``, the statistics of
the training query states and of the training keys). Kinds:

- ``standardize``: only that (no training; the statistics are the "learned" part);
- ``linear``: then ``Linear(d, d_out)`` each;
- ``mlp``: then ``Linear(d, hidden) -> GELU -> Dropout -> Linear(hidden, d_out)`` each.

With ``residual`` (the default) a net computes ``x + net(x)`` and its last layer starts at
zero, so training starts from the standardisation and learns a correction (d_out = d). On
LoCoMo, maps trained from scratch on the 883 training pairs end below the standardisation
alone; residual ones end well above it (docs/experiments/2026-12-01-retrieval-keys-maps.md).

Training (``linear``, ``mlp``): InfoNCE over (question state, evidence chunk) pairs of the
training split's questions: per question, the softmax of ``cos / temperature`` over every chunk
of its conversation (same-conversation negatives; ``negatives="all"`` adds every other
training chunk, which includes the in-batch positives), with all its evidence chunks as
positives (``-log sum_pos p``). Query states come from the model's own retrieval mode
(``ElasticMem.query_states``), keys from a bank of the training split, so the map fits the
mode and key variant it was trained for; the file records both, and the encoder's fingerprint,
and the model refuses it for anything else.

    python build_bank.py --config configs/locomo_mc10.yaml bank.dir=runs/bank/locomo_train \\
        'bank.splits=[train]' bank.key=layer_mean
    python -m elasticmem.warmup.retrieval_map --config configs/locomo_mc10.yaml \\
        bank.dir=runs/bank/locomo_train bank.key=layer_mean memory.retrieval=layer_mean \\
        --kind linear --out runs/maps/locomo_layer_mean_linear.safetensors   # or map.kind=linear map.out=...
    python evaluate.py --config configs/locomo_mc10.yaml memory.retrieval=layer_mean \\
        memory.retrieval_map=runs/maps/locomo_layer_mean_linear.safetensors ...

File: safetensors, tensors of ``RetrievalMap.state_dict()`` (float32), metadata
``{format_version, kind, d_in, d_out, hidden, dropout, retrieval, key (JSON), encoder
(JSON: name_or_path, fingerprint), train (JSON: data, splits, pairs, settings, loss)}``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Literal, Sequence

import torch
from torch import nn

from elasticmem.bank.store import Bank
from elasticmem.model.retrieval_map import KINDS, RetrievalMap
from elasticmem.utils.options import Flag, Options

# --------------------------------------------------------------------------- training


@dataclass
class MapTrainConfig:
    kind: Literal[KINDS] = "linear"
    """'standardize' (no training), 'linear' or 'mlp' (the module's docstring says what each is)."""
    d_out: int = 256
    """Output size of maps without ``residual`` (a residual map's output size is its input's)."""
    hidden: int = 1024
    """Hidden size of the mlp."""
    dropout: float = 0.1
    """Dropout of the mlp's hidden layer."""
    epochs: int = 10
    """Passes over the training questions; 0 = the standardisation alone."""
    lr: float = 3e-4
    """AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    temperature: float = 0.05
    """InfoNCE temperature of the cosines."""
    batch_size: int = 64
    """Questions per optimizer step."""
    negatives: Literal["group", "all"] = "group"
    """'group': the other chunks of the question's conversation; 'all': every training chunk."""
    seed: int = 0
    """Seed of the initialisation and of the order of the questions."""
    residual: bool = True
    """x + net(x) with net's last layer zero at the start (d_out = d_in): the map starts as the
    standardisation and learns a correction (without it, 883 LoCoMo pairs overfit a map from
    scratch: it ends below the standardisation alone)."""


@dataclass
class MapOptions(MapTrainConfig):
    """The command's options (not config keys): ``map.KEY=VALUE`` or the flag. The training
    settings are ``MapTrainConfig``'s, but for the seed: the config's ``seed``."""

    out: str = field(kw_only=True)
    """The map file to write (.safetensors)."""
    splits: list[str] = field(default_factory=lambda: ["train"])
    """Splits of data.dir whose questions train the map (the flag: once per split)."""
    query_batch: int = 16
    """Questions per forward pass when the query states are computed."""


OPTIONS = Options("map", MapOptions, flags={"d_out": "--dim", "splits": Flag("--split", repeat=True, metavar="SPLIT"),
                                        "seed": None})


def info_nce(q: torch.Tensor, k: torch.Tensor, positives: Sequence[Sequence[int]],
             ranges: Sequence[tuple[int, int]] | None, temperature: float) -> torch.Tensor:
    """Mean over queries of ``-log sum_{i in pos} softmax(cos(q, k) / t)_i``.

    Args:
        q: [B, D] mapped queries; k: [M, D] mapped keys (both normalised here).
        positives: B lists of rows of ``k`` (non-empty).
        ranges: B ``[lo, hi)`` candidate rows per query (its conversation); None = all M rows.
    """
    s = nn.functional.normalize(q, dim=-1) @ nn.functional.normalize(k, dim=-1).T / temperature  # [B, M]
    B, M = s.shape
    rows = torch.arange(M)[None, :]
    if ranges is not None:
        lo = torch.tensor([r[0] for r in ranges])[:, None]
        hi = torch.tensor([r[1] for r in ranges])[:, None]
        s = s.masked_fill((rows < lo) | (rows >= hi), float("-inf"))
    pos = torch.zeros(B, M, dtype=torch.bool)
    for i, p in enumerate(positives):
        pos[i, list(p)] = True
    return (torch.logsumexp(s, -1) - torch.logsumexp(s.masked_fill(~pos, float("-inf")), -1)).mean()


def train_map(queries: torch.Tensor, positives: Sequence[Sequence[int]], ranges: Sequence[tuple[int, int]],
              keys: torch.Tensor, cfg: MapTrainConfig, log: Callable[[str], None] | None = None) -> RetrievalMap:
    """Fit a ``RetrievalMap`` to training pairs.

    Args:
        queries: [N, d] query states; positives: N non-empty lists of rows of ``keys`` (evidence);
        ranges: N ``[lo, hi)`` rows of each query's conversation in ``keys``; keys: [M, d].
    """
    if len(queries) != len(positives) or len(queries) != len(ranges):
        raise ValueError("queries, positives and ranges must have one entry per question")
    if any(not p for p in positives):
        raise ValueError("every training question needs at least one evidence row")
    if cfg.negatives not in ("group", "all"):
        raise ValueError(f"negatives must be 'group' or 'all', got {cfg.negatives!r}")
    torch.manual_seed(cfg.seed)
    rmap = RetrievalMap(queries.shape[1], cfg.kind, cfg.d_out, cfg.hidden, cfg.dropout, cfg.residual)
    rmap.set_statistics(queries, keys)
    if cfg.kind == "standardize" or cfg.epochs == 0:
        return rmap.eval().requires_grad_(False)
    opt = torch.optim.AdamW([p for p in rmap.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    queries, keys = queries.float(), keys.float()
    for epoch in range(cfg.epochs):
        rmap.train()
        order = torch.randperm(len(queries), generator=gen).tolist()
        total = 0.0
        for a in range(0, len(order), cfg.batch_size):
            idx = order[a : a + cfg.batch_size]
            loss = info_nce(rmap.map_queries(queries[idx]), rmap.map_keys(keys), [positives[i] for i in idx],
                            None if cfg.negatives == "all" else [ranges[i] for i in idx], cfg.temperature)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        if log is not None:
            log(f"epoch {epoch + 1}/{cfg.epochs}: InfoNCE {total / len(order):.4f}")
    return rmap.eval().requires_grad_(False)


# --------------------------------------------------------------------------- data


def query_states(model, examples: Sequence, batch_size: int = 16) -> torch.Tensor:
    """[N, d] the model's retrieval query state of each example (greedy control token where the
    mode has one), exactly as ``ElasticMem`` computes it before the search."""
    out = [model.query_states(examples[a : a + batch_size]).float().cpu()
           for a in range(0, len(examples), batch_size)]
    return torch.cat(out) if out else torch.zeros(0, model.bank.hidden_size)


def training_pairs(examples: Sequence, bank: Bank) -> tuple[list, list[list[int]], list[tuple[int, int]], int]:
    """Examples with evidence in ``bank``, their evidence rows, their group's rows, and how many
    examples had none."""
    from elasticmem.eval.retrieval import evidence_rows

    kept, positives, ranges = [], [], []
    for ex in examples:
        rows = evidence_rows(ex, bank)
        if rows:
            kept.append(ex)
            positives.append(sorted(rows))
            ranges.append(bank.group_rows(ex.group))
    return kept, positives, ranges, len(examples) - len(kept)


def recall_any(rmap: RetrievalMap | None, queries: torch.Tensor, positives, ranges, keys: torch.Tensor,
               ks: Sequence[int] = (1, 5, 20)) -> dict[int, float]:
    """Fraction of questions with an evidence row in the top k of their conversation (a check)."""
    with torch.no_grad():
        q = queries if rmap is None else rmap.map_queries(queries)
        k = keys if rmap is None else rmap.map_keys(keys)
        s = nn.functional.normalize(q.float(), dim=-1) @ nn.functional.normalize(k.float(), dim=-1).T
    hits = {k_: 0 for k_ in ks}
    for i, (lo, hi) in enumerate(ranges):
        top = (torch.topk(s[i, lo:hi], min(max(ks), hi - lo)).indices + lo).tolist()
        for k_ in ks:
            hits[k_] += bool(set(top[:k_]) & set(positives[i]))
    return {k_: hits[k_] / max(len(ranges), 1) for k_ in ks}


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    from elasticmem.config import Config
    from elasticmem.utils.configuration import print_config
    from elasticmem.utils.options import parse_cli

    cfg, args = parse_cli(Config, argv, prog="python -m elasticmem.warmup.retrieval_map",
                          description=__doc__, options=OPTIONS)
    opts: MapOptions = args.options

    from elasticmem.backbone import load_backbone
    from elasticmem.data.schema import load_split
    from elasticmem.model.elasticmem import ElasticMem

    if cfg.memory.retrieval in ("semantic", "recent"):
        print(f"retrieval_map: error: memory.retrieval={cfg.memory.retrieval} does not retrieve by the model's "
              f"states; nothing to map", file=sys.stderr)
        return 2
    print_config(cfg, file=sys.stderr)
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    backbone = load_backbone(cfg.backbone)
    bank = Bank.open(cfg.bank.dir, expect_fingerprint=backbone.fingerprint)
    examples = [ex for s in opts.splits for ex in load_split(cfg.data.dir, s)]
    missing = sorted({ex.group for ex in examples} - set(bank.groups))
    if missing:
        print(f"retrieval_map: error: bank {cfg.bank.dir} lacks {len(missing)} group(s) of {'+'.join(opts.splits)} "
              f"(e.g. {missing[0]!r}); build it with build_bank.py ... 'bank.splits=[{','.join(opts.splits)}]'",
              file=sys.stderr)
        return 2
    kept, positives, ranges, n_without = training_pairs(examples, bank)
    if not kept:
        print("retrieval_map: error: no question has evidence in the bank", file=sys.stderr)
        return 2
    mem = dataclasses.replace(cfg.memory, retrieval_map=None)
    model = ElasticMem(backbone, mem, bank).eval()
    t1 = time.perf_counter()
    queries = query_states(model, kept, opts.query_batch)
    keys = bank.keys().float().clone()
    t2 = time.perf_counter()
    print(f"{len(kept)} training questions with evidence ({n_without} without), {bank.num_chunks} chunks in "
          f"{len(bank.groups)} conversations; query states in {t2 - t1:.1f} s", file=sys.stderr)
    settings = {f.name: getattr(opts, f.name) for f in dataclasses.fields(MapTrainConfig)}
    tcfg = MapTrainConfig(**{**settings, "seed": cfg.seed})
    rmap = train_map(queries, positives, ranges, keys, tcfg, log=lambda s: print(s, file=sys.stderr))
    before = recall_any(None, queries, positives, ranges, keys)
    after = recall_any(rmap, queries, positives, ranges, keys)
    train_info = {"data_dir": cfg.data.dir, "splits": opts.splits, "bank_dir": cfg.bank.dir,
                  "groups": sorted(bank.groups), "pairs": len(kept), "without_evidence": n_without,
                  "settings": asdict(tcfg), "train_recall_any_before": before, "train_recall_any_after": after,
                  "seconds": time.perf_counter() - t0}
    encoder = {"name_or_path": backbone.name_or_path, "fingerprint": backbone.fingerprint}
    out = rmap.save(opts.out, cfg.memory.retrieval, bank.key, encoder, train_info)
    fmt = lambda r: " ".join(f"R@{k} {v:.3f}" for k, v in r.items())  # noqa: E731
    print(f"retrieval map ({opts.kind}, {cfg.memory.retrieval} queries, keys {bank.key}) -> {out}\n"
          f"  training questions: {fmt(before)} without the map, {fmt(after)} with it\n"
          f"  {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
