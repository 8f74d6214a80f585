"""Which kernel binaries a change altered: every build's cubin in two trees, compared byte for byte.

``python -m harness.compile_check.binaries --base-dir DIR`` compiles every variant of every op in
DIR and in this checkout (or ``--candidate-dir``) with NVRTC (no GPU needed) and lists the builds
whose cubins differ. A change to a shared header, a macro or a comment often leaves most binaries as
they were; a perf verdict on a case whose binary did not change speaks of the host path or of the
measurement, not of the kernel (perf README, "Reading the summary").

Each tree is compiled in its own process with only that tree on the import path, so each build is
that tree's own spec, sources and compile options; nothing of one tree's code runs in the other's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from harness import settings

# Run in a tree's own process (its harness, its kernels/): sha256 of every build's cubin as JSON.
# Only names every tree since the op registry has kept: ops.compile_specs, jit.compile_kernel.
_DIGEST_SCRIPT = """
import fnmatch, hashlib, json, os, sys
from concurrent.futures import ThreadPoolExecutor
import harness
from harness.runtime import jit, ops
archs, pattern = json.loads(sys.argv[1]), sys.argv[2]
named = [(f"{name}@{arch}", spec) for arch in archs for name, spec in ops.compile_specs(arch)]
named = [(n, s) for n, s in named if fnmatch.fnmatchcase(n, pattern)]
with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # NVRTC runs without the GIL
    cubins = pool.map(lambda s: jit.compile_kernel(s).cubin, [s for _, s in named])
    digests = {n: hashlib.sha256(c).hexdigest() for (n, _), c in zip(named, cubins)}
print(json.dumps({"package": os.path.abspath(harness.__file__), "digests": digests}))
"""

STATUSES = ("changed", "only in base", "only in candidate", "same")


class TreeError(RuntimeError):
    """A tree that is not a checkout, or whose own harness could not compile its kernels."""


def digests(tree: Path, archs: tuple[str, ...], pattern: str = "*") -> dict[str, str]:
    """``build@arch`` -> sha256 of its cubin, for every build of ``tree`` matching ``pattern``,
    compiled by ``tree``'s own code in a process of its own."""
    tree = tree.resolve()
    if not (tree / "harness").is_dir() or not (tree / "kernels").is_dir():
        raise TreeError(f"{tree}: not a checkout (no harness/ and kernels/)")
    env = {k: v for k, v in os.environ.items() if k != settings.KERNELS_DIR.name}  # the tree's own kernels/
    env["PYTHONPATH"] = str(tree)
    done = subprocess.run(
        [sys.executable, "-c", _DIGEST_SCRIPT, json.dumps(list(archs)), pattern],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise TreeError(f"{tree}: compiling its builds failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result["package"]).is_relative_to(tree):  # another harness would compile other kernels
        raise TreeError(f"{tree}: its process imported {result['package']}, not the tree's own harness")
    return result["digests"]


@dataclass(frozen=True)
class Build:
    name: str  # build@arch
    status: str  # one of STATUSES


def compare(base: dict[str, str], candidate: dict[str, str]) -> list[Build]:
    """Every build of either side with its status, changed ones first, then by name."""
    builds = []
    for name in base.keys() | candidate.keys():
        if name not in candidate:
            status = "only in base"
        elif name not in base:
            status = "only in candidate"
        else:
            status = "same" if base[name] == candidate[name] else "changed"
        builds.append(Build(name, status))
    return sorted(builds, key=lambda b: (STATUSES.index(b.status), b.name))


def report(builds: list[Build]) -> str:
    """The builds that differ as a table, then a count of each status."""
    differ = [(b.name, b.status) for b in builds if b.status != "same"]
    counts = ", ".join(f"{sum(b.status == s for b in builds)} {s}" for s in STATUSES)
    table = tabulate(differ, headers=("build@arch", "cubin"), tablefmt="github") if differ else "no cubin differs"
    return f"{table}\n\n{len(builds)} builds: {counts}"


def main(argv: list[str] | None = None) -> int:
    from harness.runtime import jit  # the default archs: the ones the resource record checks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-dir", type=Path, required=True, help="the tree to compare against")
    parser.add_argument("--candidate-dir", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--arch", action="append", help=f"sm_XY, repeatable (default: {' '.join(jit.CHECKED_ARCHS)})")
    parser.add_argument("-k", "--builds", default="*", help="glob over build@arch names, e.g. 'mm4-*-m128-*@sm_90'")
    parser.add_argument("--json", type=Path, help="also write every build's status here")
    args = parser.parse_args(argv)

    archs = tuple(args.arch or jit.CHECKED_ARCHS)
    try:
        base = digests(args.base_dir, archs, args.builds)
        candidate = digests(args.candidate_dir, archs, args.builds)
    except TreeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    builds = compare(base, candidate)
    print(report(builds))
    if args.json:
        args.json.write_text(json.dumps({b.name: b.status for b in builds}, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
