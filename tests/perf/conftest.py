"""Perf session plumbing: GPU identity in the benchmark JSON, the same-run copy bandwidth, the
baseline, and the summary (table, Markdown, plot) written when the session ends."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
import torch

from harness.perf import gpu_info, report, verdict
from harness.perf.gpu_timer import ColdL2Timer


class Replay:
    """A clock for pytest-benchmark that advances by recorded times instead of host time: the
    benchmark record then holds the GPU (or end-to-end) samples the harness measured."""

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


RESULTS: list[dict] = []
E2E_RESULTS: list[dict] = []
SESSION: dict = {}


def pytest_addoption(parser):
    group = parser.getgroup("nf4-harness perf")
    group.addoption("--save-baseline", action="store_true", help="write this run as the baseline for this GPU model")
    group.addoption("--perf-out", default="perf-out", help="directory for the summary and the plot")


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info.update(gpu_info.machine_info())


@pytest.fixture(scope="session")
def perf_device():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="session")
def gpu(perf_device):
    ident = gpu_info.gpu_identity(perf_device.index)
    SESSION["gpu"] = ident
    return ident


@pytest.fixture(scope="session")
def timer(perf_device):
    return ColdL2Timer(perf_device, clock=gpu_info.sm_clock_reader(perf_device.index))


@pytest.fixture(scope="session")
def copy_gbps(perf_device, timer):
    """Device-to-device copy bandwidth in this session, same method, counting read + write."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=perf_device).fill_(7)
    dst = torch.empty_like(src)
    m = timer.measure(lambda: dst.copy_(src))
    gbps = 2 * src.numel() / m.median_s / 1e9
    SESSION["copy"] = {"gbps": gbps, **m.summary()}
    return gbps


@pytest.fixture(scope="session")
def baseline(request, gpu):
    if request.config.getoption("--save-baseline"):
        return None
    return verdict.load_baseline(gpu)  # BaselineError names the command that fixes it


def pytest_sessionfinish(session, exitstatus):
    if not RESULTS and not E2E_RESULTS:
        return
    gpu = SESSION.get("gpu", {})
    copy = SESSION.get("copy", {})
    header = [
        f"GPU: {gpu.get('name')} (driver {gpu.get('driver')}, SM clock default {gpu.get('default_sm_clock_mhz')} MHz)"
    ]
    if copy:  # measured only when a kernel case ran
        header.append(
            f"copy bandwidth this run: {copy['gbps']:.0f} GB/s (read + write); "
            f"NVML theoretical: {gpu.get('theoretical_gbps') or 0:.0f} GB/s"
        )
    if overhead := SESSION.get("host_overhead_us"):
        header.append(
            "host time per call (validation + launch, no GPU wait): "
            + ", ".join(f"{k} {v:.1f} µs" for k, v in overhead.items())
        )
    for name, reason in SESSION.get("peers_not_run", {}).items():
        header.append(f"peer {name}: {reason}")
    counts = {}
    for r in RESULTS + E2E_RESULTS:
        counts[r.get("verdict", "—")] = counts.get(r.get("verdict", "—"), 0) + 1
    header.append("verdicts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    out_dir = Path(session.config.getoption("--perf-out"))
    if session.config.getoption("--save-baseline"):
        cases = {r["case"]: r["baseline_record"] for r in RESULTS + E2E_RESULTS}
        path = verdict.save_baseline(gpu, gpu_info.software_versions(), cases)
        header.append(f"baseline written: {path}")
    outputs = report.write_outputs(RESULTS, header, out_dir, E2E_RESULTS)
    text = report.render(RESULTS, header, "simple", E2E_RESULTS)
    terminal = session.config.pluginmanager.get_plugin("terminalreporter")
    if terminal:
        terminal.write_line("")
        for line in text.splitlines():
            terminal.write_line(line)
        terminal.write_line(f"summary: {outputs['markdown']}  plot: {outputs['plot']}")
