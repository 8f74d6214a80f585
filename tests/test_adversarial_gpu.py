"""Raw packed bytes (all 256 values) and hostile scales fed straight to both implementations.

No quantizer in the loop: zeros of both signs, subnormals, values that overflow fp16/bf16 once
scaled, infinities and NaNs with payloads reach the multiply and the final rounding. The nested
form puts them in the 256-entry code table, the second-level absmax and the offset as well.
"""

from __future__ import annotations

import pytest
import torch

import harness
from harness.correctness import cases
from harness.correctness.bitcompare import assert_bit_exact, poison_
from harness.runtime.dequantize_kernel import OUT_DTYPES

pytestmark = pytest.mark.gpu

MATRIX = cases.format_matrix()
IDS = [cases.format_id(c) for c in MATRIX]


def _run(F, case):
    qs = case.quant_state()
    expected = poison_(torch.empty(case.shape, dtype=case.dtype, device=case.A.device), alternate=True)
    F.dequantize_4bit(case.A, qs, out=expected)
    got = poison_(torch.empty(case.shape, dtype=case.dtype, device=case.A.device))
    harness.dequantize_4bit(case.A, qs, out=got)
    return got, expected


@pytest.mark.parametrize(("quant_type", "out_dtype", "blocksize", "nested"), MATRIX, ids=IDS)
@pytest.mark.parametrize("shape", [(4097,), (255, 1031), (1 << 18,)], ids=lambda s: "x".join(map(str, s)))
def test_raw_bytes_and_hostile_scales(cuda, bnb, run_seed, shape, quant_type, out_dtype, blocksize, nested):
    case = cases.raw_case(shape, quant_type, blocksize, cases.dtype_of(out_dtype), nested, run_seed, device=cuda)
    got, expected = _run(bnb, case)
    assert_bit_exact(got, expected, f"seed={run_seed}")
    if -(-case.A.numel() * 2 // blocksize) >= 256:
        # The scales really were hostile: NaN outputs exist, so payloads were exercised, and with
        # plain scales infinities too (nested decode can turn an inf scale into NaN or a finite).
        assert bool(torch.isnan(expected).any())
        assert nested or bool(torch.isinf(expected).any())


@pytest.mark.parametrize("blocksize2", [64, 256, 4096])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_nested_second_level_block_sizes(cuda, bnb, run_seed, out_dtype, blocksize2):
    case = cases.raw_case(
        (300_001,), "nf4", 32, cases.dtype_of(out_dtype), True, run_seed, device=cuda, blocksize2=blocksize2
    )
    got, expected = _run(bnb, case)
    assert_bit_exact(got, expected, f"seed={run_seed}")


@pytest.mark.parametrize("offset", [0.0, -0.0, float("inf"), float("nan"), 1e-45, -3.0e38])
def test_nested_offset_values_and_forms(cuda, bnb, run_seed, offset):
    """The offset as a device tensor (read in-kernel), a CPU tensor and a Python float."""
    case = cases.raw_case((65_536 + 3,), "fp4", 64, torch.float16, True, run_seed, device=cuda, special_scales=False)
    outs = []
    for form in (torch.tensor(offset, device=cuda), torch.tensor(offset), offset):
        case.offset = form
        outs.append(_run(bnb, case))
    for got, expected in outs:
        assert_bit_exact(got, expected, f"offset={offset!r} seed={run_seed}")
