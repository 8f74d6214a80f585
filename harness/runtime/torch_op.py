"""Our kernel as registered PyTorch ops, so ``torch.compile``d graphs run it.

TorchDynamo cannot trace the launcher (it passes raw pointers to the driver), so
``harness.dequantize_4bit`` and the patched bitsandbytes function call these ops while they are
being traced: the graph holds one opaque ``nf4_harness::dequantize_4bit`` node (nested decode
fused, as in eager mode), whose fake implementation checks the call against the same rules as
eager mode (``dequantize.check_call``, metadata only) and gives the compiler the output's shape and dtype.

The ops are registered once per process: a second copy of ``harness`` loaded beside this one
(the perf gate's A/B process holds two) finds them registered and calls the first copy's.
"""

from __future__ import annotations

import torch

from harness.runtime import dequantize, matmul, route_counts
from harness.runtime.dequantize_kernel import BLOCKSIZES, QUANT_TYPES
from harness.runtime.dtypes import DTYPES


def dequantize_4bit(
    A: torch.Tensor,
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    shape: list[int],
    dtype: torch.dtype,
    code2: torch.Tensor | None,
    absmax2: torch.Tensor | None,
    blocksize2: int,
    offset: torch.Tensor | None,
    offset_value: float,
) -> torch.Tensor:
    return _run(A, absmax, blocksize, quant_type, shape, dtype, None, code2, absmax2, blocksize2, offset, offset_value)


def _dequantize_4bit_fake(
    A, absmax, blocksize, quant_type, shape, dtype, code2, absmax2, blocksize2, offset, offset_value
):
    _check(A, absmax, blocksize, quant_type, shape, dtype, None, code2, absmax2, blocksize2, offset, offset_value)
    return A.new_empty(shape, dtype=dtype)


def _check(A, absmax, blocksize, quant_type, shape, dtype, out, code2, absmax2, blocksize2, offset, offset_value):
    """Bad input fails while the graph is traced, with eager mode's InputError."""
    if offset is not None and offset.device.type == "cpu":
        offset = offset_value  # a host offset is read with .item() at run time; a fake has no value
    nested = _nested(code2, absmax2, blocksize2, offset, offset_value)
    dequantize.check_call(A, absmax, blocksize, quant_type, shape, dtype, out, **nested)


def _nested(code2, absmax2, blocksize2, offset, offset_value) -> dict:
    if code2 is None:
        return {}
    return {
        "code2": code2,
        "absmax2": absmax2,
        "blocksize2": blocksize2,
        "offset": offset if offset is not None else offset_value,
    }


def dequantize_4bit_out(
    A: torch.Tensor,
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    shape: list[int],
    dtype: torch.dtype,
    code2: torch.Tensor | None,
    absmax2: torch.Tensor | None,
    blocksize2: int,
    offset: torch.Tensor | None,
    offset_value: float,
    out: torch.Tensor,
) -> None:
    _run(A, absmax, blocksize, quant_type, shape, dtype, out, code2, absmax2, blocksize2, offset, offset_value)


def _dequantize_4bit_out_fake(
    A, absmax, blocksize, quant_type, shape, dtype, code2, absmax2, blocksize2, offset, offset_value, out
):
    _check(A, absmax, blocksize, quant_type, shape, dtype, out, code2, absmax2, blocksize2, offset, offset_value)


def matmul_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    shape: list[int],
    dtype: torch.dtype,
    code2: torch.Tensor | None,
    absmax2: torch.Tensor | None,
    blocksize2: int,
    offset: torch.Tensor | None,
    offset_value: float,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    nested = _nested(code2, absmax2, blocksize2, offset, offset_value)
    return matmul.matmul_parts(A, B, (absmax, blocksize, quant_type, shape, dtype), nested, None, bias)


def _matmul_4bit_fake(
    A, B, absmax, blocksize, quant_type, shape, dtype, code2, absmax2, blocksize2, offset, offset_value, bias
):
    features, transposed = matmul.result_features(A, shape)
    weight_dtype = dtype if transposed else A.dtype  # what eager mode decodes the weight into
    _check(
        B, absmax, blocksize, quant_type, shape, weight_dtype, None, code2, absmax2, blocksize2, offset, offset_value
    )
    return A.new_empty((*A.shape[:-1], features))


