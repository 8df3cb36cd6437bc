"""A continuous batch that takes requests as they arrive (what serve.py runs): requests joining
mid-run, each with its own sampling settings and seed, and cancelled ones, against each request
run alone."""

import pytest
import torch

from compression.config import CompressionConfig
from engine.options import RunOptions, generate
from kv.paged import PageConfig
from engine.sampling import RowSampling, SamplingConfig
from engine.scheduler import ContinuousBatch, ContinuousSession, Request
from errors import UserError
from weights.forms import load_model

CPU = torch.device("cpu")
SAMPLED = SamplingConfig(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02)


def prompts_of(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]


def new_batch(model, rows: int, n_slots: int = 64, n_blocks: int | None = None) -> tuple[ContinuousBatch, dict]:
    """A batch of seeded per-row sampling; its answers so far by key, and None once ended."""
    answers: dict = {}

    def on_tokens(news):
        for key, token in news.items():
            if token is None:
                answers[key] = (answers.get(key) or []) + [None]
            else:
                answers.setdefault(key, []).append(token)

    sampling = RowSampling([SamplingConfig()] * rows, CPU, seeded=True)
    session = ContinuousSession(model, rows, n_slots, RunOptions(pages=PageConfig(block_size=4, n_blocks=n_blocks)), eos_ids=frozenset(), sampling=sampling)
    return ContinuousBatch(session, CompressionConfig(), on_tokens), answers


def alone(model, request: Request) -> list[int]:
    """The request in a session of its own, one row."""
    batch, answers = new_batch(model, 1)
    batch.add(0, request)
    while batch.busy():
        batch.step()
    assert answers[0][-1] is None
    return answers[0][:-1]


@pytest.fixture
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint("qwen3")[0], torch.float32, CPU)


def test_requests_joining_mid_run_with_their_own_settings_get_their_solo_answers(model):
    prompts = prompts_of([5, 30, 12, 3, 21], seed=1)
    settings = [SamplingConfig(), SAMPLED, SamplingConfig(repetition_penalty=1.5), SamplingConfig(temperature=1.2), SAMPLED]
    requests = [Request(p, n, s, seed) for p, n, s, seed in zip(prompts, [9, 14, 6, 12, 10], settings, [0, 7, 0, 3, 8])]
    batch, answers = new_batch(model, 3)
    batch.add(0, requests[0])
    batch.add(1, requests[1])
    batch.step()
    batch.step()
    batch.add(2, requests[2])  # join while others run
    batch.step()
    batch.add(3, requests[3])
    batch.add(4, requests[4])  # waits for a row
    for _ in range(200):
        if not batch.busy():
            break
        batch.step()
    assert not batch.busy()
    assert [answers[key][:-1] for key in range(5)] == [alone(model, r) for r in requests]
    assert all(answers[key][-1] is None for key in range(5))
    greedy = generate(model, [prompts[0]], 9, eos_ids=frozenset()).tokens[0]
    assert answers[0][:-1] == greedy  # a greedy row is the engine's greedy answer
    assert answers[1][:-1] != alone(model, Request(prompts[1], 14, SAMPLED, seed=8))  # the seed matters


def test_a_cancelled_request_leaves_at_once_and_returns_its_blocks(model):
    batch, answers = new_batch(model, 2, n_blocks=40)
    prompts = prompts_of([9, 14, 6], seed=2)
    for key, prompt in enumerate(prompts):
        batch.add(key, Request(prompt, 20))
    for _ in range(3):
        batch.step()
    batch.cancel(1)  # running
    batch.cancel(2)  # may still wait; either way it never shows up again
    heard = {key: len(answers.get(key, [])) for key in range(3)}
    while batch.busy():
        batch.step()
    assert {key: len(answers.get(key, [])) for key in (1, 2)} == {1: heard[1], 2: heard[2]}
    assert answers[0][:-1] == alone(model, Request(prompts[0], 20))
    assert len(batch.session.cache.blocks.free) == batch.pool_blocks == 40


def test_a_penalised_request_in_a_row_that_sat_idle_is_its_solo_answer(model):
    """An idle row's steps feed a token; the penalty must not count it for the next request (it did)."""
    batch, answers = new_batch(model, 2)
    prompt = prompts_of([7], seed=3)[0]
    penalised = Request(prompt, 12, SamplingConfig(repetition_penalty=3.0))
    batch.add(0, Request(prompt, 3))  # leaves row 0 feeding its greedy third token, a likely one for the same prompt
    batch.add(1, Request(prompts_of([5], seed=5)[0], 16))
    for _ in range(8):
        batch.step()  # row 0 sits idle from step 2 on
    batch.add(2, penalised)
    while batch.busy():
        batch.step()
    assert answers[2][:-1] == alone(model, penalised)


def test_requests_that_cannot_fit_get_clear_errors(model):
    batch, _ = new_batch(model, 2, n_slots=32, n_blocks=6)
    with pytest.raises(UserError, match="more than a row's 32"):
        batch.add(0, Request([5] * 20, 20))
    with pytest.raises(UserError, match="pool has 6"):
        batch.add(0, Request([5] * 20, 8))
    with pytest.raises(UserError, match="at least one token"):
        batch.add(0, Request([], 8))
    assert not batch.busy()
