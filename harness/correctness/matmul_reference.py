"""What a 4-bit matmul's result may be, for judging a fused kernel that cannot be bit-identical to
cuBLAS: an fp64 reference of ``A · Wᵀ (+ bias)`` on the exactly dequantized weights ``W``, and a
per-element bound derived from the arithmetic, not fitted to any implementation.

The derivation, for fp16/bf16 ``A`` and ``W`` (``W`` holds our dequantization kernel's bits):

- Every product ``a·w`` is exact in fp32: at most 11 + 11 significant bits of fp32's 24, and
  inside its exponent range.
- The K products (and the bias, one more term) are summed in fp32 in an order the kernel picks
  (split-K partial sums, tensor-core trees, atomics). Tensor cores may round the running sum
  toward zero, so each addition is taken to err by at most ``u = 2^-23`` (twice round-to-nearest's
  unit). Any order of summing ``n`` terms then errs by at most ``γ(n−1) · S`` with
  ``γ(n) = n·u / (1 − n·u)`` and ``S = Σ|a_k w_k| + |bias|`` (Higham, *Accuracy and Stability of
  Numerical Algorithms*, §4.2).
- One rounding to the output dtype adds at most half its unit roundoff times the magnitude, or
  half its smallest subnormal below the normal range.
- The fp64 reference itself errs by at most ``γ₆₄(n−1) · S`` (``u = 2^-53``), added to the bound.

Where the reference is NaN the result must be NaN; where it is ±inf, the same infinity.

The 8-token kernel of nested weights multiplies other weights ("scaled sums",
``kernels/matmul_4bit_m8_pairs.cu``): each code rounded to A's dtype, the block's fp32 scale applied
to the fp32 sum of each chunk of k by one fma. Its reference takes the exact weights ``code · scale``
in fp64 (``exact_weights``), and its bound two more terms:

- The rounded code differs from the code by at most ``u_d · |code|`` (``u_d`` = 2^-11 for fp16,
  2^-8 for bf16: every code is a normal number in both), so the sum of the exact products differs
  by at most ``u_d · S``.
- The scale multiplies an fp32 partial sum inside an fma, exactly; the products it scales are
  exact, so the K products still pass through at most K − 1 roundings, each term ``(1 + u_d)``
  times its exact size at most: ``γ(n−1) · (1 + u_d) · S``.

Its one-hot result is ``round_out(fp32(scale · round_d(code)))`` (``scaled_sum_weights``), tested
bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.correctness import reference as format_reference

U_ACCUMULATE = 2.0**-23  # fp32 additions, rounding toward zero allowed
U_REFERENCE = 2.0**-53  # fp64
# Half the unit roundoff and half the smallest subnormal of each output dtype.
_OUT_ROUNDING = {
    torch.float16: (2.0**-11, 2.0**-25),
    torch.bfloat16: (2.0**-8, 2.0**-134),
    torch.float32: (2.0**-24, 2.0**-150),
}


def gamma(n: int, u: float) -> float:
    if n * u >= 1:
        raise ValueError(f"no bound: {n} terms at unit roundoff {u}")
    return n * u / (1 - n * u)


@dataclass(frozen=True)
class Reference:
    """The fp64 reference and the per-element bound on ``|result − value|``."""

    value: torch.Tensor  # fp64, shape [..., N]
    bound: torch.Tensor  # fp64, same shape; inf where value is not finite


# Unit roundoff of rounding a normal value to nearest in each operand dtype (the output's above).
UNIT = {dtype: _OUT_ROUNDING[dtype][0] for dtype in (torch.float16, torch.bfloat16)}


def reference(
    A: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, weight_error: float = 0.0
) -> Reference:
    """``A`` [..., K] in fp16/bf16; ``W`` [N, K] the weights the kernel multiplies in fp16/bf16, or
    the exact weights in fp64 with ``weight_error`` the relative error of the kernel's own;
    ``bias`` [N] or None; ``out_dtype`` the result's."""
    if A.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the bound holds for fp16/bf16 activations, got A {A.dtype}")
    if W.dtype not in ((torch.float64,) if weight_error else (torch.float16, torch.bfloat16)):
        raise ValueError(f"W {W.dtype}: fp16/bf16 weights, or fp64 exact ones with a weight error")
    a, w = A.double(), W.double()
    value = a @ w.t()
    magnitude = a.abs() @ w.abs().t()
    terms = A.shape[-1]
    if bias is not None:
        value = value + bias.double()
        magnitude = magnitude + bias.double().abs()
        terms += 1
    unit, tiny = _OUT_ROUNDING[out_dtype]
    sum_error = (
        weight_error + gamma(terms - 1, U_ACCUMULATE) * (1 + weight_error) + gamma(terms - 1, U_REFERENCE)
    ) * magnitude
    bound = sum_error + unit * (value.abs() + sum_error) + tiny
    return Reference(value, torch.where(value.isfinite(), bound, torch.full_like(bound, float("inf"))))


