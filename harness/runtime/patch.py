"""Route bitsandbytes' 4-bit dequantizations to our kernel, at bitsandbytes' own seams, in one call.

bitsandbytes 0.50.2 dequantizes 4-bit weights on CUDA through three module-level names, each
looked up at call time, so rebinding them reroutes every caller (``SEAMS``):

- ``bitsandbytes.functional.dequantize_4bit``: QLoRA's ``MatMul4Bit.backward``, the
  [K, N]-orientation path of ``matmul_4bit``, ``Embedding4bit``, the ``Params4bit``
  parametrization, ``dequantize_nf4`` / ``dequantize_fp4``, transformers' and peft's
  ``dequantize_bnb_weight`` (peft's LoRA merge and unmerge). Ours decodes nested statistics in
  the same launch, where bitsandbytes runs three kernels (8-bit decode, offset add, 4-bit decode).
- ``bitsandbytes.backends.cuda.ops._dequant_linear_fallback``: ``gemm_4bit``'s
  dequantize-then-``F.linear`` path, taken for M > 1536 and wherever its per-GPU heuristic
  prefers it (prefill, the training forward). Ours again fuses the nested decode; the
  ``F.linear`` is bitsandbytes' own.
- ``bitsandbytes.backends.cuda.ops._dequantize_4bit_impl``: the CUDA kernel of the
  ``bitsandbytes::dequantize_4bit`` op and its ``.out`` overload (plain fp32 scales), so a
  caller of ``torch.ops.bitsandbytes.dequantize_4bit`` and a ``torch.compile``d graph that
  holds that op run ours too.

Under ``torch.compile`` the ``functional`` seam calls our own registered op
``nf4_harness::dequantize_4bit`` (``dequantize.TORCH_OPS``), so compiled graphs keep the fused
nested decode; the two ``backends.cuda.ops`` seams run inside bitsandbytes' ops, which compiled
graphs call as opaque kernels.

Names touched: the three above, and any module-level name bound to one of those functions
inside the packages in ``PATCHED_PACKAGES`` (bitsandbytes, transformers, peft; in bitsandbytes
0.50.2, transformers 5.23 and peft 0.21 none from-imports them). A user's own variables and
modules are never rebound: ``ref = F.dequantize_4bit`` taken before the patch keeps pointing at
bitsandbytes' function. Without CUDA, bitsandbytes does not load ``backends.cuda.ops`` and only
the ``functional`` seam is patched.

Anything our kernel does not take (CPU tensors, a non-contiguous input, ...) goes to the
original unchanged: ours validates everything before it launches, so a refusal (a
``InputError``) has touched nothing. Any other error (a misconfigured setting, a
toolchain that cannot build, a refused launch) is raised, never hidden behind a fallback.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from harness.errors import InputError
from harness.runtime import compiled_decode as compiled_decode_seams
from harness.runtime import route_counts

# The bitsandbytes release the patch was proven against (bit-exact, end to end).
PROVEN_BITSANDBYTES = "0.50.2"
# Packages whose modules may hold a seam's function under another name; nothing else is rebound.
PATCHED_PACKAGES = ("bitsandbytes", "transformers", "peft")
CUDA_OPS = "bitsandbytes.backends.cuda.ops"


@dataclass(frozen=True)
class Seam:
    """One module-level function bitsandbytes calls by name, and the signature it was proven with."""

    module: str
    name: str
    signature: tuple[str, ...]
    label: str  # the key of its counts in routed_calls()
    needs_cuda: bool  # its module exists only where bitsandbytes loaded its CUDA backend
    matmul_only: bool = False  # patched only with patch_bitsandbytes(matmul=True)


# The arguments of gemm_4bit's two paths (its fused kernel and its dequantize + F.linear fallback).
GEMM_SIGNATURE = (
    "A", "B", "shapeB", "absmax", "blocksize", "quant_type", "bias", "absmax_8bit", "absmax_code", "absmax_offset",
)  # fmt: skip

SEAMS = (
    Seam(
        "bitsandbytes.functional",
        "dequantize_4bit",
        ("A", "quant_state", "absmax", "out", "blocksize", "quant_type"),
        "functional",
        needs_cuda=False,
    ),
    Seam(
        CUDA_OPS,
        "_dequant_linear_fallback",
        GEMM_SIGNATURE,
        "gemm_4bit fallback",
        needs_cuda=True,
    ),
    Seam(
        CUDA_OPS,
        "_dequantize_4bit_impl",
        ("A", "absmax", "blocksize", "quant_type", "dtype", "out"),
        "dequantize_4bit op",
        needs_cuda=True,
    ),
    Seam(
        CUDA_OPS,
        "_gemm_4bit_kernel_impl",
        GEMM_SIGNATURE,
        "gemm_4bit kernel",
        needs_cuda=True,
        matmul_only=True,
    ),
)
# gemm_4bit's fallback decodes nested statistics with this fixed block size (bitsandbytes 0.50.2).
GEMM_FALLBACK_BLOCKSIZE2 = 256

_lock = threading.Lock()
_originals: dict[Seam, Callable] = {}  # bitsandbytes' functions while patched, else empty
_rebound: list[tuple[object, str, Callable]] = []  # (module, attribute, original) we replaced
_matmul_mode = False  # whether the patch in place routes matmuls too
_compiled_decode_mode = False  # whether it lets transformers compile 4-bit models' decode


def _functional_wrapper(original, matmul: bool = False):
    import torch

    from harness.runtime import api, dequantize

    is_compiling = torch.compiler.is_compiling

    @functools.wraps(original)
    def dequantize_4bit(A, quant_state=None, absmax=None, out=None, blocksize=None, quant_type="fp4"):
        if is_compiling():
            # Traced: our registered op when the call is one it takes, judged on what tracing
            # knows (device, dtypes, block size); bitsandbytes' own ops otherwise.
            if quant_state is not None and dequantize.traced_takes(A, quant_state):
                return dequantize.traced_call(A, quant_state, out=out)
            return original(A, quant_state, absmax, out, blocksize, quant_type)
        try:
            result = api.dequantize_4bit(A, quant_state, absmax, out, blocksize, quant_type)
        except InputError:
            pass  # not something our kernel takes (nothing was launched): bitsandbytes decides
        else:
            route_counts.count("functional", True)
            return result
        route_counts.count("functional", False)
        return original(A, quant_state, absmax, out, blocksize, quant_type)

    return dequantize_4bit


def _gemm_weight(shapeB, absmax, blocksize, quant_type, dtype, absmax_8bit, absmax_code, absmax_offset):
    """gemm_4bit's weight arguments as ``dequantize.quant_state_args``' (fields, nested keywords)."""
    if absmax_8bit is None:
        return (absmax, blocksize, quant_type, shapeB, dtype), {}
    nested = {"code2": absmax_code, "absmax2": absmax, "blocksize2": GEMM_FALLBACK_BLOCKSIZE2, "offset": absmax_offset}
    return (absmax_8bit, blocksize, quant_type, shapeB, dtype), nested


def _fused_gemm(A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code, absmax_offset):
    """Our fused kernel's result for a gemm_4bit call, or None where it does not take it."""
    from harness.runtime import matmul

    weight = (shapeB, absmax, blocksize, quant_type, A.dtype, absmax_8bit, absmax_code, absmax_offset)
    try:
        result = matmul.try_fused(A, B, *_gemm_weight(*weight), bias)
    except InputError:
        result = None
    route_counts.count("gemm_4bit fused", result is not None)
    return result


