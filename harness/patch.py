"""Route bitsandbytes' ``dequantize_4bit`` to our kernel, for every caller, in one call.

Every 4-bit dequantization in bitsandbytes 0.50.2, transformers and peft looks the function up
on the ``bitsandbytes.functional`` module at call time (``F.dequantize_4bit`` /
``bnb.functional.dequantize_4bit``): QLoRA's ``MatMul4Bit.backward``, the [K, N]-orientation
path of ``matmul_4bit``, ``Embedding4bit``, the ``Params4bit`` parametrization,
``dequantize_nf4`` / ``dequantize_fp4``, transformers' and peft's ``dequantize_bnb_weight``
(peft's LoRA merge and unmerge), and peft's ``helpers``. Replacing that one attribute reroutes
them all; any module that did ``from bitsandbytes.functional import dequantize_4bit`` is found
in ``sys.modules`` and rebound too. bitsandbytes' 4-bit forward is a fused GEMM
(``gemm_4bit``) that never dequantizes, so inference forwards gain nothing; backward passes,
merges and explicit dequantization do.

Anything our kernel does not take (CPU tensors, a packed ``quant_storage`` dtype other than
uint8, ...) goes to the original unchanged: ours validates everything before it launches, so a
refusal has touched nothing. Under ``torch.compile`` the original is called too: its custom op
traces, while our launcher passes raw pointers that TorchDynamo cannot trace.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_original = None  # bitsandbytes' function while patched, else None
_rebound: list[tuple[object, str]] = []  # (module, attribute) we replaced
_counts = {"ours": 0, "fallback": 0}


def _make_wrapper(original):
    import torch

    from harness import api

    is_compiling = torch.compiler.is_compiling

    @functools.wraps(original)
    def dequantize_4bit(A, quant_state=None, absmax=None, out=None, blocksize=None, quant_type="fp4"):
        if not is_compiling():
            try:
                result = api.dequantize_4bit(A, quant_state, absmax, out, blocksize, quant_type)
            except ValueError:
                pass  # not something our kernel takes (nothing was launched): bitsandbytes decides
            else:
                _counts["ours"] += 1
                return result
        _counts["fallback"] += 1
        return original(A, quant_state, absmax, out, blocksize, quant_type)

    dequantize_4bit._nf4_harness_original = original
    return dequantize_4bit


def _bindings_of(obj) -> list[tuple[object, str]]:
    """Every (module, attribute) in ``sys.modules`` currently bound to ``obj``."""
    found = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for name, value in list(namespace.items()):
            if value is obj:
                found.append((module, name))
    return found


def is_patched() -> bool:
    return _original is not None


def patch_bitsandbytes() -> None:
    """Send every ``bitsandbytes.functional.dequantize_4bit`` call to our kernel. Idempotent."""
    global _original
    import bitsandbytes.functional as F

    with _lock:
        if _original is not None:
            return
        original = F.dequantize_4bit
        wrapper = _make_wrapper(original)
        bindings = _bindings_of(original)
        for module, name in bindings:
            setattr(module, name, wrapper)
        _rebound[:] = bindings
        _original = original


def unpatch_bitsandbytes() -> None:
    """Restore bitsandbytes' own function everywhere it was, and wherever a module imported the
    patched one since. Harmless when not patched."""
    global _original
    with _lock:
        if _original is None:
            return
        import bitsandbytes.functional as F

        wrapper = F.dequantize_4bit
        for module, name in _rebound:
            setattr(module, name, _original)
        if getattr(wrapper, "_nf4_harness_original", None) is _original:
            for module, name in _bindings_of(wrapper):  # from-imports made while patched
                setattr(module, name, _original)
        _rebound.clear()
        _original = None


@contextlib.contextmanager
def bitsandbytes_patched() -> Iterator[None]:
    """``with bitsandbytes_patched(): ...`` patches for the block; leaves a patch made before it."""
    already = is_patched()
    patch_bitsandbytes()
    try:
        yield
    finally:
        if not already:
            unpatch_bitsandbytes()


def routed_calls() -> dict[str, int]:
    """How many patched calls ran our kernel and how many went to bitsandbytes, since import."""
    return dict(_counts)
