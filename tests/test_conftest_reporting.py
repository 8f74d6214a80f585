"""What a run tells its user: a failing seeded case names the command that replays it, in the
failure itself; a CPU run's last line says how many GPU tests did not run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def _run(tmp_path: Path, *args: str, seed: str | None = None) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_planted.py").write_text(FAILING)
    (tmp_path / "test_planted_marked.py").write_text(MARKED)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    if seed is not None:
        env["NF4_HARNESS_SEED"] = seed
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args, str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip


def test_a_failure_carries_the_command_that_replays_it(tmp_path):
    done = _run(tmp_path, seed="1234")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "NF4_HARNESS_SEED=1234 python -m pytest 'test_planted.py::test_seeded_case_fails'" in done.stdout


def test_the_last_line_of_a_cpu_run_says_which_gpu_tests_did_not_run(tmp_path):
    done = _run(tmp_path, "-k", "gpu")
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("GPU: 5 GPU tests not run"), done.stdout


def test_a_cpu_run_reports_its_gpu_skips_in_one_line_and_other_skips_as_they_are(tmp_path):
    """`-ra`, as the correctness session runs: the GPU tests of every file fold into one SKIPPED
    line; a skip for any other reason keeps its own line."""
    done = _run(tmp_path, "-ra", "-k", "gpu or own_reason")
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 2, done.stdout
    assert skipped[0].startswith("SKIPPED [5] ") and "GPU tests: no CUDA GPU visible" in skipped[0], done.stdout
    assert "test_planted.py" in skipped[1] and "not a GPU matter" in skipped[1], done.stdout
