"""The noxfile: every session listed with help, GPU detection and the offline (--no-venv) path."""

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _nox_list() -> dict[str, tuple[bool, str]]:
    """`nox -l` as {session: (selected by default, one-line help)}."""
    pytest.importorskip("nox")
    done = subprocess.run([sys.executable, "-m", "nox", "-l"], cwd=ROOT, capture_output=True, text=True, check=True)
    listed = {}
    for line in done.stdout.splitlines():
        if m := re.match(r"^([*-]) (\S+) -> (.+)$", line):
            listed[m[2]] = (m[1] == "*", m[3])
    return listed


def test_sessions_are_listed_with_one_line_help():
    sessions = _nox_list()
    assert {name: default for name, (default, _) in sessions.items()} == {
        "lint": True,
        "compile": True,
        "correctness": True,
        "perf": False,  # opt-in: needs a GPU
        "bnb-paths": False,  # opt-in: needs a GPU
        "grid-sweep": False,  # opt-in: needs a GPU, or a recorded sweep to replay
        "sanitize": False,  # opt-in: needs a GPU
    }
    assert all(help_text.strip() for _, help_text in sessions.values())


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


def test_perf_options_are_taken_from_posargs():
    sys.path.insert(0, str(ROOT))
    try:
        import noxfile
    finally:
        sys.path.remove(str(ROOT))
    args = ["--against", "origin/main", "-k", "llama", "--candidate-dir=../pr"]
    assert noxfile._take_option(args, "--against") == "origin/main"
    assert noxfile._take_option(args, "--candidate-dir") == "../pr"
    assert noxfile._take_option(args, "--base-dir") is None
    assert args == ["-k", "llama"]  # what is left goes to pytest


def _collect_one_file() -> list[str]:
    """pytest arguments that collect one small test file in a session that always names tests/:
    the others ignored, so that a check of the session itself does not collect the whole suite."""
    ignored = [f"--ignore={p.relative_to(ROOT)}" for p in sorted((ROOT / "tests").glob("test_*.py"))]
    return ["--collect-only", "-q", *(a for a in ignored if not a.endswith("test_ptxas_report.py"))]


@pytest.mark.parametrize("gpus", ["0", "2"])
def test_no_venv_correctness_runs_in_this_interpreter_installing_nothing(gpus):
    """The offline-GPU-box path: --no-venv must not reach session.install (it raises there). With
    two GPUs (pretended: collection only) one file of single-GPU tests leaves the multi-GPU pass
    nothing, which is skipped instead of failing the session with pytest's exit 5."""
    pytest.importorskip("nox")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")} | {"NF4_HARNESS_GPUS": gpus}
    done = subprocess.run(
        [sys.executable, "-m", "nox", "--no-venv", "-s", "correctness", "--", *_collect_one_file()],
        cwd=ROOT, capture_output=True, text=True, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    output = done.stdout + done.stderr
    assert "installing nothing" in output and "2 tests collected" in output
    if gpus == "2":
        assert "no test selected with -m 'multigpu': that pass skipped" in output


def test_perf_against_a_ref_runs_that_refs_tests_on_both_checkouts(tmp_path):
    """`nox -s perf -- --against HEAD` checks HEAD out as the judge and runs its perf tests with
    both sides named (collection only: no GPU here; NF4_HARNESS_GPUS pretends one)."""
    pytest.importorskip("nox")
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    # Not this run's pytest-xdist worker variables: the child's pytest-benchmark would take them
    # for its own xdist and refuse --benchmark-only.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env |= {"NF4_HARNESS_GPUS": "1", "NF4_HARNESS_PERF_OUT": str(tmp_path / "out")}
    done = subprocess.run(
        [sys.executable, "-m", "nox", "--no-venv", "-s", "perf", "--", "--against", "HEAD", "--collect-only", "-q"],
        cwd=ROOT, capture_output=True, text=True, check=False, env=env,
    )  # fmt: skip
    worktree = ROOT / ".nox" / "perf" / "tmp" / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], capture_output=True)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "git worktree add --detach" in output
    assert re.search(r"tests/perf/test_perf_\w+\.py: \d+", output), output  # the ref's own files, collected, not run
    assert f"--base-dir={worktree}" in output and f"--candidate-dir={ROOT}" in output
    assert f"{worktree}/tests/perf" in output  # the judge's tests, not the working tree's


