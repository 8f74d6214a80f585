"""Which host path serves a call: the compiled entry points (``host_launcher``), bound once per
process on the first call, or the Python path alone.

A call goes to the compiled entry first, which takes it where every tensor is as the kernel reads
it; anything else runs the op's Python path, which owns every error message.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from harness.runtime import host_launcher

# The compiled dequantization entry: None until the first call binds it, False where the Python path
# is used. Read directly on every call (a module global, not a function call: host time).
dequantize = None
# The compiled matmul entry, bound beside the dequantization entry it was configured from.
_matmul: tuple = (None, None)
_lock = threading.Lock()


def bind_dequantize():
    """The compiled dequantization entry, bound on first use (False: the Python path)."""
    global dequantize
    with _lock:
        if dequantize is None:
            chosen = host_launcher.mode()  # an unknown mode raises here, GPU or not
            # Without a GPU there is nothing the compiled path could take: no build, no warning.
            dequantize = (host_launcher.bind() if chosen != "python" and torch.cuda.is_available() else None) or False
    return dequantize


def matmul_entry(crossover):
    """The compiled matmul entry (None: the Python path), bound beside the dequantization entry
    with ``crossover`` (device index -> the GPU's crossover table) as its rows rule; the same
    binding mode, and ``python_path_only`` turns both off."""
    global _matmul
    bound_to, entry = _matmul
    if bound_to is dequantize and bound_to:  # bound, and beside the entry in use: every call after the first
        return entry
    beside = dequantize if dequantize is not None else bind_dequantize()
    if not beside:
        return None
    bound_to, entry = _matmul
    if bound_to is not beside:
        with _lock:
            bound_to, entry = _matmul
            if bound_to is not beside:
                entry = host_launcher.bind_matmul(beside, crossover)
                _matmul = (beside, entry)
    return entry


@contextlib.contextmanager
def python_path_only():
    """Run the calls inside through the Python path alone: for side-by-side measurements and tests
    of the two paths (not thread-safe; nothing in the harness uses it outside those)."""
    global dequantize
    saved, dequantize = dequantize, False
    try:
        yield
    finally:
        dequantize = saved
