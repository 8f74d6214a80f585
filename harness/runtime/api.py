"""Drop-in ``dequantize_4bit`` with bitsandbytes 0.50.2's signature, defaults and return shape.

Everything is validated before anything is enqueued, so a bad call never reaches the GPU and the
CUDA context stays usable. Differences from bitsandbytes are deliberate and only make it stricter:
bitsandbytes would silently read out of bounds or reinterpret memory for the inputs rejected here
(short absmax, wrong dtypes, tensors on another GPU, a non-contiguous ``out``).

A call goes to the compiled host path first (``host_launcher``), which takes it when every tensor
is already as the kernel reads it; anything else, bad input included, runs the Python path below,
which owns every error message.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any

import torch

from harness.errors import DequantizeInputError
from harness.runtime import dequantize_kernel, host_launcher, launcher
from harness.runtime.dequantize_kernel import BLOCKSIZES, QUANT_TYPES

# Output dtypes by the name the kernel variants use: the one map between the two spellings.
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_OUT_NAME = {dtype: name for name, dtype in DTYPES.items()}


def _fail(msg: str):
    raise DequantizeInputError(msg)


def _check_tensor(name: str, t: Any, device_index: int, dtype: torch.dtype, numel: int | None) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.get_device() != device_index:
        _fail(f"{name} is on {t.device}, but A is on cuda:{device_index}; all tensors must be on the same GPU")
    if t.dtype != dtype:
        _fail(f"{name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous")
    if numel is not None and t.numel() != numel:
        _fail(f"{name} must hold {numel} elements for this shape and block size, got {t.numel()}")


def _offset_args(offset: Any, device_index: int) -> tuple[int, float]:
    """The nested offset as (device pointer, value): a device tensor is read by the kernel (no sync)."""
    if isinstance(offset, torch.Tensor):
        if offset.numel() != 1:
            _fail(f"quant_state.offset must hold one value, got {offset.numel()}")
        if offset.is_cuda:
            if offset.get_device() != device_index:
                _fail(f"quant_state.offset is on {offset.device}, but A is on cuda:{device_index}")
            if offset.dtype != torch.float32:
                offset = offset.float()  # exact for fp16/bf16; torch rounds wider types to fp32 too
            return offset.data_ptr(), 0.0
        return 0, float(offset.item())
    if isinstance(offset, (int, float)):
        return 0, float(offset)
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
    if quant_state is None:
        if absmax is None or out is None:
            _fail("dequantize_4bit requires both absmax and out when quant_state is not provided")
        if not isinstance(out, torch.Tensor):
            _fail(f"out must be a torch.Tensor, got {type(out).__name__}")
        result = dequantize_packed(
            A, absmax, 64 if blocksize is None else blocksize, quant_type, out.shape, out.dtype, out
        )
    else:
        try:  # read every field first, so only a quant state's own gap is reported as one
            absmax, shape, dtype = quant_state.absmax, quant_state.shape, quant_state.dtype
            blocksize, quant_type = quant_state.blocksize, quant_state.quant_type
            state2 = getattr(quant_state, "state2", None)
            nested = bool(getattr(quant_state, "nested", state2 is not None))  # what bitsandbytes branches on
            if nested and state2 is not None:
                code2, absmax2, blocksize2 = state2.code, state2.absmax, getattr(state2, "blocksize", None)
        except AttributeError as e:
            _fail(f"quant_state must be a bitsandbytes QuantState: {e}")
        if not nested:
            result = dequantize_packed(A, absmax, blocksize, quant_type, shape, dtype, out)
        else:
            if state2 is None:
                _fail("quant_state.nested is set but quant_state.state2 is None")
            if getattr(state2, "dtype", torch.float32) != torch.float32:
                _fail(f"nested statistics must decode to float32 (state2.dtype), got {state2.dtype}")
            offset = getattr(quant_state, "offset", None)
            if offset is None:
                _fail("nested quant_state has no offset")
            result = dequantize_packed(
                A,
                absmax,
                blocksize,
                quant_type,
                shape,
                dtype,
                out,
                code2=code2,
                absmax2=absmax2,
                blocksize2=blocksize2,
                offset=offset,
            )
    # bitsandbytes' back-compat shim: A passed as [1, bytes] gets its output transposed.
    if A.shape[0] == 1:
        return result.t()
    return result


# The compiled entry point: None until the first call binds it, False where the Python path is used.
_host = None
_bind_lock = threading.Lock()


def _bind_host():
    global _host
    with _bind_lock:
        if _host is None:
            # Without a GPU there is nothing the compiled path could take: no build, no warning.
            _host = (host_launcher.bind() if torch.cuda.is_available() else None) or False
    return _host


@contextlib.contextmanager
def python_path_only():
    """Run the calls inside through the Python path alone: for side-by-side measurements and tests
    of the two paths (not thread-safe; nothing in the harness uses it outside those)."""
    global _host
    saved, _host = _host, False
    try:
        yield
    finally:
        _host = saved


def dequantize_packed(
    A: torch.Tensor,
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    shape,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    *,
    code2: torch.Tensor | None = None,
    absmax2: torch.Tensor | None = None,
    blocksize2: int | None = None,
    offset: Any = None,
) -> torch.Tensor:
    """The tensor-level entry every caller shares: ``A`` packed bytes, ``absmax`` the fp32 block
    scales or, with ``code2`` given, their 8-bit codes decoded in the same launch as
    ``code2[absmax] * absmax2[block // blocksize2] + offset``. Returns ``out`` (allocated when
    None) shaped ``shape``; never transposes."""
    host = _host if _host is not None else _bind_host()
    if host:
        result = host(A, absmax, code2, absmax2, offset, out, shape, dtype, blocksize, blocksize2, quant_type)
        if result is not None:
            if result.__class__ is int:  # the driver refused the launch: name the variant and the error
                variant = dequantize_kernel.plan(
                    quant_type, _OUT_NAME[dtype], code2 is not None, math.prod(shape), A.get_device()
                )
                raise launcher.launch_error(variant.kernel.label, result)
            return result
    # The Python path: the same checks, order and messages as bitsandbytes.
    if blocksize not in BLOCKSIZES:
        _fail(f"invalid blocksize {blocksize}")
    if quant_type not in QUANT_TYPES:
        _fail(f"quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    out_name = _OUT_NAME.get(dtype)
    if out_name is None:
        _fail(f"Blockwise 4bit dequantization only supports 16/32-bit floats, but got {dtype}")

    if not isinstance(A, torch.Tensor):
        _fail(f"A must be a torch.Tensor, got {type(A).__name__}")
    if not A.is_cuda:
        _fail(f"A must be on a CUDA device, got {A.device}")
    if A.dtype != torch.uint8:
        _fail(
            f"A must be uint8 packed 4-bit data, got {A.dtype} (for a packed quant_storage, pass A.view(torch.uint8))"
        )
    if A.dim() == 0:
        _fail("A must have at least one dimension")
    if not A.is_contiguous():
        _fail("A must be contiguous")
    device_index = A.get_device()

    if type(shape) is not torch.Size:
        shape = torch.Size(shape)
    n = math.prod(shape)
    if A.numel() < (n + 1) // 2:
        _fail(f"A holds {A.numel()} bytes but shape {tuple(shape)} needs {(n + 1) // 2}")
    nblocks = -(-n // blocksize)

    nested = code2 is not None
    if nested:
        _check_tensor("quant_state.absmax (nested codes)", absmax, device_index, torch.uint8, nblocks)
        bs2 = blocksize2
        if not isinstance(bs2, int) or bs2 <= 0 or bs2 & (bs2 - 1):
            _fail(f"quant_state.state2.blocksize must be a positive power of two, got {bs2!r}")
        _check_tensor("quant_state.state2.code", code2, device_index, torch.float32, 256)
        _check_tensor("quant_state.state2.absmax", absmax2, device_index, torch.float32, -(-nblocks // bs2))
        offset_ptr, offset_value = _offset_args(offset, device_index)
    else:
        _check_tensor("absmax", absmax, device_index, torch.float32, nblocks)

    if out is None:
        out = A.new_empty(shape, dtype=dtype)
    else:
        if not isinstance(out, torch.Tensor):
            _fail(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.shape != shape:
            raise DequantizeInputError(f"Expected out.shape == {tuple(shape)}, got {out.shape}")
        if out.dtype != dtype:
            raise DequantizeInputError(f"Expected out.dtype == {dtype}, got {out.dtype}")
        _check_tensor("out", out, device_index, dtype, None)

    if n:
        if nested:
            scales = (A.data_ptr(), absmax.data_ptr(), code2.data_ptr(), absmax2.data_ptr(), offset_ptr, offset_value)
        else:
            scales, bs2 = (A.data_ptr(), absmax.data_ptr(), 0, 0, 0, 0.0), 1
        dequantize_kernel.launch(quant_type, out_name, nested, device_index, scales, out.data_ptr(), n, blocksize, bs2)
    return out
