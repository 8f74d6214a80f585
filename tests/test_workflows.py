"""Policy checks on the GitHub workflows that actionlint and zizmor don't express."""

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

WORKFLOWS = Path(__file__).resolve().parent.parent / ".github" / "workflows"
FILES = sorted(WORKFLOWS.glob("*.yml"))


def _load(path):
    data = yaml.safe_load(path.read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def _steps(data):
    for job in data["jobs"].values():
        yield from job.get("steps", [])


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_actions_pinned_by_commit_sha(path):
    for step in _steps(_load(path)):
        if "uses" in step:
            assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", step["uses"]), step["uses"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_minimal_permissions_and_timeouts(path):
    data = _load(path)
    assert "permissions" in data and "write" not in str(data["permissions"])
    for name, job in data["jobs"].items():
        assert isinstance(job.get("timeout-minutes"), int), f"{path.name}:{name} has no timeout"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_pull_request_target_never_checks_out_code(path):
    data = _load(path)
    if "pull_request_target" in data["on"]:
        for step in _steps(data):
            assert "checkout" not in step.get("uses", ""), "pull_request_target must not check out PR code"


def test_gpu_job_runs_fork_code_only_after_approval():
    pr = _load(WORKFLOWS / "pr.yml")
    gpu = pr["jobs"]["gpu"]
    assert {"self-hosted", "gpu"} <= set(gpu["runs-on"])
    condition = " ".join(gpu["if"].split())
    assert "github.event.pull_request.head.repo.full_name == github.repository" in condition
    assert "github.event.label.name == 'gpu-approved'" in condition
    checkouts = {s["with"]["path"]: s["with"] for s in gpu["steps"] if "checkout" in s.get("uses", "")}
    assert checkouts["candidate"]["ref"] == "${{ github.event.pull_request.head.sha }}"
    assert checkouts["judge"]["ref"] == "${{ github.event.pull_request.base.sha }}"
    assert all(c["persist-credentials"] is False for c in checkouts.values())
    assert gpu["concurrency"]["cancel-in-progress"] is False
    reset = _load(WORKFLOWS / "gpu-label-reset.yml")
    assert reset["on"]["pull_request_target"]["types"] == ["synchronize"]


def test_perf_gate_is_judged_by_the_base():
    """The perf step runs the base's noxfile and compares the two checkouts side by side."""
    gpu = _load(WORKFLOWS / "pr.yml")["jobs"]["gpu"]
    perf = next(s for s in gpu["steps"] if "-s perf" in s.get("run", ""))
    assert perf["run"].split() == [
        "python3", "-m", "nox", "-f", "judge/noxfile.py", "-s", "perf", "--",
        "--base-dir", "judge", "--candidate-dir", "candidate",
    ]  # fmt: skip
    assert "working-directory" not in perf


def test_cpu_job_runs_ci_script():
    pr = _load(WORKFLOWS / "pr.yml")
    assert any(s.get("run") == "bash .ci/run" for s in pr["jobs"]["cpu"]["steps"])
