"""The dequantization kernel, everything about it in one place: its variants (one compiled module
per quant type, output dtype, scale kind and tiling), its parameter layout, the rules its call's
tensors obey and the launch plan (tiling, alignment, grid); ``dequantize`` turns a call into its
launch recipe, which either host path runs.

Importable without PyTorch (the compile check lists the variants); PyTorch is bound at the first
launch.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import NamedTuple

from harness.runtime import jit, launcher
from harness.runtime.operands import BYTES, OUT, Count, Operand

QUANT_TYPES = ("nf4", "fp4")
OUT_DTYPES = ("fp16", "bf16", "fp32")
# Block sizes bitsandbytes 0.50.2 accepts for 4-bit (de)quantization.
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)

_OUT_CODE = {"fp16": 0, "bf16": 1, "fp32": 2}
_QUANT_CODE = {"nf4": 0, "fp4": 1}

SOURCE = "dequantize_4bit.cu"
ENTRY = "dequantize_4bit_kernel"


class KernelArgs(NamedTuple):
    """The entry point's parameters, in order (a test checks them against the CUDA signature)."""

    packed: int  # A: two 4-bit codes per byte
    absmax: int  # fp32 block scales, or their 8-bit codes when nested
    code2: int  # nested only: the 256-entry fp32 code book of the scales
    absmax2: int  # nested only: one fp32 scale per blocksize2 scale codes
    offset_ptr: int  # nested only: the offset on the device (0: use offset_value)
    offset_value: float
    out: int
    n: int
    bs_log2: int
    bs2_log2: int
    vectorized: int  # 1: 16-byte stores and chunked loads; 0: the scalar path


# How launcher packs each KernelArgs field.
KERNEL_PARAMS = ("ptr", "ptr", "ptr", "ptr", "ptr", "f32", "ptr", "i64", "i32", "i32", "i32")

# -- the call's rules ---------------------------------------------------------------------------
# The quantities a call's sizes are written in: n output elements, n / blocksize scales, one
# second-level scale per blocksize2 scale codes, two nibbles a byte, 256 codes of an 8-bit code book.
QUANTITIES = ("one", "two", "codes8", "n", "nblocks", "blocksize2")


def quantities(n: int, blocksize: int, blocksize2: int) -> dict[str, int]:
    return {"one": 1, "two": 2, "codes8": 256, "n": n, "nblocks": -(-n // blocksize), "blocksize2": blocksize2}


# Packed data is read as bytes whatever dtype holds it, as bitsandbytes reads it (quant_storage).
PACKED = Operand("A", "A", BYTES, Count("n", "two", at_least=True), min_dims=1)
PLAIN_OPERANDS = (PACKED, Operand("absmax", "absmax", "float32", Count("nblocks")))
NESTED_OPERANDS = (
    PACKED,
    Operand("quant_state.absmax (nested codes)", "absmax", "uint8", Count("nblocks")),
    Operand("quant_state.state2.code", "code2", "float32", Count("codes8")),
    Operand("quant_state.state2.absmax", "absmax2", "float32", Count("nblocks", "blocksize2")),
)
# A nested offset is a Python number or this tensor (read by the kernel, no sync).
OFFSET = Operand("quant_state.offset", "offset", "float32", Count("one"))
OUTPUT = Operand("out", "out", OUT, None)

# Tilings (threads per block, chunks per thread), picked by tensor size. Both tiles are 1024
# chunks; measured on an H100 (kernels/NOTES.md): 512 x 2 is fastest on large weights, 256 x 4
# on small ones, where fewer, fuller warps per block win. The crossover sits between 8M and 22M
# elements.
LARGE_TILING = (512, 2)
SMALL_TILING = (256, 4)
LARGE_MIN_ELEMENTS = 16 << 20
# Indexed by ``numel >= LARGE_MIN_ELEMENTS``.
TILINGS = (SMALL_TILING, LARGE_TILING)


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
    return TILINGS[numel >= LARGE_MIN_ELEMENTS]


def all_variants(arch: str | None = None) -> list[KernelVariant]:
    """Every entry point the drop-in API can launch (the same for every ``arch``)."""
    return [
        KernelVariant(q, d, n, threads=t, unroll=u)
        for q, d, n in itertools.product(QUANT_TYPES, OUT_DTYPES, (False, True))
        for t, u in (SMALL_TILING, LARGE_TILING)
    ]


def spec_for(variant: KernelVariant, arch: str) -> jit.CompileSpec:
    """The compile spec of one variant for one arch."""
    return launcher.source_spec(SOURCE, arch, variant.macros(), variant.name)


# -- the launch plan ----------------------------------------------------------------------------
# The kernel loops over tiles, so a capped grid is still complete; 2^31 - 1 is the CUDA limit.
MAX_GRID = (1 << 31) - 1
OUT_ALIGN = 16  # bytes: one 16-byte store per lane


@dataclass(frozen=True)
class Geometry:
    """How one variant cuts its grid: no GPU needed to know it."""

    threads: int
    tile_elems: int  # elements one block writes on the vectorized path
    chunk: int  # elements one thread writes with one 16-byte store

    @property
    def packed_align(self) -> int:
        """Bytes of packed data one thread loads at once on the vectorized path."""
        return self.chunk // 2

    def grid_and_path(self, packed_ptr: int, out_ptr: int, n: int) -> tuple[int, int]:
        """(blocks, vectorized flag). 16-byte stores need a 16-byte aligned output and aligned
        packed loads; one tile per block (measured fastest, NOTES.md), or one element per thread
        on the scalar path a misaligned call takes."""
        if packed_ptr % self.packed_align == 0 and out_ptr % OUT_ALIGN == 0:
            return max(1, min(-(-n // self.tile_elems), MAX_GRID)), 1
        return max(1, min(-(-n // self.threads), MAX_GRID)), 0


@functools.cache  # every Python-path call asks (through its plan): a few keys, each built once
def geometry(quant_type: str, out_dtype: str, nested: bool, tiling: tuple[int, int]) -> Geometry:
    variant = KernelVariant(quant_type, out_dtype, nested, *tiling)
    chunk = variant.chunk_elems
    return Geometry(variant.threads, variant.threads * variant.unroll * chunk, chunk)


@dataclass(frozen=True)
class Plan:
    """One launch configuration loaded on one GPU."""

    kernel: launcher.LoadedKernel
    geometry: Geometry


_plans: dict[tuple, Plan] = {}


def plan(quant_type: str, out_dtype: str, nested: bool, n: int, device_index: int) -> Plan:
    """The plan for ``n`` output elements on one GPU, compiling and loading its variant once."""
    return plan_tiled(quant_type, out_dtype, nested, tiling_for(n), device_index)


def plan_tiled(quant_type: str, out_dtype: str, nested: bool, tiling: tuple[int, int], device_index: int) -> Plan:
    """The plan of one tiling on one GPU, compiling and loading its variant once."""
    key = (quant_type, out_dtype, nested, tiling, device_index)
    if (hit := _plans.get(key)) is None:
        variant = KernelVariant(quant_type, out_dtype, nested, *tiling)
        loaded = launcher.load(variant.name, SOURCE, ENTRY, device_index, KERNEL_PARAMS, variant.macros())
        hit = _plans[key] = Plan(loaded, geometry(quant_type, out_dtype, nested, tiling))
    return hit
