"""What the perf gate calls a regression, and how hard it looks: data, kept apart from the code.

Two different questions, two different numbers:

* *Practical*: how large a slowdown is worth failing a pull request for. Per size class, because
  the smaller the weight the more of its time is launch ramp and tail, and the more it moves
  between identical runs. ``threshold`` below.
* *Statistical*: how sure the gate must be that a slowdown is real. One family-wise error rate for
  the whole session (Holm-Bonferroni over every gated case), and one per-case confidence for
  proving a case unchanged.

The numbers are justified in ``kernels/NOTES.md`` ("The A/B perf gate") with the A/A and planted
slowdown sessions they came from. The judge always reads this module from the base revision.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class SizeClass:
    """Weights of at least ``min_elements`` elements (and below the next class up)."""

    name: str
    min_elements: int
    # Smallest candidate/base slowdown that fails the gate (a fraction: 0.01 is 1%).
    threshold: float
    # Smallest tolerance against the pinned baseline (the drift guard); the baseline's own
    # between-session spread can widen it (``drift_tolerance``).
    drift_floor: float


# Largest first. Large: every MLP projection of the paper's models and the big attention ones.
SIZE_CLASSES = (
    SizeClass("large", 40_000_000, threshold=0.010, drift_floor=0.025),
    SizeClass("mid", 16_000_000, threshold=0.015, drift_floor=0.04),
    SizeClass("small", 0, threshold=0.025, drift_floor=0.08),
)

# Chance that a session of unchanged code calls any case SLOWER (or FASTER), all cases together.
FAMILY_ALPHA = 0.01
# A case is SAME only when this two-sided interval of its ratio lies inside +-threshold.
CASE_CONFIDENCE = 0.99
# The drift tolerance is at least this many times the baseline's between-session spread.
DRIFT_SPREAD_FACTOR = 3.0


class Isolation(enum.Enum):
    """Where the sides are measured: each in a process of its own (neither side's code can reach
    the other's timing), or both in one process (the same CUDA context, so the same mappings of
    the judge's buffers). The judge is a process apart either way."""

    PER_SIDE = "per-side"
    SHARED = "shared"


# One process for both sides. A process per side was measured on H100s (kernels/NOTES.md, "The
# sides' processes") to shift whole sessions by about 1%, up to 3.6% on small weights, either
# way: FASTER verdicts on unchanged kernels, an undecided session. It keeps each side's code out
# of the other's timing, but not a side's code out of its own, so it buys no protection against
# a candidate written to cheat (.github/SECURITY.md).
ISOLATION = Isolation.SHARED
# Where a kernel's module lands in the GPU's memory moves its time: the same cubin loaded as six
# modules in one process timed up to 0.75% apart, instance by instance, the same pattern in a second
# process (H100, the o weight 8192x8192 at 1 and 8 rows; kernels/NOTES.md, "Where a module lands").
# In one shared process the sides' modules always land in the same order, so one side carried a fixed
# offset: unchanged code was SLOWER on H100s (o at one row, +1.1%, in 2 of 2 sessions). So an A/B
# session shares its sides between this many processes, the first loading the base's modules first,
# the next the candidate's, rounds alternating between them two at a time: each side is timed in
# both places, and the offset one process gives a side's ratio the other takes back.
SHARED_PROCESSES = 2

# No timed call can move its bytes faster than the same session's device copy; one that seems to
# by more than this factor did its work outside the timed region, and its batch is rejected.
ROOFLINE_MARGIN = 1.10


@dataclass(frozen=True)
class Schedule:
    """How a case is measured: ``rounds`` ABBA rounds of ``samples`` cold-L2 launches per batch;
    an AMBIGUOUS case gets ``remeasure_factor`` times its rounds again, up to ``max_rounds``."""

    rounds: int = 8
    samples: int = 12
    remeasure_factor: int = 2
    # 32 left a case of unchanged code undecided in two of three full sessions on fresh H100s
    # (qwen3-32b q_proj fp16 bs128 nested: 0.9972 [0.9897, 1.0047] and [0.9901, 1.0043], against
    # SAME's 1/1.01 .. 1.01); twice the rounds narrow an interval by about 1.4x (kernels/NOTES.md).
    max_rounds: int = 64
    # End-to-end steps: wall time per step, ``e2e_steps`` steps per batch.
    e2e_rounds: int = 6
    e2e_steps: int = 3


SCHEDULE = Schedule()


def size_class(numel: int) -> SizeClass:
    return next(c for c in SIZE_CLASSES if numel >= c.min_elements)


def drift_tolerance(cls: SizeClass, spread: float) -> float:
    return max(cls.drift_floor, DRIFT_SPREAD_FACTOR * spread)
