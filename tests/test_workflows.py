"""Security and scheduling properties of the GitHub workflows that actionlint and zizmor don't
express, asserted so a later edit cannot quietly undo them (README, Security)."""

import json
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

GITHUB = Path(__file__).resolve().parent.parent / ".github"
WORKFLOWS = GITHUB / "workflows"
FILES = sorted(WORKFLOWS.glob("*.yml"))
PR_CODE = re.compile(r"github\.event\.pull_request\.head\.")


def _load(path):
    data = yaml.safe_load(path.read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def _jobs():
    for path in FILES:
        data = _load(path)
        for name, job in data["jobs"].items():
            yield path.name, data, name, job


def _self_hosted(job) -> bool:
    return "self-hosted" in job.get("runs-on", [])


def _checkouts(job):
    return [s for s in job.get("steps", []) if "actions/checkout" in s.get("uses", "")]


def _runs_pr_code(job) -> bool:
    return any(PR_CODE.search(str(s.get("with", {}).get("ref", ""))) for s in _checkouts(job))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_actions_pinned_by_commit_sha(path):
    for job in _load(path)["jobs"].values():
        for step in job.get("steps", []):
            if "uses" in step:
                assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", step["uses"]), step["uses"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_read_only_by_default_with_timeouts(path):
    data = _load(path)
    assert "permissions" in data and "write" not in str(data["permissions"])
    for name, job in data["jobs"].items():
        assert isinstance(job.get("timeout-minutes"), int), f"{path.name}:{name} has no timeout"


def test_no_self_hosted_job_runs_on_a_pull_request_trigger():
    """`pull_request` takes the workflow from the pull request itself: a fork could rewrite it."""
    for file, data, name, job in _jobs():
        if _self_hosted(job):
            assert "pull_request" not in data["on"], f"{file}:{name}"
            assert "labeled" not in str(data["on"]), f"{file}:{name}: a label must not start a GPU job"


def test_every_self_hosted_job_waits_in_an_environment():
    for file, _, name, job in _jobs():
        if _self_hosted(job):
            assert job.get("environment") in ("gpu-runners", "gpu-main"), f"{file}:{name}"
    gate = _load(WORKFLOWS / "gpu.yml")["jobs"]["gate"]
    assert gate["environment"] == "gpu-runners"  # required reviewers: approval per run


def test_pull_request_code_never_meets_a_write_token_or_a_secret():
    seen = 0
    for file, data, name, job in _jobs():
        if not _runs_pr_code(job):
            continue
        seen += 1
        permissions = job.get("permissions", data.get("permissions"))
        assert isinstance(permissions, dict) and set(permissions.values()) <= {"read", "none"}, f"{file}:{name}"
        assert "secrets." not in json.dumps(job), f"{file}:{name} uses a secret"
        assert "github.token" not in json.dumps(job), f"{file}:{name} hands out the token"
        for step in _checkouts(job):
            assert step["with"]["persist-credentials"] is False, f"{file}:{name}"
    assert seen == 1  # the GPU gate; the CPU job checks out the merge commit of `pull_request`


def test_gpu_jobs_pin_the_commits_they_check_out():
    for file, _, name, job in _jobs():
        if _self_hosted(job):
            for step in _checkouts(job):
                assert re.fullmatch(r"\$\{\{ github\.[\w.]*sha \}\}", step["with"]["ref"]), f"{file}:{name}"
    gate = _load(WORKFLOWS / "gpu.yml")["jobs"]["gate"]
    refs = {s["with"]["path"]: s["with"]["ref"] for s in _checkouts(gate)}
    assert refs == {
        "judge": "${{ github.event.pull_request.base.sha }}",
        "candidate": "${{ github.event.pull_request.head.sha }}",
    }


def test_the_gate_is_judged_by_the_base():
    gate = _load(WORKFLOWS / "gpu.yml")["jobs"]["gate"]
    perf = next(s for s in gate["steps"] if "-s perf" in s.get("run", ""))
    assert perf["run"].split()[1:] == [
        "-m", "nox", "-f", "judge/noxfile.py", "-s", "perf", "--",
        "--base-dir", "judge", "--candidate-dir", "candidate",
    ]  # fmt: skip
    assert "working-directory" not in perf


def test_gpu_jobs_install_into_a_private_place():
    for file, _, name, job in _jobs():
        if not _self_hosted(job):
            continue
        text = json.dumps(job)
        assert "--user" not in text and "pip install" in text, f"{file}:{name}"
        for step in job["steps"]:
            if "run" in step:
                assert step["env"]["NF4_HARNESS_CACHE_DIR"].startswith("${{ runner.temp }}"), f"{file}:{name}"
                assert step["env"]["PIP_CACHE_DIR"].startswith("${{ runner.temp }}"), f"{file}:{name}"


def test_concurrency_never_lets_a_label_or_another_pull_request_cancel_a_gate():
    gpu = _load(WORKFLOWS / "gpu.yml")
    assert gpu["on"] == {"pull_request_target": {"types": ["opened", "synchronize", "reopened"]}}
    group = gpu["concurrency"]["group"]
    assert "github.event.pull_request.number" in group and "label" not in group and "matrix" not in group
    for file, _, name, job in _jobs():
        if _self_hosted(job):
            assert "concurrency" not in job, f"{file}:{name}: a shared runner group would cancel queued gates"
    assert _load(WORKFLOWS / "baseline.yml")["concurrency"]["cancel-in-progress"] is False


def test_runner_kinds_are_listed_once():
    kinds = json.loads((GITHUB / "gpu-runners.json").read_text())
    assert isinstance(kinds, list) and kinds and all(isinstance(k, str) for k in kinds)
    for file, _, name, job in _jobs():
        if _self_hosted(job):
            assert job["strategy"]["matrix"]["gpu"] == "${{ fromJSON(needs.kinds.outputs.kinds) }}", f"{file}:{name}"


def test_baseline_workflow_measures_read_only_and_proposes_from_a_hosted_runner():
    data = _load(WORKFLOWS / "baseline.yml")
    assert set(data["on"]) == {"workflow_dispatch", "schedule"}
    measure, propose = data["jobs"]["measure"], data["jobs"]["propose"]
    assert measure["permissions"] == {"contents": "read"}
    assert any("upload-artifact" in s.get("uses", "") for s in measure["steps"])
    assert propose["runs-on"] == "ubuntu-latest" and propose["needs"] == "measure"
    script = next(s["run"] for s in propose["steps"] if "gh pr" in s.get("run", ""))
    assert "git status --porcelain" in script  # sees new, untracked baseline files
    assert "git diff --quiet" not in script and "x-access-token" not in script


def test_cpu_job_runs_ci_script():
    pr = _load(WORKFLOWS / "pr.yml")
    assert any(s.get("run") == "bash .ci/run" for s in pr["jobs"]["cpu"]["steps"])


def test_codeowners_cover_what_judges_a_pull_request():
    owned = {line.split()[0] for line in (GITHUB / "CODEOWNERS").read_text().splitlines() if line.startswith("/")}
    assert {
        "/kernels/", "/baselines/", "/harness/perf/", "/harness/correctness/data/", "/tests/perf/", "/noxfile.py",
        "/pyproject.toml", "/.github/", "/.ci/",
    } <= owned  # fmt: skip
