"""The fused 4-bit matmul kernel (``kernels/matmul_4bit.cu``), everything about it in one place:
its variants, parameter layouts, the shapes it takes, the launch plan (token tile, split of K)
and the launch on a raw stream: the main kernel, writing the output itself when K is not split,
else its partial sums into a workspace that ``matmul_4bit_finish`` adds in split order.

Importable without PyTorch (the compile check lists the variants).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

from harness.runtime import jit, launcher

SOURCE = "matmul_4bit.cu"
ENTRY, FINISH = "matmul_4bit_kernel", "matmul_4bit_finish"
QUANT_TYPES = ("nf4", "fp4")
DTYPES = ("fp16", "bf16")  # activations, decoded weights and output
TOKEN_TILES = (8, 16, 32, 64)  # tokens one warp multiplies each decoded weight with
WARPS = 4  # warps per block, 16 output features each
FEATURES_PER_BLOCK = WARPS * 16
STEP_K = 128  # k one warp covers per step
K_MULTIPLE = 32  # a lane's 32 k are all inside K or all outside: no per-element tail
ALIGN = 16  # bytes: weights, activations and bias are read 16 bytes at a time

# A, W, absmax, code2, absmax2, offset pointer, offset value, partial, bias, out, M, N, K,
# log2 block size, log2 second-level block size, steps per split.
MAIN_PARAMS = ("ptr",) * 6 + ("f32", "ptr", "ptr", "ptr", "i64", "i32", "i32", "i32", "i32", "i32")
FINISH_PARAMS = ("ptr", "ptr", "ptr", "i64", "i32", "i32")  # partial, bias, out, M, N, splits
FINISH_THREADS = 256


@dataclass(frozen=True)
class MatmulVariant:
    dtype: str
    quant_type: str
    nested: bool
    tokens: int

    def __post_init__(self):
        if self.dtype not in DTYPES or self.quant_type not in QUANT_TYPES or self.tokens not in TOKEN_TILES:
            raise ValueError(f"no such matmul variant: {self}")

    @property
    def name(self) -> str:
        return f"mm4-{self.quant_type}-{self.dtype}-{'nested' if self.nested else 'plain'}-m{self.tokens}-w{WARPS}"

    def macros(self) -> tuple[tuple[str, str], ...]:
        return (
            ("MM_DTYPE", str(DTYPES.index(self.dtype))),
            ("MM_QUANT", str(QUANT_TYPES.index(self.quant_type))),
            ("MM_NESTED", "1" if self.nested else "0"),
            ("MM_TOKENS", str(self.tokens)),
            ("MM_WARPS", str(WARPS)),
        )


def all_variants() -> list[MatmulVariant]:
    return [MatmulVariant(*v) for v in itertools.product(DTYPES, QUANT_TYPES, (False, True), TOKEN_TILES)]


def spec_for(variant: MatmulVariant, arch: str) -> jit.CompileSpec:
    return launcher.source_spec(SOURCE, arch, variant.macros(), variant.name)


def token_tile(m: int) -> int:
    """The smallest token tile holding ``m`` tokens (the largest for more: the grid covers the rest)."""
    return next((t for t in TOKEN_TILES if m <= t), TOKEN_TILES[-1])


def takes_shape(K: int, blocksize: int) -> bool:
    """Shapes the kernel computes: K a multiple of 32 (every model's is), blocks of 32 or more."""
    return K > 0 and K % K_MULTIPLE == 0 and blocksize >= K_MULTIPLE


@dataclass(frozen=True)
class Grid:
    blocks: tuple[int, int, int]  # feature groups, splits of K, token tiles
    steps_per_split: int

    @property
    def splits(self) -> int:
        return self.blocks[1]

    def workspace_elements(self, M: int, N: int) -> int:
        """fp32 partial sums the launch needs: one [M, N] slice per split, none without a split."""
        return self.splits * M * N if self.splits > 1 else 0


# Partial sums of all splits together at most this share of the packed weights' bytes: a split's
# slice is written and read back once, so more splits only pay while the weights dominate.
PARTIAL_SHARE = 0.25
# The finish adds a value's splits one after another: more than this many and its latency shows.
MAX_SPLITS = 16


def grid_for(M: int, N: int, K: int, tokens: int, resident_blocks: int) -> Grid:
    """At most one wave where the features and token tiles alone leave SMs idle: K is split into
    as many parts as fit beside each other in the blocks the GPU keeps resident (a grid just
    over one wave would run its few extra blocks as a second wave, doubling the time), as far as
    the partial sums stay a small share of the weights' traffic, every split has at least one
    step and there are at most ``MAX_SPLITS``."""
    groups, tiles, steps = -(-N // FEATURES_PER_BLOCK), -(-M // tokens), -(-K // STEP_K)
    cap = max(1, int(PARTIAL_SHARE * (N * K / 2) // (4 * M * N)))
    splits = max(1, min(steps, cap, MAX_SPLITS, resident_blocks // (groups * tiles)))
    per_split = -(-steps // splits)
    return Grid((groups, -(-steps // per_split), tiles), per_split)


@dataclass(frozen=True)
class Plan:
    main: launcher.LoadedKernel
    finish: launcher.LoadedKernel
    resident_blocks: int  # main kernel blocks the whole GPU holds at once

    def grid(self, M: int, N: int, K: int, tokens: int) -> Grid:
        return grid_for(M, N, K, tokens, self.resident_blocks)


_plans: dict[tuple, Plan] = {}


def plan(variant: MatmulVariant, device_index: int) -> Plan:
    key = (variant, device_index)
    if (hit := _plans.get(key)) is None:
        main = launcher.load(variant.name, SOURCE, ENTRY, device_index, MAIN_PARAMS, variant.macros())
        finish = launcher.load(f"{variant.name}-finish", SOURCE, FINISH, device_index, FINISH_PARAMS, variant.macros())
        per_sm = main.kernel.occupancy.max_active_blocks_per_multiprocessor(WARPS * 32, 0)
        hit = _plans[key] = Plan(main, finish, max(1, per_sm) * _sm_count(device_index))
    return hit


@functools.cache
def _sm_count(device_index: int) -> int:
    from cuda.core import Device

    return Device(device_index).properties.multiprocessor_count


def launch(
    p: Plan,
    grid: Grid,
    stream: int,
    A_ptr: int,
    scales: tuple[int, int, int, int, int, float],
    workspace_ptr: int,
    bias_ptr: int,
    out_ptr: int,
    M: int,
    N: int,
    K: int,
    blocksize: int,
    blocksize2: int,
) -> None:
    """Enqueue the main kernel (and, when K is split, the finish) on ``stream``; ``scales`` holds
    (packed weights, absmax, code2, absmax2, offset pointer, offset value); the workspace holds
    ``grid.workspace_elements(M, N)`` fp32 (no initial value: every element is written); ``p``
    is the variant's plan on the stream's GPU (``plan``), ``grid`` its grid for the call."""
    main_args = (
        A_ptr, *scales, workspace_ptr, bias_ptr, out_ptr, M, N, K, blocksize.bit_length() - 1,
        blocksize2.bit_length() - 1, grid.steps_per_split,
    )  # fmt: skip
    launcher.launch(p.main, grid.blocks, WARPS * 32, stream, main_args)
    if grid.splits > 1:
        finish_blocks = max(1, min(-(-(M * N) // FINISH_THREADS), 65535))
        finish_args = (workspace_ptr, bias_ptr, out_ptr, M, N, grid.splits)
        launcher.launch(p.finish, finish_blocks, FINISH_THREADS, stream, finish_args)
