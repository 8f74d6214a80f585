"""The same blockwise 4-bit dequantization written in Triton, as the Triton NF4 projects do it:
one program per run of packed bytes, both nibbles decoded from one byte load, the nested scale
decoded inline. It reproduces bitsandbytes' arithmetic (flush-to-zero multiplies through inline
PTX, a plain add for the offset, round-to-nearest-even conversion) and is checked bit-exact in
tests/test_triton_peer_gpu.py. A peer for timing: it takes the quant_state form only.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from harness.correctness import reference

BYTES_PER_PROGRAM = 1024


@triton.jit
def _mul_ftz(a, b):
    # fp32 multiply with subnormal inputs and result flushed to signed zero, as bitsandbytes' CUDA
    # build does; through bit patterns so the asm sees plain 32-bit registers.
    r = tl.inline_asm_elementwise(
        "{ .reg .f32 a, b, c; mov.b32 a, $1; mov.b32 b, $2; mul.rn.ftz.f32 c, a, b; mov.b32 $0, c; }",
        "=r,r,r",
        [a.to(tl.uint32, bitcast=True), b.to(tl.uint32, bitcast=True)],
        dtype=tl.uint32,
        is_pure=True,
        pack=1,
    )
    return r.to(tl.float32, bitcast=True)


@triton.jit
def _dequantize_4bit_kernel(
    A,
    absmax,
    code,
    code2,
    absmax2,
    offset_ptr,
    out,
    n_bytes,
    n,
    bs2_log2,
    BS_LOG2: tl.constexpr,
    NESTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    byte_idx = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = byte_idx < n_bytes
    byte = tl.load(A + byte_idx, mask=in_range, other=0).to(tl.int32)
    hi = tl.load(code + (byte >> 4))
    lo = tl.load(code + (byte & 15))
    block = (byte_idx * 2) >> BS_LOG2  # both nibbles of a byte share a block (block size >= 32)
    if NESTED:
        q = tl.load(absmax + block, mask=in_range, other=0).to(tl.int32)
        a2 = tl.load(absmax2 + (block >> bs2_log2), mask=in_range, other=0.0)
        scale = _mul_ftz(tl.load(code2 + q), a2) + tl.load(offset_ptr)
    else:
        scale = tl.load(absmax + block, mask=in_range, other=0.0)
    ty = out.dtype.element_ty
    values = tl.join(_mul_ftz(hi, scale).to(ty), _mul_ftz(lo, scale).to(ty)).reshape(2 * BLOCK)
    elem = pid * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
    tl.store(out + elem, values, mask=elem < n)


@functools.cache
def _code_table(quant_type: str, device: torch.device) -> torch.Tensor:
    return reference.code_table(quant_type, device)


def dequantize_4bit(A: torch.Tensor, quant_state) -> torch.Tensor:
    """``bitsandbytes.functional.dequantize_4bit(A, quant_state)``, in Triton."""
    qs = quant_state
    out = torch.empty(qs.shape, dtype=qs.dtype, device=A.device)
    n = out.numel()
    n_bytes = (n + 1) // 2
    code = _code_table(qs.quant_type, A.device)
    if qs.nested:
        offset = qs.offset if isinstance(qs.offset, torch.Tensor) else torch.tensor(qs.offset)
        offset = offset.to(device=A.device, dtype=torch.float32).reshape(1)
        scales = (qs.absmax, qs.state2.code, qs.state2.absmax, offset)
        bs2_log2 = qs.state2.blocksize.bit_length() - 1
    else:
        scales = (qs.absmax, code, qs.absmax, code)  # unused pointers for the plain build
        bs2_log2 = 0
    grid = (triton.cdiv(n_bytes, BYTES_PER_PROGRAM),)
    _dequantize_4bit_kernel[grid](
        A,
        scales[0],
        code,
        scales[1],
        scales[2],
        scales[3],
        out,
        n_bytes,
        n,
        bs2_log2,
        BS_LOG2=qs.blocksize.bit_length() - 1,
        NESTED=bool(qs.nested),
        BLOCK=BYTES_PER_PROGRAM,
        num_warps=4,
    )
    return out
