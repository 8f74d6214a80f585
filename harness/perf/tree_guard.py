"""Whether the judge's files changed while a perf session ran the candidate's code.

The candidate's measuring process runs as the same user as the judge, so it can write into the
judge's checkout: a kernel source the base compiles later, a module it imports late, a package
that shadows one the judge imports (a new top-level directory on the judge's import path), a
bytecode file, a stored baseline. Nothing here prevents that; it proves it did not happen. Every
file and directory of the judge's and the base's checkouts (but hidden ones and the session's own
output) is fingerprinted before the candidate's process starts and again when the session ends; a
file added, removed, or changed in size, mode, modification time or inode change time (which no
unprivileged process can set back) fails the session.

Bytecode caches (``__pycache__``) are left out, and directories count by their entries, not their
times: other processes of the same checkout (a test run's workers, nox) write bytecode at any time.
Bytecode planted beside the judge's modules is kept out by another means: the judge and the measuring
processes read and write bytecode only in a directory of their own (``sys.pycache_prefix``,
``PYTHONPYCACHEPREFIX``: ``harness.perf.session``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

SKIPPED_DIRS = frozenset({"__pycache__"})

Fingerprint = dict[str, tuple[int, int, int, int]]


def _stat(path: Path) -> tuple[int, int, int, int]:
    s = path.lstat()
    if stat.S_ISDIR(s.st_mode):
        return (s.st_mode, 0, 0, 0)
    return (s.st_mode, s.st_size, s.st_mtime_ns, s.st_ctime_ns)


def guarded(root: Path, exclude: tuple[Path, ...] = ()) -> list[Path]:
    """The entries of a checkout the guard covers: every top-level one but hidden ones (``.git``,
    virtualenvs: no import name starts with a dot) and ``exclude`` (the session's output)."""
    skipped = {Path(p).resolve() for p in exclude}
    return sorted(p for p in Path(root).iterdir() if not p.name.startswith(".") and p.resolve() not in skipped)


def fingerprint(roots: list[Path], exclude: tuple[Path, ...] = ()) -> Fingerprint:
    """``{path: (mode, size, mtime, ctime)}`` of every file and directory ``guarded`` covers under
    ``roots`` (a new top-level entry is a new path)."""
    out: Fingerprint = {}
    for root in dict.fromkeys(Path(r).resolve() for r in roots):
        for top in guarded(root, exclude):
            out[str(top)] = _stat(top)
            if not top.is_dir() or top.is_symlink():
                continue
            for directory, dirs, files in os.walk(top):
                dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
                for entry in dirs + files:
                    path = Path(directory) / entry
                    out[str(path)] = _stat(path)
    return out


def changed(before: Fingerprint, after: Fingerprint) -> list[str]:
    """Paths added, removed or changed between two fingerprints, sorted."""
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
