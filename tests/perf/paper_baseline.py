"""The paper's baseline, once: our kernel against bitsandbytes 0.47.0's branchy-decode kernel (the
last release before the global-memory lookup table of 0.48.0), and 0.50.2's, side by side.

    python -m tests.perf.paper_baseline --bnb-src DIR --out DIR

``--bnb-src`` is a checkout of bitsandbytes at tag 0.47.0 (its ``csrc`` and ``include``). Its
wheel carries no CUDA 13 library, so its C library is built here with nvcc for this GPU, with
bitsandbytes' own release flags (-O3 --use_fast_math). CUDA 13's CUB dropped ``cub::Max`` and
``cub::Sum``, which 0.47.0's quantization kernels use; a pre-included header defines the two
functors (the dequantization kernel uses neither), kernel templates keep the external
linkage older nvcc gave them, and a few lines of ours call its host launcher
``dequantizeBlockwise<T, NF4>``, as its Python did. Each weight of the paper's three models is
quantized by the installed bitsandbytes (nf4, block size 64, plain scales, as the paper measures
the kernel alone) and timed cold-L2 with the perf gate's timer; outputs are compared bit for bit.
Results: kernels/NOTES.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from harness.correctness import cases, shapes
from harness.perf import gpu_info, gpu_timer
from harness.runtime import api, dtypes

SOURCES = ("kernels.cu", "ops.cu", "common.cpp")
# Our C entry points into 0.47.0's host launcher (its own C API file no longer compiles against
# CUDA 13's runtime headers, for functions unrelated to dequantization).
ENTRY = """#include "ops.cuh"
#define DQ047(name, T) extern "C" void name(unsigned char* A, float* absmax, T* out, int blocksize, int n, \\
                                           cudaStream_t stream) { \\
    dequantizeBlockwise<T, NF4>(NULL, A, absmax, out, blocksize, n, stream); }
DQ047(dq047_fp16_nf4, half)
DQ047(dq047_bf16_nf4, __nv_bfloat16)
"""
CUB_SHIM = """#pragma once
#include <cub/cub.cuh>
namespace cub {
struct Max {
  template <class T> __host__ __device__ T operator()(const T& a, const T& b) const { return a < b ? b : a; }
};
struct Sum {
  template <class T> __host__ __device__ T operator()(const T& a, const T& b) const { return a + b; }
};
}
"""
MODELS = ("gemma-3-27b", "qwen3-32b", "llama-3.3-70b")
DTYPES = {name: dtypes.DTYPES[name] for name in ("fp16", "bf16")}


def build(src: Path, arch: str, work: Path) -> Path:
    """bitsandbytes 0.47.0's C library for ``arch``, built with nvcc from ``src``."""
    shim = work / "cub_shim.cuh"
    shim.write_text(CUB_SHIM)
    common = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-DBUILD_CUDA", f"-I{src / 'csrc'}", f"-I{src / 'include'}"]
    # CUDA 13 gives __global__ template stubs internal linkage by default; 0.47.0 launches
    # kernels.cu's templates from ops.cu.
    cuda_flags = [f"-arch={arch}", "--use_fast_math", "-static-global-template-stub=false", "-include", str(shim)]

    entry = work / "entry.cu"
    entry.write_text(ENTRY)

    def compile_one(path: Path) -> Path:
        obj = work / f"{path.name}.o"
        language = [] if path.suffix == ".cu" else ["-x", "cu"]
        subprocess.run(["nvcc", *common, *language, *cuda_flags, "-c", str(path), "-o", str(obj)], check=True)
        return obj

    with ThreadPoolExecutor(len(SOURCES) + 1) as pool:
        objects = list(pool.map(compile_one, [*(src / "csrc" / name for name in SOURCES), entry]))
    lib = work / "libbitsandbytes_0470.so"
    subprocess.run(
        ["nvcc", "-shared", *map(str, objects), "-lcublas", "-lcublasLt", "-lcusparse", "-o", str(lib)], check=True
    )
    return lib


def load(lib: Path) -> dict[str, object]:
    handle = ctypes.CDLL(str(lib))
    fns = {}
    for dtype in DTYPES:
        fn = getattr(handle, f"dq047_{dtype}_nf4")
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        fn.restype = None
        fns[dtype] = fn
    return fns


def main(argv: list[str] | None = None) -> int:
    import bitsandbytes.functional as F
    from tabulate import tabulate

    parser = argparse.ArgumentParser(prog="python -m tests.perf.paper_baseline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bnb-src", type=Path, required=True, help="bitsandbytes checkout at tag 0.47.0")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(device)
    with tempfile.TemporaryDirectory(prefix="bnb-0470-") as work:
        old = load(build(args.bnb_src.resolve(), f"sm_{major}{minor}", Path(work)))
        timer = gpu_timer.ColdL2Timer(device, clock=gpu_info.sm_clock_reader(gpu_info.nvml_device(device.index)))
        rows = []
        for weight in shapes.model_shapes():
            if weight.model not in MODELS:
                continue
            for dtype_name, dtype in DTYPES.items():
                A, qs = cases.quantize_weights(weight.shape, "nf4", 64, False, dtype, seed=0, device=device)
                out_old = torch.empty(qs.shape, dtype=dtype, device=device)

                def run_old(A=A, qs=qs, out=out_old, fn=old[dtype_name]):
                    stream = torch.cuda.current_stream(device).cuda_stream
                    fn(A.data_ptr(), qs.absmax.data_ptr(), out.data_ptr(), qs.blocksize, out.numel(), stream)

                calls = {
                    "bnb 0.47.0": run_old,
                    "bnb 0.50.2": lambda A=A, qs=qs: F.dequantize_4bit(A, qs),
                    "ours": lambda A=A, qs=qs: api.dequantize_4bit(A, qs),
                }
                us = {name: timer.measure(fn).median_s * 1e6 for name, fn in calls.items()}
                run_old()
                ours = api.dequantize_4bit(A, qs)
                same = torch.equal(out_old.view(torch.int16), ours.view(torch.int16))
                rows.append(
                    {
                        "weight": weight.id,
                        "shape": "x".join(map(str, weight.shape)),
                        "dtype": dtype_name,
                        **{f"{k} µs": round(v, 2) for k, v in us.items()},
                        "ours vs 0.47.0": round(us["bnb 0.47.0"] / us["ours"], 3),
                        "ours vs 0.50.2": round(us["bnb 0.50.2"] / us["ours"], 3),
                        "0.47.0 bits = ours": same,
                    }
                )
                del A, qs, out_old, ours
                torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    table = tabulate(rows, headers="keys", tablefmt="github")
    (args.out / "paper-baseline.md").write_text(table + "\n")
    (args.out / "paper-baseline.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
