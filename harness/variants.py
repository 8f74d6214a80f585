"""The kernel entry points: one compiled module per (quant type, output dtype, scale kind, tiling)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

QUANT_TYPES = ("nf4", "fp4")
OUT_DTYPES = ("fp16", "bf16", "fp32")
# Block sizes bitsandbytes 0.50.2 accepts for 4-bit (de)quantization.
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)

_OUT_CODE = {"fp16": 0, "bf16": 1, "fp32": 2}
_QUANT_CODE = {"nf4": 0, "fp4": 1}

SOURCE = "dequantize_4bit.cu"
ENTRY = "dequantize_4bit_kernel"
# The entry point's parameters, in order, as launcher.launch packs them:
# A, absmax, code2, absmax2, offset_ptr, offset_value, out, n, bs_log2, bs2_log2, vectorized.
KERNEL_PARAMS = ("ptr", "ptr", "ptr", "ptr", "ptr", "f32", "ptr", "i64", "i32", "i32", "i32")

# Tilings (threads per block, chunks per thread), picked by tensor size. Both tiles are 1024
# chunks; measured on an H100 (kernels/NOTES.md): 512 x 2 is fastest on large weights, 256 x 4
# on small ones, where fewer, fuller warps per block win. The crossover sits between 8M and 22M
# elements.
LARGE_TILING = (512, 2)
SMALL_TILING = (256, 4)
LARGE_MIN_ELEMENTS = 16 << 20


@dataclass(frozen=True)
class KernelVariant:
    """Every template parameter of the kernel; its ``name`` encodes all of them."""

    quant_type: str
    out_dtype: str
    nested: bool
    threads: int = SMALL_TILING[0]
    unroll: int = SMALL_TILING[1]

    def __post_init__(self):
        if self.quant_type not in _QUANT_CODE:
            raise ValueError(f"quant_type must be one of {QUANT_TYPES}, got {self.quant_type!r}")
        if self.out_dtype not in _OUT_CODE:
            raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {self.out_dtype!r}")
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {self.threads}")
        if not 1 <= self.unroll <= 16:
            raise ValueError(f"unroll must be in [1, 16], got {self.unroll}")

    @property
    def chunk_elems(self) -> int:
        """Elements one thread writes with one 16-byte store (the kernel's CHUNK)."""
        return 4 if self.out_dtype == "fp32" else 8

    @property
    def name(self) -> str:
        scales = "nested" if self.nested else "plain"
        return f"dq4-{self.quant_type}-{self.out_dtype}-{scales}-t{self.threads}-u{self.unroll}"

    def macros(self) -> tuple[tuple[str, str], ...]:
        return (
            ("DQ_OUT", str(_OUT_CODE[self.out_dtype])),
            ("DQ_QUANT", str(_QUANT_CODE[self.quant_type])),
            ("DQ_NESTED", "1" if self.nested else "0"),
            ("DQ_THREADS", str(self.threads)),
            ("DQ_UNROLL", str(self.unroll)),
        )


def tiling_for(numel: int) -> tuple[int, int]:
    """(threads, unroll) the drop-in API launches for a tensor of ``numel`` elements."""
    return LARGE_TILING if numel >= LARGE_MIN_ELEMENTS else SMALL_TILING


def all_variants() -> list[KernelVariant]:
    """Every entry point the drop-in API can launch."""
    return [
        KernelVariant(q, d, n, threads=t, unroll=u)
        for q, d, n in itertools.product(QUANT_TYPES, OUT_DTYPES, (False, True))
        for t, u in (SMALL_TILING, LARGE_TILING)
    ]