def test_xdist_workers_are_pinned_one_gpu_each(monkeypatch):
    from tests.conftest import _pin_xdist_worker_to_gpu

    monkeypatch.setenv("NF4_HARNESS_WORKER_GPUS", "0,1")
    seen = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        _pin_xdist_worker_to_gpu()
        seen.append(os.environ["CUDA_VISIBLE_DEVICES"])
    assert seen == ["0", "1", "0"]


def test_a_users_marker_filter_narrows_the_sessions_instead_of_replacing_it():
    """`nox -s correctness -- -m "not huge"` on one GPU must still deselect multi-GPU cases."""
    sys.path.insert(0, str(ROOT))
    try:
        import noxfile
    finally:
        sys.path.remove(str(ROOT))
    for given in (["-m", "not huge", "-x"], ["-mnot huge", "-x"], ["-m=not huge", "-x"]):
        args = list(given)
        assert noxfile._and_marks("not multigpu", noxfile._take_marker(args)) == "(not multigpu) and (not huge)"
        assert args == ["-x"]
    args = ["-k", "nested", "--maxfail=2"]
    assert noxfile._and_marks("not multigpu", noxfile._take_marker(args)) == "not multigpu"
    assert args == ["-k", "nested", "--maxfail=2"]


class _RecordedSession:
    """What the correctness session uses of a nox session under --no-venv; records each command
    and answers a collection (a silent ``python -c``) from ``empty``: the ``-m`` expressions that
    select no test."""

    venv_backend = "none"

    def __init__(self, posargs: list[str], empty: tuple[str, ...] = ()):
        self.posargs, self.empty, self.runs = posargs, empty, []

    def log(self, *args) -> None:
        pass

    def error(self, message: str):
        raise RuntimeError(message)

    def run(self, *args, **kwargs):
        if args[1] == "-c" and kwargs.get("silent"):
            return f"collected\npytest exit {5 if _pass_marks(args) in self.empty else 0}\n"
        self.runs.append((args, kwargs))


def _pass_marks(args: tuple[str, ...]) -> str:
    """The marker expression of a pytest command (after its last ``-m``; the first is ``python -m``)."""
    return args[max(i for i, arg in enumerate(args) if arg == "-m") + 1]


@pytest.mark.parametrize(
    ("posargs", "empty", "passes"),
    [
        ([], (), ["not multigpu", "multigpu"]),
        (["-m", "multigpu"], ("(not multigpu) and (multigpu)",), ["(multigpu) and (multigpu)"]),
        (["-m", "fp4"], ("(multigpu) and (fp4)",), ["(not multigpu) and (fp4)"]),
        (["-k", "ptxas_report"], ("multigpu",), ["not multigpu"]),
        (["-k", "fp4"], (), ["not multigpu", "multigpu"]),
    ],
    ids=["whole-suite", "marker-multigpu", "marker-fp4", "keyword-single-gpu-only", "keyword-both"],
)
def test_a_selection_that_empties_one_pass_of_a_multi_gpu_run_skips_that_pass(monkeypatch, posargs, empty, passes):
    """On several GPUs the session runs two passes (one worker per GPU, then the multi-GPU cases):
    a user's narrowing may leave one of them nothing (`-m multigpu` the first, `-k` naming
    single-GPU tests the second), where pytest would exit 5 and fail the session: that pass is
    skipped. The whole suite runs both passes without asking."""
    noxfile = _noxfile()
    monkeypatch.setenv("NF4_HARNESS_GPUS", "2")
    session = _RecordedSession(list(posargs), empty)
    noxfile.correctness(session)
    assert [_pass_marks(args) for args, _ in session.runs] == passes
    assert all("success_codes" not in kwargs for _, kwargs in session.runs)


def test_a_selection_that_no_pass_runs_fails_the_multi_gpu_session(monkeypatch):
    noxfile = _noxfile()
    monkeypatch.setenv("NF4_HARNESS_GPUS", "2")
    session = _RecordedSession(["-k", "no_such_test"], ("not multigpu", "multigpu"))
    with pytest.raises(RuntimeError, match="no test on either pass"):
        noxfile.correctness(session)
    assert session.runs == []


