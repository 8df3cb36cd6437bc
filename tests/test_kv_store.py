"""Demote instead of evict (--kv-store): a compaction's evicted slots go to a bounded store, and
each decode step attends over the pages whose bound says they may matter (kv/store.py)."""

import pytest
import torch

from kv.compaction import evicted_offsets
from compression.config import STORE_PAGE, CompressionConfig
from engine.options import RunOptions, generate, open_session
from kv.store import KVStore
from kv.paged import PageConfig
from engine.scheduler import Request, serve
from errors import UserError
from kv.quantized import kv_read, quantize
from kv.store import page_bound
from weights.forms import load_model

CPU = torch.device("cpu")
EVICTING = dict(policy="snapkv", budget=8, hysteresis=4, window=4, n_recent=4)


def prompts_of(lengths, seed=3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


def test_the_page_bound_is_never_below_a_key_of_its_page_and_is_a_lone_keys_own_score():
    torch.manual_seed(0)
    B, H, H_kv, n_pages, page, D = 2, 4, 2, 5, 16, 8
    keys = torch.randn(B, H_kv, n_pages, page, D) * torch.rand(1, 1, n_pages, 1, D) * 4
    q = torch.randn(B, H, D)
    bound = page_bound(q, keys.amin(3), keys.amax(3))  # [B, H, n_pages]
    for b in range(B):
        for h in range(H):
            for p in range(n_pages):
                scores = keys[b, h // 2, p] @ q[b, h]  # [page]: brute force
                assert bound[b, h, p] >= scores.max() - 1e-5
    lone = keys[:, :, :, 0]  # a page of one key: its minimum and maximum are the key
    assert torch.allclose(page_bound(q, lone, lone), torch.einsum("bkpd,bkgd->bkgp", lone, q.view(B, H_kv, 2, D)).flatten(1, 2), atol=1e-5)


def test_evicted_offsets_are_the_candidates_not_kept_in_order():
    keep = torch.tensor([[[[0, 3, 4]]]])
    assert evicted_offsets(keep, 7).tolist() == [[[[1, 2, 5, 6]]]]


@pytest.mark.parametrize("store_drops", ["oldest", "least_attended"])
@pytest.mark.parametrize("pages", [None, PageConfig(block_size=4)], ids=["contiguous", "paged"])
def test_a_store_that_holds_every_evicted_slot_and_recalls_every_page_gives_the_full_caches_answer(pages, store_drops, tiny_checkpoint):
    """Resident slots and the whole store are every slot the full cache holds: the same softmax,
    up to the order of its sums, so the same tokens; eviction alone gives others."""
    model = load_model(tiny_checkpoint("qwen2")[0], torch.float32, CPU)
    prompts = prompts_of([5, 30, 12])
    full = generate(model, prompts, 60, eos_ids=frozenset(), options=RunOptions(pages=pages))
    evicting = generate(model, prompts, 60, eos_ids=frozenset(), options=RunOptions(pages=pages, compression=CompressionConfig(**EVICTING)))
    stored = CompressionConfig(**EVICTING, store_slots=64, store_dtype="f32", recall_pages=64 // STORE_PAGE, store_drops=store_drops)
    recalled = generate(model, prompts, 60, eos_ids=frozenset(), options=RunOptions(pages=pages, compression=stored))
    assert recalled.compression.compactions > 3
    assert evicting.tokens != full.tokens
    assert recalled.tokens == full.tokens


def test_a_full_store_drops_its_oldest_and_holds_the_same_memory(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    config = CompressionConfig(**EVICTING, store_slots=32, recall_pages=1)
    session = open_session(model, 1, config.slots_needed(9, 10_000), RunOptions(compression=config), eos_ids=frozenset())
    session.prefill(prompts_of([9]))
    store = session.policy.store
    held = [t.untyped_storage().data_ptr() for t in (store.k.codes, store.v.codes, store.low, store.filled)]
    while session.stats.compactions < 12:
        session.step()
    assert [t.untyped_storage().data_ptr() for t in (store.k.codes, store.v.codes, store.low, store.filled)] == held
    assert bool(store.filled.all())
    positions = store.positions[:, 0]  # [L, H_kv, N]
    resident = session.policy.slot_positions()[:, 0, :, : int(session.cache.length[0])]  # [L, H_kv, S]
    for layer in range(positions.shape[0]):
        for head in range(positions.shape[1]):
            stored = set(positions[layer, head].tolist())
            assert len(stored) == 32 and not stored & set(resident[layer, head].tolist())


def test_the_ring_keeps_the_last_demoted_slots_and_summarizes_each_page(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    c = model.config
    store = KVStore.allocate(c, 1, 32, "f32", torch.float32, 1, CPU)
    L, H_kv, D = c.n_layers, c.n_kv_heads, c.head_dim
    demoted = []
    for first, count in ((0, 12), (12, 12), (24, 12), (36, 5)):  # 41 slots into 32
        keys = torch.randn(L, 1, H_kv, count, D)
        store.demote(keys, torch.randn(L, 1, H_kv, count, D), torch.arange(first, first + count).expand(L, 1, H_kv, count))
        demoted += [(first + i, keys[:, :, :, i]) for i in range(count)]
    assert sorted(store.positions[0, 0, 0].tolist()) == list(range(9, 41))  # the 9 oldest were overwritten
    for position, key in demoted[9:]:
        slot = store.positions[0, 0, 0].tolist().index(position)
        assert torch.equal(store.k[:, :, :, slot], key)
    pages = store.k.view(L, 1, H_kv, 2, STORE_PAGE, D)
    assert torch.equal(store.low, pages.amin(4)) and torch.equal(store.high, pages.amax(4))


@pytest.mark.parametrize("store_dtype", ["f32", "int4"])
def test_a_scored_store_keeps_the_best_scored_slots_ever_demoted(tiny_checkpoint, store_dtype):
    """Brute force: after demotions of every size (one past the store's size included), each layer,
    row and KV head holds the N best-scored slots of all those demoted, each with its own key,
    value and position, and each page's summary is the minimum and maximum of its keys."""
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    c = model.config
    L, B, H_kv, D, N = c.n_layers, 2, c.n_kv_heads, c.head_dim, 32
    store = KVStore.allocate(c, B, N, store_dtype, torch.float32, 1, CPU, scored=True)
    g = torch.Generator().manual_seed(0)
    keys, values, scores = [], [], []
    for count in (12, 12, 5, 40, 3):
        k, v = torch.randn(L, B, H_kv, count, D, generator=g), torch.randn(L, B, H_kv, count, D, generator=g)
        first = sum(part.shape[3] for part in keys)
        score = torch.rand(L, B, H_kv, count, generator=g)
        store.demote(k, v, torch.arange(first, first + count).expand(L, B, H_kv, count), score)
        keys, values, scores = keys + [k], values + [v], scores + [score]
    keys, values, scores = (torch.cat(parts, dim=3) for parts in (keys, values, scores))
    if store_dtype == "int4":  # what the codes of each demoted slot read back as
        keys, values = (kv_read(quantize(x, kv.bits, kv.rotation), torch.float32) for x, kv in ((keys, store.k), (values, store.v)))
    assert bool(store.filled.all())
    held_keys, held_values = kv_read(store.k, torch.float32), kv_read(store.v, torch.float32)
    tolerance = 1e-6
    for layer in range(L):
        for b in range(B):
            for head in range(H_kv):
                best = set(scores[layer, b, head].topk(N).indices.tolist())
                held = store.positions[layer, b, head].tolist()
                assert set(held) == best
                for slot, position in enumerate(held):
                    assert float(store.score[layer, b, head, slot]) == float(scores[layer, b, head, position])
                    torch.testing.assert_close(held_keys[layer, b, head, slot], keys[layer, b, head, position], atol=tolerance, rtol=0)
                    torch.testing.assert_close(held_values[layer, b, head, slot], values[layer, b, head, position], atol=tolerance, rtol=0)
    pages = held_keys.view(L, B, H_kv, N // STORE_PAGE, STORE_PAGE, D)
    assert torch.equal(store.low, pages.amin(4)) and torch.equal(store.high, pages.amax(4))


def test_a_scored_store_takes_the_most_attention_each_evicted_slot_received(tiny_checkpoint):
    """At a compaction, each slot the store takes scores what the manager recorded for it in the
    cache: the most attention it received (the record is read where the slot was, before the move)."""
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    config = CompressionConfig(**EVICTING, store_slots=64, store_dtype="f32", recall_pages=1, store_drops="least_attended")
    session = open_session(model, 1, config.slots_needed(9, 10_000), RunOptions(compression=config), eos_ids=frozenset())
    session.prefill(prompts_of([9]))
    manager = session.policy
    seen = {}
    demote = manager.store.demote

    def watched(*args):
        seen.update(record=manager.received["max"].clone(), positions=manager.slot_positions().clone())
        demote(*args)

    manager.store.demote = watched
    while manager.stats.compactions < 1:
        session.step()
    store, n = manager.store, int(manager.store.filled[0].sum())
    assert n > 0 and float(seen["record"].abs().sum()) > 0
    for layer in range(store.positions.shape[0]):
        for head in range(store.positions.shape[2]):
            for slot in range(n):
                where = (seen["positions"][layer, 0, head] == store.positions[layer, 0, head, slot]).nonzero()[0, 0]
                assert float(store.score[layer, 0, head, slot]) == float(seen["record"][layer, 0, head, where])


def test_compiled_step_with_a_store_equals_eager(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    prompts = prompts_of([7, 19], seed=2)
    config = CompressionConfig(**EVICTING, store_slots=32, recall_pages=1, store_drops="least_attended")
    eager = generate(model, prompts, 40, eos_ids=frozenset(), options=RunOptions(compression=config))
    compiled = generate(model, prompts, 40, eos_ids=frozenset(), options=RunOptions(compression=config, compile=True))
    assert eager.compression.compactions > 0
    assert compiled.tokens == eager.tokens


def test_continuous_batching_with_a_store_answers_each_prompt_as_it_alone_would_be_answered(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen2")[0], torch.float32, CPU)
    prompts = prompts_of([5, 21, 9, 14], seed=5)
    config = CompressionConfig(**EVICTING, store_slots=32, recall_pages=1, store_dtype="int8")
    alone = [generate(model, [p], 36, eos_ids=frozenset(), options=RunOptions(compression=config)).tokens[0] for p in prompts]
    assert serve(model, [Request(p, 36) for p in prompts], 2, eos_ids=frozenset(), options=RunOptions(compression=config)).tokens == alone


def test_the_store_is_counted_in_the_caches_bytes(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    c = model.config
    without = generate(model, prompts_of([6]), 4, eos_ids=frozenset(), options=RunOptions(compression=CompressionConfig(**EVICTING)))
    stored = generate(model, prompts_of([6]), 4, eos_ids=frozenset(), options=RunOptions(compression=CompressionConfig(**EVICTING, store_slots=32, store_dtype="f32", recall_pages=2)))
    heads = c.n_layers * c.n_kv_heads
    assert stored.kv_cache_bytes - without.kv_cache_bytes == heads * (2 * 32 * c.head_dim * 4 + 2 * (32 // STORE_PAGE) * c.head_dim * 4)


def test_bad_store_options_get_one_clear_error():
    with pytest.raises(UserError, match="--kv-store holds what a policy evicts"):
        CompressionConfig(store_slots=32)
    with pytest.raises(UserError, match="multiple of its page of 16"):
        CompressionConfig(**EVICTING, store_slots=40)
    with pytest.raises(UserError, match="unknown --kv-store-dtype 'int5'"):
        CompressionConfig(**EVICTING, store_slots=32, store_dtype="int5", recall_pages=1)
    with pytest.raises(UserError, match="unknown --kv-store-drops 'newest'"):
        CompressionConfig(**EVICTING, store_slots=32, recall_pages=1, store_drops="newest")
    with pytest.raises(UserError, match="--kv-recall must be between 1 and the store's 2 pages"):
        CompressionConfig(**EVICTING, store_slots=32, recall_pages=3)