@dataclass(frozen=True)
class Judgement:
    outside: int  # finite elements farther from the reference than the bound
    nonfinite_mismatch: int  # NaN/inf elements that do not match the reference's
    worst_ratio: float  # max |result − value| / bound over finite elements
    error_norm: float  # ‖result − value‖₂ over elements where the reference is finite

    @property
    def ok(self) -> bool:
        return self.outside == 0 and self.nonfinite_mismatch == 0


def judge(result: torch.Tensor, ref: Reference) -> Judgement:
    """How ``result`` stands against ``ref``."""
    got = result.double().to(ref.value.device)
    finite = ref.value.isfinite()
    nan_ok = ref.value.isnan() == got.isnan()
    inf_ok = torch.where(ref.value.isinf(), got == ref.value, True)
    error = (got - ref.value).abs()
    error = torch.where(finite, error, torch.zeros_like(error))
    outside = finite & ~(error <= ref.bound)  # a NaN result where the reference is finite is outside
    ratio = error / ref.bound
    return Judgement(
        outside=int(outside.sum()),
        nonfinite_mismatch=int((~(nan_ok & inf_ok) & ~finite).sum()),
        worst_ratio=float(torch.where(finite, ratio, torch.zeros_like(ratio)).max()) if ratio.numel() else 0.0,
        error_norm=float(torch.linalg.vector_norm(error)),
    )


