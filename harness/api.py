"""Drop-in ``dequantize_4bit`` with bitsandbytes 0.50.2's signature, defaults and return shape.

Everything is validated before anything is enqueued, so a bad call never reaches the GPU and the
CUDA context stays usable. Differences from bitsandbytes are deliberate and only make it stricter:
bitsandbytes would silently read out of bounds or reinterpret memory for the inputs rejected here
(short absmax, wrong dtypes, tensors on another GPU, a non-contiguous ``out``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from harness import launcher
from harness.errors import DequantizeInputError
from harness.variants import BLOCKSIZES, KernelVariant, extra_read_requested

_OUT_NAME = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_NULL = np.uint64(0)
_EXTRA_READ = extra_read_requested()  # the perf gate's deliberately slower build, read once


def _fail(msg: str):
    raise DequantizeInputError(msg)


def _check_tensor(name: str, t: Any, device: torch.device, dtype: torch.dtype, numel: int | None) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        _fail(f"{name} is on {t.device}, but A is on {device}; all tensors must be on the same GPU")
    if t.dtype != dtype:
        _fail(f"{name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous")
    if numel is not None and t.numel() != numel:
        _fail(f"{name} must hold {numel} elements for this shape and block size, got {t.numel()}")


def _offset_args(offset: Any, device: torch.device) -> tuple[np.uint64, np.float32]:
    """The nested offset as (device pointer, value): a device tensor is read by the kernel (no sync)."""
    if isinstance(offset, torch.Tensor):
        if offset.numel() != 1:
            _fail(f"quant_state.offset must hold one value, got {offset.numel()}")
        if offset.device.type == "cuda":
            if offset.device != device:
                _fail(f"quant_state.offset is on {offset.device}, but A is on {device}")
            if offset.dtype != torch.float32:
                offset = offset.float()  # exact for fp16/bf16; torch rounds wider types to fp32 too
            return launcher.pointer(offset.data_ptr()), np.float32(0)
        return _NULL, np.float32(offset.item())
    if isinstance(offset, (int, float)):
        return _NULL, np.float32(offset)
    _fail(f"nested quant_state needs a numeric offset, got {type(offset).__name__}")


def dequantize_4bit(
    A: torch.Tensor,
    quant_state: Any = None,
    absmax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    blocksize: int | None = None,
    quant_type: str = "fp4",
) -> torch.Tensor:
    """Dequantize a packed 4-bit tensor; same meaning as ``bitsandbytes.functional.dequantize_4bit``.

    Nested (double-quantized) statistics are decoded inside the same kernel launch.
    """
    if blocksize is None:
        blocksize = 64

    if quant_state is None:
        if absmax is None or out is None:
            raise ValueError("dequantize_4bit requires both absmax and out when quant_state is not provided")
        if not isinstance(out, torch.Tensor):
            _fail(f"out must be a torch.Tensor, got {type(out).__name__}")
        shape, dtype, state2, offset, nested = out.shape, out.dtype, None, None, False
    else:
        absmax = quant_state.absmax
        shape, dtype = quant_state.shape, quant_state.dtype
        blocksize, quant_type = quant_state.blocksize, quant_state.quant_type
        state2, offset = getattr(quant_state, "state2", None), getattr(quant_state, "offset", None)
        nested = bool(getattr(quant_state, "nested", state2 is not None))  # what bitsandbytes branches on

    # Same checks, order and messages as bitsandbytes.
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"invalid blocksize {blocksize}")
    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    if dtype not in _OUT_NAME:
        raise ValueError(f"Blockwise 4bit dequantization only supports 16/32-bit floats, but got {dtype}")

    if not isinstance(A, torch.Tensor):
        _fail(f"A must be a torch.Tensor, got {type(A).__name__}")
    if A.device.type != "cuda":
        _fail(f"A must be on a CUDA device, got {A.device}")
    if A.dtype != torch.uint8:
        _fail(
            f"A must be uint8 packed 4-bit data, got {A.dtype} (for a packed quant_storage, pass A.view(torch.uint8))"
        )
    if A.dim() == 0:
        _fail("A must have at least one dimension")
    if not A.is_contiguous():
        _fail("A must be contiguous")
    device = A.device

    shape = torch.Size(shape)
    n = math.prod(shape)
    if A.numel() < (n + 1) // 2:
        _fail(f"A holds {A.numel()} bytes but shape {tuple(shape)} needs {(n + 1) // 2}")
    nblocks = -(-n // blocksize)

    if nested:
        if state2 is None:
            _fail("quant_state.nested is set but quant_state.state2 is None")
        _check_tensor("quant_state.absmax (nested codes)", absmax, device, torch.uint8, nblocks)
        bs2 = getattr(state2, "blocksize", None)
        if not isinstance(bs2, int) or bs2 <= 0 or bs2 & (bs2 - 1):
            _fail(f"quant_state.state2.blocksize must be a positive power of two, got {bs2!r}")
        if getattr(state2, "dtype", torch.float32) != torch.float32:
            _fail(f"nested statistics must decode to float32 (state2.dtype), got {state2.dtype}")
        _check_tensor("quant_state.state2.code", state2.code, device, torch.float32, 256)
        _check_tensor("quant_state.state2.absmax", state2.absmax, device, torch.float32, -(-nblocks // bs2))
        if offset is None:
            _fail("nested quant_state has no offset")
        offset_ptr, offset_value = _offset_args(offset, device)
    else:
        _check_tensor("absmax", absmax, device, torch.float32, nblocks)

    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    else:
        if not isinstance(out, torch.Tensor):
            _fail(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.shape != shape:
            raise DequantizeInputError(f"Expected out.shape == {tuple(shape)}, got {out.shape}")
        if out.dtype != dtype:
            raise DequantizeInputError(f"Expected out.dtype == {dtype}, got {out.dtype}")
        _check_tensor("out", out, device, dtype, None)

    if n:
        variant = KernelVariant(quant_type, _OUT_NAME[dtype], nested, extra_read=_EXTRA_READ)
        if nested:
            scale_args = (
                launcher.pointer(absmax.data_ptr()),
                launcher.pointer(state2.code.data_ptr()),
                launcher.pointer(state2.absmax.data_ptr()),
                offset_ptr,
                offset_value,
            )
            bs2_log2 = bs2.bit_length() - 1
        else:
            scale_args = (launcher.pointer(absmax.data_ptr()), _NULL, _NULL, _NULL, np.float32(0))
            bs2_log2 = 0
        _launch(variant, A, out, n, blocksize.bit_length() - 1, bs2_log2, scale_args)

    # bitsandbytes' back-compat shim: A passed as [1, bytes] gets its output transposed.
    if A.shape[0] == 1:
        return out.t()
    return out


def _launch(variant, A, out, n, bs_log2, bs2_log2, scale_args) -> None:
    device_index = A.device.index if A.device.index is not None else torch.cuda.current_device()
    loaded = launcher.load(variant, device_index)
    vectorized = A.data_ptr() % 4 == 0 and out.data_ptr() % 16 == 0
    per_block = variant.threads * (variant.unroll if vectorized else 1)
    work = (n >> 3) if vectorized else n
    grid = max(1, min(-(-work // per_block), loaded.sm_count * 16))
    stream = torch.cuda.current_stream(A.device)
    with torch.cuda.device(A.device):
        launcher.launch(
            loaded,
            grid,
            variant.threads,
            stream.cuda_stream,
            (
                launcher.pointer(A.data_ptr()),
                *scale_args,
                launcher.pointer(out.data_ptr()),
                np.int64(n),
                np.int32(bs_log2),
                np.int32(bs2_log2),
                np.int32(1 if vectorized else 0),
            ),
        )
