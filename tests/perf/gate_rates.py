"""How often the perf gate is wrong: repeated A/B sessions of unchanged code and of planted
slowdowns, one session per GPU at a time, each through the same pytest path as ``nox -s perf``.

    python -m tests.perf.gate_rates --out DIR [--repeat N] [-k EXPR] [--isolation per-side|shared] SCENARIO...

SCENARIO is ``aa`` (the candidate is an unchanged copy of this checkout), ``swap`` (the same two
trees with their roles swapped: the copy is the base, this checkout the candidate; an offset that
follows the candidate's slot rather than its tree shows in both), ``plant:X`` (every
launch of its dequantization kernel takes 1 + X times as long, ``tests/perf/planted.py``),
``fp32:X`` (the same in the fp32-output builds only) or ``mm:X`` (the fused matmul's kernel),
optionally with ``*N`` to run it N times instead of ``--repeat``. The judge is always this
checkout's, and so is the base but under ``swap``. Prints one table last and writes
``DIR/gate-rates.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tabulate import tabulate

from harness.perf.stats import rate_bounds

from . import planted

ROOT = Path(__file__).resolve().parents[2]
LARGE = "large"
UNCHANGED = ("aa", "swap")  # scenarios of unchanged code: a red session is a false alarm


def scenario_trees(scenario: str, source: Path, tmp: Path) -> tuple[Path, Path]:
    """The (base, candidate) checkouts of a scenario, built once in ``tmp``."""
    built = scenario_tree(scenario, source, tmp)
    return (built, source) if scenario == "swap" else (source, built)


def scenario_tree(scenario: str, source: Path, tmp: Path) -> Path:
    """The checkout a scenario measures against ``source``, built once in ``tmp``: an unchanged
    copy (``aa``, and ``swap``'s base) or a planted one."""
    dest = tmp / scenario.replace(":", "-")
    if scenario in UNCHANGED:
        return planted.copy_checkout(source, dest)
    kind, stretch = scenario.split(":")
    if kind not in ("plant", "fp32", "mm"):
        raise ValueError(f"unknown scenario {scenario!r}: aa, swap, plant:X, fp32:X or mm:X")
    kernel = "matmul" if kind == "mm" else "dequantize"
    return planted.build(source, dest, float(stretch), only_fp32=kind == "fp32", kernel=kernel)


def run_session(
    gpu: int, trees: tuple[Path, Path], out: Path, k_expr: str | None, isolation: str | None = None
) -> dict:
    """One A/B session of (base, candidate) on one GPU; its exit status, verdicts and wall time."""
    base, candidate = trees
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pytest", str(ROOT / "tests" / "perf"), "-p", "no:cacheprovider", "-q",
        "--require-gpu", "--benchmark-only", "--no-references", f"--base-dir={base}",
        f"--candidate-dir={candidate}", f"--perf-out={out}", f"--benchmark-json={out / 'benchmark.json'}",
        "-k", f"not qlora and ({k_expr})" if k_expr else "not qlora",
        *([f"--isolation={isolation}"] if isolation else []),
    ]  # fmt: skip
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": str(gpu),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    t0 = time.perf_counter()
    with open(out / "session.log", "w") as log:
        status = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    verdicts_file = out / "verdicts.json"
    cases = json.loads(verdicts_file.read_text())["cases"] if verdicts_file.exists() else {}
    return {"status": status, "wall_s": time.perf_counter() - t0, "cases": cases, "gpu": gpu}


def _bound(scenario: str, red: int, sessions: int) -> str:
    """What the count says about the rate: for unchanged code the most its false alarms could be,
    for a planted slowdown the least its detections could be (one-sided, 95%)."""
    if not sessions:
        return "—"
    lower, upper = rate_bounds(red, sessions)
    return f"≤ {upper:.0%}" if scenario in UNCHANGED else f"≥ {lower:.0%}"


def summarize(scenario: str, sessions: list[dict]) -> dict:
    """Rates over the sessions of one scenario."""
    slower = [{c for c, v in s["cases"].items() if v.get("verdict") == "SLOWER"} for s in sessions]
    kernel = [{c: v for c, v in s["cases"].items() if v.get("class")} for s in sessions]
    large = [{c for c, v in k.items() if v["class"] == LARGE} for k in kernel]
    fp32 = [{c for c in k if "-fp32-" in c} for k in kernel]
    ratios = sorted(v["ratio"] for k in kernel for v in k.values() if v.get("ratio"))
    return {
        "scenario": scenario,
        "sessions": len(sessions),
        "red": (red := sum(s["status"] != 0 for s in sessions)),
        "red rate, 95% bound": _bound(scenario, red, len(sessions)),
        "undecided": sum(s["status"] == 6 for s in sessions),
        # Red by the stored baseline rather than by the A/B (a session can be both).
        "with a case DRIFTED": sum(any(v.get("drift") == "DRIFTED" for v in s["cases"].values()) for s in sessions),
        "cases per session": statistics.median(len(k) for k in kernel) if kernel else 0,
        "SLOWER cases (all sessions)": sum(len(s) for s in slower),
        "every large SLOWER": sum(bool(lg) and lg <= sl for lg, sl in zip(large, slower, strict=True)),
        "every case SLOWER": sum(bool(k) and set(k) == sl for k, sl in zip(kernel, slower, strict=True)),
        "only fp32 SLOWER": sum(bool(f) and sl == f for f, sl in zip(fp32, slower, strict=True)),
        "ratio min / median / max": (
            f"{ratios[0]:.4f} / {statistics.median(ratios):.4f} / {ratios[-1]:.4f}" if ratios else "—"
        ),
        "wall s (median)": round(statistics.median(s["wall_s"] for s in sessions), 1) if sessions else 0,
    }


def visible_gpus() -> list[int]:
    import pynvml

    pynvml.nvmlInit()
    return list(range(pynvml.nvmlDeviceGetCount()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.perf.gate_rates", description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("-k", dest="k_expr", default=None, help="pytest -k expression selecting the cases")
    parser.add_argument("--isolation", default=None, help="the perf session's --isolation (default: the policy's)")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="nf4-gate-rates-"))
    repeats = {s.split("*")[0]: int(s.split("*")[1]) if "*" in s else args.repeat for s in args.scenarios}
    trees = {s: scenario_trees(s, ROOT, tmp) for s in repeats}
    jobs: queue.Queue = queue.Queue()
    for rep in range(max(repeats.values())):
        for s, count in repeats.items():
            if rep < count:
                jobs.put((s, rep))
    results: dict[str, list[dict]] = {s: [] for s in repeats}
    lock = threading.Lock()

    def write(results: dict[str, list[dict]]) -> list[dict]:
        rows = [summarize(s, results[s]) for s in repeats if results[s]]
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gate-rates.json").write_text(json.dumps({"rows": rows, "sessions": results}, indent=1) + "\n")
        return rows

    def serve(gpu: int) -> None:
        while True:
            try:
                scenario, rep = jobs.get_nowait()
            except queue.Empty:
                return
            out = args.out / scenario.replace(":", "-") / f"session-{rep:02d}-gpu{gpu}"
            result = run_session(gpu, trees[scenario], out, args.k_expr, args.isolation)
            with lock:
                results[scenario].append(result)
                print(f"{scenario} #{rep} gpu{gpu}: status {result['status']} in {result['wall_s']:.0f} s", flush=True)
                write(results)  # after every session, so a run cut short keeps what it measured

    threads = [threading.Thread(target=serve, args=(g,)) for g in visible_gpus()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = write(results)
    print(tabulate([list(r.values()) for r in rows], headers=list(rows[0]), tablefmt="simple", disable_numparse=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