def _register() -> None:
    if hasattr(torch.ops.nf4_harness, "dequantize_4bit"):
        return  # another copy of harness in this process registered them
    op = torch.library.custom_op("nf4_harness::dequantize_4bit", dequantize_4bit, mutates_args=())
    op.register_fake(_dequantize_4bit_fake)
    op_out = torch.library.custom_op("nf4_harness::dequantize_4bit_out", dequantize_4bit_out, mutates_args=("out",))
    op_out.register_fake(_dequantize_4bit_out_fake)
    op_matmul = torch.library.custom_op("nf4_harness::matmul_4bit", matmul_4bit, mutates_args=())
    op_matmul.register_fake(_matmul_4bit_fake)


_register()


def _run(A, absmax, blocksize, quant_type, shape, dtype, out, code2, absmax2, blocksize2, offset, offset_value):
    nested = _nested(code2, absmax2, blocksize2, offset, offset_value)
    result = dequantize.dequantize_packed(A, absmax, blocksize, quant_type, shape, dtype, out, **nested)
    route_counts.count("compiled op", True)
    return result


def takes(A, quant_state) -> bool:
    """Whether the patched bitsandbytes function, being traced, sends a call to our op: judged on
    its configuration (the same tables as eager mode); everything else about the call is checked
    by the op's fake implementation. Anything else stays with bitsandbytes' own traced ops."""
    if not (isinstance(A, torch.Tensor) and A.is_cuda and A.dim() > 0):
        return False
    if quant_state.dtype not in DTYPES.values() or quant_state.blocksize not in BLOCKSIZES:
        return False
    if quant_state.quant_type not in QUANT_TYPES:
        return False
    if quant_state.nested:
        state2 = quant_state.state2
        return state2 is not None and state2.dtype == torch.float32 and quant_state.offset is not None
    return True


def _state_args(quant_state, dtype) -> tuple:
    """A quant state's fields as the ops' arguments after ``A`` (the nested ones included)."""
    offset, offset_value, code2, absmax2, blocksize2 = None, 0.0, None, None, 0
    if quant_state.nested:
        state2 = quant_state.state2
        code2, absmax2, blocksize2 = state2.code, state2.absmax, state2.blocksize
        if isinstance(quant_state.offset, torch.Tensor):
            offset = quant_state.offset
        else:
            offset_value = float(quant_state.offset)
    shape = list(quant_state.shape)
    return (
        quant_state.absmax,
        quant_state.blocksize,
        quant_state.quant_type,
        shape,
        dtype,
        code2,
        absmax2,
        blocksize2,
        offset,
        offset_value,
    )


def call(A, quant_state, absmax=None, out=None, blocksize=None, quant_type="fp4"):
    """The traced equivalent of ``api.dequantize_4bit``, same arguments."""
    if quant_state is None:
        dequantize.check_explicit_args(absmax, out)
        blocksize = 64 if blocksize is None else blocksize
        args = (A, absmax, blocksize, quant_type, list(out.shape), out.dtype, None, None, 0, None, 0.0)
        torch.ops.nf4_harness.dequantize_4bit_out(*args, out)
        return dequantize.transposed_like_bitsandbytes(A, out)
    args = (A, *_state_args(quant_state, quant_state.dtype))
    if out is None:
        result = torch.ops.nf4_harness.dequantize_4bit(*args)
    else:
        torch.ops.nf4_harness.dequantize_4bit_out(*args, out)
        result = out
    return dequantize.transposed_like_bitsandbytes(A, result)


def matmul_call(A, B, quant_state, bias):
    """The traced equivalent of ``api.matmul_4bit`` without ``out``: with gradients, our
    dequantization op and an F.linear autograd differentiates; without, one matmul op."""
    if matmul.needs_grad(A, bias):
        _features, transposed = matmul.result_features(A, quant_state.shape)
        # As eager mode: a [K, N] weight in the quant state's dtype, cast after; else in A's.
        W = torch.ops.nf4_harness.dequantize_4bit(
            B, *_state_args(quant_state, quant_state.dtype if transposed else A.dtype)
        )
        return torch.nn.functional.linear(A, W.to(A.dtype).t() if transposed else W, bias)
    return torch.ops.nf4_harness.matmul_4bit(A, B, *_state_args(quant_state, quant_state.dtype), bias)
