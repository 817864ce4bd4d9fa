"""The statistics of the proof, all from scipy.stats (no hand-written distributions).

* A rate k of n gets the exact Clopper-Pearson interval (`binomtest(...).proportion_ci(method="exact")`):
  two-sided for display, and one-sided upper at the confidence level for the side that should be
  clean. For 0 of n that bound is 1 - alpha**(1/n); the *rule of three*, 3/n, is its familiar
  approximation at 95 % and is the headline number ("zero of 1000, so below 0.3 %").
* The difference between two rates is Fisher's exact test on the 2x2 table
  [[k_stock, n_stock - k_stock], [k_fixed, n_fixed - k_fixed]]: one-sided (alternative "greater":
  the stock rate is higher) and two-sided.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rate:
    k: int
    n: int

    def __post_init__(self):
        if self.n < 0 or not 0 <= self.k <= max(self.n, 0):
            raise ValueError(f"a rate needs 0 <= k <= n, got {self.k} of {self.n}")

    @property
    def value(self) -> float | None:
        return self.k / self.n if self.n else None

    def interval(self, confidence: float = 0.95) -> tuple[float, float] | None:
        """Two-sided exact (Clopper-Pearson) interval; None when n is 0."""
        if not self.n:
            return None
        from scipy.stats import binomtest

        ci = binomtest(self.k, self.n).proportion_ci(confidence_level=confidence, method="exact")
        return float(ci.low), float(ci.high)

    def upper_bound(self, confidence: float = 0.95) -> float | None:
        """One-sided exact upper bound on the rate; None when n is 0."""
        if not self.n:
            return None
        from scipy.stats import binomtest

        ci = binomtest(self.k, self.n, alternative="less").proportion_ci(confidence_level=confidence, method="exact")
        return float(ci.high)

    def rule_of_three(self) -> float | None:
        """3/n, the 95 % headline bound for zero events; None unless k is 0 and n > 0."""
        return 3.0 / self.n if self.n and self.k == 0 else None


@dataclass(frozen=True)
class FisherResult:
    odds_ratio: float | None
    p_one_sided: float | None  # H1: the first rate is higher than the second
    p_two_sided: float | None


def fisher(first: Rate, second: Rate) -> FisherResult:
    """Fisher's exact test of first vs second. All None when either side has no units."""
    if not first.n or not second.n:
        return FisherResult(None, None, None)
    from scipy.stats import fisher_exact

    table = [[first.k, first.n - first.k], [second.k, second.n - second.k]]
    odds, p_greater = fisher_exact(table, alternative="greater")
    _, p_two = fisher_exact(table, alternative="two-sided")
    odds = float(odds)
    return FisherResult(odds if odds == odds else None, float(p_greater), float(p_two))
