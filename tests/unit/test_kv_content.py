"""Per-layer KV memories (bank.kv_cache, memory.content=kv) against independent computations.

    pytest tests/unit/test_kv_content.py

- the bank's keys and values equal the encoder's own, recomputed chunk by chunk at the
  positions of the stored frame (position ids shifted, so no rotation code is involved);
- a rotated key equals the key computed at the shifted position;
- the reader's batched forward over KV memories equals a one-at-a-time reference built from
  plain forward passes: prompt, then the memories' cached keys and values appended at their
  positions, then the separators and the suffix;
- a memory that holds the whole chunk read from position 0 equals reading the chunk as text;
- sampled log-probs equal the scored ones, greedy answers equal one-at-a-time answers, and
  gradients reach the adapter, not the bank.
"""

from __future__ import annotations

import pytest
import torch
from test_elasticmem import lengthened, memory_cfg, tiny_backbone

from elasticmem.bank import Bank, BankError, build_bank
from elasticmem.bank.kv import rotary_module, rotate_keys
from elasticmem.config import BankConfig, ChunkingConfig
from elasticmem.data.chunking import tokenize_chunks
from elasticmem.data.synthetic import SyntheticConfig, generate
from elasticmem.model.elasticmem import ElasticMem
from elasticmem.model.injection import KVPiece, Layout, assemble

N_CACHE = 6


@pytest.fixture(scope="module")
def data():
    return generate(SyntheticConfig(variant="tiny", num_histories=6, num_facts=5, num_options=4), seed=0)


@pytest.fixture(scope="module")
def kv_bank(tmp_path_factory, data):
    examples = lengthened([ex for split in data.values() for ex in split])  # chunks longer and shorter than N_CACHE
    out = tmp_path_factory.mktemp("kvbank")
    build_bank({"all": examples}, tiny_backbone(), ChunkingConfig(max_tokens=32),
               BankConfig(dir=str(out), n_cache=N_CACHE, shard_rows=8, kv_cache=True, kv_dtype="float32"),
               torch.float32, show_progress=False)
    return Bank.open(out)


def _chunk_ids(bank, backbone, rows):
    t = bank.manifest["tokenization"]
    return tokenize_chunks([bank.chunk(r)["text"] for r in rows], backbone.tokenizer, t["max_tokens"],
                           t["truncation_side"], t["add_special_tokens"])


