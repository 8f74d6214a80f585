"""GPU time of the drop-ins per case (``dequantize_4bit``, and ``matmul_4bit`` for the matmul
cases): the candidate, and in an A/B session the base beside it. The test measures; the gate
judges every case together when the session ends."""

from __future__ import annotations

import pytest

from harness.perf import catalog, policy

from .conftest import Replay, replay_into

pytestmark = pytest.mark.gpu

CASES = catalog.timed_cases()


@pytest.mark.benchmark(timer=Replay.clock, disable_gc=True, warmup=False)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_drop_in_speed(benchmark, perf_session, case):
    result = perf_session.measure_kernel(case)
    benchmark.extra_info.update(
        {
            "case": case.id,
            "size_class": policy.size_class(case.numel).name,
            "bytes_moved": case.bytes_moved(),
            "candidate_rounds_s": result.cand_rounds_s,
            "base_rounds_s": result.base_rounds_s,
            "outputs_agree": result.outputs_agree,
            "references_s": result.references_s,
            "copy_gbps": perf_session.copy_gbps,
            "wall_s": result.wall_s,
        }
    )
    replay_into(benchmark, result.cand_samples_s)
