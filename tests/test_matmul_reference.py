"""The 4-bit matmul's oracle on the CPU: its bound holds for bitsandbytes' own result and for fp32
sums in other orders, it catches a result just outside it, it matches non-finite values by class,
and one-hot rows of A turn the matmul into a copy of the weights (the part a fused kernel must
get bit for bit). The scaled-sums oracle (the 8-token kernel's arithmetic): its exact weights are
the format's, its bound holds for that arithmetic emulated here and for bitsandbytes, and its
one-hot weights are scale * round(code), not the dequantized bits."""

from __future__ import annotations

import itertools

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
    A = torch.ones(1, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="exact ones with a weight error"):
        mr.reference(A, torch.ones(2, 4, dtype=torch.float64), None, torch.bfloat16)  # exact weights, no error
    with pytest.raises(ValueError, match="exact ones with a weight error"):
        mr.reference(A, torch.ones(2, 4, dtype=torch.bfloat16), None, torch.bfloat16, 2.0**-8)
    with pytest.raises(ValueError, match="no such arithmetic"):
        mr.kernel_reference("fused", A, None, None, None, None, torch.bfloat16)
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


def _scaled_sums(A: torch.Tensor, packed, state, chunk: int) -> torch.Tensor:
    """The 8-token kernel's arithmetic (kernels/matmul_4bit_m8_pairs.cu) in fp32 on the CPU: codes rounded
    to A's dtype, each chunk's products summed in fp32, its block's scale applied by one fma."""
    from harness.correctness import reference as fr

    N, K = state.shape
    codes = fr.code_table(state.quant_type)[fr.unpack_nibbles(packed, N * K)].reshape(N, K)
    rounded = codes.to(A.dtype).float()
    scales = mr.block_scales(state).double()
    acc = torch.zeros(A.shape[0], N, dtype=torch.float64)
    for k0 in range(0, K, chunk):
        part = A.float()[:, k0 : k0 + chunk] @ rounded[:, k0 : k0 + chunk].t()  # fp32
        scale = scales[(torch.arange(N) * K + k0) // state.blocksize]
        acc = (acc + part.double() * scale).float().double()  # one rounding: the fma's
    return acc.float().to(A.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_the_scaled_sums_bound_holds_for_its_arithmetic_and_for_bitsandbytes(bnb, run_seed, dtype, quant_type):
    """Nested weights, the only ones the scaled-sums kernel takes (plain ones measured 5-14% less
    accurate than bitsandbytes' in that arithmetic: kernels/NOTES.md)."""
    import bitsandbytes

    # 2048 outputs: on 240 the two error norms' ratio spread 0.80-1.11 over seeds, on 2048 0.87-0.97.
    q, state, W = _weights(256, 2048, dtype, quant_type, True, run_seed)
    A = torch.randn(8, 2048, generator=torch.Generator().manual_seed(run_seed + 1)).to(dtype)
    ref = mr.kernel_reference("scaled-sums", A, q, state, W, None, dtype)
    ours = mr.judge(_scaled_sums(A, q, state, 64), ref)
    assert ours.ok and mr.judge(bitsandbytes.matmul_4bit(A, q.t(), state), ref).ok
    # bitsandbytes' CUDA arithmetic: its dequantized weights, products summed in fp32. Rounding the
    # codes loses no more than rounding the products (tests/test_matmul.py holds the GPU kernels to it).
    theirs = mr.judge((A.float() @ W.float().t()).to(dtype), ref)
    assert ours.error_norm <= 1.01 * theirs.error_norm, (ours, theirs)
    # And the bound is tight enough to catch a result off by a few codes' rounding.
    off = _scaled_sums(A, q, state, 64).double()
    off[2, 7] += 4 * mr.UNIT[dtype] * float((A.double().abs() @ mr.exact_weights(q, state).abs().t())[2, 7])
    assert mr.judge(off, ref).outside == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("quant_type", "nested"), [("nf4", True), ("fp4", False)])
def test_exact_weights_are_the_formats_and_one_hot_weights_are_the_kernels(run_seed, dtype, quant_type, nested):
    """exact_weights rounded once is the format reference's dequantization (subnormals kept); the
    scaled-sums one-hot weights are fp32(scale * round(code)) rounded, which differ from the
    dequantized bits for some weights (a bf16 product rounds differently from a bf16 code)."""
    from harness.correctness import reference as fr

    q, state, W = _weights(64, 256, dtype, quant_type, nested, run_seed)
    exact = mr.exact_weights(q, state)
    assert exact.dtype == torch.float64
    dequantized = fr.dequantize_state(q, state, ftz=False)
    assert torch.equal(exact.float().to(dtype).view(torch.int16), dequantized.view(torch.int16))
    one_hot = mr.one_hot_weights("scaled-sums", q, state, W)
    codes = fr.code_table(quant_type)[fr.unpack_nibbles(q, 64 * 256)].reshape(64, 256)
    scales = mr.block_scales(state)[(torch.arange(64 * 256) // 64).reshape(64, 256)]
    by_hand = (scales * codes.to(dtype).float()).to(dtype) + 0.0
    assert torch.equal(one_hot.view(torch.int16), by_hand.view(torch.int16))
    assert not torch.equal(one_hot.view(torch.int16), (W + 0.0).view(torch.int16))
    assert torch.equal(mr.one_hot_weights("dequantized", q, state, W).view(torch.int16), (W + 0.0).view(torch.int16))


def test_the_judge_and_the_runtime_agree_on_each_calls_arithmetic():
    """The judge states the arithmetic of each call itself (``arithmetic_of``), so a candidate's
    runtime cannot pick its own oracle; the runtime's kernel choice must agree with it."""
    from harness.runtime import matmul_kernel

    line, large = matmul_kernel.TWO_TILE_ELEMENTS, 28672 * 8192
    for rows, nested, elements in itertools.product(range(1, 300), (True, False), (1, line, line + 1, large)):
        assert matmul_kernel.arithmetic(rows, nested, elements) == mr.arithmetic_of(rows, nested), (
            rows, nested, elements,
        )  # fmt: skip
    assert [mr.arithmetic_of(m, True) for m in (1, 8, 9, 16, 17, 32, 33)] == [*["scaled-sums"] * 6, "dequantized"]
    assert mr.arithmetic_of(1, False) == mr.arithmetic_of(17, False) == "dequantized"


def test_the_judge_and_the_runtime_agree_on_each_token_tiles_arithmetic():
    """A tile's arithmetic whatever the call (the grid sweep runs both tiles of a 17-32-row call on
    every weight): the decode tiles' of nested weights scaled sums, the wider ones' the dequantized
    bits, on every arch's build."""
    from harness.runtime import matmul_kernel as mk

    for tokens, nested in itertools.product(mk.TOKEN_TILES, (True, False)):
        assert mk.tile_arithmetic(tokens, nested) == mr.arithmetic_of(tokens, nested), (tokens, nested)
        for arch in ("sm_80", "sm_90"):
            source = mk.MatmulVariant("bf16", "nf4", nested, tokens).build(arch)[0]
            assert mk.ARITHMETIC.get(source, "dequantized") == mr.arithmetic_of(tokens, nested), (arch, tokens)
    assert [mr.arithmetic_of(t, True) for t in (8, 16, 32, 64)] == [*["scaled-sums"] * 3, "dequantized"]
    assert mr.arithmetic_of(16, False) == "dequantized"
