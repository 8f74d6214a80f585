"""Planted regressions that prove the perf gate: a copy of a checkout whose kernel is deliberately
slower (or whose output is wrong), built in a temporary tree. A test fixture, never a switch in
the product.

The planted kernel stretches each launch's GPU time by a set fraction: every block notes when
it started (the earliest start wins), and the last block to finish spins until the launch has
taken ``1 + stretch`` times as long as it had when that block got there. The slowdown is the
same fraction on every weight size, and optionally only in the fp32-output builds. The kernel is
the dequantization kernel, or (``--kernel matmul``) the fused matmul's main kernels (every token
tile's, the Hopper one included), which every matmul case at or below the crossover runs.

    python -m tests.perf.planted DEST --stretch 0.02 [--only-fp32] [--kernel matmul]
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Target:
    """Kernels the slowdown can be planted in: their sources, and in each its entry line, a
    statement near the start and its last lines (where the planted code goes; each must occur
    once; no ``end``: the kernel is the file's last function, its closing brace the file's last),
    and the condition of the builds its ``--only-fp32`` form slows down."""

    kernels: tuple[Path, ...]
    entry: str
    start: str
    end: str | None
    fp32_only: str


TARGETS = {
    "dequantize": Target(
        (Path("kernels") / "dequantize_4bit.cu",),
        'extern "C" __global__ void __launch_bounds__(DQ_THREADS) dequantize_4bit_kernel(',
        "    __shared__ __align__(16) float s_code[16];\n",
        "        out[e] = to_out(mul_ftz(s_code[nib], scale));\n    }\n}\n",
        "(DQ_OUT == 2)",
    ),
    "matmul": Target(
        tuple(Path("kernels") / f"matmul_4bit{name}.cu" for name in ("_m8", "_m8_pairs", "", "_sm90")),
        'extern "C" __global__ void __launch_bounds__(',
        "    MM_SCALES_PROLOGUE;\n",
        None,  # after the epilogue's store_tile, the main kernel's last statement
        "0",  # no fp32-output build
    ),
}
_COPY_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", ".nox", ".ci-venv", ".whl", ".hypothesis", "__pycache__", "perf-out*", ".benchmarks"
)

_GLOBALS = """// PLANTED SLOWDOWN (tests/perf/planted.py): state shared by the blocks of one launch.
__device__ unsigned long long planted_start = ~0ull;
__device__ unsigned int planted_done = 0;
__device__ __forceinline__ unsigned long long planted_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

"""
_AT_START = "    if (PLANTED_ON && threadIdx.x == 0) atomicMin(&planted_start, planted_now());\n"
_AT_END = """    // PLANTED SLOWDOWN: the last block to finish stretches the launch by PLANTED_STRETCH.
    // (No barrier or fence: a block counts as done when its thread 0 is, which keeps the
    // planted code's own cost small.)
    if (PLANTED_ON && threadIdx.x == 0) {
        if (atomicAdd(&planted_done, 1u) + 1 == gridDim.x * gridDim.y * gridDim.z) {
            const unsigned long long start = atomicAdd(&planted_start, 0ull);
            const unsigned long long now = planted_now();
            const unsigned long long until = now + (unsigned long long)((double)(now - start) * PLANTED_STRETCH);
            while (planted_now() < until) {
            }
            atomicExch(&planted_start, ~0ull);  // ready for the next launch
            atomicExch(&planted_done, 0u);
        }
    }
"""


def planted_source(source: str, stretch: float, only_fp32: bool = False, target: Target = TARGETS["dequantize"]) -> str:
    """``source`` (``target``'s kernel) with the stretch planted (see the module docstring)."""
    for anchor in (target.entry, target.start, *((target.end,) if target.end else ())):
        if source.count(anchor) != 1:
            raise ValueError(f"the kernel no longer has the planted slowdown's anchor {anchor.strip()!r}")
    if target.end is None and "__global__" in source[source.index(target.entry) + len(target.entry) :]:
        raise ValueError("the kernel is no longer its file's last function, where the slowdown ends")
    if not 0 < stretch < 10:
        raise ValueError(f"stretch must be in (0, 10), got {stretch}")
    macros = f"#define PLANTED_STRETCH {stretch!r}\n#define PLANTED_ON {target.fp32_only if only_fp32 else '1'}\n"
    source = source.replace(target.entry, macros + _GLOBALS + target.entry)
    source = source.replace(target.start, target.start + _AT_START)
    if target.end is None:
        cut = source.rindex("\n}\n") + 1
        return source[:cut] + _AT_END + source[cut:]
    end_body = target.end[: -len("}\n")]
    return source.replace(target.end, end_body + _AT_END + "}\n")


def copy_checkout(source_root: Path, dest: Path) -> Path:
    """A copy of the checkout's files (no git, virtualenvs or outputs) at ``dest``, which must not exist."""
    shutil.copytree(source_root, dest, ignore=_COPY_IGNORE)
    return dest


def build(source_root: Path, dest: Path, stretch: float, only_fp32: bool = False, kernel: str = "dequantize") -> Path:
    """Copy the checkout at ``source_root`` to ``dest`` and plant the slowdown in ``kernel``'s sources there."""
    target = TARGETS[kernel]
    copy_checkout(source_root, dest)
    for path in (dest / k for k in target.kernels):
        path.write_text(planted_source(path.read_text(), stretch, only_fp32, target))
    return dest


_WRONG_OUTPUT = """

# PLANTED WRONG OUTPUT (tests/perf/planted.py): the drop-in flips the lowest bit of its first byte.
_planted_exact = dequantize_4bit


def dequantize_4bit(*args, **kwargs):
    result = _planted_exact(*args, **kwargs)
    result.view(-1)[:1].view(torch.uint8)[:1].bitwise_xor_(1)
    return result
"""


def build_wrong_output(source_root: Path, dest: Path) -> Path:
    """Copy the checkout to ``dest`` with a drop-in whose output differs from the original's in
    one bit (and which costs one more tiny launch): the gate must fail it for its output."""
    api = copy_checkout(source_root, dest) / "harness" / "runtime" / "api.py"
    api.write_text(api.read_text() + _WRONG_OUTPUT)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.perf.planted", description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--stretch", type=float, required=True, help="fraction added to each launch's GPU time")
    parser.add_argument("--only-fp32", action="store_true")
    parser.add_argument("--kernel", choices=sorted(TARGETS), default="dequantize")
    args = parser.parse_args(argv)
    print(build(args.source, args.dest, args.stretch, args.only_fp32, args.kernel))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