def test_every_nf4_harness_variable_is_declared_once_in_settings():
    """One place: any NF4_HARNESS_* name the code, workflows or docs use is a declared setting,
    and no module reads one at import time (the only reader is Setting.get)."""
    import re

    from harness import settings

    declared = {s.name for s in settings.ALL}
    assert len(declared) == len(settings.ALL)
    used = set()
    files = [*ROOT.glob("harness/**/*.py"), *ROOT.glob("tests/**/*.py"), ROOT / "noxfile.py", ROOT / "README.md"]
    files += [*ROOT.glob(".github/workflows/*.yml"), ROOT / ".ci" / "run"]
    for path in files:
        used |= set(re.findall(r"NF4_HARNESS_[A-Z0-9_]+", path.read_text()))
    assert used <= declared, f"not declared in harness/settings.py: {sorted(used - declared)}"
    readers = [
        p.relative_to(ROOT)
        for p in [*ROOT.glob("harness/**/*.py"), ROOT / "noxfile.py", ROOT / "tests" / "conftest.py"]
        if re.search(r"environ(\.get)?\(\s*['\"]NF4_HARNESS_|environ\[\s*['\"]NF4_HARNESS_", p.read_text())
    ]
    assert readers == [], f"read the environment directly: {readers}"


def test_readme_lists_every_setting():
    from harness import settings

    readme = (ROOT / "README.md").read_text()
    assert all(f"| `{s.name}` |" in readme for s in settings.ALL)


def _noxfile():
    pytest.importorskip("nox")
    sys.path.insert(0, str(ROOT))
    try:
        import noxfile
    finally:
        sys.path.remove(str(ROOT))
    return noxfile


def test_pytorch_is_a_cpu_build_where_no_gpu_is_visible(monkeypatch):
    noxfile = _noxfile()
    monkeypatch.delenv("NF4_HARNESS_TORCH_INDEX", raising=False)
    monkeypatch.setenv("NF4_HARNESS_TORCH_SPEC", "torch")
    monkeypatch.setenv("NF4_HARNESS_GPUS", "0")
    assert noxfile.torch_requirement() == ["torch", "--index-url", noxfile.CPU_TORCH_INDEX]
    monkeypatch.setenv("NF4_HARNESS_GPUS", "1")  # a GPU machine keeps pip's index (a CUDA build)
    assert noxfile.torch_requirement() == ["torch"]
    monkeypatch.setenv("NF4_HARNESS_GPUS", "0")
    monkeypatch.setenv("NF4_HARNESS_TORCH_INDEX", "")  # the override: pip's configured index
    monkeypatch.setenv("NF4_HARNESS_TORCH_SPEC", "torch==2.13.0")
    assert noxfile.torch_requirement() == ["torch==2.13.0"]


class _Session:
    """What ``_has_module`` reads of a nox session: ``run_install`` with ``silent=True`` returns
    the command's output as a string (nox's documented behaviour), never True."""

    venv_backend = "venv"

    def __init__(self, output: str):
        self.output = output

    def run_install(self, *args, silent=False, **kwargs):
        assert silent, "the answer is read from the output, which nox returns only when silent"
        return self.output


def test_has_module_reads_what_the_interpreter_printed():
    noxfile = _noxfile()
    assert noxfile._has_module(_Session("found\n"), "torch")
    assert not noxfile._has_module(_Session("missing\n"), "torch")
    assert not noxfile._has_module(_Session(""), "torch")


def test_a_second_correctness_run_installs_nothing():
    """The run that is testing this installed into .nox/correctness; running the session again
    must reuse it without a single pip install (collection only: seconds)."""
    noxfile = _noxfile()
    venv = ROOT / ".nox" / "correctness"
    if Path(sys.prefix).resolve() != venv.resolve():
        pytest.skip("runs inside `nox -s correctness`, whose virtualenv it reuses")
    assert (venv / noxfile.INSTALL_STAMP).is_file()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    done = subprocess.run(
        [sys.executable, "-m", "nox", "-s", "correctness", "--", *_collect_one_file()],
        cwd=ROOT, capture_output=True, text=True, check=False, env=env,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "installing nothing" in output and "pip install" not in output, output


def test_the_perf_judge_keeps_an_inherited_pythonpath_and_reads_no_bytecode_from_a_checkout(monkeypatch):
    noxfile = _noxfile()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/opt/site-a", "", "/opt/site-b"]))
    judge, tmp = Path("/ci/judge"), Path("/ci/tmp")
    env = noxfile.judge_env(judge, tmp)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(judge), "/opt/site-a", "/opt/site-b"]
    assert env["PYTHONPYCACHEPREFIX"] == str(tmp / "judge-bytecode")  # outside both checkouts
    monkeypatch.delenv("PYTHONPATH")
    assert noxfile.judge_env(judge, tmp)["PYTHONPATH"] == str(judge)


