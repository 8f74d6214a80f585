"""Perf session fixtures: one ``PerfSession`` for the run (``harness.perf.session``), the gate and
the summary when it ends, and pytest-benchmark records holding the measured GPU samples.

The tests in this directory only measure. Every verdict needs every case at once (the
family-wise error control), so the gate judges when the session fixture is torn down, re-measures
what is still AMBIGUOUS while the measuring processes are alive, and sets the exit status last.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import pytest

from harness import settings
from harness.perf import baseline, gate, gpu_info, policy, report
from harness.perf.session import JUDGE_ROOT, PerfSession

SESSION_KEY = pytest.StashKey[PerfSession]()


class Replay:
    """A clock for pytest-benchmark that advances by recorded times instead of host time: the
    benchmark record then holds the GPU (or end-to-end) samples the session measured."""

    now: ClassVar[float] = 0.0
    pending: ClassVar[list[float]] = []

    @classmethod
    def clock(cls) -> float:
        return cls.now

    @classmethod
    def step(cls) -> None:
        cls.now += cls.pending.pop(0)


def replay_into(benchmark, samples_s: list[float]) -> None:
    """Feed measured samples to a test marked ``@pytest.mark.benchmark(timer=Replay.clock, ...)``."""
    Replay.pending = list(samples_s)
    benchmark.pedantic(Replay.step, rounds=len(samples_s), iterations=1)


def pytest_addoption(parser):
    group = parser.getgroup("nf4-harness perf")
    group.addoption(
        "--base-dir",
        default=None,
        help="checkout of the base revision: measure it beside the candidate and gate on the pair (A/B)",
    )
    group.addoption(
        "--candidate-dir", default=str(JUDGE_ROOT), help="checkout to measure (default: the one running the tests)"
    )
    group.addoption("--save-baseline", action="store_true", help="merge this session into the stored baseline")
    group.addoption("--baseline-dir", default=str(JUDGE_ROOT / "baselines"), help="stored baselines (the judge's)")
    group.addoption(
        "--perf-out", default=settings.PERF_OUT.default, help="directory for the summary, plot and session record"
    )
    group.addoption("--no-references", action="store_true", help="skip the bitsandbytes and copy reference timings")
    group.addoption(
        "--isolation",
        choices=[i.value for i in policy.Isolation],
        default=policy.ISOLATION.value,
        help="measure each side in a process of its own, or both in one (harness.perf.policy.Isolation)",
    )


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info.update(gpu_info.machine_info(gpu_info.nvml_device(0)))


@pytest.fixture(scope="session")
def perf_session(request, run_seed):
    opt = request.config.getoption
    session = PerfSession(
        Path(opt("--candidate-dir")),
        Path(opt("--base-dir")) if opt("--base-dir") else None,
        seed=run_seed,
        references=not opt("--no-references"),
        isolation=policy.Isolation(opt("--isolation")),
        output_dirs=(Path(opt("--perf-out")),),
    )
    request.config.stash[SESSION_KEY] = session
    try:
        yield session
        session.settle()
    finally:
        session.close()


def pytest_sessionfinish(session, exitstatus):
    perf = session.config.stash.get(SESSION_KEY, None)
    if perf is None or not (perf.kernel or perf.e2e):
        return
    opt = session.config.getoption
    out_dir = Path(opt("--perf-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    record = perf.record()
    (out_dir / "session-record.json").write_text(json.dumps(record, indent=1) + "\n")
    directory = Path(opt("--baseline-dir"))
    drift = {}
    if opt("--save-baseline"):
        saved = baseline.save([record], directory)
        drift_line = f"baseline: {saved} (this session merged; no drift check)"
        if warning := baseline.one_gpu_warning(saved, [record]):
            drift_line += f"; {warning}"
    else:
        stored, drift_line = baseline.load(perf.gpu, directory)
        if stored is not None:
            drift = baseline.check_drift(stored, perf.medians_us(), perf.timer_floor_us)
            drift_line += f"; {baseline.floor_line(stored, perf.timer_floor_us)}: {baseline.counts_line(drift)}"
    drifted = sum(r.status == "DRIFTED" for r in drift.values())
    differing = sum(r.outputs_agree is False for r in perf.kernel.values())
    status = gate.exit_status(
        perf.judgements, drifted, errors=session.testsfailed, differing=differing, judge_changed=len(perf.judge_changed)
    )
    outputs = report.write_outputs(perf, drift, drift_line, status, out_dir)
    (out_dir / "verdicts.json").write_text(json.dumps(report.verdicts(perf, drift, status), indent=1) + "\n")
    terminal = session.config.pluginmanager.get_plugin("terminalreporter")
    if terminal:
        terminal.write_line("")
        for line in report.render(perf, drift, drift_line, status, "simple").splitlines():
            terminal.write_line(line)
        terminal.write_line(f"summary: {outputs['markdown']}  plot: {outputs['plot']}")
    if status not in (gate.EXIT_OK, gate.EXIT_ERROR):
        session.exitstatus = status  # pytest's own status already says a test failed
