"""A tensor of more than 2**31 elements, dequantized in one call (64-bit indexing).

bitsandbytes 0.50.2 cannot do this in one call (its issue #2067: 32-bit element counts), so the
reference is bitsandbytes applied chunk by chunk at boundaries aligned to whole blocks (and, when
nested, whole second-level blocks), compared chunk by chunk to keep memory bounded.
Needs about 8 GiB of free GPU memory; deselect on small GPUs with ``-m "not huge"``.
"""

from __future__ import annotations

import pytest
import torch

import harness
from harness.correctness import cases
from harness.correctness.bitcompare import assert_bit_exact, poison_

pytestmark = [pytest.mark.gpu, pytest.mark.huge]

N = 2**31 + 4096 * 3 + 77  # odd, and not a multiple of any block size
CHUNK = 2**28  # a multiple of blocksize * blocksize2 for every case below


@pytest.mark.parametrize(
    ("quant_type", "out_dtype", "blocksize", "nested"),
    [("nf4", torch.float16, 64, True), ("fp4", torch.bfloat16, 128, False)],
    ids=["nf4-fp16-bs64-nested", "fp4-bf16-bs128-plain"],
)
def test_more_than_2_31_elements(cuda, bnb, run_seed, quant_type, out_dtype, blocksize, nested):
    free, _ = torch.cuda.mem_get_info(cuda)
    need = N * (out_dtype.itemsize + 1) + CHUNK * out_dtype.itemsize + (1 << 30)
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB free GPU memory, {free / 2**30:.1f} GiB free")
    case = cases.raw_case((N,), quant_type, blocksize, out_dtype, nested, run_seed, device=cuda, special_scales=False)
    got = poison_(torch.empty(N, dtype=out_dtype, device=cuda))
    harness.dequantize_4bit(case.A, case.quant_state(), out=got)

    from bitsandbytes.functional import QuantState

    bs2 = case.blocksize2
    for start in range(0, N, CHUNK):
        stop = min(start + CHUNK, N)
        b0, b1 = start // blocksize, -(-stop // blocksize)
        A_chunk = case.A[start // 2 : (stop + 1) // 2]
        if nested:
            state2 = QuantState(
                absmax=case.absmax2[b0 // bs2 : -(-b1 // bs2)], code=case.code2, blocksize=bs2, dtype=torch.float32
            )
            qs = QuantState(
                absmax=case.absmax[b0:b1],
                shape=torch.Size([stop - start]),
                blocksize=blocksize,
                quant_type=quant_type,
                dtype=out_dtype,
                offset=case.offset,
                state2=state2,
            )
        else:
            qs = QuantState(
                absmax=case.absmax[b0:b1],
                shape=torch.Size([stop - start]),
                blocksize=blocksize,
                quant_type=quant_type,
                dtype=out_dtype,
            )
        want = poison_(torch.empty(stop - start, dtype=out_dtype, device=cuda), alternate=True)
        bnb.dequantize_4bit(A_chunk, qs, out=want)
        assert_bit_exact(got[start:stop], want, f"chunk at element {start}, seed={run_seed}")
