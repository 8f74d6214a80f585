"""The judge's half of the dequantization, ``harness.dequantize_4bit(W, state)``: its oracle is
bitsandbytes' bits, equal bit patterns (in a perf session the first prepared side's, the base's in
an A/B session).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch

from harness.correctness import bitcompare, sanitize_inputs, shapes
from harness.correctness.op_checks.unit import OpChecks, PerfCase, packed_bytes


class Staging:
    """The live input is the absmax (its blocks rotated: valid scales, nearly every block
    changed); the reference is the first prepared side's bits, and an output must equal them."""

    def inputs(self, spec: dict, A, qs, dtype: torch.dtype, device: torch.device, variants: int) -> tuple:
        step = max(1, qs.absmax.numel() // variants)
        versions = torch.stack([qs.absmax.roll(v * step + v) for v in range(variants)])
        return None, versions, torch.empty(qs.shape, dtype=dtype, device=device)

    def live(self, lent) -> torch.Tensor:
        return lent.qs.absmax

    def call(self, lent, drop_ins, into_out: bool = True) -> Callable[[], torch.Tensor]:
        A, qs, out, entry = lent.A, lent.qs, lent.out, drop_ins.dequantize_4bit
        return (lambda: entry(A, qs, out=out)) if into_out else (lambda: entry(A, qs))

    def references(self, lent: dict) -> list[object] | None:
        return None  # the first prepared side's outputs

    def agrees(self, output: torch.Tensor, expected: torch.Tensor) -> bool:
        return torch.equal(bitcompare.int_view(output), bitcompare.int_view(expected))

    def bitsandbytes_calls(self, lent: dict, names: list[str], device: torch.device) -> dict:
        """bitsandbytes' kernel alone (fp32 scales) and its full ``dequantize_4bit``."""
        import bitsandbytes.functional as F

        A, qs, calls = lent["A"], lent["qs"], {}
        if "bnb_kernel" in names:
            absmax = F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset if qs.nested else qs.absmax
            out = torch.empty(qs.shape, dtype=qs.dtype, device=device)
            calls["bnb_kernel"] = lambda: torch.ops.bitsandbytes.dequantize_4bit.out(
                A, absmax, qs.blocksize, qs.quant_type, qs.shape, qs.dtype, out=out
            )
        if "bnb_full" in names:
            calls["bnb_full"] = lambda: F.dequantize_4bit(A, qs)
        return calls


@dataclass(frozen=True)
class DequantizeCase(PerfCase):
    """``harness.dequantize_4bit(W, state)``."""

    kind = "dequantize"

    @property
    def id(self) -> str:
        return self.weight_id

    def bytes_moved(self) -> int:
        """Fewest bytes the dequantization must move: packed input, output, scales."""
        return packed_bytes(self.numel, self.blocksize, self.nested) + self.numel * self.itemsize


def perf_cases() -> list[DequantizeCase]:
    """Every unique weight shape of the paper's three models at the deployed configurations (nf4,
    block size 64, fp16 and bf16 output, nested and plain scales), plus fp4, fp32 output and other
    block sizes on a few shapes."""
    out = [
        DequantizeCase(w, dtype, scales)
        for w in shapes.model_shapes()
        for dtype in ("fp16", "bf16")
        for scales in ("nested", "plain")
    ]
    by_id = {w.id: w for w in shapes.model_shapes()}
    gate, q, k = by_id["llama-3.3-70b.gate_proj"], by_id["qwen3-32b.q_proj"], by_id["qwen3-32b.k_proj"]
    out += [
        DequantizeCase(gate, "fp16", "nested", "fp4"),
        DequantizeCase(gate, "fp32", "nested"),
        DequantizeCase(q, "fp16", "nested", blocksize=128),
        DequantizeCase(q, "fp16", "nested", blocksize=4096),
        DequantizeCase(k, "fp16", "nested", "fp4"),
        DequantizeCase(k, "fp32", "plain"),
    ]
    return out


# Sanitizer shapes: several vectorized tiles with no tail, a tail (odd element count), a single byte.
SANITIZE_SHAPES = ((64, 96), (37, 61), (1, 3))


def sanitize_cases(inputs: str, device) -> int:
    """Every dequantization variant (nf4/fp4 x fp16/bf16/fp32 x plain/nested), launched by the
    compiled host path and by the Python path at both tilings (the large one forced onto small
    tensors, which a sanitizer runs in seconds), with and without a tail, and with a misaligned
    output (the scalar path); the number of outputs that differ from bitsandbytes' bits."""
    import bitsandbytes.functional as F

    from harness.runtime import api, dequantize_kernel, host_path

    mismatches = 0
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    # The compiled host path as it picks the launch, then the Python path with each tiling forced.
    host_paths = [contextlib.nullcontext] + [
        functools.partial(_python_path_tiled, host_path, dequantize_kernel, tiling)
        for tiling in dequantize_kernel.TILINGS
    ]
    for quant, dtype, nested, shape in itertools.product(("nf4", "fp4"), dtypes, (False, True), SANITIZE_SHAPES):
        A, qs = sanitize_inputs.weights(inputs, shape, quant, dtype, nested, device)
        sanitize_inputs.print_ranges(f"{quant} {dtype} nested={nested} {shape}", A, qs)
        expected = F.dequantize_4bit(A, qs)
        for path, misaligned in itertools.product(host_paths, (False, True)):
            buffer = torch.empty(expected.numel() + 1, dtype=dtype, device=device)
            out = buffer[1:].view(expected.shape) if misaligned else buffer[:-1].view(expected.shape)
            bitcompare.poison_(out)
            with path():
                api.dequantize_4bit(A, qs, out=out)
            mismatches += not torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    return mismatches


@contextlib.contextmanager
def _python_path_tiled(host_path, dequantize_kernel, tiling):
    with host_path.python_path_only(), mock.patch.object(dequantize_kernel, "tiling_for", lambda n: tiling):
        yield


CHECKS = OpChecks("dequantize", "4-bit dequantization", Staging(), perf_cases, sanitize_cases)
