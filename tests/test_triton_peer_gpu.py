"""The Triton peer (harness/correctness/peers/triton_dequantize.py) is held to the same bar as our kernel:
bit-exact against bitsandbytes on quantized weights and on raw bytes with hostile scales."""

from __future__ import annotations

import pytest

from harness.correctness import cases
from harness.correctness.bitcompare import assert_bit_exact

pytestmark = pytest.mark.gpu

MATRIX = cases.format_matrix((32, 64, 4096))
IDS = [cases.format_id(c) for c in MATRIX]


@pytest.fixture(scope="module")
def triton_peer():
    pytest.importorskip("triton", reason="the Triton peer needs triton (ships with CUDA builds of PyTorch)")
    from harness.correctness.peers import triton_dequantize

    return triton_dequantize


@pytest.mark.parametrize(("quant_type", "out_dtype", "blocksize", "nested"), MATRIX, ids=IDS)
@pytest.mark.parametrize("shape", [(4097,), (123, 457), (1024, 640)], ids=lambda s: "x".join(map(str, s)))
def test_triton_peer_is_bit_exact(cuda, bnb, triton_peer, run_seed, shape, quant_type, out_dtype, blocksize, nested):
    dtype = cases.dtype_of(out_dtype)
    A, qs = cases.quantize_weights(shape, quant_type, blocksize, nested, dtype, run_seed, device=cuda)
    assert_bit_exact(triton_peer.dequantize_4bit(A, qs), bnb.dequantize_4bit(A, qs), f"seed={run_seed}")
    raw = cases.raw_case(shape, quant_type, blocksize, dtype, nested, run_seed, device=cuda)
    qs = raw.quant_state()
    assert_bit_exact(triton_peer.dequantize_4bit(raw.A, qs), bnb.dequantize_4bit(raw.A, qs), f"seed={run_seed}")