def one_hot_rows(M: int, K: int, dtype: torch.dtype, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``A`` [M, K] whose row i is 1.0 at column ``columns[i]`` and +0.0 elsewhere: then every output
    ``out[i, n]`` is exactly ``W[n, columns[i]]`` (a sum of one exact product and +0.0 terms, which
    turns a weight of −0.0 into +0.0 and a non-finite weight into NaN). Returns (A, columns)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    columns = torch.randint(0, K, (M,), generator=g)
    A = torch.zeros(M, K, dtype=dtype)
    A[torch.arange(M), columns] = 1.0
    return A.to(device), columns.to(device)


def block_scales(quant_state) -> torch.Tensor:
    """The fp32 scale of every block, as the kernels form it before multiplying (nested: two fp32
    operations, the multiply flushing subnormals as bitsandbytes' CUDA build does)."""
    qs = quant_state
    if qs.state2 is None:
        return qs.absmax.reshape(-1).to(torch.float32)
    return format_reference.nested_absmax(qs.absmax, qs.state2.code, qs.state2.absmax, qs.state2.blocksize, qs.offset)


def _codes_and_scales(packed: torch.Tensor, quant_state) -> tuple[torch.Tensor, torch.Tensor]:
    qs = quant_state
    n = int(torch.Size(qs.shape).numel())
    codes = format_reference.code_table(qs.quant_type, packed.device)[format_reference.unpack_nibbles(packed, n)]
    scales = block_scales(qs).to(packed.device).repeat_interleave(qs.blocksize)[:n]
    return codes.reshape(qs.shape), scales.reshape(qs.shape)


def exact_weights(packed: torch.Tensor, quant_state) -> torch.Tensor:
    """``code · scale`` of every weight in fp64, unrounded: what the format means."""
    codes, scales = _codes_and_scales(packed, quant_state)
    return codes.double() * scales.double()


def scaled_sum_weights(packed: torch.Tensor, quant_state, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``scale · round_d(code)`` (one rounding, subnormals kept): the scaled-sums kernel's
    result for a one-hot activation, before its rounding to the output dtype."""
    codes, scales = _codes_and_scales(packed, quant_state)
    return scales * codes.to(dtype).to(torch.float32)


def kernel_reference(
    arithmetic: str, A: torch.Tensor, packed: torch.Tensor, quant_state, dequantized: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> Reference:  # fmt: skip
    """The reference and bound of a fused kernel of ``arithmetic`` (``arithmetic_of``)."""
    weights, weight_error = reference_weights(arithmetic, packed, quant_state, dequantized, A.dtype)
    return reference(A, weights, bias, out_dtype, weight_error)


def reference_weights(
    arithmetic: str, packed: torch.Tensor, quant_state, dequantized: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, float]:
    """The weights ``reference`` takes for a kernel of ``arithmetic`` multiplying activations of
    ``dtype``, with their weight error (one pair serves every activation of a weight):
    ``dequantized`` multiplies the dequantization kernel's bits (``dequantized``, no error);
    ``scaled-sums`` rounds the codes to ``dtype`` (the exact weights, ``UNIT[dtype]``)."""
    if arithmetic == "dequantized":
        return dequantized, 0.0
    if arithmetic == "scaled-sums":
        return exact_weights(packed, quant_state), UNIT[dtype]
    raise ValueError(f"no such arithmetic: {arithmetic!r}")


# The judge's own statement of which arithmetic a fused call runs, not read from the runtime it
# judges (a candidate's kernels are imported from its tree): nested weights at up to this many rows
# take scaled sums, whatever their size (the pair-table kernel's tiles of 8, 16 and 32 tokens, or two
# of its 16-token tiles). tests/test_matmul_reference.py holds the runtime's ``matmul_kernel.arithmetic``
# to it, so a change of arithmetic lands in the judge first.
SCALED_SUMS_ROWS = 32


def arithmetic_of(rows: int, nested: bool) -> str:
    """The arithmetic of the fused kernel that multiplies a call of ``rows`` rows, or whose token tile
    holds ``rows`` (the grid sweep times both tiles a 17-32-row call may run, on every weight; the two
    agree, so one statement serves both): nested weights up to SCALED_SUMS_ROWS take scaled sums (the
    pair-table kernel's tiles, one or two of them), the wider tiles the dequantized bits."""
    return "scaled-sums" if nested and rows <= SCALED_SUMS_ROWS else "dequantized"


def fused_reference(
    A: torch.Tensor, packed: torch.Tensor, quant_state, dequantized: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> Reference:  # fmt: skip
    """``kernel_reference`` of the fused kernel that multiplies A's rows (by their count)."""
    return fused_references([A], packed, quant_state, dequantized, bias, out_dtype)[0]


def fused_references(
    As: list[torch.Tensor], packed: torch.Tensor, quant_state, dequantized: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> list[Reference]:  # fmt: skip
    """``fused_reference`` of each of ``As``, activations of one shape and dtype: the reference
    weights formed once."""
    rows = As[0].numel() // As[0].shape[-1] if As[0].shape[-1] else 0
    arithmetic = arithmetic_of(max(rows, 1), quant_state.state2 is not None)
    weights, weight_error = reference_weights(arithmetic, packed, quant_state, dequantized, As[0].dtype)
    return [reference(A, weights, bias, out_dtype, weight_error) for A in As]


def one_hot_weights(arithmetic: str, packed: torch.Tensor, quant_state, dequantized: torch.Tensor) -> torch.Tensor:
    """What a one-hot activation at column k gives for every feature, as [N, K] in the output
    dtype (a −0.0 weight sums to +0.0)."""
    if arithmetic == "dequantized":
        return dequantized + 0.0
    if arithmetic == "scaled-sums":
        return scaled_sum_weights(packed, quant_state, dequantized.dtype).to(dequantized.dtype) + 0.0
    raise ValueError(f"no such arithmetic: {arithmetic!r}")
