"""The judge's half of the fused matmul, ``harness.matmul_4bit(A, W.t(), state)``: its oracle is
the fp64 product of the arithmetic its kernel runs, with a bound every output must lie inside
(``harness.correctness.matmul_reference``; the summation order is the kernel's to choose).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.correctness import bitcompare, cases, sanitize_inputs, shapes
from harness.correctness import matmul_reference as mr
from harness.correctness.op_checks.unit import OpChecks, PerfCase, packed_bytes


class Staging:
    """The live input is the activations (seeded versions), the reference each version's fp64
    product, and an output must lie inside that reference's bound."""

    def inputs(self, spec: dict, A, qs, dtype: torch.dtype, device: torch.device, variants: int) -> tuple:
        tokens, K, seed = spec["tokens"], qs.shape[1], spec["seed"]
        versions = torch.stack([_activations(tokens, K, dtype, seed + 1 + v, device) for v in range(variants)])
        return versions[0].clone(), versions, torch.empty(tokens, qs.shape[0], dtype=dtype, device=device)

    def live(self, lent) -> torch.Tensor:
        return lent.x

    def call(self, lent, drop_ins, into_out: bool = True) -> Callable[[], torch.Tensor]:
        x, B, qs, out, entry = lent.x, lent.A.t(), lent.qs, lent.out, drop_ins.matmul_4bit
        return (lambda: entry(x, B, qs, out=out)) if into_out else (lambda: entry(x, B, qs))

    def references(self, lent: dict) -> list[object]:
        """Each variant's fp64 reference (bitsandbytes' dequantized weights where the kernel
        multiplies those), the weights formed once."""
        import bitsandbytes.functional as F

        W = F.dequantize_4bit(lent["A"], lent["qs"])
        versions = list(lent["variants"])
        return mr.fused_references(versions, lent["A"], lent["qs"], W, None, versions[0].dtype)

    def agrees(self, output: torch.Tensor, expected: object) -> bool:
        return mr.judge(output, expected).ok

    def bitsandbytes_calls(self, lent: dict, names: list[str], device: torch.device) -> dict:
        """bitsandbytes' full ``matmul_4bit`` (its kernel alone has no counterpart here)."""
        import bitsandbytes

        x, B, qs = lent["x"], lent["A"].t(), lent["qs"]
        return {"bnb_full": lambda: bitsandbytes.matmul_4bit(x, B, qs)} if "bnb_full" in names else {}


def _activations(tokens: int, K: int, dtype: torch.dtype, seed: int, device: torch.device) -> torch.Tensor:
    g = cases.seeded_generator(seed, device)
    return torch.randn(tokens, K, generator=g, device=device).to(dtype)


def matmul_bytes(n: int, k: int, tokens: int, blocksize: int = 64, nested: bool = True, itemsize: int = 2) -> int:
    """Fewest bytes a 4-bit matmul must move (its roofline's numerator): the packed weight with its
    scales, read once, the activations and the output."""
    return packed_bytes(n * k, blocksize, nested) + tokens * (k + n) * itemsize


@dataclass(frozen=True)
class MatmulCase(PerfCase):
    """``harness.matmul_4bit(A, W.t(), state)`` with A of ``tokens`` rows; sized (its threshold
    class) by its weight, like the dequantization of that weight."""

    tokens: int = 1
    kind = "matmul"

    @property
    def id(self) -> str:
        return f"matmul-{self.weight_id}-m{self.tokens}"

    def spec(self, seed: int) -> dict:
        return super().spec(seed) | {"tokens": self.tokens}

    def bytes_moved(self) -> int:
        n, k = self.weight.shape
        return matmul_bytes(n, k, self.tokens, self.blocksize, self.nested, self.itemsize)


# Rows of the timed calls: one for each build the drop-in picks (matmul_kernel.variant_for: with
# nested scales the few-rows build at 1, the pair-table kernel's tiles of 8, 16 and 32 tokens at 8,
# 16 and 32, where the k weight at 32 takes two 16-token tiles (matmul_kernel.tile_for), the wide
# tiles at 64 and 128) and, with nested scales, dequantize + F.linear past the
# crossover at 256. Plain fp32 scales (transformers' default, no double quantization) run other
# kernels: the register tables up to 16 rows, their own wide builds above.
PERF_TOKENS = (1, 8, 16, 32, 64, 128, 256)
PLAIN_PERF_TOKENS = (1, 8, 16, 32, 64, 128)
# On Hopper the 128-token tile has two builds (matmul_kernel.pick_plan): the o weight takes the
# 12-warp one, the gate and k weights the 8-warp one; with plain scales the o weight times the former.
PLAIN_O_PERF_TOKENS = (128,)


