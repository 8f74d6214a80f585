"""The A/B gate end to end on a GPU: unchanged code is not SLOWER, a planted slowdown is.

Both sessions run on a few cases only (a large and a small weight, one fp32), through the same
``PerfSession`` the perf session uses; the planted copy is built in a temporary tree
(``tests/perf/planted.py``). The false-alarm and detection *rates* are measured over many
sessions by ``python -m tests.perf.gate_rates`` (numbers in kernels/NOTES.md).
"""

from __future__ import annotations

import pytest

from harness.perf import catalog, gate
from harness.perf.gate import Verdict
from harness.perf.session import JUDGE_ROOT, PerfSession
from tests.perf import planted

pytestmark = pytest.mark.gpu

CASE_IDS = (
    "llama-3.3-70b.gate_proj-nf4-fp16-bs64-nested",
    "qwen3-32b.k_proj-nf4-bf16-bs64-plain",
    "qwen3-32b.k_proj-nf4-fp32-bs64-plain",
)


def _session(candidate, run_seed) -> PerfSession:
    cases = [c for c in catalog.kernel_cases() if c.id in CASE_IDS]
    session = PerfSession(candidate, JUDGE_ROOT, seed=run_seed, references=False)
    try:
        for case in cases:
            session.measure_kernel(case)
        session.settle()
    finally:
        session.close()
    return session


def _verdicts(candidate, run_seed) -> dict[str, Verdict]:
    return {cid: j.verdict for cid, j in _session(candidate, run_seed).judgements.items()}


def test_unchanged_copy_is_not_slower(cuda, tmp_path, run_seed):
    verdicts = _verdicts(planted.copy_checkout(JUDGE_ROOT, tmp_path / "same"), run_seed)
    assert set(verdicts) == set(CASE_IDS)
    assert Verdict.SLOWER not in verdicts.values(), verdicts


def test_planted_slowdown_is_slower_everywhere(cuda, tmp_path, run_seed):
    verdicts = _verdicts(planted.build(JUDGE_ROOT, tmp_path / "slow", stretch=0.05), run_seed)
    assert verdicts == dict.fromkeys(CASE_IDS, Verdict.SLOWER)


def test_fp32_only_slowdown_is_slower_only_there(cuda, tmp_path, run_seed):
    verdicts = _verdicts(planted.build(JUDGE_ROOT, tmp_path / "fp32", stretch=0.10, only_fp32=True), run_seed)
    assert {c for c, v in verdicts.items() if v is Verdict.SLOWER} == {CASE_IDS[2]}, verdicts


def test_a_candidate_whose_output_differs_fails_the_gate_for_it(cuda, tmp_path, run_seed):
    session = _session(planted.build_wrong_output(JUDGE_ROOT, tmp_path / "wrong"), run_seed)
    differing = [cid for cid, r in session.kernel.items() if r.outputs_agree is False]
    assert sorted(differing) == sorted(CASE_IDS)
    assert gate.exit_status(session.judgements, differing=len(differing)) == gate.EXIT_OUTPUT_DIFFERS
