"""Bit-exactness of our kernel against bitsandbytes 0.50.2's dequantize_4bit on the GPU.

Matrix: {nf4, fp4} x {fp16, bf16, fp32} x every block size x {nested, plain} over the odd shapes
and three model shapes spanning the catalog's sizes (smallest, mid, largest). The remaining model
shapes differ from those only in element count, so by default they run at the configurations
models are deployed with (nf4, block size 64, every dtype, nested and plain); ``--full-matrix``
runs them through everything too.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

import harness
from harness.correctness import cases, shapes
from harness.correctness.bitcompare import assert_bit_exact, poison_
from harness.runtime.dequantize_kernel import BLOCKSIZES, OUT_DTYPES, QUANT_TYPES

pytestmark = pytest.mark.gpu

SCALES = ("plain", "nested")
FULL = list(itertools.product(QUANT_TYPES, OUT_DTYPES, BLOCKSIZES, SCALES))
DEPLOYED = list(itertools.product(("nf4",), OUT_DTYPES, (64,), SCALES))
FULL_IDS = [f"{q}-{d}-bs{b}-{s}" for q, d, b, s in FULL]
DEPLOYED_IDS = [f"{q}-{d}-bs{b}-{s}" for q, d, b, s in DEPLOYED]


def case_seed(run_seed: int, *params) -> int:
    return (run_seed + zlib.crc32(repr(params).encode())) % 2**31


def check_against_bnb(F, shape, quant_type, out_dtype, blocksize, scales, seed):
    dtype = cases.dtype_of(out_dtype)
    A, qs = cases.quantize_weights(shape, quant_type, blocksize, scales == "nested", dtype, seed)
    expected = poison_(torch.empty(qs.shape, dtype=dtype, device=A.device), alternate=True)
    got = poison_(torch.empty(qs.shape, dtype=dtype, device=A.device))
    F.dequantize_4bit(A, qs, out=expected)
    returned = harness.dequantize_4bit(A, qs, out=got)
    # Like bitsandbytes: the out tensor itself, or its transpose when A is [1, bytes].
    assert returned is got if A.shape[0] != 1 else returned.data_ptr() == got.data_ptr()
    assert_bit_exact(
        got, expected, f"shape={tuple(shape)} {quant_type} {out_dtype} bs={blocksize} {scales} seed={seed}"
    )


@pytest.mark.parametrize(("quant_type", "out_dtype", "blocksize", "scales"), FULL, ids=FULL_IDS)
@pytest.mark.parametrize("shape", shapes.odd_shapes(), ids=lambda s: "x".join(map(str, s)))
def test_odd_shapes(cuda, bnb, run_seed, shape, quant_type, out_dtype, blocksize, scales):
    seed = case_seed(run_seed, shape, quant_type, out_dtype, blocksize, scales)
    check_against_bnb(bnb, shape, quant_type, out_dtype, blocksize, scales, seed)


@pytest.mark.parametrize(("quant_type", "out_dtype", "blocksize", "scales"), FULL, ids=FULL_IDS)
@pytest.mark.parametrize("weight", shapes.full_matrix_shapes(), ids=lambda w: w.id)
def test_model_shapes_full_matrix(cuda, bnb, run_seed, weight, quant_type, out_dtype, blocksize, scales):
    seed = case_seed(run_seed, weight.id, quant_type, out_dtype, blocksize, scales)
    check_against_bnb(bnb, weight.shape, quant_type, out_dtype, blocksize, scales, seed)


def pytest_generate_tests(metafunc):
    """The rest of the model shapes: deployed configurations, or everything with --full-matrix."""
    if metafunc.function.__name__ != "test_model_shapes":
        return
    full = {w.id for w in shapes.full_matrix_shapes()}
    weights = [w for w in shapes.model_shapes() if w.id not in full]
    combos, ids = (FULL, FULL_IDS) if metafunc.config.getoption("--full-matrix") else (DEPLOYED, DEPLOYED_IDS)
    params = [(w, *c) for w in weights for c in combos]
    metafunc.parametrize(
        ("weight", "quant_type", "out_dtype", "blocksize", "scales"),
        params,
        ids=[f"{w.id}-{i}" for w in weights for i in ids],
    )


def test_model_shapes(cuda, bnb, run_seed, weight, quant_type, out_dtype, blocksize, scales):
    seed = case_seed(run_seed, weight.id, quant_type, out_dtype, blocksize, scales)
    check_against_bnb(bnb, weight.shape, quant_type, out_dtype, blocksize, scales, seed)


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("shape", [(4097,), (123, 457), (64, 64)], ids=lambda s: "x".join(map(str, s)))
def test_misaligned_pointers_take_the_scalar_path(cuda, bnb, run_seed, shape, quant_type, out_dtype, scales):
    """A and out at odd offsets into larger buffers: no 16-byte path, same bits."""
    dtype = cases.dtype_of(out_dtype)
    seed = case_seed(run_seed, "misaligned", shape, quant_type, out_dtype, scales)
    A, qs = cases.quantize_weights(shape, quant_type, 64, scales == "nested", dtype, seed)
    a_buf = torch.empty(A.numel() + 3, dtype=torch.uint8, device=cuda)
    A_off = a_buf[1 : 1 + A.numel()].view(A.shape)
    A_off.copy_(A)
    n = qs.shape.numel()
    o_buf = poison_(torch.empty(n + 3, dtype=dtype, device=cuda))
    got = o_buf[1 : 1 + n].view(qs.shape)
    assert A_off.data_ptr() % 4 and got.data_ptr() % 16
    harness.dequantize_4bit(A_off, qs, out=got)
    expected = bnb.dequantize_4bit(A, qs)
    assert_bit_exact(got, expected)
    assert_bit_exact(o_buf[:1], poison_(torch.empty(1, dtype=dtype, device=cuda)), "wrote before out")
    assert_bit_exact(o_buf[1 + n :], poison_(torch.empty(2, dtype=dtype, device=cuda)), "wrote past out")


@pytest.mark.parametrize("scales", SCALES)
def test_return_semantics_match_bitsandbytes(cuda, bnb, run_seed, scales):
    """No ``out``: fresh tensor of quant_state.shape; A given as [1, bytes]: output transposed."""
    A, qs = cases.quantize_weights((96, 40), "nf4", 64, scales == "nested", torch.bfloat16, run_seed)
    ours, ref = harness.dequantize_4bit(A, qs), bnb.dequantize_4bit(A, qs)
    assert ours.shape == ref.shape == qs.shape
    assert_bit_exact(ours, ref)
    A_row = A.view(1, -1)
    ours_t, ref_t = harness.dequantize_4bit(A_row, qs), bnb.dequantize_4bit(A_row, qs)
    assert ours_t.shape == ref_t.shape == (40, 96)
    assert_bit_exact(ours_t, ref_t)


def test_absmax_and_out_without_quant_state(cuda, bnb, run_seed):
    """The quant_state=None form: shape and dtype come from ``out``."""
    A, qs = cases.quantize_weights((33, 65), "fp4", 128, False, torch.float16, run_seed)
    got = poison_(torch.empty(33, 65, dtype=torch.float16, device=cuda))
    want = poison_(torch.empty(33, 65, dtype=torch.float16, device=cuda), alternate=True)
    harness.dequantize_4bit(A, absmax=qs.absmax, out=got, blocksize=128, quant_type="fp4")
    bnb.dequantize_4bit(A, absmax=qs.absmax, out=want, blocksize=128, quant_type="fp4")
    assert_bit_exact(got, want)


def test_zero_elements_launch_nothing(cuda, monkeypatch):
    from harness.runtime import launcher

    def no_launch(*args, **kwargs):
        raise AssertionError("an empty tensor must not launch a kernel")

    monkeypatch.setattr(launcher, "launch", no_launch)
    A = torch.empty((0, 1), dtype=torch.uint8, device=cuda)
    absmax = torch.empty(0, dtype=torch.float32, device=cuda)
    out = torch.empty((0, 4), dtype=torch.float16, device=cuda)
    assert harness.dequantize_4bit(A, absmax=absmax, out=out, quant_type="nf4") is out


def test_runs_on_the_current_torch_stream(cuda, bnb, run_seed):
    """Work goes to torch's current stream: ordered after a pending fill on a side stream."""
    A, qs = cases.quantize_weights((512, 1024), "nf4", 64, True, torch.float16, run_seed)
    side = torch.cuda.Stream()
    out = torch.empty(qs.shape, dtype=torch.float16, device=cuda)
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000)  # keep the side stream busy so a wrong stream would race
        poison_(out)
        harness.dequantize_4bit(A, qs, out=out)
    side.synchronize()
    assert_bit_exact(out, bnb.dequantize_4bit(A, qs))