def _gemm_fallback_wrapper(original, matmul: bool = False):
    import torch

    from harness.runtime import dequantize

    linear = torch.nn.functional.linear

    @functools.wraps(original)
    def _dequant_linear_fallback(
        A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None, absmax_offset=None
    ):
        args = (A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code, absmax_offset)
        if matmul and (result := _fused_gemm(*args)) is not None:
            return result
        fields, nested = _gemm_weight(shapeB, absmax, blocksize, quant_type, A.dtype, *args[7:])
        try:
            B_dq = dequantize.dequantize_packed(B, *fields, **nested)
        except InputError:
            route_counts.count("gemm_4bit fallback", False)
            return original(*args)
        route_counts.count("gemm_4bit fallback", True)
        return linear(A, B_dq, bias)

    return _dequant_linear_fallback


def _gemm_kernel_wrapper(original, matmul: bool = True):
    @functools.wraps(original)
    def _gemm_4bit_kernel_impl(
        A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None, absmax_offset=None
    ):
        args = (A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code, absmax_offset)
        result = _fused_gemm(*args)
        return result if result is not None else original(*args)

    return _gemm_4bit_kernel_impl


def _op_impl_wrapper(original, matmul: bool = False):
    from harness.runtime import dequantize

    @functools.wraps(original)
    def _dequantize_4bit_impl(A, absmax, blocksize, quant_type, dtype, out):
        try:
            if out.dtype != dtype:
                raise InputError("out's dtype differs: bitsandbytes' kernel decides")
            dequantize.dequantize_packed(A, absmax, blocksize, quant_type, out.shape, dtype, out)
        except InputError:
            route_counts.count("dequantize_4bit op", False)
            return original(A, absmax, blocksize, quant_type, dtype, out)
        route_counts.count("dequantize_4bit op", True)
        return None

    return _dequantize_4bit_impl


_WRAPPERS = {
    "functional": _functional_wrapper,
    "gemm_4bit fallback": _gemm_fallback_wrapper,
    "dequantize_4bit op": _op_impl_wrapper,
    "gemm_4bit kernel": _gemm_kernel_wrapper,
}


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
    return bool(_originals)


def _present_seams(matmul: bool = False) -> list[Seam]:
    """The seams of this mode whose module bitsandbytes has loaded (its CUDA backend only where
    CUDA is)."""
    return [s for s in SEAMS if (matmul or not s.matmul_only) and (not s.needs_cuda or s.module in sys.modules)]


