"""The A/B gate end to end on a GPU: unchanged code is not SLOWER, a planted slowdown is, and a
candidate that attacks the gate instead of being faster never ends green and FASTER.

The sessions run on a few cases only (a large and a small weight, one fp32; a dequantization and
a matmul for the attacks), through the same ``PerfSession`` the perf session uses; the planted and
attacking copies are built in temporary trees (``tests/perf/planted.py``,
``tests/perf/adversarial.py``). The false-alarm and detection *rates* are measured over many
sessions by ``python -m tests.perf.gate_rates`` (numbers in kernels/NOTES.md).
"""

from __future__ import annotations

import pytest
import torch

from harness import settings
from harness.perf import catalog, gate, policy, stage
from harness.perf.gate import Verdict
from harness.perf.session import JUDGE_ROOT, PerfSession
from tests.perf import adversarial, planted

pytestmark = pytest.mark.gpu

CASE_IDS = (
    "llama-3.3-70b.gate_proj-nf4-fp16-bs64-nested",
    "qwen3-32b.k_proj-nf4-bf16-bs64-plain",
    "qwen3-32b.k_proj-nf4-fp32-bs64-plain",
)


ATTACK_CASE_IDS = (
    "qwen3-32b.k_proj-nf4-bf16-bs64-nested",
    "matmul-llama-3.3-70b.k_proj-nf4-bf16-bs64-nested-m1",
)


def _cases(case_ids) -> list:
    return [c for c in catalog.timed_cases() if c.id in case_ids]


@pytest.fixture(autouse=True, scope="module")
def _compiled():
    """Every kernel these sessions run, compiled once into this machine's cache, which each
    session copies into its sides' own caches: the sessions then time instead of compiling."""
    if not torch.cuda.is_available():
        return
    import harness

    device = torch.device("cuda", torch.cuda.current_device())
    for case in _cases(CASE_IDS + ATTACK_CASE_IDS):
        st = stage.Stage(case.spec(0), device, torch.empty(1, dtype=torch.uint8, device=device))
        st.lent_to("warm").call(harness)()
    torch.cuda.synchronize(device)


# The perf report's directory in the judge's checkout: the suite's perf modules (tests/perf) write
# their report there while these sessions run beside them, as a perf session's own output does.
REPORT_DIR = JUDGE_ROOT / settings.PERF_OUT.default


def _session(candidate, run_seed, base=JUDGE_ROOT, case_ids=CASE_IDS, isolation=policy.ISOLATION) -> PerfSession:
    cases = _cases(case_ids)
    session = PerfSession(
        candidate, base, seed=run_seed, references=False, isolation=isolation, output_dirs=(REPORT_DIR,)
    )
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
    assert _status(session) == gate.EXIT_OUTPUT_DIFFERS


def _status(session: PerfSession) -> int:
    differing = sum(r.outputs_agree is False for r in session.kernel.values())
    return gate.exit_status(session.judgements, differing=differing, judge_changed=len(session.judge_changed))


# What each attack must end in, and how the sides are measured for it: the timer's checks catch
# the first two; a process for each side keeps the third from reaching the base (neither the status
# nor the verdicts are asserted there: sessions of a process per side shift by about 1%,
# kernels/NOTES.md, "The sides' processes", so an unchanged candidate can end SLOWER or FASTER on
# a small case; what is asserted is that no base carries the attack's 100 µs a call, which on the
# attack's cases of a few µs reads as a ratio under 0.2); the judge's process, apart from every
# side's, the fourth; the judge's file guard catches the fifth; the sixth slows only its own
# dequantization (each side's kernel sources are fixed as it loads), which the gate calls SLOWER.
# The seventh is the residual risk .github/SECURITY.md states (a side's code runs where its timing
# is taken): asserted to still win, FASTER and green, so that this test fails the day the gate
# catches it and the residual's line changes with it.
# Candidate over base: a base slowed by the reach-base attack's 100 µs a call reads under 0.2 on the
# attack's cases; the sides' processes shift by a few percent.
REACH_RATIO_FLOOR = 0.5
RESIDUAL = "residual"
ATTACK_OUTCOMES = {
    "memoise": (gate.EXIT_OUTPUT_DIFFERS, policy.ISOLATION),
    "side-stream": (gate.EXIT_OUTPUT_DIFFERS, policy.ISOLATION),
    "reach-base": (None, policy.Isolation.PER_SIDE),
    "reach-judge": (gate.EXIT_OK, policy.ISOLATION),
    "edit-judge": (gate.EXIT_JUDGE_CHANGED, policy.ISOLATION),
    "redirect": (gate.EXIT_REGRESSION, policy.ISOLATION),
    "rescale": (RESIDUAL, policy.ISOLATION),
}


@pytest.mark.parametrize("attack", adversarial.ATTACKS)
def test_an_attack_on_the_gate_ends_red_or_changes_nothing(cuda, tmp_path, run_seed, attack):
    base = planted.copy_checkout(JUDGE_ROOT, tmp_path / "base")  # the copy an attack may write into
    expected, isolation = ATTACK_OUTCOMES[attack]
    candidate = adversarial.build(JUDGE_ROOT, tmp_path / attack, attack)
    session = _session(candidate, run_seed, base, ATTACK_CASE_IDS, isolation)
    verdicts = {cid: j.verdict for cid, j in session.judgements.items()}
    assert set(verdicts) == set(ATTACK_CASE_IDS)
    status = _status(session)
    if expected is None:  # the base out of reach: no ratio carries the attack's slowdown of it
        ratios = {cid: j.ratio for cid, j in session.judgements.items()}
        assert min(ratios.values()) > REACH_RATIO_FLOOR, ratios
    elif expected == RESIDUAL:  # rescaled by 0.97 / 1.08: every case reads about 10% faster, green
        assert status == gate.EXIT_OK and set(verdicts.values()) == {Verdict.FASTER}, (status, verdicts)
    else:
        assert status != gate.EXIT_OK or Verdict.FASTER not in verdicts.values(), verdicts  # never a green FASTER
        assert status == expected, (verdicts, session.judge_changed)
    if expected == gate.EXIT_OK:
        assert set(verdicts.values()) == {Verdict.SAME}, verdicts
    if attack == "edit-judge":
        assert str(base / "kernels" / "dequantize_4bit.cu") in session.judge_changed
    if attack == "redirect":  # the candidate's dequantization slowed, the base's and the matmul not
        assert verdicts == {ATTACK_CASE_IDS[0]: Verdict.SLOWER, ATTACK_CASE_IDS[1]: Verdict.SAME}, verdicts
