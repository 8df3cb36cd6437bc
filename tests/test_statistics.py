"""Wilson intervals and McNemar's exact test against hand-checked values and brute force."""

import itertools
import math

import pytest

from evaluation.statistics import holm, mcnemar, wilson


@pytest.mark.parametrize(
    "k, n, low, high",
    [
        (0, 10, 0.0, 0.2775),  # the closed form at k = 0: z^2 / (n + z^2)
        (10, 10, 0.7225, 1.0),
        (8, 10, 0.4902, 0.9433),
        (50, 100, 0.4038, 0.5962),
    ],
)
def test_wilson_interval_matches_hand_computed_values(k, n, low, high):
    got = wilson(k, n)
    assert got == pytest.approx((low, high), abs=5e-4)


def test_wilson_of_nothing_is_undefined():
    assert all(math.isnan(x) for x in wilson(0, 0))


def test_mcnemar_counts_the_discordant_pairs_and_gives_the_exact_binomial_p():
    a = [True] * 8 + [False] * 2 + [True] * 5 + [False] * 5
    b = [False] * 8 + [True] * 2 + [True] * 5 + [False] * 5
    test = mcnemar(a, b)
    assert (test.only_a, test.only_b) == (8, 2)
    assert test.p_value == pytest.approx(2 * (1 + 10 + 45) / 1024)  # 2 P(X <= 2), X ~ Bin(10, 1/2)
    assert mcnemar(b, a).p_value == test.p_value
    assert mcnemar(a, a).p_value == 1.0


def test_mcnemar_p_value_equals_enumerating_every_sign_assignment():
    """Under the null each discordant pair is A's or B's with probability 1/2: count the
    assignments at least as extreme as the observed one."""
    for only_a, only_b in [(0, 5), (3, 4), (7, 1), (6, 0)]:
        n = only_a + only_b
        observed = abs(only_a - only_b)
        extreme = sum(abs(2 * sum(signs) - n) >= observed for signs in itertools.product([0, 1], repeat=n))
        a = [True] * only_a + [False] * only_b
        b = [False] * only_a + [True] * only_b
        assert mcnemar(a, b).p_value == pytest.approx(min(1.0, extreme / 2**n))


def test_mcnemar_refuses_unpaired_outcomes():
    with pytest.raises(ValueError, match="same items"):
        mcnemar([True], [True, False])


def test_holm_adjusts_step_down_and_keeps_the_order():
    # Hand-checked: sorted p = 0.01, 0.02, 0.04 with m = 3 -> 0.03, 0.04, 0.04 (monotone).
    assert holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert holm([0.001]) == [0.001]
    assert holm([]) == []
