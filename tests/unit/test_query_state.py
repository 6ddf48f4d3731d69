"""Independent checks of the query state, the retrieval and the budget policy's input features.

    pytest tests/unit/test_query_state.py

Everything here is recomputed with plain transformers / peft / safetensors / torch, never with
the project's helpers (DESIGN.md section 1 items 2-3):

* the query state h (``control``: the final-layer state, after the final norm, of the
  LoRA-adapted model at the control token a; ``query_only``: at the last prompt token, adapter
  on; ``frozen``: the same with the adapter disabled), the control token (argmax when greedy)
  and its log-probability at the control temperature, one unpadded example at a time while the
  model batched prompts of different lengths (left padding);
* the retrieved rows: brute-force cosine top-Z of h over the keys of the example's group, read
  from the bank's shard files, manifest.json and chunks.jsonl (DESIGN.md 3.1);
* the budget policy's per-memory input ``Linear([h; k_j; h*k_j; s_j]) + rank_embedding[j]``
  (or without ``h*k_j``), captured with a forward pre-hook on the policy's body, and a proof
  that the comparison catches a feature built from h*h or with h and k swapped.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import make_examples
from safetensors.torch import load_file

from elasticmem.backbone import load_backbone
from elasticmem.bank import Bank, build_bank
from elasticmem.config import BankConfig, ChunkingConfig, LoraConfig, MemoryConfig, BackboneConfig
from elasticmem.model.budget_policy import BudgetPolicy, BudgetPolicyConfig
from elasticmem.model.elasticmem import ElasticMem
from elasticmem.model.projector import ProjectorConfig

TOP_Z = 4
ATOL = 1e-5
# Questions of different token lengths, so the batched prompts are left-padded differently.
QUESTIONS = [
    "cat?",
    "what did the cat do?",
    "where did the dog and the fox go after the owl sat on the map?",
    "pen",
    "did the owl see the egg in the cup near the bed or the car?",
    "what is in the box?",
    "why?",
    "the fox, the hat, the key and the sun: which one came first on the map?",
]


@pytest.fixture(scope="module")
def bank_dir(tmp_path_factory, tiny_backbone) -> tuple[Path, list]:
    """4 groups of 7, 3, 2 and 4 chunks over 4 shards (Z = 4: two groups are smaller than Z)."""
    examples = make_examples(n_groups=4, seed=0, questions_per_group=2)
    examples = [dataclasses.replace(ex, question=q) for ex, q in zip(examples, QUESTIONS, strict=True)]
    out = tmp_path_factory.mktemp("bank")
    build_bank({"all": examples}, tiny_backbone, ChunkingConfig(max_tokens=32),
               BankConfig(dir=str(out), n_cache=6, shard_rows=5), torch.float32, show_progress=False)
    return out, examples


@pytest.fixture(scope="module")
def raw_bank(bank_dir) -> dict:
    """The bank read from its files: keys [rows, d] in manifest shard order, groups, chunk records."""
    root = bank_dir[0]
    manifest = json.loads((root / "manifest.json").read_text())
    keys = torch.cat([load_file(str(root / s["file"]))["keys"] for s in manifest["shards"]])
    chunks = [json.loads(line) for line in (root / "chunks.jsonl").read_text().splitlines() if line.strip()]
    assert keys.shape[0] == manifest["num_chunks"] == len(chunks)
    assert [c["row"] for c in chunks] == list(range(len(chunks)))
    groups = {g: (int(a), int(b)) for g, (a, b) in manifest["groups"].items()}
    for g, (a, b) in groups.items():  # the manifest's ranges agree with the chunk records
        assert [c["row"] for c in chunks if c["group"] == g] == list(range(a, b))
    sizes = sorted(b - a for a, b in groups.values())
    assert sizes[0] < TOP_Z < sizes[-1], f"want groups smaller and larger than Z, got sizes {sizes}"
    return {"keys": keys, "groups": groups, "row_group": [c["group"] for c in chunks]}


def make_model(bank_dir, retrieval: str = "control", control_temperature: float = 1.0,
               policy: dict | None = None) -> ElasticMem:
    """ElasticMem on a fresh tiny backbone (peft mutates it) with a non-trivial LoRA adapter."""
    torch.manual_seed(0)
    cfg = MemoryConfig(
        retrieval=retrieval, control_temperature=control_temperature, top_z=TOP_Z, max_new_tokens=2,
        suffix_template="\n{options}\nAnswer:", lora=LoraConfig(r=4, alpha=8, dropout=0.1),
        policy=BudgetPolicyConfig(**{"d_model": 32, "num_heads": 2, "num_layers": 1, "max_budget": 8,
                                     **(policy or {})}),
        projector=ProjectorConfig(hidden_size=32),
    )
    model = ElasticMem(load_backbone(BackboneConfig(name_or_path="tiny", device="cpu")), cfg, Bank.open(bank_dir[0]))
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():  # lora_B starts at zero: perturb every adapter weight so the adapter matters
        lora = [p for n, p in model.lm.named_parameters() if "lora_" in n]
        assert lora, "no LoRA parameters found"
        for p in lora:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def rollout(model: ElasticMem, examples, greedy: bool, G: int = 3):
    if greedy:
        return model.greedy(examples)
    torch.manual_seed(7)
    return model.sample(examples, group_size=G, temperature=1.0)


def plain_forward(model: ElasticMem, ids: list[int], adapter: bool):
    """(final-layer states [L, d] after the final norm, logits [L, V]) of one unpadded sequence."""
    with torch.no_grad():
        x = torch.tensor([ids])
        if adapter:
            out = model.lm(input_ids=x, output_hidden_states=True)
        else:
            with model.lm.disable_adapter():
                out = model.lm(input_ids=x, output_hidden_states=True)
    H, logits = out.hidden_states[-1][0].float(), out.logits[0].float()
    # hidden_states[-1] is the state after the final norm: the LM head applied to it gives the logits
    head = model.lm.get_base_model().lm_head.weight.float()
    torch.testing.assert_close(H @ head.T, logits, atol=1e-4, rtol=1e-4)
    return H, logits


# ---------------------------------------------------------------------------- 1. query state


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sample"])
@pytest.mark.parametrize("mode", ["control", "query_only", "frozen"])
def test_query_state_matches_plain_transformers(bank_dir, one_thread, mode, greedy):
    examples = bank_dir[1]
    tau = 0.7
    model = make_model(bank_dir, retrieval=mode, control_temperature=tau)
    traj = rollout(model, examples, greedy)
    G = 1 if greedy else 3
    tok = model.tokenizer
    prompts = [tok(ex.question)["input_ids"] for ex in examples]
    assert len({len(p) for p in prompts}) >= 5, "prompts of different lengths are needed to exercise padding"
    assert len(traj) == len(examples) * G
    assert traj.control_temperature == (1.0 if greedy else tau)
    controls = set()
    for n in range(len(traj)):
        prompt = prompts[n // G]
        assert traj.prompt_ids[n] == prompt
        a = int(traj.control[n])
        if mode == "control":
            assert 0 <= a < len(tok)
            controls.add(a)
            H, logits = plain_forward(model, prompt + [a], adapter=True)
            h_ref, next_logits = H[-1], logits[-2]  # state at a; distribution of a after the prompt
            if greedy:
                assert a == int(next_logits.argmax()), f"trajectory {n}: greedy control token is not the argmax"
            logp_ref = torch.log_softmax(next_logits / traj.control_temperature, -1)[a]
            torch.testing.assert_close(traj.logp_control[n], logp_ref, atol=ATOL, rtol=0)
        else:
            assert a == -1 and float(traj.logp_control[n]) == 0.0
            H, _ = plain_forward(model, prompt, adapter=mode == "query_only")
            h_ref = H[-1]
        torch.testing.assert_close(traj.query_state[n], h_ref, atol=ATOL, rtol=0,
                                   msg=lambda m, n=n: f"trajectory {n} ({mode}): {m}")
        # The adapter is non-trivial: the other setting of the adapter gives another state.
        ids = prompt + [a] if mode == "control" else prompt
        H_other, _ = plain_forward(model, ids, adapter=mode == "frozen")
        assert (H_other[-1] - h_ref).abs().max() > 1e-3, "adapter on and off give the same state"
    if greedy:  # the public step-1 call gives the rollout's states
        torch.testing.assert_close(model.query_states(examples), traj.query_state, atol=ATOL, rtol=0)
    if mode == "control" and not greedy:
        assert len(controls) > 1, "sampling should give different control tokens (different states)"


# ---------------------------------------------------------------------------- 2. retrieval


@pytest.mark.parametrize("mode, greedy", [("control", False), ("frozen", True)])
def test_retrieval_is_brute_force_top_z_within_group(bank_dir, raw_bank, one_thread, mode, greedy):
    examples = bank_dir[1]
    model = make_model(bank_dir, retrieval=mode)
    traj = rollout(model, examples, greedy)
    keys, groups, row_group = raw_bank["keys"], raw_bank["groups"], raw_bank["row_group"]
    saw_short, saw_full = False, False
    for n in range(len(traj)):
        g = traj.groups[n]
        assert g == examples[int(traj.query_index[n])].group
        start, end = groups[g]
        h = F.normalize(traj.query_state[n].float(), dim=0)
        ref = keys[start:end] @ h  # cosine against every key of the group (keys are unit vectors)
        valid = min(TOP_Z, end - start)
        saw_short |= valid < TOP_Z
        saw_full |= valid == TOP_Z
        rows, scores, mask = traj.rows[n], traj.scores[n], traj.mask[n]
        assert mask.tolist() == [True] * valid + [False] * (TOP_Z - valid)
        assert rows[valid:].tolist() == [-1] * (TOP_Z - valid) and scores[valid:].tolist() == [0.0] * (TOP_Z - valid)
        got = rows[:valid].tolist()
        assert len(set(got)) == valid, f"trajectory {n}: a row retrieved twice: {got}"
        for r in got:  # never a row of another group
            assert start <= r < end and row_group[r] == g, f"trajectory {n} (group {g}) retrieved row {r}"
        # each score is the row's cosine, in descending (rank) order, and they are the top-Z scores
        torch.testing.assert_close(scores[:valid], ref[torch.tensor(got) - start], atol=ATOL, rtol=0)
        assert (scores[:valid].diff() <= ATOL).all(), f"trajectory {n}: scores not in rank order"
        top = ref.topk(valid)
        torch.testing.assert_close(scores[:valid], top.values, atol=ATOL, rtol=0)
        # the row sets agree unless the Z-th and (Z+1)-th scores tie
        if valid < end - start and float(top.values[-1] - ref.sort(descending=True).values[valid]) < ATOL:
            continue
        assert set(got) == set((top.indices + start).tolist()), f"trajectory {n}: rows {got}"
    assert saw_short and saw_full


# ---------------------------------------------------------------------------- 3. policy input


def policy_input_reference(policy: BudgetPolicy, h, keys, mask, budgets) -> torch.Tensor:
    """Linear([h; k_j; h*k_j; s_j]) + rank_embedding[j] (+ the decision embedding, autoregressive)."""
    s = keys @ F.normalize(h, dim=-1)[:, :, None]  # [N, Z, 1] cosine (keys are unit vectors)
    hq = h[:, None, :].expand_as(keys)
    parts = [hq, keys, hq * keys] if policy.cfg.product_feature else [hq, keys]
    feats = torch.cat(parts + [s], dim=-1)
    W, b = policy.input_proj.weight.detach(), policy.input_proj.bias.detach()
    x = feats @ W.T + b + policy.rank_embedding.weight.detach()[: keys.shape[1]]
    if policy.cfg.variant == "autoregressive":
        # the last decoding step sees every earlier decision: start, then class of b_{j-1} + 1 (absent: K+1)
        K = policy.cfg.max_budget - policy.cfg.min_budget + 1
        prev = torch.where(mask, budgets - policy.cfg.min_budget + 1, K + 1)
        tokens = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], 1)
        x = x + policy.decision_embedding.weight.detach()[tokens]
    return x


def captured_policy_input(model: ElasticMem, examples, raw_bank):
    """Greedy rollout; (what the policy's body received, its reference)."""
    seen = []
    handle = model.policy.body.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    try:
        traj = model.greedy(examples)
    finally:
        handle.remove()
    assert seen, "the policy's body was never called"
    rows = traj.rows
    keys = torch.where((rows >= 0)[..., None], raw_bank["keys"][rows.clamp(min=0)], 0.0)
    ref = policy_input_reference(model.policy, traj.query_state.float(), keys, traj.mask, traj.budgets)
    return seen[-1], ref, traj.mask


def assert_same_input(got, ref, mask):
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert torch.isfinite(got).all()
    err = (got - ref).abs()[mask].max()  # absent slots carry no information: compare present ones
    assert err < ATOL, f"policy input differs from Linear([h; k; h*k; s]) + rank embedding by {err}"


def embed_h_times_h(self, h, keys, scores, mask):
    """A wrong feature construction: h*h in place of h*k_j."""
    hq = h.float()[:, None, :].expand_as(keys.float())
    feats = torch.cat([hq, keys.float(), hq * hq, scores.float()[..., None]], dim=-1)
    feats = torch.where(mask[..., None], feats, 0.0)
    return self.input_proj(feats) + self.rank_embedding(torch.arange(keys.shape[1]))


def embed_swapped(self, h, keys, scores, mask):
    """A wrong feature construction: k_j and h swapped ([k_j; h; (h*k_j); s_j])."""
    keys = keys.float()
    hq = h.float()[:, None, :].expand_as(keys)
    parts = [keys, hq, hq * keys] if self.cfg.product_feature else [keys, hq]
    feats = torch.where(mask[..., None], torch.cat(parts + [scores.float()[..., None]], dim=-1), 0.0)
    return self.input_proj(feats) + self.rank_embedding(torch.arange(keys.shape[1]))


@pytest.mark.parametrize("policy", [
    {"variant": "transformer"},
    {"variant": "transformer", "product_feature": False},
    {"variant": "autoregressive", "min_budget": 1},
    {"variant": "mlp"},
], ids=["transformer", "transformer-no-hk", "autoregressive", "mlp"])
def test_policy_input_is_projection_of_h_k_hk_s_plus_rank(bank_dir, raw_bank, one_thread, monkeypatch, policy):
    examples = bank_dir[1]
    model = make_model(bank_dir, policy=policy)
    d = model.policy.hidden_size
    assert model.policy.input_proj.in_features == (3 if policy.get("product_feature", True) else 2) * d + 1
    got, ref, mask = captured_policy_input(model, examples, raw_bank)
    assert (~mask).any() and mask.any(), "want present and absent slots"
    assert_same_input(got, ref, mask)
    # Teeth: a policy that built its features wrongly must fail the same comparison.
    wrong = [embed_swapped] + ([embed_h_times_h] if policy.get("product_feature", True) else [])
    for bad in wrong:
        with monkeypatch.context() as m:
            m.setattr(BudgetPolicy, "_embed", bad)
            got, ref, mask = captured_policy_input(model, examples, raw_bank)
        with pytest.raises(AssertionError, match="policy input differs"):
            assert_same_input(got, ref, mask)
