"""Security and scheduling properties of the GitHub workflows that actionlint and zizmor don't
express, asserted so a later edit cannot quietly undo them (.github/SECURITY.md)."""

import copy
import json
import re
from pathlib import Path

import pytest

from tests import workflow_policy as policy

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
GITHUB = ROOT / ".github"
WORKFLOWS = GITHUB / "workflows"
FILES = sorted(WORKFLOWS.glob("*.yml"))
_load = policy.load


def _jobs():
    for path in FILES:
        data = _load(path)
        for name, job in data["jobs"].items():
            yield path.name, data, name, job


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


def test_the_workflows_keep_every_security_rule():
    """tests/workflow_policy.py states the rules (.github/SECURITY.md); the workflows break none."""
    found = [v for path in FILES for v in policy.violations(_load(path), path.name)]
    assert found == []


def test_pull_request_code_runs_in_the_jobs_we_know_of():
    """Adding a job that runs pull-request code is a decision to make here, on purpose."""
    jobs = {f"{file}:{name}" for file, data, name, job in _jobs() if policy.runs_pull_request_code(data, job)}
    assert jobs == {"gpu.yml:perf", "gpu.yml:correctness", "pr.yml:cpu"}


def _gpu_gate():
    return _load(WORKFLOWS / "gpu.yml")


def _mutated(change) -> list[str]:
    data = copy.deepcopy(_gpu_gate())
    change(data)
    return policy.violations(data, "gpu.yml")


def _step(job: dict, text: str) -> dict:
    return next(s for s in job["steps"] if text in str(s.get("run", "")) + str(s.get("name", "")))


BREAKS = {
    # The example: a labelled self-hosted job, a pull_request and comment trigger, no environment.
    "self-hosted by labels, pull_request and comments": lambda d: (
        d.update({"on": {"pull_request": None, "issue_comment": {"types": ["created"]}}}),
        d["jobs"]["correctness"].pop("environment"),
        d["jobs"]["correctness"].update({"runs-on": ["linux", "x64", "gpu", "a100"]}),
    ),
    "a label starts the gate": lambda d: d["on"]["pull_request_target"]["types"].append("labeled"),
    "workflow_run": lambda d: d["on"].update({"workflow_run": {"workflows": ["pr"]}}),
    "pull-request code checked out by a branch name": lambda d: _checkout(d, "candidate").update(
        {"ref": "${{ github.head_ref }}"}
    ),
    "pull-request code with a write token": lambda d: d["jobs"]["correctness"].update(
        {"permissions": {"contents": "write"}}
    ),
    "persisted credentials": lambda d: _checkout(d, "judge").update({"persist-credentials": True}),
    # Finding 1: the candidate's code (its own nox session) runs in the gate's job before the judge.
    "candidate code before the judge": lambda d: d["jobs"]["perf"]["steps"].insert(
        3, {"name": "candidate", "working-directory": "candidate", "run": "python -m nox -s correctness", "env": {}}
    ),
    "the candidate checked out before the judge is installed": lambda d: _move_before(
        d["jobs"]["perf"]["steps"], "Check out the pull request", "Install the judge"
    ),
    "the judge's virtualenvs in the workspace": lambda d: _step(d["jobs"]["perf"], "Perf gate").update(
        {"run": _step(d["jobs"]["perf"], "Perf gate")["run"].replace('--envdir "$RUNNER_TEMP/nox" ', "")}
    ),
    "the user site on": lambda d: _step(d["jobs"]["perf"], "Perf gate")["env"].pop("PYTHONNOUSERSITE"),
    "Triton's cache in the home directory": lambda d: _step(d["jobs"]["perf"], "Perf gate")["env"].pop(
        "TRITON_CACHE_DIR"
    ),
    # Finding 4: the pull request's own (possibly weakened) tests are the only correctness verdict.
    "the candidate judged by its own tests alone": lambda d: d["jobs"]["correctness"]["steps"].remove(
        _step(d["jobs"]["correctness"], "Correctness by the base's tests")
    ),
    "the candidate's tests before the base's": lambda d: _move_before(
        d["jobs"]["correctness"]["steps"], "The pull request's own tests", "Correctness by the base's tests"
    ),
    "the gate run by the candidate's noxfile": lambda d: _step(d["jobs"]["perf"], "Perf gate").update(
        {"run": _step(d["jobs"]["perf"], "Perf gate")["run"].replace("judge/noxfile.py", "candidate/noxfile.py")}
    ),
}


def _move_before(steps: list, moved: str, anchor: str) -> None:
    step = steps.pop(next(i for i, s in enumerate(steps) if s.get("name", "").startswith(moved)))
    steps.insert(next(i for i, s in enumerate(steps) if s.get("name", "").startswith(anchor)), step)


def _checkout(data: dict, path: str) -> dict:
    return next(s["with"] for s in policy.checkouts(data["jobs"]["perf"]) if s["with"].get("path") == path)


