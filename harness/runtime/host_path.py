"""Which host path serves a call: an op's compiled entry point (``host_launcher``), bound once per
process on the op's first call, or the op's Python path alone.

A call goes to the compiled entry first, which takes it where every tensor is as the kernels read
it; anything else runs the op's Python path, which owns every error message. An op's call reads
its ``Entry``'s ``fn`` itself, so the compiled path costs one attribute read and one call.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from harness.runtime import host_launcher, launcher

_lock = threading.Lock()


class Entry:
    """One op's compiled entry point. ``fn`` is read on every call (an attribute, not a function
    call: host time): None until the op's first call binds it (``bound``), False where the Python
    path is used."""

    def __init__(self, op: host_launcher.HostOp):
        self.op = op
        self.fn = None

    def bound(self):
        """``fn``, bound on first use."""
        with _lock:
            if self.fn is None:
                chosen = host_launcher.mode()  # an unknown mode raises here, GPU or not
                # Without a GPU there is nothing the compiled path could take: no build, no warning.
                self.fn = (
                    host_launcher.bind(self.op) if chosen != "python" and torch.cuda.is_available() else None
                ) or False
            return self.fn

    def refused(self, result: tuple, args: tuple):
        """Raise KernelLaunchError for ``fn``'s answer (launch index, CUresult): the driver refused that launch."""
        kernel = self.op.form(*args).launches[result[0]].kernel
        raise launcher.launch_error(kernel.label, result[1])


_entries: dict[str, Entry] = {}


def entry(op: host_launcher.HostOp) -> Entry:
    """The compiled entry of ``op`` (one per op name and process)."""
    with _lock:
        return _entries.setdefault(op.name, Entry(op))


@contextlib.contextmanager
def python_path_only():
    """Run the calls inside through the Python path alone: for side-by-side measurements and tests
    of the two paths (not thread-safe; nothing in the harness uses it outside those)."""
    saved = {name: e.fn for name, e in _entries.items()}
    for e in _entries.values():
        e.fn = False
    try:
        yield
    finally:
        for name, fn in saved.items():
            _entries[name].fn = fn
