"""The paged KV cache and continuous batching: block accounting, attention through the block
table against the contiguous cache, compaction on pages, and answers in prompt order."""

import pytest
import torch

from kv.compaction import compact_in_place
from compression.config import POLICIES, CompressionConfig
from engine.options import RunOptions, generate, open_session
from kv.cache import KVCache
from kv.paged import SCRATCH_BLOCK, PageConfig, PagedKVCache
from engine.scheduler import ContinuousSession, Request, serve
from errors import UserError
from models.config import ModelConfig
from kv.paged import gather_pages, read_pages
from weights.forms import load_model

CPU = torch.device("cpu")
SMALL = CompressionConfig(budget=6, hysteresis=3, window=3, n_recent=4, n_beacon=4)
POLICY_RUNS = [CompressionConfig(**{**SMALL.__dict__, "policy": p}) for p in POLICIES if p != "none"]
POLICY_RUNS.append(CompressionConfig(**{**SMALL.__dict__, "policy": "beacon", "prefix_budget": 6, "prefix_tail": 4}))


def prompts_of(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


def tiny_config(n_kv_heads: int = 2) -> ModelConfig:
    return ModelConfig(
        model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16, n_layers=2, n_heads=2, n_kv_heads=n_kv_heads,
        head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=False,
        qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
    )


def test_blocks_are_handed_out_as_rows_grow_and_all_come_back():
    cache = PagedKVCache.allocate(tiny_config(), 2, 10, torch.float32, CPU, PageConfig(block_size=4, n_blocks=5))
    assert cache.block_table.shape == (2, 3) and cache.n_slots == 10
    cache.fit(0, 5)  # two blocks
    cache.fit(1, 4)  # one
    cache.fit(0, 8)  # still two
    assert [len(r) for r in cache.blocks.rows] == [2, 1] and len(cache.blocks.free) == 2 and cache.blocks.in_use == 3
    held = cache.blocks.rows[0] + cache.blocks.rows[1]
    assert SCRATCH_BLOCK not in held and len(set(held)) == 3
    assert cache.block_table[0, :2].tolist() == cache.blocks.rows[0] and cache.block_table[0, 2] == SCRATCH_BLOCK
    cache.fit(0, 3)
    assert len(cache.blocks.rows[0]) == 1 and cache.block_table[0, 1] == SCRATCH_BLOCK and len(cache.blocks.free) == 3
    cache.release(0)
    cache.release(1)
    assert sorted(cache.blocks.free) == [1, 2, 3, 4, 5] and cache.blocks.peak == 3
    assert (cache.block_table == SCRATCH_BLOCK).all()


def test_a_row_past_its_table_or_a_full_pool_gets_a_clear_error():
    cache = PagedKVCache.allocate(tiny_config(), 2, 8, torch.float32, CPU, PageConfig(block_size=4, n_blocks=3))
    with pytest.raises(UserError, match="rows hold 8"):
        cache.fit(0, 9)
    cache.fit(0, 8)
    with pytest.raises(UserError, match="all in use"):
        cache.fit(1, 8)
    with pytest.raises(UserError, match="power of two"):
        PageConfig(block_size=6)
    with pytest.raises(UserError, match="at least one block"):
        PageConfig(n_blocks=0)


def test_gathered_pages_hold_each_rows_slots_in_order():
    """The pool filled by hand, slot by slot through the table, read back by gather_pages."""
    H_kv, block, D = 2, 4, 3
    pool = torch.zeros(6, H_kv, block, D)
    table = torch.tensor([[4, 1, 0], [2, 5, 3]])
    expected = torch.randn(2, H_kv, 12, D)
    for row in range(2):
        for slot in range(12):
            pool[table[row, slot // block], :, slot % block] = expected[row, :, slot]
    assert torch.equal(gather_pages(pool, read_pages(table, 12, H_kv, block)), expected)
    assert torch.equal(gather_pages(pool, read_pages(table, 7, H_kv, block)), expected[:, :, :7])
    layers = torch.stack([pool, 2 * pool])  # every layer at once
    assert torch.equal(gather_pages(layers, read_pages(table, 9, H_kv, block)), torch.stack([expected, 2 * expected])[:, :, :, :9])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compaction_on_pages_moves_what_compaction_on_the_contiguous_cache_moves(dtype):
    torch.manual_seed(0)
    config = tiny_config()
    L, B, H_kv, S, D = config.n_layers, 2, config.n_kv_heads, 12, config.head_dim
    contiguous = KVCache.allocate(config, B, S, dtype, CPU)
    paged = PagedKVCache.allocate(config, B, S, dtype, CPU, PageConfig(block_size=4))
    for row in range(B):
        paged.fit(row, S)
    contiguous.k.copy_(torch.randn(L, B, H_kv, S, D))
    contiguous.v.copy_(torch.randn(L, B, H_kv, S, D))
    for row in range(B):
        for slot in range(S):
            paged.k[:, paged.blocks.rows[row][slot // 4], :, slot % 4] = contiguous.k[:, row, :, slot]
            paged.v[:, paged.blocks.rows[row][slot // 4], :, slot % 4] = contiguous.v[:, row, :, slot]
    prompt_length = torch.tensor([2, 3])
    keep = torch.randint(0, 6, (L, B, H_kv, 3)).sort(dim=-1).values  # ascending offsets, repeats allowed
    positions = torch.arange(S).expand(L, B, H_kv, S).clone()
    compact_in_place([contiguous.k, contiguous.v], prompt_length, keep, 6, 2)
    paged.compact([positions], prompt_length, keep, 6, 2)
    pages = read_pages(paged.block_table, S, H_kv, 4)
    assert torch.equal(gather_pages(paged.k, pages), contiguous.k)
    assert torch.equal(gather_pages(paged.v, pages), contiguous.v)
    assert torch.equal(positions[:, 0, :, 2:5], 2 + keep[:, 0])  # row 0: its kept offsets, after its prefix of 2


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_paged_cache_gives_the_tokens_of_the_contiguous_cache(kind, tiny_checkpoint):
    model = load_model(tiny_checkpoint(kind)[0], torch.float32, CPU)
    prompts = prompts_of([5, 23, 12])
    contiguous = generate(model, prompts, 24, eos_ids=frozenset())
    paged = generate(model, prompts, 24, eos_ids=frozenset(), options=RunOptions(pages=PageConfig(block_size=4)))
    assert paged.tokens == contiguous.tokens
    # Each row holds its own slots only (5/23/12 + 23 written), not the longest row's.
    assert paged.kv_peak_bytes < contiguous.kv_peak_bytes


def test_compiled_step_on_the_paged_cache_equals_eager(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen2")[0], torch.float32, CPU)
    prompts = prompts_of([7, 19, 3], seed=2)
    eager = generate(model, prompts, 16, eos_ids=frozenset()).tokens
    assert generate(model, prompts, 16, eos_ids=frozenset(), options=RunOptions(compile=True, pages=PageConfig(block_size=8))).tokens == eager


@pytest.mark.parametrize("compression", POLICY_RUNS, ids=lambda c: f"{c.policy}-prefix{c.prefix_budget}")
def test_every_kv_policy_on_pages_gives_the_tokens_of_the_contiguous_cache(compression, tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen2")[0], torch.float32, CPU)
    prompts = prompts_of([5, 30, 12], seed=3)
    contiguous = generate(model, prompts, 30, eos_ids=frozenset(), options=RunOptions(compression=compression))
    paged = generate(model, prompts, 30, eos_ids=frozenset(), options=RunOptions(compression=compression, pages=PageConfig(block_size=4)))
    assert contiguous.compression.compactions > 0
    assert paged.tokens == contiguous.tokens


def test_compaction_returns_exactly_the_blocks_left_empty(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    compression = CompressionConfig(**{**SMALL.__dict__, "policy": "beacon"})
    session = open_session(model, 2, 40, RunOptions(compression=compression, pages=PageConfig(block_size=2)), eos_ids=frozenset())
    cache = session.cache
    session.prefill(prompts_of([5, 8], seed=4))
    while True:
        held_before, free_before = [list(r) for r in cache.blocks.rows], len(cache.blocks.free)
        session.step()
        if session.policy.stats.compactions:
            break
    lengths = cache.length.tolist()  # prompt + budget + window after the compaction
    assert lengths == [5 + 6 + 3, 8 + 6 + 3]
    for row in range(2):
        assert cache.blocks.rows[row] == held_before[row][: -(-lengths[row] // 2)]  # the front blocks stay, in order
    freed = sum(len(before) for before in held_before) - cache.blocks.in_use
    assert freed > 0 and len(cache.blocks.free) == free_before + freed


def test_a_stopped_row_of_a_model_without_eos_keeps_feeding_a_real_token(tiny_checkpoint):
    """A row stopped by the host (a stop string) while the others go on: with no EOS id, the step
    once fed it -1, which no embedding row has."""
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    prompts = prompts_of([6, 9], seed=5)
    alone = generate(model, prompts[1:], 12, eos_ids=frozenset()).tokens[0]
    result = generate(model, prompts, 12, eos_ids=frozenset(), on_tokens=lambda tokens: [0])
    assert result.tokens[1] == alone and len(result.tokens[0]) == 1


@pytest.mark.parametrize("compression", [CompressionConfig(), *POLICY_RUNS[:2], POLICY_RUNS[-1]], ids=lambda c: c.policy)
def test_continuous_batching_answers_each_prompt_as_it_alone_would_be_answered(compression, tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    prompts = prompts_of([5, 40, 12, 3, 27, 9, 18], seed=6)
    requests = [Request(p, n) for p, n in zip(prompts, [10, 30, 5, 20, 8, 25, 12])]
    alone = [generate(model, [r.prompt], r.max_new_tokens, eos_ids=frozenset(), options=RunOptions(compression=compression)).tokens[0] for r in requests]
    finished = []
    def on_tokens(news):
        finished.extend(p for p, token in news.items() if token is None)

    run = serve(model, requests, 3, eos_ids=frozenset(), on_tokens=on_tokens, options=RunOptions(compression=compression, pages=PageConfig(block_size=4)))
    assert run.tokens == alone
    assert sorted(finished) == list(range(len(requests))) and finished != sorted(finished)  # they ended out of order
    assert run.most_rows == 3


def test_continuous_batching_with_the_compiled_step_and_a_small_pool(tiny_checkpoint):
    """A pool of 24 blocks, where the longest prompt may need 18: fewer rows run at once, the answers stay the same."""
    model = load_model(tiny_checkpoint("qwen3")[0], torch.float32, CPU)
    requests = [Request(p, n) for p, n in zip(prompts_of([5, 40, 12, 3, 27], seed=7), [10, 30, 5, 20, 8])]
    alone = [generate(model, [r.prompt], r.max_new_tokens, eos_ids=frozenset()).tokens[0] for r in requests]
    run = serve(model, requests, 4, eos_ids=frozenset(), options=RunOptions(pages=PageConfig(block_size=4, n_blocks=24), compile=True))
    assert run.tokens == alone
    assert run.most_rows < 4 and run.kv_peak_bytes <= run.kv_cache_bytes


def test_continuous_batching_stops_at_eos_and_on_request(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    prompts = prompts_of([8, 15, 6], seed=8)
    free = [generate(model, [p], 12, eos_ids=frozenset()).tokens[0] for p in prompts]
    eos = free[0][4]
    k = free[0].index(eos)
    run = serve(model, [Request(p, 12) for p in prompts], 2, eos_ids=frozenset({eos}), on_tokens=lambda news: [p for p in news if p == 2])
    assert run.tokens[0] == free[0][:k]
    assert run.tokens[2] == free[2][:1]  # stopped after its first token
    expected_1 = free[1][: free[1].index(eos)] if eos in free[1] else free[1]
    assert run.tokens[1] == expected_1


def test_every_block_is_back_in_the_pool_after_rows_leave(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    session = ContinuousSession(model, 3, 32, RunOptions(pages=PageConfig(block_size=4)), eos_ids=frozenset())
    pool = len(session.cache.blocks.free)
    for row, prompt in enumerate(prompts_of([5, 17, 9], seed=9)):
        session.admit(row, prompt)
    for _ in range(6):
        session.step()
    session.release(1)
    session.admit(1, prompts_of([3], seed=10)[0])
    session.step()
    for row in range(3):
        session.release(row)
    assert len(session.cache.blocks.free) == pool and sorted(session.cache.blocks.free) == list(range(1, pool + 1))


def test_bad_continuous_batches_get_clear_errors(tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)
    requests = [Request(p, 8) for p in prompts_of([5, 9])]
    with pytest.raises(UserError, match="max-batch must be >= 1"):
        serve(model, requests, 0, eos_ids=frozenset())
    with pytest.raises(UserError, match="pool has 2"):
        serve(model, requests, 2, eos_ids=frozenset(), options=RunOptions(pages=PageConfig(block_size=4, n_blocks=2)))
    with pytest.raises(UserError, match="at least one token"):
        serve(model, [Request([], 8)], 2, eos_ids=frozenset())
