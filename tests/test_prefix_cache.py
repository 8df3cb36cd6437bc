"""Prefix caching in the continuous batch: prompts that begin alike share the cached blocks and
prefill only the rest, and every answer is the one the request gets alone with nothing cached
(the reference). The pool's accounting is checked by hand: which blocks are shared, parked,
evicted least recently used first."""

import pytest
import torch

from compression.config import CompressionConfig
from engine.options import RunOptions
from engine.sampling import RowSampling, SamplingConfig
from engine.scheduler import ContinuousBatch, ContinuousSession, Request
from kv.paged import PageConfig
from weights.forms import load_model

CPU = torch.device("cpu")
BLOCK = 4


@pytest.fixture
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint("llama")[0], torch.float32, CPU)


def new_batch(model, rows: int, prefix_cache: bool = True, n_blocks: int | None = None, compression: CompressionConfig = CompressionConfig()):
    answers: dict = {}

    def on_tokens(news):
        for key, token in news.items():
            if token is not None:
                answers.setdefault(key, []).append(token)

    options = RunOptions(pages=PageConfig(block_size=BLOCK, n_blocks=n_blocks), prefix_cache=prefix_cache, compression=compression)
    session = ContinuousSession(model, rows, 96, options, eos_ids=frozenset(), sampling=RowSampling([SamplingConfig()] * rows, CPU, seeded=True))
    return ContinuousBatch(session, compression, on_tokens), answers


def run(batch: ContinuousBatch, requests: dict) -> None:
    for key, request in requests.items():
        batch.add(key, request)
    while batch.busy():
        batch.step()


def alone(model, request: Request) -> list[int]:
    batch, answers = new_batch(model, 1, prefix_cache=False)
    run(batch, {0: request})
    return answers[0]


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prompts_that_begin_alike_share_blocks_and_get_their_solo_answers(model):
    system = tokens(22, seed=1)  # 5 full blocks and 2 tokens
    first, second = Request(system + tokens(5, 2), 6), Request(system + tokens(9, 3), 8, SamplingConfig(repetition_penalty=1.8))
    batch, answers = new_batch(model, 2)
    run(batch, {0: first})
    run(batch, {1: second})
    assert batch.cached_tokens == {0: 0, 1: 20}  # the 5 full blocks of the common head
    assert answers[0] == alone(model, first) and answers[1] == alone(model, second)


def test_rows_running_at_once_hold_the_same_blocks(model):
    system = tokens(17, seed=4)
    batch, _ = new_batch(model, 3)
    batch.add(0, Request(system + [7], 30))
    batch.step()  # the first prompt's blocks are findable once it is prefilled
    batch.add(1, Request(system + [8, 9], 30))
    batch.add(2, Request(system, 30))  # its last token is always computed: 16 cached, not 17
    batch.step()
    rows = batch.session.cache.blocks.rows
    assert rows[0][:4] == rows[1][:4] == rows[2][:4]
    assert [batch.session.cache.blocks.holders[b] for b in rows[0][:4]] == [3, 3, 3, 3]
    assert batch.cached_tokens == {0: 0, 1: 16, 2: 16}
    assert len(set(rows[0] + rows[1] + rows[2])) == 4 + 3  # the shared head once, each row's own last block


def test_an_answer_is_cached_for_the_next_turn(model):
    """A chat's next prompt holds the last answer: the blocks the answer filled are found too."""
    prompt = tokens(10, seed=5)
    batch, answers = new_batch(model, 1)
    run(batch, {0: Request(prompt, 12)})
    history = prompt + answers[0]
    follow_up = Request(history + tokens(3, 6), 5)
    run(batch, {1: follow_up})
    fed = len(prompt) + len(answers[0]) - 1  # the last answer token was never fed
    assert batch.cached_tokens[1] == fed // BLOCK * BLOCK == 20
    assert answers[1] == alone(model, follow_up)


def test_parked_blocks_are_taken_last_and_least_recently_used_first(model):
    batch, _ = new_batch(model, 1, n_blocks=12)
    blocks = batch.session.cache.blocks
    a, b = tokens(9, seed=7), tokens(9, seed=8)
    run(batch, {0: Request(a, 2)})  # 3 blocks, 2 of them full of its prompt: parked when it leaves
    run(batch, {1: Request(b, 2)})
    assert len(blocks.prefix.parked) == 4 and len(blocks.free) == 8 and blocks.n_free == 12
    run(batch, {2: Request(tokens(30, seed=9), 1)})  # 8 blocks: the plain free ones, none parked
    assert len(blocks.prefix.lookup(a + [1])) == len(blocks.prefix.lookup(b + [1])) == 2
    assert len(blocks.free) == 1 and len(blocks.prefix.parked) == 4 + 7
    run(batch, {3: Request(tokens(12, seed=10), 1)})  # 3 blocks: the free one, then the two parked longest (a's)
    assert blocks.prefix.lookup(a + [1]) == [] and len(blocks.prefix.lookup(b + [1])) == 2
    run(batch, {4: Request(b + [1], 2)})
    assert batch.cached_tokens[4] == 8 and blocks.n_free == 12


def test_rows_under_a_kv_policy_share_nothing(model):
    policy = CompressionConfig(policy="streaming", budget=8, window=4, hysteresis=4)
    batch, _ = new_batch(model, 1, compression=policy)
    system = tokens(20, seed=11)
    run(batch, {0: Request(system + [5], 20), 1: Request(system + [6], 20)})
    assert batch.cached_tokens == {0: 0, 1: 0} and batch.session.cache.blocks.prefix is None


def test_off_nothing_is_cached(model):
    batch, _ = new_batch(model, 1, prefix_cache=False)
    system = tokens(20, seed=12)
    run(batch, {0: Request(system + [5], 2), 1: Request(system + [6], 2)})
    assert batch.cached_tokens == {0: 0, 1: 0}
