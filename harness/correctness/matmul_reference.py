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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def reference(A: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> Reference:
    """``A`` [..., K] and ``W`` [N, K] in fp16/bf16; ``bias`` [N] or None; ``out_dtype`` the result's."""
    if A.dtype not in (torch.float16, torch.bfloat16) or W.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the bound holds for fp16/bf16 operands, got A {A.dtype} and W {W.dtype}")
    a, w = A.double(), W.double()
    value = a @ w.t()
    magnitude = a.abs() @ w.abs().t()
    terms = A.shape[-1]
    if bias is not None:
        value = value + bias.double()
        magnitude = magnitude + bias.double().abs()
        terms += 1
    unit, tiny = _OUT_ROUNDING[out_dtype]
    sum_error = (gamma(terms - 1, U_ACCUMULATE) + gamma(terms - 1, U_REFERENCE)) * magnitude
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
