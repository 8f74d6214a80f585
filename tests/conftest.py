"""GPU gating for the suite.

Tests marked ``gpu`` need a CUDA device. Without one they are skipped and the run ends with one
line saying how many were not run. With ``--require-gpu`` (what ``nox -s correctness`` passes
on a machine that has a GPU) a skipped GPU test is reported as a failure: a missing feature,
compiler or memory must never turn into a silent green.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from harness import settings

PINNED_BITSANDBYTES = "0.50.2"
_counts = {"gpu_not_run": 0}


def pytest_addoption(parser):
    parser.addoption(
        "--require-gpu",
        action="store_true",
        default=settings.REQUIRE_GPU.get() == "1",
        help="treat a skipped GPU test as a failure (gating runs on GPU machines)",
    )
    parser.addoption(
        "--full-matrix",
        action="store_true",
        default=False,
        help="run every model shape through the full quant x dtype x blocksize x nested matrix",
    )


def _pin_xdist_worker_to_gpu() -> None:
    """Under xdist on a multi-GPU runner, worker gwN sees only GPU N (mod the GPU count).

    Runs before anything initialises CUDA in the worker, so CUDA_VISIBLE_DEVICES still applies.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    gpus = [g for g in (settings.WORKER_GPUS.get() or "").split(",") if g]
    if worker.startswith("gw") and gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[int(worker[2:]) % len(gpus)]


def pytest_configure(config):
    _pin_xdist_worker_to_gpu()
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")
    config.addinivalue_line("markers", "huge: needs ~12 GiB of free GPU memory (deselect with -m 'not huge')")
    config.addinivalue_line("markers", "multigpu: needs two GPUs (deselect with -m 'not multigpu')")


def _has_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


NO_GPU = "no CUDA GPU visible (torch.cuda.is_available() is False)"


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=NO_GPU))


# Where every GPU test skipped for want of a GPU is reported: pytest's short summary folds skips
# by place and reason, so one place makes them one line instead of one a test file.
_NO_GPU_PLACE = (__file__, pytest_collection_modifyitems.__code__.co_firstlineno - 1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and hasattr(report.longrepr, "addsection") and "run_seed" in getattr(item, "funcargs", {}):
        # In the failure itself, not only in captured output: the command that replays this case
        # (per-case seeds are derived from the run's seed and the case's parameters).
        seed = item.funcargs["run_seed"]
        report.longrepr.addsection("replay", f"{settings.SEED.name}={seed} python -m pytest '{item.nodeid}'")
    if not report.skipped or "gpu" not in item.keywords:
        return
    if item.config.getoption("--require-gpu"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"GPU test skipped in a run that requires the GPU: {reason}"
    elif not _has_gpu():
        report.longrepr = (*_NO_GPU_PLACE, f"Skipped: GPU tests: {NO_GPU}")
        # pytest folds a marker's skips by file alone unless the module has a pytestmark, then
        # by line too: without it, every GPU skip has the one key.
        report.keywords.pop("pytestmark", None)


def pytest_runtest_logreport(report):
    # Counted here, not in makereport, so the count also reaches the controller under xdist.
    if report.skipped and report.when == "setup" and "gpu" in report.keywords:
        _counts["gpu_not_run"] += 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _has_gpu():
        from harness.perf.gpu_info import gpu_identity

        nvml = gpu_identity().get("nvml")
        if nvml != "ok":
            terminalreporter.write_line(f"NVML: {nvml} (no GPU identity to record on this machine)")


def pytest_unconfigure(config):
    # After pytest's own result line, so a CPU run's last line says what it did not prove.
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if _counts["gpu_not_run"] and reporter is not None:
        reporter.write_line(
            f"GPU: {_counts['gpu_not_run']} GPU tests not run (no CUDA GPU visible); "
            "run `nox -s correctness` on a GPU machine for the bit-exactness verdict",
            yellow=True,
            bold=True,
        )


@pytest.fixture(scope="session")
def run_seed() -> int:
    """A fresh seed each run (printed, so a failure can be replayed with NF4_HARNESS_SEED)."""
    seed = int(settings.SEED.get() or random.SystemRandom().randrange(2**31))
    print(f"\nnf4-harness seed: {settings.SEED.name}={seed}")
    return seed


@pytest.fixture(scope="session")
def bnb():
    """bitsandbytes at the pinned version: the reference every result is compared against."""
    import bitsandbytes
    import bitsandbytes.functional as F

    if bitsandbytes.__version__ != PINNED_BITSANDBYTES:
        pytest.fail(
            f"bitsandbytes {bitsandbytes.__version__} installed; the reference is pinned to "
            f"{PINNED_BITSANDBYTES} (pip install bitsandbytes=={PINNED_BITSANDBYTES})"
        )
    return F


@pytest.fixture
def cuda():
    """The CUDA device; also checks after the test that nothing left the context broken."""
    if not _has_gpu():
        pytest.skip("no CUDA GPU visible")
    device = torch.device("cuda", torch.cuda.current_device())
    yield device
    torch.cuda.synchronize(device)  # surfaces any asynchronous fault from this test, here


@pytest.fixture(scope="session")
def small_checkpoint():
    """A small Llama built from a config (2 layers, hidden 2048, random bf16 weights), saved once
    per session: the end-to-end modules load it quantized, on one GPU or split over two."""
    pytest.importorskip("transformers", reason="the end-to-end checks need transformers")
    if not _has_gpu():
        pytest.skip("no CUDA GPU visible")
    from harness.correctness import qlora

    tmp = qlora.temporary_checkpoint(dims=qlora.SMALL_LLAMA, layers=2)
    yield tmp.name
    tmp.cleanup()