def test_kernels_is_not_importable_from_any_directory(tmp_path):
    """kernels/ holds CUDA sources, never a Python package: bitsandbytes probes for a package named
    `kernels` (kernels-community) and prints an error on every import when it finds ours."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = "import importlib.util; print(importlib.util.find_spec('kernels'))"
    for cwd in (tmp_path, ROOT / "tests"):
        done = subprocess.run([sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, env=env)
        assert done.stdout.strip() == "None", f"from {cwd}: {done.stdout}{done.stderr}"
    done = subprocess.run(
        [sys.executable, "-c", "import harness, bitsandbytes; print(harness.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, env=env,
    )  # fmt: skip
    if done.returncode:
        pytest.skip(f"harness and bitsandbytes are not both installed here: {done.stderr.strip().splitlines()[-1:]}")
    # bitsandbytes says it could not load kernels-community's package wherever that is not
    # installed; what it must never find is ours (then it fails on the missing get_kernel).
    assert "from 'kernels'" not in done.stderr and str(ROOT / "kernels") not in done.stderr, done.stderr


_INSTALLED_PROBE = """
import hashlib, importlib.util, json, harness
from harness.runtime import jit
sources = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in jit.kernels_dir().glob("*.cu*")}
drop_ins = [harness.dequantize_4bit.__name__, harness.matmul_4bit.__name__]
print(json.dumps({"file": harness.__file__, "drop_ins": drop_ins, "sources": sources,
                  "kernels_package": importlib.util.find_spec("kernels") is not None}))
"""


def _installed_view(cwd: Path, env: dict) -> dict:
    """What ``import harness`` gives an interpreter started in ``cwd``: its file, both drop-ins,
    the CUDA sources it would compile (name: sha256) and whether a ``kernels`` package is importable."""
    done = subprocess.run([sys.executable, "-c", _INSTALLED_PROBE], cwd=cwd, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_installed_package_has_both_drop_ins_and_every_kernel_source_from_any_directory(tmp_path):
    """From a directory outside the checkout, as a user's script or notebook imports it: the
    session's own (editable) install, and a plain install of the wheel, each import the package
    with both drop-ins and compile the checkout's CUDA sources, every one of them."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        importlib.metadata.distribution("nf4-harness")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("nf4-harness is not installed in this interpreter (the suite runs from the checkout)")
    expected = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (ROOT / "kernels").glob("*.cu*")}
    assert expected and all(name.endswith((".cu", ".cuh")) for name in expected)
    editable = _installed_view(tmp_path, env)
    assert Path(editable["file"]).resolve() == ROOT / "harness" / "__init__.py", editable
    assert editable["drop_ins"] == ["dequantize_4bit", "matmul_4bit"]
    assert editable["sources"] == expected and not editable["kernels_package"]
    pytest.importorskip("hatchling", reason="building the wheel without network needs hatchling installed")
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site)]
    subprocess.run([*pip, str(ROOT)], check=True, capture_output=True, env=env)
    wheel = _installed_view(tmp_path, {**env, "PYTHONPATH": str(site)})
    assert Path(wheel["file"]).resolve() == site / "harness" / "__init__.py", wheel
    assert wheel["drop_ins"] == ["dequantize_4bit", "matmul_4bit"]
    assert wheel["sources"] == expected and not wheel["kernels_package"]


def test_gpu_sessions_switch_the_user_site_off(monkeypatch):
    """A .pth left in the user site runs in every virtualenv that sees the system's packages
    (every GPU session uses one): GPU sessions run with the user site off."""
    monkeypatch.delenv("NF4_HARNESS_HOST_LAUNCHER", raising=False)
    env = _noxfile()._gpu_env(PYTHONPATH="/judge")
    assert env["PYTHONNOUSERSITE"] == "1" and env["PYTHONPATH"] == "/judge"
    assert env["NF4_HARNESS_HOST_LAUNCHER"] == "compiled"


