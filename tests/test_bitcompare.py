"""The comparison itself must be able to fail: signed zeros, NaN payloads, one-ULP differences."""

import pytest
import torch

from harness.correctness.bitcompare import POISON_BITS, assert_bit_exact, compare_bits, poison_
from harness.correctness.cases import floats_from_bits


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_signed_zero_and_nan_payload_are_mismatches(dtype):
    a = torch.tensor([0.0, 1.0, float("nan")], dtype=dtype)
    b = a.clone()
    b[0] = -0.0
    report = compare_bits(a, b)
    assert report.mismatches == 1 and report.first[0][0] == (0,)
    c = a.clone()
    c.view(torch.int16 if dtype.itemsize == 2 else torch.int32)[2] += 1  # another NaN payload
    report = compare_bits(a, c)
    assert report.mismatches == 1 and report.nan_mismatches == 1
    assert compare_bits(a, c, nan_payloads=False) is None


def test_report_gives_count_indices_hex_floats_and_ulps():
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = a.clone()
    b[2, 1] = torch.nextafter(b[2, 1], torch.tensor(100.0))
    b[0, 3] = float("inf")
    report = compare_bits(a, b)
    text = str(report)
    assert report.mismatches == 2 and report.inf_mismatches == 1 and report.max_ulp == 1
    assert "(2, 1)" in text and "0x41100000" in text and "9.0" in text
    with pytest.raises(AssertionError, match="2 of 12 elements differ"):
        assert_bit_exact(a, b)


def test_ulp_distance_across_zero():
    a = floats_from_bits([0x00000001])
    b = floats_from_bits([0x80000001])
    assert compare_bits(a, b).max_ulp == 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_poison_is_a_nan_and_both_patterns_differ(dtype):
    a, b = poison_(torch.empty(4, dtype=dtype)), poison_(torch.empty(4, dtype=dtype), alternate=True)
    assert torch.isnan(a).all() and torch.isnan(b).all()
    assert compare_bits(a, b).mismatches == 4
    bits = a.view(torch.int16 if dtype.itemsize == 2 else torch.int32)[0].item() & ((1 << (8 * dtype.itemsize)) - 1)
    assert bits == POISON_BITS[dtype]
