"""One setup factory for tests and benchmarks: quantized weights, raw packed bytes, hostile scales.

bitsandbytes is imported lazily: CPU-only callers of the raw-input builders don't need it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from harness.correctness.bitcompare import floats_from_bits
from harness.runtime.dequantize_kernel import BLOCKSIZES, OUT_DTYPES, QUANT_TYPES
from harness.runtime.dtypes import DTYPES

# fp32 scales that stress the multiply and the final rounding: zeros of both signs, the smallest
# subnormal and normal, values that overflow fp16/bf16 once scaled, infinities, quiet and signalling
# NaNs with payloads, negatives.
SPECIAL_SCALE_BITS = (
    0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x80800000,
    0x3F800000, 0xBF800000, 0x477FE000, 0x47800000, 0x7F7FFFFF, 0xFF7FFFFF,
    0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FC12345, 0xFFBFFFFF,
    0x3A83126F, 0x33800000, 0x5F000000,
)  # fmt: skip


def dtype_of(name: str) -> torch.dtype:
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def format_matrix(blocksizes=BLOCKSIZES) -> list[tuple[str, str, int, bool]]:
    """(quant type, output dtype name, block size, nested) for every format the kernel takes."""
    return list(itertools.product(QUANT_TYPES, OUT_DTYPES, blocksizes, (False, True)))


def format_id(case: tuple[str, str, int, bool]) -> str:
    quant_type, out_dtype, blocksize, nested = case
    return f"{quant_type}-{out_dtype}-bs{blocksize}-{'nested' if nested else 'plain'}"


def seeded_generator(seed: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def quantize_weights(
    shape,
    quant_type: str,
    blocksize: int,
    nested: bool,
    out_dtype: torch.dtype,
    seed: int,
    device="cuda",
):
    """Fresh random weights quantized by bitsandbytes; returns (packed A, QuantState)."""
    import bitsandbytes.functional as F

    g = seeded_generator(seed, device)
    w = torch.randn(tuple(shape), generator=g, device=device, dtype=torch.float32)
    # A few outliers per tensor, as real weights have, so block scales vary widely.
    if w.numel() >= 64:
        idx = torch.randint(0, w.numel(), (max(1, w.numel() // 4096),), generator=g, device=device)
        w.view(-1)[idx] *= 40.0
    A, qs = F.quantize_4bit(w.to(out_dtype), blocksize=blocksize, compress_statistics=nested, quant_type=quant_type)
    return A, qs


def report_matmul_inputs(weights: dict[str, tuple[int, int]], rows, seed: int, device="cuda"):
    """The perf reports' fused matmul calls: for each weight [N, K] (nf4, nested, blocks of 64,
    bf16) and each row count, (name, packed weight, QuantState, its dequantized bits [N, K],
    activations [M, K]); a weight is quantized once and freed before the next."""
    from harness.runtime import api

    for name, (N, K) in weights.items():
        B, qs = quantize_weights((N, K), "nf4", 64, True, torch.bfloat16, seed=seed, device=device)
        W = api.dequantize_4bit(B, qs)
        for m in rows:
            yield name, B, qs, W, torch.randn(m, K, device=device, dtype=torch.bfloat16)
        del B, qs, W
        torch.cuda.empty_cache()


@dataclass
class RawCase:
    """Packed bytes and scale tensors fed straight to both implementations (no quantizer)."""

    A: torch.Tensor
    absmax: torch.Tensor  # fp32 per block, or uint8 codes when nested
    shape: tuple[int, ...]
    blocksize: int
    quant_type: str
    dtype: torch.dtype
    code2: torch.Tensor | None = None
    absmax2: torch.Tensor | None = None
    blocksize2: int = 256
    offset: torch.Tensor | None = None

    def quant_state(self):
        """A bitsandbytes QuantState describing this case."""
        from bitsandbytes.functional import QuantState

        state2 = None
        if self.code2 is not None:
            state2 = QuantState(absmax=self.absmax2, code=self.code2, blocksize=self.blocksize2, dtype=torch.float32)
        return QuantState(
            absmax=self.absmax,
            shape=torch.Size(self.shape),
            blocksize=self.blocksize,
            quant_type=self.quant_type,
            dtype=self.dtype,
            offset=self.offset,
            state2=state2,
        )


def distinct_positions(size: int, count: int, g: torch.Generator, device) -> torch.Tensor:
    """``min(count, size)`` distinct random indices below ``size``: one per equal stripe, O(count) memory."""
    count = min(count, size)
    stripe = size // count
    jitter = torch.randint(0, stripe, (count,), generator=g, device=device)
    return torch.arange(count, device=device) * stripe + jitter


def _scales(nblocks: int, g: torch.Generator, device, special: bool) -> torch.Tensor:
    """Random scales in [-2, 2); with ``special``, about half the blocks get a hostile value."""
    scales = torch.rand(nblocks, generator=g, device=device) * 4 - 2
    if special:
        specials = floats_from_bits(SPECIAL_SCALE_BITS, device)
        pick = distinct_positions(nblocks, max(specials.numel(), nblocks // 2), g, device)
        scales[pick] = specials.repeat(math.ceil(pick.numel() / specials.numel()))[: pick.numel()]
    return scales.contiguous()


def raw_case(
    shape,
    quant_type: str,
    blocksize: int,
    out_dtype: torch.dtype,
    nested: bool,
    seed: int,
    device="cuda",
    special_scales: bool = True,
    blocksize2: int = 256,
) -> RawCase:
    """Random packed bytes covering all 256 byte values, with (optionally hostile) scales."""
    shape = tuple(shape)
    n = math.prod(shape)
    nbytes = (n + 1) // 2
    g = seeded_generator(seed, device)
    A = torch.randint(0, 256, (nbytes,), generator=g, device=device, dtype=torch.uint8)
    if nbytes >= 256:  # every byte value appears at least once, at random places
        A[distinct_positions(nbytes, 256, g, device)] = torch.arange(256, device=device, dtype=torch.uint8)
    A = A.reshape(nbytes, 1)
    nblocks = -(-n // blocksize)
    if not nested:
        return RawCase(A, _scales(nblocks, g, device, special_scales), shape, blocksize, quant_type, out_dtype)
    qabsmax = torch.randint(0, 256, (nblocks,), generator=g, device=device, dtype=torch.uint8)
    code2 = _scales(256, g, device, special_scales)
    absmax2 = _scales(-(-nblocks // blocksize2), g, device, special_scales)
    offset = torch.tensor(float(torch.rand((), generator=g, device=device)) - 0.5, device=device)
    return RawCase(A, qabsmax, shape, blocksize, quant_type, out_dtype, code2, absmax2, blocksize2, offset)