def perf_cases() -> list[MatmulCase]:
    """``harness.matmul_4bit`` as a user calls it (the fused kernel up to the GPU's crossover,
    dequantize + F.linear above) on Llama-3.3-70B's gate, o and k weights with nested scales at
    ``PERF_TOKENS`` rows, its gate weight with plain scales at ``PLAIN_PERF_TOKENS`` and its o weight
    with plain scales at ``PLAIN_O_PERF_TOKENS``."""
    by_id = {w.id: w for w in shapes.model_shapes(unique=False)}
    weights = [by_id[f"llama-3.3-70b.{layer}"] for layer in ("gate_proj", "o_proj", "k_proj")]
    nested = [MatmulCase(w, "bf16", "nested", tokens=m) for w in weights for m in PERF_TOKENS]
    plain = [MatmulCase(weights[0], "bf16", "plain", tokens=m) for m in PLAIN_PERF_TOKENS]
    return nested + plain + [MatmulCase(weights[1], "bf16", "plain", tokens=m) for m in PLAIN_O_PERF_TOKENS]


# Sanitizer cases (M, N, K), both kernels split and unsplit: the 8-token kernel with K in two
# splits ending in a partial step (one table per 64 k), and unsplit over one partial step (K % 64
# == 32: a table per 32-k half), and in 16 splits (on Hopper one cluster, past the portable size)
# and in 7 splits of 3 steps (on Hopper a cluster of an odd size); the 16-token one unsplit over 4
# steps; the wide kernel at 32 tokens split in two (no cluster epilogue: the finish adds them on any
# GPU), at 64 split in two and unsplit; at 128 (its activation stages in dynamic shared memory)
# split in two and unsplit over two token tiles, and on Hopper in its 12-warp build (a weight of 112
# such blocks against 168 of 8 warps: ``pick_plan``). The split rules decide these splits on any GPU
# that holds three blocks (tests/test_sanitize.py).
SANITIZE_SHAPES = (
    (3, 40, 1856), (3, 40, 224), (5, 40, 16384), (5, 40, 5376), (9, 40, 1024), (20, 40, 1024), (40, 40, 1024),
    (60, 40, 128), (100, 40, 1024), (130, 40, 256), (100, 21504, 256),
    (20, 12352, 1024),  # past matmul_kernel.TWO_TILE_ELEMENTS: the pair-table kernel's 32-token tile (nested)
)  # fmt: skip


def sanitize_cases(inputs: str, device) -> int:
    """The fused matmul (nf4/fp4 x fp16/bf16 x plain/nested) over ``SANITIZE_SHAPES`` with a bias,
    launched by the compiled host path and by the Python path; the number of results outside the
    fp64 bound."""
    from harness.runtime import api, host_path, matmul

    wrong = 0
    formats = itertools.product(("nf4", "fp4"), (torch.float16, torch.bfloat16), (False, True), SANITIZE_SHAPES)
    for quant, dtype, nested, (M, N, K) in formats:
        B, qs = sanitize_inputs.weights(inputs, (N, K), quant, dtype, nested, device)
        sanitize_inputs.print_ranges(f"matmul {quant} {dtype} nested={nested} {M}x{N}x{K}", B, qs)
        g = cases.seeded_generator(M, device)
        A = torch.randn(M, K, generator=g, device=device).to(dtype)
        bias = torch.randn(N, generator=g, device=device).to(dtype)
        expected = mr.fused_reference(A, B, qs, api.dequantize_4bit(B, qs), bias, dtype)
        for path in (contextlib.nullcontext, host_path.python_path_only):  # the compiled entry, then Python's
            out = bitcompare.poison_(torch.empty(M, N, dtype=dtype, device=device))
            with path():
                matmul.fused_matmul(A, B.t(), qs, bias=bias, out=out)
            wrong += not mr.judge(out, expected).ok
    return wrong


CHECKS = OpChecks("matmul", "fused 4-bit matmul", Staging(), perf_cases, sanitize_cases)
