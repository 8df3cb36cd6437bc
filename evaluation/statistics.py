"""How sure a share is, and whether two policies differ on the same items.

- Wilson's score interval for a binomial share (it stays inside [0, 1] and behaves at 0/n and n/n,
  where the normal approximation does not).
- Holm's step-down adjustment, for a table of many such tests read at once.
- McNemar's exact test for paired outcomes: only the items where the two policies disagree count;
  under the null hypothesis each such item is a fair coin, so the p-value is a two-sided binomial tail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Z_95 = 1.959963984540054


def wilson(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The 95% Wilson score interval of successes / n; (nan, nan) when n is 0."""
    if n == 0:
        return float("nan"), float("nan")
    share = successes / n
    centre = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def interval_text(successes: int, n: int) -> str:
    """The interval as a table shows it: "[41%, 60%]"."""
    low, high = wilson(successes, n)
    return f"[{low:.0%}, {high:.0%}]"


@dataclass(frozen=True)
class Paired:
    only_a: int  # items A got right and B wrong
    only_b: int
    p_value: float  # McNemar's exact two-sided test


def mcnemar(a: list[bool], b: list[bool]) -> Paired:
    """A against B on the same items, in the same order."""
    if len(a) != len(b):
        raise ValueError(f"paired outcomes need the same items: {len(a)} against {len(b)}")
    only_a = sum(x and not y for x, y in zip(a, b))
    only_b = sum(y and not x for x, y in zip(a, b))
    n, k = only_a + only_b, min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n  # P(X <= k), X ~ Binomial(n, 1/2)
    return Paired(only_a, only_b, min(1.0, 2 * tail))


def holm(p_values: list[float]) -> list[float]:
    """Holm-adjusted p-values, in the given order: the k-th smallest is multiplied by (m - k + 1),
    and no adjusted value is below one of a smaller p. Rejecting where adjusted < 0.05 keeps the
    chance of any false rejection in the whole family under 5%."""
    m = len(p_values)
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