def test_correctness_on_a_candidate_runs_this_checkouts_tests_and_checking_code_on_the_candidates_package(tmp_path):
    """The base's tests judge a pull request: a candidate that breaks a rule and weakens the test
    of it passes its own suite and fails this checkout's (CPU tests; --no-venv, nothing installed);
    its checking code (here ``harness/correctness/cases.py``, which the tests import) never runs."""
    pytest.importorskip("nox")
    from tests.perf import planted

    candidate = planted.copy_checkout(ROOT, tmp_path / "candidate")
    kernel = candidate / "harness" / "runtime" / "matmul_kernel.py"
    kernel.write_text(kernel.read_text().replace("for t in TOKEN_TILES if m <= t", "for t in TOKEN_TILES if m < t"))
    test = candidate / "tests" / "test_matmul.py"
    test.write_text(test.read_text().replace("def test_a_token_tile_holds", "def _weakened_test_a_token_tile_holds"))
    marker = tmp_path / "candidate-checking-code-ran"
    checking = candidate / "harness" / "correctness" / "cases.py"
    checking.write_text(checking.read_text() + f"\nopen({str(marker)!r}, 'a').write('ran')\n")
    select = ["tests/test_matmul.py", "-k", "token_tile", "-n", "0"]  # a few tests: no workers to start
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")} | {"NF4_HARNESS_GPUS": "0"}

    def correctness(cwd: Path, *extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "nox", "--no-venv", "-s", "correctness", "--", *extra, *select]
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False, env=env)

    own = correctness(candidate)
    assert own.returncode == 0, own.stdout + own.stderr  # its own, weakened suite passes
    assert marker.read_text() == "ran"  # and there its checking code runs
    marker.unlink()
    judged = correctness(ROOT, "--candidate-dir", str(candidate))
    output = judged.stdout + judged.stderr
    assert f"this checkout's tests and judging packages on the package and kernels at {candidate}" in output
    assert judged.returncode != 0 and "test_a_token_tile_holds_the_rows" in output, output
    assert not marker.exists(), "the candidate's checking code ran in the base's test run"
    empty = correctness(ROOT, "--candidate-dir", str(tmp_path))
    assert empty.returncode != 0 and "holds no harness package" in empty.stdout + empty.stderr


def test_a_candidate_tree_takes_the_judging_packages_from_the_judge_and_the_rest_from_the_candidate(tmp_path):
    """Each entry of the tree the base's tests run from, and which checkout it is: the candidate's
    product (its harness package but the judging packages, its kernels/, whatever new module it adds),
    the judge's tests, configuration, records and judging packages."""
    noxfile = _noxfile()
    judge, candidate = tmp_path / "judge", tmp_path / "candidate"
    for root in (judge, candidate):
        for path in ("harness/runtime", "harness/correctness/data", "harness/perf", "harness/compile_check", "kernels"):
            (root / path).mkdir(parents=True)
        (root / "harness" / "__init__.py").write_text("")
    (judge / "tests").mkdir()
    (candidate / "harness" / "ops").mkdir()  # a new product package
    (candidate / "tests").mkdir()
    tree = noxfile.candidate_tree(judge, candidate, tmp_path / "tree")
    owner = {
        str(p.relative_to(tree)): p.resolve().relative_to(tmp_path).parts[0]
        for p in [*tree.iterdir(), *(tree / "harness").iterdir()]
    }
    assert owner == {
        "harness": "tree", "kernels": "candidate", "tests": "judge", "harness/__init__.py": "candidate",
        "harness/runtime": "candidate", "harness/ops": "candidate", "harness/correctness": "judge",
        "harness/perf": "judge", "harness/compile_check": "judge",
    }  # fmt: skip
    assert set(noxfile.JUDGE_OWNS) == {"harness/correctness", "harness/perf", "harness/compile_check"}
    # Every package of this checkout's harness is one or the other: a new judging package must be listed.
    product = {"runtime"}
    packages = {p.name for p in (ROOT / "harness").iterdir() if (p / "__init__.py").is_file()}
    assert packages == product | {Path(p).name for p in noxfile.JUDGE_OWNS}
