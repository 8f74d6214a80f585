"""Paired statistics of an A/B session: candidate over base, round by round.

Each round measures the base and the candidate back to back on the same GPU (ABBA: base,
candidate, candidate, base), so a slower or faster machine, or clock drift during the session,
scales both sides of the round alike and cancels in the round's ratio. A case's evidence is the
list of per-round log ratios ``log(candidate / base)``; its estimate is their mean, with a
Student-t interval (the rounds are few, and independent of each other).

Across a session many cases are tested at once; ``holm`` adjusts their p-values so that the chance
of *any* false SLOWER in a session stays at the family-wise level, not at that level per case.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scipy import stats as _scipy_stats


@dataclass(frozen=True)
class PairedRatio:
    """Candidate/base time ratio of one case from its per-round log ratios."""

    log_ratios: tuple[float, ...]

    @classmethod
    def from_rounds(cls, base: Sequence[float], candidate: Sequence[float]) -> PairedRatio:
        """From per-round times of each side (same length, round i of one paired with round i of
        the other)."""
        if len(base) != len(candidate):
            raise ValueError(f"{len(base)} base rounds but {len(candidate)} candidate rounds")
        if any(t <= 0 for t in (*base, *candidate)):
            raise ValueError("round times must be positive")
        return cls(tuple(math.log(c / b) for b, c in zip(base, candidate, strict=True)))

    @property
    def rounds(self) -> int:
        return len(self.log_ratios)

    @property
    def ratio(self) -> float:
        """Point estimate of candidate / base (geometric mean of the round ratios)."""
        return math.exp(statistics.fmean(self.log_ratios))

    @property
    def standard_error(self) -> float:
        """Standard error of the mean log ratio (relative, for small values)."""
        if self.rounds < 2:
            return math.inf
        return statistics.stdev(self.log_ratios) / math.sqrt(self.rounds)

    def interval(self, confidence: float) -> tuple[float, float]:
        """Two-sided ``confidence`` interval of candidate / base."""
        se = self.standard_error
        if not math.isfinite(se):
            return 0.0, math.inf
        half = float(_scipy_stats.t.ppf(0.5 + confidence / 2, self.rounds - 1)) * se
        mean = statistics.fmean(self.log_ratios)
        return math.exp(mean - half), math.exp(mean + half)

    def p_value(self) -> float:
        """Two-sided p-value of "candidate and base take the same time" (paired t-test)."""
        se = self.standard_error
        mean = statistics.fmean(self.log_ratios)
        if not math.isfinite(se):
            return 1.0
        if se == 0.0:  # every round gave the same ratio: decided by its sign alone
            return 1.0 if mean == 0.0 else 0.0
        return float(2 * _scipy_stats.t.sf(abs(mean) / se, self.rounds - 1))


def holm(p_values: Mapping[str, float]) -> dict[str, float]:
    """Holm-Bonferroni adjusted p-values: rejecting every case whose adjusted value is below
    alpha keeps the family-wise error rate at alpha, whatever the dependence between cases."""
    order = sorted(p_values, key=p_values.__getitem__)
    m, running, adjusted = len(order), 0.0, {}
    for rank, case in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[case]))
        adjusted[case] = running
    return adjusted


def relative_spread(values: Sequence[float]) -> float:
    """Largest relative distance of any value from their median (0 for fewer than two)."""
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    return max(abs(v / mid - 1) for v in values)


def rate_bounds(hits: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """One-sided Clopper-Pearson bounds (lower, upper) on a rate seen as ``hits`` of ``trials``,
    each holding at ``confidence``: what a count of gate sessions says about the gate's rate (for
    unchanged code the upper bound on its false alarms, for a planted slowdown the lower bound on
    its detections)."""
    if not 0 <= hits <= trials or trials == 0:
        raise ValueError(f"{hits} hits of {trials} trials")
    alpha = 1 - confidence
    lower = 0.0 if hits == 0 else float(_scipy_stats.beta.ppf(alpha, hits, trials - hits + 1))
    upper = 1.0 if hits == trials else float(_scipy_stats.beta.ppf(confidence, hits + 1, trials - hits))
    return lower, upper
