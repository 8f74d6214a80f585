"""The perf session's cases: every op's (each op's ``perf_cases`` in
``harness.correctness.op_checks``) and the end-to-end step. The judge reads this list from the base
revision.
"""

from __future__ import annotations

from harness.correctness import op_checks
from harness.correctness.op_checks.unit import PerfCase


def timed_cases() -> list[PerfCase]:
    """Every case a perf session times, of every op (``op_checks.CHECKS``, an entry for each op of
    ``harness.runtime.ops.OPS``)."""
    return [case for checks in op_checks.CHECKS.values() for case in checks.perf_cases()]


# The end-to-end case: one QLoRA training step (forward, loss, backward) of a 2-layer
# Llama-3.3-70B-sized model with the patch applied; report-only (see policy and harness/perf/README.md).
E2E_STEP = "e2e-qlora-llama-3.3-70b-2layers-step"
