"""Sampling against a brute-force reference written here, on small vocabularies."""

import pytest
import torch

from engine.sampling import SamplingConfig, sample
from models.errors import UserError


def allowed_tokens(logits: list[float], temperature: float, top_k: int, top_p: float) -> set[int]:
    """The brute-force rule: rank tokens; keep the k best; then keep the shortest prefix of the
    ranking whose probability (renormalised over the k kept) reaches top_p."""
    ranked = sorted(range(len(logits)), key=lambda i: -logits[i])
    kept = ranked[:top_k] if top_k else ranked
    scaled = torch.tensor([logits[i] / temperature for i in kept])
    probs = scaled.softmax(0).tolist()
    allowed, mass = set(), 0.0
    for token, p in zip(kept, probs):
        allowed.add(token)
        mass += p
        if mass >= top_p:
            break
    return allowed


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.6), (5, 0.8), (1, 1.0), (0, 0.05)])
def test_samples_never_leave_the_allowed_set(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(4, 12) * 2  # [B, V], distinct values
    config = SamplingConfig(temperature=0.9, top_k=top_k, top_p=top_p)
    allowed = [allowed_tokens(row.tolist(), 0.9, top_k, top_p) for row in logits]
    seen = [set() for _ in range(4)]
    for _ in range(400):
        for row, token in enumerate(sample(logits, config).tolist()):
            seen[row].add(token)
    for row in range(4):
        assert seen[row] <= allowed[row]
        assert seen[row] == allowed[row] or len(allowed[row]) > 8  # every allowed token shows up


def test_sampling_frequencies_follow_the_softmax():
    torch.manual_seed(1)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20000, 4)
    counts = torch.bincount(sample(logits, SamplingConfig(temperature=1.0)), minlength=4).float()
    expected = torch.tensor([2.0, 1.0, 0.0, -1.0]).softmax(0)
    assert torch.allclose(counts / counts.sum(), expected, atol=0.015)


def test_temperature_zero_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    assert sample(logits, SamplingConfig(temperature=0.0, top_k=3, top_p=0.5)).tolist() == logits.argmax(-1).tolist()


def test_a_fixed_seed_reproduces():
    logits = torch.randn(3, 100)
    torch.manual_seed(5)
    a = [sample(logits, SamplingConfig(temperature=1.0, top_p=0.9)).tolist() for _ in range(5)]
    torch.manual_seed(5)
    b = [sample(logits, SamplingConfig(temperature=1.0, top_p=0.9)).tolist() for _ in range(5)]
    assert a == b


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(top_k=-2), "top-k must be >= 0"),
        (dict(top_p=0.0), "top-p must be in"),
        (dict(top_p=1.5), "top-p must be in"),
    ],
)
def test_bad_values_are_refused(kwargs, message):
    with pytest.raises(UserError, match=message):
        SamplingConfig(**kwargs)
