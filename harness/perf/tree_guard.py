"""Whether the judge's files changed while a perf session ran the candidate's code.

The candidate's measuring process runs as the same user as the judge, so it can write into the
judge's checkout: a kernel source the base compiles later, a module it imports late, a stored
baseline. Nothing here prevents that; it proves it did not happen. Every file and directory the
judge or the base runs or reads is fingerprinted before the candidate's process starts and again
when the session ends; a file added, removed, or changed in size, mode, modification time or
inode change time (which no unprivileged process can set back) fails the session.

Bytecode caches (``__pycache__``) are left out, and directories count by their entries, not their
times: the judge's own lazy imports write bytecode during a session, creating ``__pycache__``
directories as they go. Bytecode caches are a residual risk, stated in .github/SECURITY.md.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

# What the judge and the base read from a checkout while they measure.
GUARDED = ("harness", "kernels", "tests", "baselines", "noxfile.py", "pyproject.toml")
SKIPPED_DIRS = frozenset({"__pycache__"})

Fingerprint = dict[str, tuple[int, int, int, int]]


def _stat(path: Path) -> tuple[int, int, int, int]:
    s = path.lstat()
    if stat.S_ISDIR(s.st_mode):
        return (s.st_mode, 0, 0, 0)
    return (s.st_mode, s.st_size, s.st_mtime_ns, s.st_ctime_ns)


def fingerprint(roots: list[Path]) -> Fingerprint:
    """``{path: (mode, size, mtime, ctime)}`` of every guarded file and directory under ``roots``."""
    out: Fingerprint = {}
    for root in dict.fromkeys(Path(r).resolve() for r in roots):
        for name in GUARDED:
            top = root / name
            if not top.exists():
                continue
            out[str(top)] = _stat(top)
            for directory, dirs, files in os.walk(top):
                dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
                for entry in dirs + files:
                    path = Path(directory) / entry
                    out[str(path)] = _stat(path)
    return out


def changed(before: Fingerprint, after: Fingerprint) -> list[str]:
    """Paths added, removed or changed between two fingerprints, sorted."""
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
