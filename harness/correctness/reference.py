"""A plain PyTorch statement of the 4-bit format, as bitsandbytes' CUDA kernels compute it.

Including their flush-to-zero multiplies (``ftz=True``, the default); ``ftz=False`` gives the
arithmetic of bitsandbytes' CPU backend, which keeps subnormals.

It runs on any device and is slow on purpose: each step is one obvious tensor operation.
It is the specification the CPU tests pin against bitsandbytes' CPU backend, and what the
CUDA kernel's tables (kernels/dequantize_4bit.cu) must agree with.
"""

from __future__ import annotations

import math

import torch

from harness.correctness.bitcompare import floats_from_bits

# IEEE-754 bits of bitsandbytes' CUDA code tables. FP4 entry 8 is -0.0 on CUDA (0 * sign with
# sign = -1); bitsandbytes' Python table (get_4bit_type) and its CPU backend hold +0.0 there.
NF4_BITS = (
    0xBF800000, 0xBF3239B1, 0xBF066B30, 0xBECA32A0, 0xBE91A24D, 0xBE3D353F, 0xBDBA7871, 0x00000000,
    0x3DA2FAFF, 0x3E24CAE3, 0x3E7C04DD, 0x3EAD033A, 0x3EE1A4B8, 0x3F1007AB, 0x3F3913B3, 0x3F800000,
)  # fmt: skip
FP4_BITS = (
    0x00000000, 0x3BAAAAAB, 0x3F2AAAAB, 0x3F800000, 0x3EAAAAAB, 0x3F000000, 0x3E2AAAAB, 0x3E800000,
    0x80000000, 0xBBAAAAAB, 0xBF2AAAAB, 0xBF800000, 0xBEAAAAAB, 0xBF000000, 0xBE2AAAAB, 0xBE800000,
)  # fmt: skip
CODE_BITS = {"nf4": NF4_BITS, "fp4": FP4_BITS}
_FLT_MIN = 1.1754943508222875e-38


def flush_subnormals(x: torch.Tensor) -> torch.Tensor:
    """Subnormal fp32 values become zeros of the same sign."""
    return torch.where((x.abs() < _FLT_MIN) & (x != 0), x * 0.0, x)


def mul(a: torch.Tensor, b: torch.Tensor, ftz: bool) -> torch.Tensor:
    """One rounded fp32 product; with ``ftz`` as bitsandbytes' CUDA build computes it (mul.ftz)."""
    if not ftz:
        return a * b
    return flush_subnormals(flush_subnormals(a) * flush_subnormals(b))


def code_table(quant_type: str, device="cpu") -> torch.Tensor:
    return floats_from_bits(CODE_BITS[quant_type], device)


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Codes of the first ``n`` elements: high nibble of byte i is element 2i, low nibble 2i+1."""
    flat = packed.reshape(-1).to(torch.int64)
    codes = torch.stack((flat >> 4, flat & 0xF), dim=1).reshape(-1)
    return codes[:n]


def nested_absmax(
    qabsmax: torch.Tensor, code2: torch.Tensor, absmax2: torch.Tensor, blocksize2: int, offset, ftz: bool = True
) -> torch.Tensor:
    """fp32 block scales from double-quantized statistics: code2[q] * absmax2[b // bs2], then + offset."""
    idx = torch.arange(qabsmax.numel(), device=qabsmax.device) // blocksize2
    scaled = mul(code2[qabsmax.reshape(-1).to(torch.int64)], absmax2.reshape(-1)[idx], ftz)  # one rounding
    off = offset if isinstance(offset, torch.Tensor) else torch.tensor(float(offset), dtype=torch.float32)
    return scaled + off.to(device=scaled.device, dtype=torch.float32)  # a second, separate rounding


def dequantize(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    shape,
    dtype: torch.dtype,
    blocksize: int,
    quant_type: str,
    table: torch.Tensor | None = None,
    ftz: bool = True,
) -> torch.Tensor:
    """code[nibble] * absmax[element // blocksize] in fp32, rounded once to ``dtype``.

    ``table`` replaces the CUDA code table (to model bitsandbytes' Python-table fallback);
    ``ftz=False`` models bitsandbytes' CPU backend, which keeps subnormals.
    """
    shape = torch.Size(shape)
    n = math.prod(shape)
    codes = unpack_nibbles(packed, n)
    table = code_table(quant_type, packed.device) if table is None else table.to(packed.device)
    values = table[codes]
    scales = absmax.reshape(-1).to(torch.float32)[torch.arange(n, device=packed.device) // blocksize]
    return mul(values, scales, ftz).to(dtype).reshape(shape)


def dequantize_state(
    packed: torch.Tensor, quant_state, table: torch.Tensor | None = None, ftz: bool = True
) -> torch.Tensor:
    """The reference applied to a bitsandbytes QuantState (nested or not)."""
    qs = quant_state
    absmax = qs.absmax
    if qs.state2 is not None:
        absmax = nested_absmax(absmax, qs.state2.code, qs.state2.absmax, qs.state2.blocksize, qs.offset, ftz)
    return dequantize(packed, absmax, qs.shape, qs.dtype, qs.blocksize, qs.quant_type, table, ftz)