@torch.no_grad()
def test_bank_kv_equals_the_encoders_own_states_in_the_window_frame(kv_bank):
    bb = tiny_backbone()
    dec = bb.model.get_decoder()
    rows = list(range(kv_bank.num_chunks))
    kv = kv_bank.gather_kv(rows)
    assert kv.shape == (len(rows), N_CACHE, 2, 2, 2, 16)
    lengths = set()
    for r, ids in zip(rows, _chunk_ids(kv_bank, bb, rows)):
        L = len(ids)
        lengths.add(L)
        # the stored frame puts slot s at position s: encode at positions shifted by N_CACHE - L
        out = dec(input_ids=torch.tensor([ids]), position_ids=torch.arange(L)[None] + N_CACHE - L, use_cache=True)
        for s in range(N_CACHE):
            p = L - N_CACHE + s
            for li, layer in enumerate(out.cache.layers):
                if p >= 1:
                    torch.testing.assert_close(kv[r, s, li, 0], layer.keys[0, :, p], atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(kv[r, s, li, 1], layer.values[0, :, p], atol=1e-5, rtol=1e-5)
                else:  # before the chunk, or its position 0 (the attention sink): not stored
                    assert kv[r, s, li].abs().max() == 0
        assert int(kv_bank.kv_lengths([r])) == min(N_CACHE, L - 1)
    assert min(lengths) < N_CACHE < max(lengths)


@torch.no_grad()
def test_rotated_keys_equal_keys_computed_at_the_shifted_positions():
    bb = tiny_backbone()
    dec = bb.model.get_decoder()
    ids = torch.tensor([[5, 9, 13, 2, 7, 11]])
    a = dec(input_ids=ids, use_cache=True).cache
    b = dec(input_ids=ids, position_ids=torch.arange(6)[None] + 37, use_cache=True).cache
    for la, lb in zip(a.layers, b.layers):
        torch.testing.assert_close(rotate_keys(la.keys, torch.tensor([37]), rotary_module(dec)), lb.keys,
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rotate_keys(lb.keys, torch.tensor([-37]), rotary_module(dec)), la.keys,
                                   atol=1e-5, rtol=1e-5)


@torch.no_grad()
def _reference_states(bb, lm, prompt, pieces, sep, suffix):
    """Final states of [prompt][m_1][sep]...[suffix], built step by step from plain forwards:
    the memories' keys rotated with positions re-encoded, one sequence, no padding."""
    from transformers import DynamicCache

    dec = lm.get_decoder()
    cache = DynamicCache()
    out = dec(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
    states = [out.last_hidden_state[0]]
    pos = len(prompt)
    for piece in pieces:
        c = piece.kv.shape[0]
        for li, layer in enumerate(cache.layers):
            k = rotate_keys(piece.kv[:, li, 0].permute(1, 0, 2)[None], torch.tensor([pos - piece.first]),
                            rotary_module(dec))
            layer.keys = torch.cat([layer.keys, k], 2)
            layer.values = torch.cat([layer.values, piece.kv[:, li, 1].permute(1, 0, 2)[None]], 2)
        pos += c
        out = dec(input_ids=torch.tensor([sep]), position_ids=torch.arange(pos, pos + len(sep))[None], cache=cache,
                  use_cache=True)
        states.append(out.last_hidden_state[0])
        pos += len(sep)
    out = dec(input_ids=torch.tensor([suffix]), position_ids=torch.arange(pos, pos + len(suffix))[None], cache=cache,
              use_cache=True)
    states.append(out.last_hidden_state[0])
    return torch.cat(states)


@pytest.mark.parametrize("additive", [False, True])
@torch.no_grad()
def test_batched_kv_reading_equals_one_at_a_time_reference(kv_bank, additive):
    bb = tiny_backbone()
    dec = bb.model.get_decoder()
    kv = kv_bank.gather_kv(list(range(kv_bank.num_chunks)))
    lens = kv_bank.kv_lengths(list(range(kv_bank.num_chunks)))
    sep = [3, 4]
    layouts = [  # rows of different prompt lengths, memory counts (0 included) and memory lengths
        Layout([10, 11, 12], 20, [KVPiece(kv[0, N_CACHE - 2:], N_CACHE - 2), KVPiece(kv[3, N_CACHE - 4:], N_CACHE - 4)],
               [30, 31], []),
        Layout([10, 14, 15, 16, 17, 18], None, [KVPiece(kv[1, N_CACHE - int(lens[1]):], N_CACHE - int(lens[1]))],
               [30], []),
        Layout([12], 21, [], [30, 32, 33], []),
    ]
    x = assemble(bb.model.get_input_embeddings(), layouts, sep, rotary_module(dec), additive=additive)
    H = dec(**x.forward_kwargs(), use_cache=False).last_hidden_state
    for i, lay in enumerate(layouts):
        head = lay.prompt + ([lay.control] if lay.control is not None else [])
        ref = _reference_states(bb, bb.model, head, lay.memories, sep, lay.suffix)
        got = H[i, H.shape[1] - int(x.lengths[i]):]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_a_whole_chunk_read_as_kv_from_position_0_equals_reading_it_as_text(kv_bank):
    """With nothing before it, a chunk's stored states placed where it was encoded (positions
    1..L-1 after its first token as text) are exactly the text reading's."""
    bb = tiny_backbone()
    dec = bb.model.get_decoder()
    row = next(r for r in range(kv_bank.num_chunks) if int(kv_bank.kv_lengths([r])) < N_CACHE)
    ids = _chunk_ids(kv_bank, bb, [row])[0]
    c = len(ids) - 1
    piece = KVPiece(kv_bank.gather_kv([row])[0, N_CACHE - c:], N_CACHE - c)
    suffix = [30, 31, 32]
    x = assemble(bb.model.get_input_embeddings(), [Layout(ids[:1], None, [piece], suffix, [])], [], rotary_module(dec))
    got = dec(**x.forward_kwargs(), use_cache=False).last_hidden_state[0, -len(suffix):]
    ref = dec(input_ids=torch.tensor([ids + suffix])).last_hidden_state[0, -len(suffix):]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_kv_model_samples_scores_and_answers_as_one_at_a_time(kv_bank, data):
    torch.manual_seed(0)
    model = ElasticMem(tiny_backbone(), memory_cfg(content="kv", policy={"max_budget": N_CACHE}), kv_bank)
    assert not list(model.projector.parameters())  # nothing to project
    batch = data["train"][:3]
    traj = model.sample(batch, group_size=2)
    assert int(traj.memory_tokens.sum()) > 0
    model.eval()
    out = model.score(traj)
    torch.testing.assert_close(out.logp_answer, traj.logp_answer.to(out.logp_answer), atol=1e-5, rtol=1e-5)
    many = model.greedy(batch)
    for i, ex in enumerate(batch):
        one = model.greedy([ex])
        assert one.answers == [many.answers[i]]
        assert torch.equal(one.soft_counts[0], many.soft_counts[i])
    # memory tokens are the readable slots the budgets took
    lens = kv_bank.kv_lengths(traj.rows.clamp(min=0).reshape(-1)).reshape(traj.rows.shape)
    expect = torch.where(traj.mask, torch.minimum(traj.budgets, lens), torch.zeros_like(lens))
    assert torch.equal(traj.soft_counts, expect)
    model.train()
    loss = -model.score(traj).logp_answer.sum()
    loss.backward()
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)


def test_kv_content_needs_a_kv_bank(tmp_path, data):
    examples = [ex for split in data.values() for ex in split]
    build_bank({"all": examples}, tiny_backbone(), ChunkingConfig(max_tokens=32),
               BankConfig(dir=str(tmp_path), n_cache=N_CACHE), torch.float32, show_progress=False)
    with pytest.raises(BankError, match="bank.kv_cache=true"):
        ElasticMem(tiny_backbone(), memory_cfg(content="kv"), Bank.open(tmp_path))
