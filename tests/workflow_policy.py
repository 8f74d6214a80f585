"""The security rules of the GitHub workflows, as checks that return what breaks them.

Each check reads a workflow as GitHub does and states a property, not a spelling: a job is
self-hosted unless it names one GitHub-hosted image; a checkout runs pull-request code unless it is
the base's commit; a trigger is untrusted when anyone who can open a pull request, comment,
review or label can fire it, or when the workflow's definition comes from the pull request.
``tests/test_workflows.py`` runs them over ``.github/`` and over workflows built to break each rule.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

HOSTED_IMAGE = re.compile(r"(ubuntu|windows|macos)-(latest|\d[\w.]*)(-arm|-arm64|-xlarge|-large)?")
# Triggers a self-hosted job may have: their workflow definition comes from the base branch and
# no outsider's comment, review, label or upstream run starts them.
BASE_DEFINED_TRIGGERS = {"pull_request_target", "schedule", "workflow_dispatch", "push"}
PULL_REQUEST_TARGET_TYPES = {"opened", "synchronize", "reopened"}
BASE_SHA = "${{ github.event.pull_request.base.sha }}"
NOX_SESSION = re.compile(r"-m nox\b[^\n]*(\\\n[^\n]*)*\s-s\s")
NOX_ENVDIR = re.compile(r'--envdir "\$RUNNER_TEMP/[\w-]+"')  # nox's virtualenvs in the job's temporary directory
PRIVATE_ENV = {
    "HOME": "${{ runner.temp }}/",
    "PIP_CACHE_DIR": "${{ runner.temp }}/",
    "XDG_CACHE_HOME": "${{ runner.temp }}/",
    "TRITON_CACHE_DIR": "${{ runner.temp }}/",
    "TORCH_EXTENSIONS_DIR": "${{ runner.temp }}/",
    "NF4_HARNESS_CACHE_DIR": "${{ runner.temp }}/",
}


def load(path: Path) -> dict:
    import yaml

    data = yaml.safe_load(path.read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def triggers(workflow: dict) -> dict[str, Any]:
    on = workflow["on"]
    if isinstance(on, str):
        return {on: None}
    if isinstance(on, list):
        return dict.fromkeys(on)
    return dict(on)


def self_hosted(job: dict) -> bool:
    """Any runner but one GitHub-hosted image: label lists, groups and expressions included."""
    runs_on = job.get("runs-on")
    if isinstance(runs_on, list) and len(runs_on) == 1:
        runs_on = runs_on[0]
    return not (isinstance(runs_on, str) and HOSTED_IMAGE.fullmatch(runs_on))


def checkouts(job: dict) -> list[dict]:
    return [s for s in job.get("steps", []) if "actions/checkout" in s.get("uses", "")]


def checks_out_pull_request_code(workflow: dict, step: dict) -> bool:
    """Whether a checkout brings pull-request code: anything but the base's commit. ``github.sha``
    (the default) is the base branch's head only under base-defined triggers."""
    ref = step.get("with", {}).get("ref")
    if ref == BASE_SHA:
        return False
    if ref in (None, "${{ github.sha }}") and set(triggers(workflow)) <= BASE_DEFINED_TRIGGERS:
        return False
    return True


def runs_pull_request_code(workflow: dict, job: dict) -> bool:
    return any(checks_out_pull_request_code(workflow, s) for s in checkouts(job))


def violations(workflow: dict, name: str = "workflow") -> list[str]:
    """Every rule a workflow breaks, one line each."""
    found = []
    on = triggers(workflow)
    for job_name, job in workflow["jobs"].items():
        where = f"{name}:{job_name}"
        text = json.dumps(job)
        pr_code = runs_pull_request_code(workflow, job)
        if self_hosted(job):
            if not set(on) <= BASE_DEFINED_TRIGGERS:
                found.append(f"{where}: self-hosted job under {sorted(set(on) - BASE_DEFINED_TRIGGERS)}")
            types = set()
            if "pull_request_target" in on:  # no types: every activity type, labels included
                types = set((on["pull_request_target"] or {}).get("types", ["labeled", "edited"]))
            if types - PULL_REQUEST_TARGET_TYPES:
                found.append(f"{where}: pull_request_target fires on {sorted(types - PULL_REQUEST_TARGET_TYPES)}")
            environment = job.get("environment")
            if environment not in ("gpu-runners", "gpu-main") or (pr_code and environment != "gpu-runners"):
                found.append(f"{where}: self-hosted job outside the approval environments ({environment})")
            for step in checkouts(job):
                if not re.fullmatch(r"\$\{\{ github\.[\w.]*sha \}\}", str(step.get("with", {}).get("ref"))):
                    found.append(f"{where}: a checkout not pinned to a commit SHA")
            for step in job.get("steps", []):
                if "run" in step:
                    env = step.get("env", {})
                    for key, prefix in PRIVATE_ENV.items():
                        if not str(env.get(key, "")).startswith(prefix):
                            found.append(f"{where}: step {step.get('name')!r} keeps {key} outside RUNNER_TEMP")
                    if env.get("PYTHONNOUSERSITE") != "1" or env.get("PIP_CONFIG_FILE") != "/dev/null":
                        found.append(f"{where}: step {step.get('name')!r} reads the user site or pip config")
                    if NOX_SESSION.search(step["run"]) and not NOX_ENVDIR.search(step["run"]):
                        found.append(f"{where}: step {step.get('name')!r} keeps nox virtualenvs in the workspace")
            if "--user" in text:
                found.append(f"{where}: installs into the user site")
            if "concurrency" in job:
                found.append(f"{where}: a job-level concurrency group would cancel queued gates")
        if pr_code:
            permissions = job.get("permissions", workflow.get("permissions"))
            if not (isinstance(permissions, dict) and set(permissions.values()) <= {"read", "none"}):
                found.append(f"{where}: pull-request code with permissions {permissions}")
            if "secrets." in text or "github.token" in text:
                found.append(f"{where}: pull-request code meets a secret or the token")
            for step in checkouts(job):
                if step.get("with", {}).get("persist-credentials") is not False:
                    found.append(f"{where}: a checkout persists its credentials")
        if pr_code:
            found += judge_violations(job, where)
            found += base_tests_violations(job, where)
    return found


