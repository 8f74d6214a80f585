"""The noxfile: every session listed with help, GPU detection and the offline (--no-venv) path."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _nox_list() -> list[dict]:
    pytest.importorskip("nox")
    done = subprocess.run(
        [sys.executable, "-m", "nox", "--list", "--json"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def test_sessions_are_listed_with_one_line_help():
    sessions = {s["session"]: s for s in _nox_list()}
    assert {"lint", "compile", "correctness"} <= set(sessions)
    for name, s in sessions.items():
        assert s["description"] and "\n" not in s["description"].strip(), name


def test_gpu_count_override_and_cuda_visible_devices(monkeypatch):
    sys.path.insert(0, str(ROOT))
    try:
        import noxfile
    finally:
        sys.path.remove(str(ROOT))
    monkeypatch.setenv("NF4_HARNESS_GPUS", "3")
    assert noxfile.gpu_count() == 3
    monkeypatch.delenv("NF4_HARNESS_GPUS")
    monkeypatch.setattr(noxfile.shutil, "which", lambda name: None)
    assert noxfile.gpu_count() == 0


def test_no_venv_correctness_runs_in_this_interpreter_installing_nothing():
    """The offline-GPU-box path: --no-venv must not reach session.install (it raises there)."""
    pytest.importorskip("nox")
    done = subprocess.run(
        [sys.executable, "-m", "nox", "--no-venv", "-s", "correctness", "--", "--collect-only", "-q",
         "tests/test_ptxas_report.py"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    output = done.stdout + done.stderr
    assert "installing nothing" in output and "tests collected" in output
