"""Route bitsandbytes' ``dequantize_4bit`` to our kernel, for every caller, in one call.

Every 4-bit dequantization in bitsandbytes 0.50.2, transformers and peft looks the function up
on the ``bitsandbytes.functional`` module at call time (``F.dequantize_4bit`` /
``bnb.functional.dequantize_4bit``): QLoRA's ``MatMul4Bit.backward``, the [K, N]-orientation
path of ``matmul_4bit``, ``Embedding4bit``, the ``Params4bit`` parametrization,
``dequantize_nf4`` / ``dequantize_fp4``, transformers' and peft's ``dequantize_bnb_weight``
(peft's LoRA merge and unmerge), and peft's ``helpers``. Replacing that one attribute reroutes
them all.

Names touched: ``bitsandbytes.functional.dequantize_4bit``, and any module-level name bound to
that function inside the packages in ``PATCHED_PACKAGES`` (bitsandbytes, transformers, peft; in
the releases read, bitsandbytes 0.50.2, transformers 5.23 and peft 0.21, none from-imports it, so
today this is the one attribute). A user's own variables and modules are never rebound:
``ref = F.dequantize_4bit`` taken before the patch keeps pointing at bitsandbytes' function.

Not yet routed (bitsandbytes 0.50.2): ``gemm_4bit``'s dequantize-then-``F.linear`` fallback for
large M (prefill, training forward) and the ``torch.ops.bitsandbytes.dequantize_4bit`` op call
``_dequantize_4bit_impl`` directly, without this attribute.

Anything our kernel does not take (CPU tensors, a packed ``quant_storage`` dtype other than
uint8, ...) goes to the original unchanged: ours validates everything before it launches, so a
refusal has touched nothing. Under ``torch.compile`` the original is called too: its custom op
traces, while our launcher passes raw pointers that TorchDynamo cannot trace.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import warnings
from collections.abc import Iterator

# The bitsandbytes release and the signature of the function this patch was proven against.
PROVEN_BITSANDBYTES = "0.50.2"
PROVEN_SIGNATURE = ("A", "quant_state", "absmax", "out", "blocksize", "quant_type")
# Packages whose modules may hold the function under another name; nothing else is rebound.
PATCHED_PACKAGES = ("bitsandbytes", "transformers", "peft")

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


def _in_patched_packages(module_name: str) -> bool:
    return any(module_name == p or module_name.startswith(p + ".") for p in PATCHED_PACKAGES)


def _bindings_of(obj) -> list[tuple[object, str]]:
    """Every (module, attribute) bound to ``obj`` in the modules of ``PATCHED_PACKAGES``."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if not _in_patched_packages(module_name):
            continue
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for name, value in list(namespace.items()):
            if value is obj:
                found.append((module, name))
    return found


def is_patched() -> bool:
    return _original is not None


def unproven_reason(version: str, function) -> str | None:
    """Why the patch must not be applied to this bitsandbytes, or None when it was proven on it."""
    if version != PROVEN_BITSANDBYTES:
        return f"bitsandbytes {version} is installed; the patch is proven against {PROVEN_BITSANDBYTES} only"
    try:
        params = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return "bitsandbytes.functional.dequantize_4bit has no readable signature"
    if params != PROVEN_SIGNATURE:
        return f"bitsandbytes.functional.dequantize_4bit takes {params}, the patch was proven on {PROVEN_SIGNATURE}"
    return None


def patch_bitsandbytes() -> bool:
    """Send every ``bitsandbytes.functional.dequantize_4bit`` call to our kernel. Idempotent.

    Returns whether the patch is in place. On a bitsandbytes release or signature it was not
    proven against it warns why and patches nothing."""
    global _original
    import bitsandbytes
    import bitsandbytes.functional as F

    with _lock:
        if _original is not None:
            return True
        original = F.dequantize_4bit
        if (reason := unproven_reason(bitsandbytes.__version__, original)) is not None:
            warnings.warn(f"harness.patch_bitsandbytes: nothing patched: {reason}", RuntimeWarning, stacklevel=2)
            return False
        wrapper = _make_wrapper(original)
        bindings = _bindings_of(original)
        for module, name in bindings:
            setattr(module, name, wrapper)
        _rebound[:] = bindings
        _original = original
        return True


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
