"""The PyTorch statement of the format (harness.correctness.reference) against bitsandbytes' CPU backend.

Runs without a GPU. Two documented differences between bitsandbytes' CUDA and CPU arithmetic,
both modelled by the reference: FP4 code 0b1000 is -0.0 on CUDA (0 * sign with sign = -1) but
+0.0 in the Python table (get_4bit_type) the CPU backend uses; and the CUDA build flushes
subnormals in its multiplies while the CPU keeps them (``ftz=False`` here). The GPU suite checks
the CUDA form of both against bitsandbytes' CUDA kernels.
"""

from __future__ import annotations

import re

import pytest
import torch

from harness.correctness import cases, reference
from harness.correctness.bitcompare import assert_bit_exact, compare_bits
from harness.runtime.dequantize_kernel import QUANT_TYPES
from harness.runtime.jit import kernels_dir

SHAPES = [(1,), (7,), (4097,), (123, 458), (64, 256), (3, 5, 6)]
MATRIX = cases.format_matrix()
IDS = [cases.format_id(c) for c in MATRIX]


def bnb_cpu_result(bnb, packed, qs):
    """bitsandbytes' CPU backend: its 8-bit nested decode, then its pure-PyTorch 4-bit kernel.

    The native 4-bit CPU kernel that bitsandbytes dispatches to for an even last dimension is no
    stable oracle: on AVX-512 machines it indexes blocks per row when the block size exceeds the
    last dimension, and its fp16 results differed by 1 ULP on another x86 CPU.
    """
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    absmax = qs.absmax
    if qs.nested:
        absmax = bnb.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset
    code = _get_4bit_code(qs.quant_type, packed.device)
    return _dequantize_4bit_compute(packed.reshape(-1), absmax, code, qs.blocksize, qs.shape, qs.dtype)


def _assert_matches_bnb_cpu(bnb, packed, qs):
    # bitsandbytes' CPU arithmetic keeps subnormals: compare with the reference's ftz=False form.
    ours = reference.dequantize_state(packed, qs, ftz=False)
    python_table = reference.dequantize_state(
        packed, qs, table=bnb.get_4bit_type(qs.quant_type, device="cpu"), ftz=False
    )
    theirs = bnb_cpu_result(bnb, packed, qs)
    if qs.quant_type == "fp4":
        # The pure-PyTorch backend uses the Python table: +0.0 at code 8 (see module docstring).
        ours = python_table
    assert_bit_exact(ours, theirs, "bitsandbytes CPU backend", nan_payloads=False)


@pytest.mark.parametrize(("quant_type", "out_dtype", "blocksize", "nested"), MATRIX, ids=IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_reference_matches_bitsandbytes_cpu(bnb, run_seed, shape, quant_type, out_dtype, blocksize, nested):
    dtype = cases.dtype_of(out_dtype)
    A, qs = cases.quantize_weights(shape, quant_type, blocksize, nested, dtype, run_seed, device="cpu")
    _assert_matches_bnb_cpu(bnb, A, qs)


@pytest.mark.parametrize(("quant_type", "out_dtype", "blocksize", "nested"), MATRIX, ids=IDS)
def test_reference_on_raw_bytes_and_hostile_scales(bnb, run_seed, quant_type, out_dtype, blocksize, nested):
    case = cases.raw_case((37, 1030), quant_type, blocksize, cases.dtype_of(out_dtype), nested, run_seed, device="cpu")
    _assert_matches_bnb_cpu(bnb, case.A, case.quant_state())


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_tables_match_bitsandbytes_up_to_fp4_signed_zero(bnb, quant_type):
    ours = reference.code_table(quant_type)
    theirs = bnb.get_4bit_type(quant_type, device="cpu")
    if quant_type == "fp4":
        assert compare_bits(ours, theirs).first[0][0] == (8,)
        ours, theirs = ours.clone(), theirs.clone()
        ours[8] = theirs[8] = 0.0
    assert_bit_exact(ours, theirs)


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_kernel_source_tables_are_the_reference_tables(quant_type):
    """The kernels' shared header carries the same 16 bit patterns as the reference, in order."""
    source = (kernels_dir() / "format_4bit.cuh").read_text()
    index = {"nf4": 0, "fp4": 1}[quant_type]
    # The four CODE_* macros under this quant type's #if, in order.
    block = re.search(rf"#(?:el)?if FMT_QUANT == {index}\s*\n((?:#define CODE_\w+ [^\n]*\n){{4}})", source)
    assert block, "table not found in kernel source"
    bits = tuple(int(x, 16) for x in re.findall(r"0x([0-9a-fA-F]{8})u", block.group(1)))
    assert bits == reference.CODE_BITS[quant_type]


def test_nibble_order_high_nibble_first():
    packed = torch.tensor([[0x1F], [0xA0]], dtype=torch.uint8)
    assert reference.unpack_nibbles(packed, 3).tolist() == [0x1, 0xF, 0xA]


def test_flush_to_zero_matches_the_cuda_build():
    """With ftz, subnormal scales act as signed zeros and subnormal products flush; without, they stay."""
    packed = torch.tensor([[0xF8]], dtype=torch.uint8)  # nf4 codes 15 (1.0) and 8 (0.0796)
    tiny = cases.floats_from_bits([0x00400000])  # a subnormal scale
    ftz = reference.dequantize(packed, tiny, (2,), torch.float32, 64, "nf4")
    keep = reference.dequantize(packed, tiny, (2,), torch.float32, 64, "nf4", ftz=False)
    assert ftz.view(torch.int32).tolist() == [0, 0]
    assert keep.view(torch.int32).tolist() == [0x00400000, 0x517D8]
    normal = cases.floats_from_bits([0x00800000])  # smallest normal: 1.0 * s stays, 0.0796 * s flushes
    flushed = reference.dequantize(packed, -normal, (2,), torch.float32, 64, "nf4")
    assert [b & 0xFFFFFFFF for b in flushed.view(torch.int32).tolist()] == [0x80800000, 0x80000000]


def test_nested_decode_rounds_twice():
    """code2[q] * absmax2 then + offset, each rounded: differs from a fused multiply-add here."""
    code2 = torch.full((256,), 1.0 + 2**-23)
    absmax2 = torch.tensor([1.0 + 2**-23])
    offset = torch.tensor(-(1.0 + 2**-22))
    got = reference.nested_absmax(torch.zeros(1, dtype=torch.uint8), code2, absmax2, 256, offset)
    # Exact product 1 + 2^-22 + 2^-46 rounds to 1 + 2^-22; adding the offset gives exactly 0.
    # A fused multiply-add would keep 2^-46.
    assert got.item() == 0.0
