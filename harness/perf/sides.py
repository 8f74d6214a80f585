"""A side of an A/B session: a checkout whose own ``harness`` package is measured.

A side's measuring process (``harness.perf.worker``) holds the judge's timer, loaded first, and
the side's package. The side's modules are imported under their real names, ``harness`` and
``harness.*``, from the side's checkout, then set aside; ``Side.active()`` puts them back into
``sys.modules`` while the side runs, so an import the side's code makes at call time finds its
own modules too. Modules already loaded keep the modules they bound at import, whatever
``sys.modules`` holds later.
"""

from __future__ import annotations

import contextlib
import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

# Entry points every side must have: the drop-in contract both sides share.
ENTRY_POINTS = ("dequantize_4bit", "matmul_4bit", "patch_bitsandbytes", "unpatch_bitsandbytes")


def _is_harness(name: str) -> bool:
    return name == "harness" or name.startswith("harness.")


def _take_harness_modules() -> dict[str, ModuleType]:
    """Remove every ``harness`` module from ``sys.modules`` and return them."""
    taken = {name: sys.modules.pop(name) for name in [n for n in sys.modules if _is_harness(n)]}
    importlib.invalidate_caches()
    return taken


class Side:
    """One checkout's ``harness``, loaded beside whatever ``harness`` this process already has."""

    def __init__(self, name: str, root: Path):
        self.name, self.root = name, Path(root).resolve()
        if not (self.root / "harness" / "__init__.py").is_file():
            raise FileNotFoundError(f"{self.root} holds no harness package: not a checkout of this project")
        previous = _take_harness_modules()
        sys.path.insert(0, str(self.root))
        try:
            package = importlib.import_module("harness")
            loaded_from = Path(package.__file__).resolve().parent.parent
            if loaded_from != self.root:
                raise ImportError(f"harness was imported from {loaded_from}, not from {self.root}")
            # Resolve the entry points now (the package loads them lazily), while this side's
            # modules are the ones in sys.modules.
            self.entry = {e: getattr(package, e) for e in ENTRY_POINTS}
        finally:
            sys.path.remove(str(self.root))
            self.modules = _take_harness_modules()
            sys.modules.update(previous)

    @contextlib.contextmanager
    def active(self):
        """This side's modules in ``sys.modules`` for the duration; the previous ones after."""
        previous = _take_harness_modules()
        sys.modules.update(self.modules)
        try:
            yield self
        finally:
            self.modules = _take_harness_modules()  # keep what the side imported meanwhile
            sys.modules.update(previous)

    def __getattr__(self, name: str):
        try:
            return self.__dict__["entry"][name]
        except KeyError:
            raise AttributeError(name) from None


def describe(root: Path) -> str:
    """``<dir> @ <short commit>[+dirty]`` for the summary; just the directory where it is not the
    top of a git checkout (a tree unpacked inside another checkout is not that checkout's commit)."""
    root = Path(root).resolve()

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True)
        return done.stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return str(root)
        rev = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return str(root)
    return f"{root} @ {rev}{'+dirty' if dirty else ''}"
