"""The gate's verdicts: per case from the paired ratio, per session from all cases together.

Per case (``policy`` holds the numbers):

    SLOWER     significant after Holm-Bonferroni over the session AND the estimated slowdown is
               above the case's size-class threshold
    FASTER     the same, the other way
    SAME       the per-case interval of the ratio lies inside +-threshold: proven unchanged
    NOT_SLOWER the interval's upper end lies inside +threshold, its lower end past -threshold:
               proven not slower (a non-inferiority test), maybe faster by less than is proven.
               Re-measured as AMBIGUOUS is, in case more rounds make it SAME or FASTER
    AMBIGUOUS  none of these: the data cannot tell yet. Re-measured with more rounds; what is
               still AMBIGUOUS after ``Schedule.max_rounds`` stays so

Per session, the exit status: 0 when every gated case is SAME, NOT_SLOWER or FASTER and the drift guard
passed; ``EXIT_JUDGE_CHANGED`` when the judge's or the base's files changed while the session ran
(``tree_guard``: nothing measured can be trusted then); ``EXIT_ERROR`` when a case could not be
measured at all; ``EXIT_OUTPUT_DIFFERS`` when an output is not what its case demands: the base's
bits for a dequantization, the fp64 reference's bound for a matmul (a timing of a different
computation proves nothing, whatever it says); ``EXIT_REGRESSION`` when any case is SLOWER or
drifted past the stored baseline; ``EXIT_UNDECIDED`` when nothing regressed but some case is still
AMBIGUOUS, so a red build says which of these it is.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from harness.perf import policy
from harness.perf.stats import PairedRatio, holm

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_ERROR = 3  # a case failed to measure: pytest reports the failure, the summary says so
EXIT_UNDECIDED = 6  # pytest's own codes stop at 5
EXIT_OUTPUT_DIFFERS = 7
EXIT_JUDGE_CHANGED = 8


class Verdict(enum.Enum):
    SLOWER = "SLOWER"
    FASTER = "FASTER"
    SAME = "SAME"
    NOT_SLOWER = "NOT_SLOWER"
    AMBIGUOUS = "AMBIGUOUS"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Judgement:
    case: str
    size_class: policy.SizeClass
    paired: PairedRatio
    p_adjusted: float
    interval: tuple[float, float]
    verdict: Verdict

    @property
    def ratio(self) -> float:
        return self.paired.ratio


def judge(evidence: Mapping[str, tuple[PairedRatio, policy.SizeClass]]) -> dict[str, Judgement]:
    """Verdicts for every case of a session at once (the Holm adjustment needs them all)."""
    adjusted = holm({case: paired.p_value() for case, (paired, _) in evidence.items()})
    out = {}
    for case, (paired, cls) in evidence.items():
        band = math.log1p(cls.threshold)  # symmetric in log space: +1% slower is 1/1.01 faster
        low, high = paired.interval(policy.CASE_CONFIDENCE)
        estimate = math.log(paired.ratio)
        significant = adjusted[case] < policy.FAMILY_ALPHA
        if significant and estimate > band:
            verdict = Verdict.SLOWER
        elif significant and estimate < -band:
            verdict = Verdict.FASTER
        elif low > 0 and -band <= math.log(low) and math.log(high) <= band:
            verdict = Verdict.SAME
        elif math.log(high) <= band:  # what a regression gate must know; a speedup it need not prove
            verdict = Verdict.NOT_SLOWER
        else:
            verdict = Verdict.AMBIGUOUS
        out[case] = Judgement(case, cls, paired, adjusted[case], (low, high), verdict)
    return out


def rounds_to_add(judgement: Judgement, schedule: policy.Schedule = policy.SCHEDULE) -> int:
    """How many more rounds an AMBIGUOUS or NOT_SLOWER case gets (0 when it is decided or out of rounds)."""
    if judgement.verdict not in (Verdict.AMBIGUOUS, Verdict.NOT_SLOWER):
        return 0
    have = judgement.paired.rounds
    return max(0, min(have * (schedule.remeasure_factor - 1), schedule.max_rounds - have))


def exit_status(
    judgements: Mapping[str, Judgement], drifted: int = 0, errors: int = 0, differing: int = 0, judge_changed: int = 0
) -> int:
    """The session's exit status; ``differing`` counts the cases whose outputs are wrong,
    ``judge_changed`` the judge's files that changed during the session."""
    verdicts = [j.verdict for j in judgements.values()]
    if judge_changed:
        return EXIT_JUDGE_CHANGED
    if errors:
        return EXIT_ERROR
    if differing:
        return EXIT_OUTPUT_DIFFERS
    if drifted or Verdict.SLOWER in verdicts:
        return EXIT_REGRESSION
    if Verdict.AMBIGUOUS in verdicts:
        return EXIT_UNDECIDED
    return EXIT_OK


def counts(judgements: Mapping[str, Judgement]) -> dict[str, int]:
    out: dict[str, int] = {}
    for j in judgements.values():
        out[str(j.verdict)] = out.get(str(j.verdict), 0) + 1
    return dict(sorted(out.items()))