CAUGHT_BY = {
    "self-hosted by labels, pull_request and comments": "self-hosted job under ['issue_comment', 'pull_request']",
    "a label starts the gate": "fires on ['labeled']",
    "workflow_run": "self-hosted job under ['workflow_run']",
    "pull-request code checked out by a branch name": "not pinned to a commit SHA",
    "pull-request code with a write token": "pull-request code with permissions",
    "persisted credentials": "persists its credentials",
    "candidate code before the judge": "step 'candidate' runs in the candidate's checkout",
    "the candidate checked out before the judge is installed": "not checked out and installed before the candidate",
    "the judge's virtualenvs in the workspace": "keeps nox virtualenvs in the workspace",
    "the user site on": "reads the user site",
    "Triton's cache in the home directory": "keeps TRITON_CACHE_DIR outside RUNNER_TEMP",
    "the gate run by the candidate's noxfile": "the gate is not the judge's noxfile",
    "the candidate judged by its own tests alone": "no step runs the base's tests on the candidate",
    "the candidate's tests before the base's": "the candidate's own code runs before the base's tests judge it",
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_each_rule_catches_the_workflow_that_breaks_it(name):
    found = _mutated(lambda d: BREAKS[name](d))
    assert any(CAUGHT_BY[name] in line for line in found), found


def test_a_job_on_labels_alone_is_self_hosted():
    assert policy.self_hosted({"runs-on": ["linux", "x64", "gpu", "a100"]})
    assert policy.self_hosted({"runs-on": {"group": "gpu"}})
    assert policy.self_hosted({"runs-on": "${{ matrix.runner }}"})
    assert not policy.self_hosted({"runs-on": "ubuntu-latest"})
    assert not policy.self_hosted({"runs-on": ["ubuntu-24.04"]})


def test_every_file_that_runs_on_a_gpu_runner_or_judges_a_pull_request_has_a_code_owner():
    """Finding 4 of the gate's review: /tests/, /harness/runtime/, most of /harness/correctness/,
    harness/settings.py and harness/__init__.py had no owner, so a pull request could weaken a
    test and the code it tests together with no maintainer's review."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    codeowners = (GITHUB / "CODEOWNERS").read_text()
    assert policy.unowned(codeowners, files, exempt=("README.md", ".gitignore")) == []
    assert policy.unowned("/harness/perf/ @x\n", ["harness/runtime/api.py"], exempt=()) == ["harness/runtime/api.py"]


def test_concurrency_never_lets_a_label_or_another_pull_request_cancel_a_gate():
    gpu = _load(WORKFLOWS / "gpu.yml")
    assert gpu["on"] == {"pull_request_target": {"types": ["opened", "synchronize", "reopened"]}}
    group = gpu["concurrency"]["group"]
    assert "github.event.pull_request.number" in group and "label" not in group and "matrix" not in group
    assert _load(WORKFLOWS / "baseline.yml")["concurrency"]["cancel-in-progress"] is False


def test_runner_kinds_are_listed_once():
    kinds = json.loads((GITHUB / "gpu-runners.json").read_text())
    assert isinstance(kinds, list) and kinds and all(isinstance(k, str) for k in kinds)
    for file, _, name, job in _jobs():
        if policy.self_hosted(job):
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


def test_baseline_workflow_sweeps_the_grid_rules_on_every_runner_kind_read_only():
    """The split rules were fit on H100s: each runner kind's sweep says whether they hold there."""
    data = _load(WORKFLOWS / "baseline.yml")
    grids = data["jobs"]["grids"]
    assert grids["permissions"] == {"contents": "read"} and grids["environment"] == "gpu-main"
    assert grids["strategy"]["matrix"]["gpu"] == data["jobs"]["measure"]["strategy"]["matrix"]["gpu"]
    assert any("-s grid-sweep -- --weights all" in s.get("run", "") for s in grids["steps"])
    assert any("upload-artifact" in s.get("uses", "") for s in grids["steps"])


def test_cpu_job_runs_ci_script():
    pr = _load(WORKFLOWS / "pr.yml")
    assert any(s.get("run") == "bash .ci/run" for s in pr["jobs"]["cpu"]["steps"])


def test_every_check_the_security_table_names_exists():
    """The security policy's table names the test that fails if its line stops being true."""
    policy_doc = (ROOT / ".github" / "SECURITY.md").read_text()
    section = policy_doc[policy_doc.index("## What stops each attack") :]
    named = set(re.findall(r"`(test_\w+)`", section))
    defined = {
        m for p in (ROOT / "tests").glob("test_*.py") for m in re.findall(r"^def (test_\w+)", p.read_text(), re.M)
    }
    assert named and named <= defined, sorted(named - defined)


def test_the_gate_is_judged_by_the_base():
    perf = _load(WORKFLOWS / "gpu.yml")["jobs"]["perf"]
    gate = next(s for s in perf["steps"] if "-s perf" in s.get("run", "") and "--install-only" not in s["run"])
    assert gate["run"].replace("\\\n", " ").split()[1:] == [
        "-m", "nox", "-f", "judge/noxfile.py", "--envdir", '"$RUNNER_TEMP/nox"', "--no-install",
        "-s", "perf", "--", "--base-dir", "judge", "--candidate-dir", "candidate",
    ]  # fmt: skip
    assert "working-directory" not in gate
    refs = {s["with"]["path"]: s["with"]["ref"] for s in policy.checkouts(perf)}
    assert refs == {"judge": policy.BASE_SHA, "candidate": "${{ github.event.pull_request.head.sha }}"}