def unproven_reason(version: str, functions: dict[Seam, object]) -> str | None:
    """Why the patch must not be applied, or None when every seam matches what it was proven on."""
    if version != PROVEN_BITSANDBYTES:
        return f"bitsandbytes {version} is installed; the patch is proven against {PROVEN_BITSANDBYTES} only"
    for seam, function in functions.items():
        where = f"{seam.module}.{seam.name}"
        if function is None:
            return f"{where} is missing"
        try:
            params = tuple(inspect.signature(function).parameters)
        except (TypeError, ValueError):
            return f"{where} has no readable signature"
        if params != seam.signature:
            return f"{where} takes {params}, the patch was proven on {seam.signature}"
    return None


def patch_bitsandbytes(matmul: bool = False, compiled_decode: bool = False) -> bool:
    """Send bitsandbytes' 4-bit dequantizations to our kernel (``SEAMS``). Idempotent.

    ``matmul=True`` also sends its 4-bit matmuls (``gemm_4bit``: inference and the training
    forward) of few rows to our fused kernel: faster, not bit-identical to bitsandbytes (another
    fp32 summation order; README, "The fused matmul"). The default changes no output bit.
    ``compiled_decode=True`` also lets transformers compile the decode step of bitsandbytes 4-bit
    models (``generate(cache_implementation="static")``; ``harness.runtime.compiled_decode``),
    which it otherwise runs eager. A patch in another mode is replaced. Returns whether the patch
    is in place. On a bitsandbytes release or a seam it was not proven against it warns why and
    changes nothing; where transformers' compile seams are not there, it warns and patches the rest."""
    global _matmul_mode, _compiled_decode_mode
    import bitsandbytes  # loads backends.cuda.ops where CUDA is available

    with _lock:
        if _originals and (_matmul_mode, _compiled_decode_mode) == (matmul, compiled_decode):
            return True
        seams = _present_seams(matmul)
        functions = {s: _originals.get(s) or getattr(sys.modules.get(s.module), s.name, None) for s in seams}
        if (reason := unproven_reason(bitsandbytes.__version__, functions)) is not None:
            warnings.warn(f"harness.patch_bitsandbytes: nothing patched: {reason}", RuntimeWarning, stacklevel=2)
            return False
        _unpatch()
        rebound = []
        for seam, original in functions.items():
            wrapper = _WRAPPERS[seam.label](original, matmul)
            wrapper._nf4_harness_original = original
            for module, name in _bindings_of(original):
                setattr(module, name, wrapper)
                rebound.append((module, name, original))
            _originals[seam] = original
        _rebound[:] = rebound
        _matmul_mode = matmul
        _compiled_decode_mode = False
        if compiled_decode:
            if (reason := compiled_decode_seams.install()) is None:
                _compiled_decode_mode = True
            else:
                warnings.warn(f"harness.patch_bitsandbytes: no compiled decode: {reason}", RuntimeWarning, stacklevel=2)
        return True


def unpatch_bitsandbytes() -> None:
    """Restore bitsandbytes' own functions everywhere they were, and wherever a module imported
    a patched one since. Harmless when not patched."""
    with _lock:
        _unpatch()


def _unpatch() -> None:
    """unpatch_bitsandbytes' work; the caller holds the lock."""
    for seam, original in _originals.items():
        wrapper = getattr(sys.modules[seam.module], seam.name)
        if getattr(wrapper, "_nf4_harness_original", None) is original:
            for module, name in _bindings_of(wrapper):  # from-imports made while patched
                setattr(module, name, original)
    for module, name, original in _rebound:
        setattr(module, name, original)
    _rebound.clear()
    _originals.clear()
    compiled_decode_seams.uninstall()


@contextlib.contextmanager
def bitsandbytes_patched(matmul: bool = False, compiled_decode: bool = False) -> Iterator[None]:
    """``with bitsandbytes_patched(): ...`` patches for the block; leaves a patch made before it
    in the mode it had."""
    before = (_matmul_mode, _compiled_decode_mode) if is_patched() else None
    patch_bitsandbytes(matmul, compiled_decode)
    try:
        yield
    finally:
        if before is None:
            unpatch_bitsandbytes()
        elif before != (matmul, compiled_decode):
            patch_bitsandbytes(*before)


def routed_calls() -> dict[str, int]:
    """Patched calls since import: ``ours`` / ``fallback`` in total, and ``<seam>: ours`` /
    ``<seam>: fallback`` per seam (``functional``, ``gemm_4bit fallback``, ``dequantize_4bit op``,
    ``compiled op``, and with ``matmul=True`` ``gemm_4bit fused``)."""
    totals = {"ours": 0, "fallback": 0}
    per_seam = {}
    for (label, kind), n in sorted(route_counts.counts.items()):
        totals[kind] += n
        per_seam[f"{label}: {kind}"] = n
    return totals | per_seam
