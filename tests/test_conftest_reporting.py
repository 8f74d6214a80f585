"""What a run tells its user: a failing seeded case names the command that replays it, in the
failure itself; a CPU run's last line says how many GPU tests did not run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAILING = """
import pytest

def test_seeded_case_fails(run_seed):
    assert run_seed < 0, "planted failure"

@pytest.mark.gpu
def test_needs_gpu():
    pass

@pytest.mark.gpu
@pytest.mark.parametrize("n", range(3))
def test_needs_gpu_too(n):
    pass

def test_skips_for_its_own_reason():
    pytest.skip("not a GPU matter")
"""


# A module marked as a whole: pytest folds such a module's skips by line, the others' by file.
MARKED = """
import pytest

pytestmark = pytest.mark.gpu

def test_whole_module_on_gpu():
    pass
"""


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> subprocess.CompletedProcess:
    """One run of the planted tests with this conftest, as the correctness session runs them on a
    machine without a GPU (``-ra``), with a fixed seed."""
    tmp_path = tmp_path_factory.mktemp("planted")
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_planted.py").write_text(FAILING)
    (tmp_path / "test_planted_marked.py").write_text(MARKED)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "NF4_HARNESS_SEED": "1234"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-ra", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip


def test_a_failure_carries_the_command_that_replays_it(cpu_run):
    assert cpu_run.returncode == 1, cpu_run.stdout + cpu_run.stderr
    assert "NF4_HARNESS_SEED=1234 python -m pytest 'test_planted.py::test_seeded_case_fails'" in cpu_run.stdout


def test_the_last_line_of_a_cpu_run_says_which_gpu_tests_did_not_run(cpu_run):
    lines = cpu_run.stdout.strip().splitlines()
    assert lines[-1].startswith("GPU: 5 GPU tests not run"), cpu_run.stdout


def test_a_cpu_run_reports_its_gpu_skips_in_one_line_and_other_skips_as_they_are(cpu_run):
    """The GPU tests of every file fold into one SKIPPED line; a skip for any other reason keeps
    its own line."""
    skipped = [line for line in cpu_run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 2, cpu_run.stdout
    assert skipped[0].startswith("SKIPPED [5] ") and "GPU tests: no CUDA GPU visible" in skipped[0], cpu_run.stdout
    assert "test_planted.py" in skipped[1] and "not a GPU matter" in skipped[1], cpu_run.stdout
