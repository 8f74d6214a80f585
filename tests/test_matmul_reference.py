"""The 4-bit matmul's oracle on the CPU: its bound holds for bitsandbytes' own result and for fp32
sums in other orders, it catches a result just outside it, it matches non-finite values by class,
and one-hot rows of A turn the matmul into a copy of the weights (the part a fused kernel must
get bit for bit)."""

from __future__ import annotations

import pytest
import torch

from harness.correctness import matmul_reference as mr

DTYPES = [torch.bfloat16, torch.float16]


def _weights(N, K, dtype, quant_type, nested, seed):
    import bitsandbytes.functional as F

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g).to(dtype)
    q, state = F.quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=nested)
    return q, state, F.dequantize_4bit(q, state)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("quant_type", "nested"), [("nf4", True), ("fp4", False)])
@pytest.mark.parametrize(("M", "K"), [(1, 64), (7, 320), (33, 1024)])
def test_bitsandbytes_own_result_is_within_the_bound(bnb, run_seed, dtype, quant_type, nested, M, K):
    import bitsandbytes

    q, state, W = _weights(48, K, dtype, quant_type, nested, run_seed)
    A = torch.randn(M, K, generator=torch.Generator().manual_seed(run_seed + 1)).to(dtype)
    bias = torch.randn(48).to(dtype)
    got = bitsandbytes.matmul_4bit(A, q.t(), state, bias=bias)
    verdict = mr.judge(got, mr.reference(A, W, bias, dtype))
    assert verdict.ok, verdict


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp32_sums_in_any_order_are_within_the_bound(run_seed, dtype):
    """Split-K: partial fp32 sums over shuffled chunks of K, added in another shuffled order."""
    g = torch.Generator().manual_seed(run_seed)
    M, N, K = 5, 64, 4096
    A, W = torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)
    ref = mr.reference(A, W, None, dtype)
    for splits in (1, 7, 64):
        chunks = torch.randperm(K, generator=g).tensor_split(splits)
        partial = [A.float()[:, c] @ W.float()[:, c].t() for c in chunks]
        total = torch.zeros(M, N)
        for i in torch.randperm(splits, generator=g).tolist():
            total = total + partial[i]
        verdict = mr.judge(total.to(dtype), ref)
        assert verdict.ok, (splits, verdict)


def test_a_result_just_outside_the_bound_is_caught(run_seed):
    g = torch.Generator().manual_seed(run_seed)
    A, W = torch.randn(3, 512, generator=g).bfloat16(), torch.randn(16, 512, generator=g).bfloat16()
    ref = mr.reference(A, W, None, torch.float32)
    exact = ref.value.float()
    assert mr.judge(exact, ref).ok
    off = exact.double().clone()
    off[1, 5] += 2 * ref.bound[1, 5]
    verdict = mr.judge(off, ref)
    assert verdict.outside == 1 and verdict.worst_ratio > 1.5


def test_non_finite_values_must_match_by_class():
    W = torch.tensor([[1.0, float("inf")], [1.0, 2.0], [float("nan"), 0.0]], dtype=torch.bfloat16)
    A = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    ref = mr.reference(A, W, None, torch.bfloat16)
    good = torch.tensor([[float("inf"), 3.0, float("nan")]], dtype=torch.bfloat16)
    assert mr.judge(good, ref).ok
    for bad in ([float("nan"), 3.0, float("nan")], [float("inf"), float("nan"), float("nan")], [-float("inf"), 3, 1]):
        assert not mr.judge(torch.tensor([bad], dtype=torch.bfloat16), ref).ok, bad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_hot_rows_copy_the_weights_bit_for_bit(run_seed, dtype):
    """The exact part: with one-hot rows, an fp32 accumulation of the products is W's column."""
    g = torch.Generator().manual_seed(run_seed)
    W = torch.randn(40, 96, generator=g).to(dtype)
    W[0, :] = -0.0  # a negative zero weight comes out as +0.0 (+0.0 terms are added to it)
    A, columns = mr.one_hot_rows(9, 96, dtype, "cpu", run_seed)
    got = (A.float() @ W.float().t()).to(dtype)
    expected = W[:, columns].t() + 0.0  # + 0.0: -0.0 becomes +0.0, every other value is unchanged
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def test_the_bound_refuses_operands_it_was_not_derived_for():
    with pytest.raises(ValueError, match="fp16/bf16"):
        mr.reference(torch.ones(1, 4), torch.ones(2, 4), None, torch.float32)
    with pytest.raises(ValueError, match="no bound"):
        mr.gamma(1 << 23, mr.U_ACCUMULATE)


def test_model_distance_counts_only_the_positions_the_reference_decides():
    from harness.correctness import model_reference as dr

    reference = torch.tensor([[[3.0, 0.0, 0.0], [1.0, 0.9, 0.0], [0.0, 0.0, 2.0]]], dtype=torch.float64)
    bnb = reference + torch.tensor([0.0, 0.05, 0.0], dtype=torch.float64)  # largest error 0.05
    assert dr.tie_margin(bnb, reference) == pytest.approx(0.1)
    ours = reference.clone()
    ours[0, 1] = torch.tensor([0.9, 1.0, 0.0])  # flips a lead of 0.1: not decided at margin 0.1
    d = dr.distance(ours, reference, dr.tie_margin(bnb, reference))
    assert (d.decided, d.decided_misses, d.top1_agreement) == (2, 0, pytest.approx(2 / 3))
    ours[0, 0] = torch.tensor([0.0, 3.5, 0.0])  # flips a decided lead
    assert dr.distance(ours, reference, 0.1).decided_misses == 1
    assert dr.relative_error(reference, reference) == 0.0
