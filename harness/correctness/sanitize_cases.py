"""What the sanitizer launches, per op (``harness.correctness.sanitize`` runs ``CASES[op.name]``
for every op of ``harness.runtime.ops.OPS`` under each tool): a reduced matrix of calls through the
op's public path, each output judged, and every input buffer's address range printed in
``RANGES``' form, so an uninitialized read can be traced to the buffer it hit.

Inputs: ``raw`` are random bytes and scales written by PyTorch; ``bnb`` quantizes random weights
with bitsandbytes. Another op adds its case function here, one line in ``CASES``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
from collections.abc import Callable
from unittest import mock

# Dequantization: several vectorized tiles with no tail, a tail (odd element count), a single byte.
SHAPES = ((64, 96), (37, 61), (1, 3))
# Fused matmul cases (M, N, K), both kernels split and unsplit: the 8-token kernel with K in two
# splits ending in a partial step (one table per 64 k), and unsplit over one partial step (K % 64
# == 32: a table per 32-k half), and in 16 splits (on Hopper one cluster, past the portable size)
# and in 7 splits of 3 steps (on Hopper a cluster of an odd size); the 16-token one unsplit over 4
# steps; the wide kernel at 32 tokens split in two (no cluster epilogue: the finish adds them on any
# GPU), at 64 split in two and unsplit over two token tiles. The split rules decide these splits on
# any GPU that holds three blocks (tests/test_sanitize.py).
MATMUL_SHAPES = (
    (3, 40, 1856), (3, 40, 224), (5, 40, 16384), (5, 40, 5376), (9, 40, 1024), (20, 40, 1024), (40, 40, 1024),
    (70, 40, 256),
)  # fmt: skip

# A case's line of input buffers: "case LABEL: name 0xSTART+BYTES, ..." (print_ranges writes it,
# the sanitizer's report reader parses it).
RANGES = re.compile(r"^case (?P<label>[^:]+): (?P<ranges>.*)$", re.M)
RANGE = re.compile(r"(\w+) 0x([0-9a-f]+)\+(\d+)")


def weights(inputs: str, shape, quant: str, dtype, nested: bool, device):
    """(packed weights, quant state) of blocks of 64: ``raw`` random bytes and scales, or ``bnb``
    random weights quantized by bitsandbytes."""
    from harness.correctness import cases

    if inputs == "raw":
        case = cases.raw_case(shape, quant, 64, dtype, nested, seed=0, device=device, special_scales=False)
        return case.A, case.quant_state()
    return cases.quantize_weights(shape, quant, 64, nested, dtype, seed=0, device=device)


def dequantize_cases(inputs: str, device) -> int:
    """Every dequantization variant (nf4/fp4 x fp16/bf16/fp32 x plain/nested), launched by the
    compiled host path and by the Python path at both tilings (the large one forced onto small
    tensors, which a sanitizer runs in seconds), with and without a tail, and with a misaligned
    output (the scalar path); the number of outputs that differ from bitsandbytes' bits."""
    import bitsandbytes.functional as F
    import torch

    from harness.correctness.bitcompare import poison_
    from harness.runtime import api, dequantize_kernel, host_path

    mismatches = 0
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    # The compiled host path as it picks the launch, then the Python path with each tiling forced.
    host_paths = [contextlib.nullcontext] + [
        functools.partial(_python_path_tiled, host_path, dequantize_kernel, tiling)
        for tiling in dequantize_kernel.TILINGS
    ]
    for quant, dtype, nested, shape in itertools.product(("nf4", "fp4"), dtypes, (False, True), SHAPES):
        A, qs = weights(inputs, shape, quant, dtype, nested, device)
        print_ranges(f"{quant} {dtype} nested={nested} {shape}", A, qs)
        expected = F.dequantize_4bit(A, qs)
        for path, misaligned in itertools.product(host_paths, (False, True)):
            buffer = torch.empty(expected.numel() + 1, dtype=dtype, device=device)
            out = buffer[1:].view(expected.shape) if misaligned else buffer[:-1].view(expected.shape)
            poison_(out)
            with path():
                api.dequantize_4bit(A, qs, out=out)
            mismatches += not torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    return mismatches


def matmul_cases(inputs: str, device) -> int:
    """The fused matmul (nf4/fp4 x fp16/bf16 x plain/nested) over ``MATMUL_SHAPES`` with a bias,
    launched by the compiled host path and by the Python path; the number of results outside the
    fp64 bound."""
    import torch

    from harness.correctness import cases
    from harness.correctness import matmul_reference as mr
    from harness.correctness.bitcompare import poison_
    from harness.runtime import api, host_path, matmul

    wrong = 0
    shapes = itertools.product(("nf4", "fp4"), (torch.float16, torch.bfloat16), (False, True), MATMUL_SHAPES)
    for quant, dtype, nested, (M, N, K) in shapes:
        B, qs = weights(inputs, (N, K), quant, dtype, nested, device)
        print_ranges(f"matmul {quant} {dtype} nested={nested} {M}x{N}x{K}", B, qs)
        g = cases.seeded_generator(M, device)
        A = torch.randn(M, K, generator=g, device=device).to(dtype)
        bias = torch.randn(N, generator=g, device=device).to(dtype)
        expected = mr.fused_reference(A, B, qs, api.dequantize_4bit(B, qs), bias, dtype)
        for path in (contextlib.nullcontext, host_path.python_path_only):  # the compiled entry, then Python's
            out = poison_(torch.empty(M, N, dtype=dtype, device=device))
            with path():
                matmul.fused_matmul(A, B.t(), qs, bias=bias, out=out)
            wrong += not mr.judge(out, expected).ok
    return wrong


# Each op's cases (inputs "raw" or "bnb", the device) -> how many outputs were wrong.
CASES: dict[str, Callable[[str, object], int]] = {"dequantize": dequantize_cases, "matmul": matmul_cases}


@contextlib.contextmanager
def _python_path_tiled(host_path, dequantize_kernel, tiling):
    with host_path.python_path_only(), mock.patch.object(dequantize_kernel, "tiling_for", lambda n: tiling):
        yield


def print_ranges(label: str, A, qs) -> None:
    """The case's input buffers (the packed tensor and the quant state's), one ``RANGES`` line."""
    import torch

    buffers = {"A": A, "absmax": qs.absmax}
    if qs.nested:
        buffers |= {"code2": qs.state2.code, "absmax2": qs.state2.absmax}
        if isinstance(qs.offset, torch.Tensor) and qs.offset.is_cuda:
            buffers["offset"] = qs.offset
    ranges = ", ".join(f"{k} 0x{t.data_ptr():x}+{t.numel() * t.element_size()}" for k, t in buffers.items())
    print(f"case {label}: {ranges}", flush=True)
