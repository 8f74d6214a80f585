"""The drop-ins: ``dequantize_4bit`` and ``matmul_4bit`` with bitsandbytes 0.50.2's signatures,
defaults and results. Eager calls run ``dequantize`` and ``matmul``; under ``torch.compile`` each
call becomes its op's registered op (each op's ``TORCH_OPS``, registered through ``torch_op``),
which runs the same code when the graph runs.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.errors import InputError
from harness.runtime import matmul

# Bound here, not looked up on the module each call: the drop-in's host time.
from harness.runtime.dequantize import (
    check_explicit_args,
    dequantize_packed,
    quant_state_args,
    traced_call,
    transposed_like_bitsandbytes,
)

_is_compiling = torch.compiler.is_compiling


def _fail(message: str):
    raise InputError(message)


def dequantize_4bit(
    A: torch.Tensor,
    quant_state: Any = None,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int | None = None,
    quant_type: str = "fp4",
) -> torch.Tensor:
    """Dequantize a packed 4-bit tensor; same arguments, defaults and result as
    ``bitsandbytes.functional.dequantize_4bit`` (0.50.2), bit for bit.

    ``A`` holds the packed codes in any dtype (bitsandbytes' ``quant_storage``); it, the scales
    and ``out`` must be CUDA tensors on one GPU. Nested (double-quantized) statistics are decoded
    inside the same kernel launch. Runs on the caller's current stream; leaves the current device
    and context as they were. Works under ``torch.compile(fullgraph=True)`` (one registered op).

    Raises:
        InputError: (a ValueError) for anything the kernel cannot take, before any launch:
            host tensors, wrong dtypes or sizes, a non-contiguous tensor, an unknown block size.
        KernelLaunchError: the CUDA driver refused the launch; names the CUDA error.
        SettingError: ``NF4_HARNESS_HOST_LAUNCHER`` holds an unknown value.
        HostLauncherUnavailable: that setting is ``compiled`` and the compiled host path cannot be built.
    """
    if _is_compiling():
        return traced_call(A, quant_state, absmax, out, blocksize, quant_type)
    if quant_state is None:
        check_explicit_args(absmax, out)
        result = dequantize_packed(
            A, absmax, 64 if blocksize is None else blocksize, quant_type, out.shape, out.dtype, out
        )
    else:
        fields, nested = quant_state_args(quant_state)
        if nested:
            result = dequantize_packed(A, *fields, out, **nested)
        else:
            result = dequantize_packed(A, *fields, out)
    return transposed_like_bitsandbytes(A, result)


def matmul_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    quant_state: Any,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``bitsandbytes.matmul_4bit``'s drop-in: the same arguments and result shape, ``out``
    filled and returned when given; a weight quantized as ``[K, N]`` is used transposed, an empty
    ``A`` returns an empty result. CUDA tensors only (the fallback dequantizes with our kernel).
    Under ``torch.compile(fullgraph=True)`` it is one registered op (``nf4_harness::matmul_4bit``).

    Raises:
        InputError: (a ValueError) for anything neither path takes, before any launch.
        KernelLaunchError: the CUDA driver refused a launch; names the CUDA error.
    """
    if quant_state is None:
        _fail("quant_state is required")
    if not isinstance(A, torch.Tensor):
        _fail(f"A must be a torch.Tensor, got {type(A).__name__}")
    if _is_compiling():
        matmul.check_out_and_bias(A, matmul.result_features(A, quant_state.shape)[0], out, bias)
        return matmul.into(out, matmul.traced_call(A, B, quant_state, bias))
    fields, nested = quant_state_args(quant_state)
    return matmul.matmul_parts(A, B, fields, nested, out, bias)