def _runs_candidate_code(step: dict) -> bool:
    run = step.get("run", "")
    return str(step.get("working-directory", "")).startswith("candidate") or "candidate/noxfile.py" in run


def base_tests_violations(job: dict, where: str) -> list[str]:
    """A job that checks pull-request code for correctness judges it by the base's tests first:
    the base's noxfile runs its own tests on the candidate's package (``--candidate-dir``) before
    any of the candidate's own code runs, so a test weakened in the pull request decides nothing."""
    steps = job.get("steps", [])
    if not any("-s correctness" in s.get("run", "") for s in steps):
        return []
    judged = [
        i
        for i, s in enumerate(steps)
        if all(a in s.get("run", "") for a in ("-f judge/noxfile.py", "-s correctness", "--candidate-dir candidate"))
        and not _runs_candidate_code(s)
    ]
    if not judged:
        return [f"{where}: no step runs the base's tests on the candidate"]
    found = []
    first_candidate = next((i for i, s in enumerate(steps) if _runs_candidate_code(s)), len(steps))
    if first_candidate < judged[0]:
        found.append(f"{where}: the candidate's own code runs before the base's tests judge it")
    judge = [i for i, s in enumerate(steps) if s in checkouts(job) and s["with"].get("ref") == BASE_SHA]
    candidate = [i for i, s in enumerate(steps) if s in checkouts(job) and s["with"].get("path") == "candidate"]
    if not judge or not candidate or not judge[0] < candidate[0]:
        found.append(f"{where}: the base is not checked out before the candidate")
    return found


def judge_violations(job: dict, where: str) -> list[str]:
    """A job that gates pull-request code on speed runs nothing of the candidate before the judge:
    the judge (the base checkout) is installed before the candidate is checked out, the candidate
    is only files handed to the judge's noxfile, and nothing is reused from a path the candidate
    could have written."""
    steps = job.get("steps", [])
    gate = [i for i, s in enumerate(steps) if "-s perf" in s.get("run", "") and "--install-only" not in s["run"]]
    if not gate:
        return []
    found = []
    candidate = [i for i, s in enumerate(steps) if s in checkouts(job) and s["with"].get("path") == "candidate"]
    judge = [i for i, s in enumerate(steps) if s in checkouts(job) and s["with"].get("ref") == BASE_SHA]
    installs = [i for i, s in enumerate(steps) if "--install-only" in s.get("run", "")]
    if not judge or not installs or not candidate or not judge[0] < installs[0] < candidate[0]:
        found.append(f"{where}: the judge is not checked out and installed before the candidate")
    for i, step in enumerate(steps):
        run = step.get("run", "")
        if str(step.get("working-directory", "")).startswith("candidate") or "./candidate" in step.get("uses", ""):
            found.append(f"{where}: step {step.get('name')!r} runs in the candidate's checkout")
        if "candidate" in run.replace("--candidate-dir candidate", ""):
            found.append(f"{where}: step {step.get('name')!r} runs something of the candidate's")
        if i in gate:
            args = run.replace("\\\n", " ").split()
            expected = ["-f", "judge/noxfile.py", "--no-install", "--base-dir", "judge", "--candidate-dir", "candidate"]
            if not all(a in args for a in expected) or "working-directory" in step:
                found.append(f"{where}: the gate is not the judge's noxfile on the two checkouts ({run!r})")
    return found


def unowned(codeowners: str, files: list[str], exempt: tuple[str, ...]) -> list[str]:
    """Files no CODEOWNERS line covers (a line ``/dir/`` or ``/file``), but for ``exempt``."""
    owned = [line.split()[0] for line in codeowners.splitlines() if line.startswith("/")]

    def covered(path: str) -> bool:
        return any(("/" + path).startswith(o) if o.endswith("/") else "/" + path == o for o in owned)

    return [f for f in files if f not in exempt and not covered(f)]
