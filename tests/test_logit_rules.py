"""A served request's penalties, logit bias and log-probabilities, in a continuous batch where
requests join mid-run, against transformers' model run alone over the answer (the reference
distribution) and the OpenAI API's definitions written out by hand."""

import pytest
import torch

from compression.config import CompressionConfig
from engine.logit_rules import LogitRules
from engine.options import RunOptions
from engine.sampling import RowSampling, SamplingConfig
from engine.scheduler import ContinuousBatch, ContinuousSession, Request
from errors import UserError
from kv.paged import PageConfig
from weights.forms import load_model

CPU = torch.device("cpu")


def run_batch(model, requests: list[Request], rows: int = 2) -> tuple[dict, dict]:
    """Every request through one batch of `rows` rows (the later ones join as rows free up):
    their tokens, and the log-probabilities delivered with them, by request index."""
    answers: dict = {i: [] for i in range(len(requests))}
    logprobs: dict = {i: [] for i in range(len(requests))}
    batch: ContinuousBatch

    def on_tokens(news):
        tokens = {key: token for key, token in news.items() if token is not None}
        wanting = {key: token for key, token in tokens.items() if requests[key].rules.top_logprobs is not None}
        for key, read in batch.logprobs(wanting).items():
            logprobs[key].append(read)
        for key, token in tokens.items():
            answers[key].append(token)

    sampling = RowSampling([SamplingConfig()] * rows, CPU, seeded=True)
    session = ContinuousSession(model, rows, 64, RunOptions(pages=PageConfig(block_size=4)), eos_ids=frozenset(), sampling=sampling)
    batch = ContinuousBatch(session, CompressionConfig(), on_tokens)
    for i, request in enumerate(requests):
        batch.add(i, request)
    while batch.busy():
        batch.step()
    return answers, logprobs


@pytest.fixture
def models(tiny_checkpoint):
    folder, reference = tiny_checkpoint("llama")
    return load_model(folder, torch.float32, CPU), reference.eval()


def reference_logits(reference, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """transformers' logits [len(answer), V] at the positions that predicted each answer token."""
    ids = torch.tensor([prompt + answer])
    return reference(ids).logits[0, len(prompt) - 1 : len(prompt) + len(answer) - 1].float()


def test_logprobs_are_the_models_distribution_for_the_rows_that_ask(models):
    model, reference = models
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (7, 19, 4)]
    requests = [
        Request(prompts[0], 6, rules=LogitRules(logit_bias=((50, 4.0),), top_logprobs=5)),  # biased: its logprobs stay raw
        Request(prompts[1], 5),  # asks for none, in the same steps
        Request(prompts[2], 7, SamplingConfig(temperature=1.3), seed=4, rules=LogitRules(top_logprobs=0)),  # joins later, sampled
    ]
    answers, logprobs = run_batch(model, requests)
    assert logprobs[1] == []
    for i in (0, 2):
        expected = reference_logits(reference, prompts[i], answers[i]).log_softmax(-1)
        for t, (token, read) in enumerate(zip(answers[i], logprobs[i])):
            assert read.token == token
            assert read.logprob == pytest.approx(expected[t, token].item(), abs=1e-4)
            best = expected[t].topk(5)
            wanted = requests[i].rules.top_logprobs
            assert [tok for tok, _ in read.top] == best.indices[:wanted].tolist()
            assert [lp for _, lp in read.top] == pytest.approx(best.values[:wanted].tolist(), abs=1e-4)


@pytest.mark.parametrize("presence, frequency", [(0.3, 0.0), (0.0, 0.7), (0.4, 0.7)])
def test_penalties_and_bias_follow_the_openai_definition(models, presence, frequency):
    """Greedy under the penalties and a bias, against the definition: each logit minus
    `frequency` per time its token was generated, minus `presence` if it was, plus its bias."""
    model, reference = models
    prompt = [5, 17, 17, 9, 40, 2]
    bias = {17: 2.5, 40: -1.0, 101: 1.5}
    rules = LogitRules(presence_penalty=presence, frequency_penalty=frequency, logit_bias=tuple(bias.items()))
    answers, _ = run_batch(model, [Request([3, 4], 4), Request(prompt, 16, rules=rules)])

    expected: list[int] = []
    for _ in range(16):
        logits = reference(torch.tensor([prompt + expected])).logits[0, -1].float()
        for token in set(expected):
            logits[token] -= frequency * expected.count(token) + presence
        for token, b in bias.items():
            logits[token] += b
        expected.append(int(logits.argmax()))
    assert answers[1] == expected
    assert max(expected.count(t) for t in expected) >= 3  # some token came back under the penalty, which counts


def test_a_large_bias_forces_a_token_and_the_next_request_in_the_row_is_unbiased(models):
    model, reference = models
    forced = LogitRules(logit_bias=((123, 100.0),))
    answers, _ = run_batch(model, [Request([8, 9, 10], 5, rules=forced), Request([8, 9, 10], 5)], rows=1)
    assert answers[0] == [123] * 5
    greedy = reference_logits(reference, [8, 9, 10], answers[1]).argmax(-1).tolist()
    assert answers[1] == greedy and answers[1] != [123] * 5


def test_a_bias_on_a_token_outside_the_vocabulary_is_one_clear_error(models):
    model, _ = models
    with pytest.raises(UserError, match="logit_bias: token id 99999 is not in the vocabulary"):
        run_batch(model, [Request([1, 2], 2, rules=LogitRules(logit_bias=((99999, 1.0),)))])


def test_more_top_logprobs_than_the_api_allows_is_one_clear_error():
    with pytest.raises(UserError, match="top_logprobs must be in 0..20"):
        LogitRules(top_logprobs=21)


class OnlyThese:
    """A hand-written token mask: these tokens and no others, whatever came before."""

    def __init__(self, allowed: set[int]):
        self.allowed, self.seen = allowed, []

    def fill(self, bitmask, row):
        bitmask[row] = 0
        for token in self.allowed:
            bitmask[row, token // 32] |= 1 << (token % 32)

    def accept(self, token):
        self.seen.append(token)


def test_a_token_mask_allows_only_its_tokens_and_hears_each_one(models):
    model, reference = models
    mask = OnlyThese({7, 40, 261})
    sampled = Request([5, 6, 7], 12, SamplingConfig(temperature=1.5), seed=2, rules=LogitRules(top_logprobs=0), mask=mask)
    answers, logprobs = run_batch(model, [Request([9, 9], 6), sampled])
    assert set(answers[1]) <= {7, 40, 261} and len(set(answers[1])) > 1 and mask.seen == answers[1]
    raw = reference_logits(reference, [5, 6, 7], answers[1]).log_softmax(-1)
    assert [r.logprob for r in logprobs[1]] == pytest.approx([raw[t, tok].item() for t, tok in enumerate(answers[1])], abs=1e-4)  # still the model's own
    greedy = reference_logits(reference, [9, 9], answers[0]).argmax(-1).tolist()
    assert answers[0] == greedy  # the row beside it is unmasked
