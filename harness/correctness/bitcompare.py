"""Bit-pattern comparison of floating-point tensors and a readable mismatch report."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
# Poison patterns: NaNs with a payload no arithmetic produces (GPUs emit the canonical NaN),
# so an element a kernel forgot to write can never equal the reference by accident.
# The alternate pattern poisons the reference's buffer, so two kernels that both skip an element
# still disagree there.
POISON_BITS = {torch.float16: 0x7D5A, torch.bfloat16: 0x7FA5, torch.float32: 0x7FB5A5A5}
POISON_ALT_BITS = {torch.float16: 0xFE0F, torch.bfloat16: 0xFF8F, torch.float32: 0xFF80F00F}


def as_signed(bits: int, width: int) -> int:
    """An unsigned ``width``-bit pattern as the signed integer torch's int views hold."""
    return bits - (1 << width) if bits >= 1 << (width - 1) else bits


def int_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as a same-width signed integer tensor (what bit-exact comparisons compare)."""
    return t.view(_INT_VIEW[t.dtype])


def floats_from_bits(bits, device="cpu") -> torch.Tensor:
    """fp32 values from their unsigned 32-bit patterns."""
    return torch.tensor([as_signed(b, 32) for b in bits], dtype=torch.int32, device=device).view(torch.float32)


def poison_(t: torch.Tensor, alternate: bool = False) -> torch.Tensor:
    """Fill ``t`` in place with a NaN bit pattern no kernel produces."""
    bits = (POISON_ALT_BITS if alternate else POISON_BITS)[t.dtype]
    int_view(t).fill_(as_signed(bits, t.element_size() * 8))
    return t


def _ordered(bits: torch.Tensor, width: int) -> torch.Tensor:
    """Map float bit patterns to integers whose difference is the ULP distance."""
    b = bits.to(torch.int64)
    sign_mask = 1 << (width - 1)
    b = torch.where(b < 0, b + (1 << width), b)  # unsigned view
    return torch.where(b >= sign_mask, sign_mask - b, b)


@dataclass
class MismatchReport:
    total: int
    mismatches: int
    nan_mismatches: int
    inf_mismatches: int
    max_ulp: int
    first: list[tuple[tuple[int, ...], int, int, float, float]]
    width: int

    def __str__(self) -> str:
        digits = self.width // 4
        lines = [
            f"{self.mismatches} of {self.total} elements differ in bits "
            f"({self.nan_mismatches} NaN-related, {self.inf_mismatches} Inf-related, "
            f"max {self.max_ulp} ULP among finite pairs)"
        ]
        for idx, got, want, gotf, wantf in self.first:
            lines.append(f"  at {idx}: got 0x{got:0{digits}x} ({gotf!r}), expected 0x{want:0{digits}x} ({wantf!r})")
        return "\n".join(lines)


def compare_bits(
    actual: torch.Tensor, expected: torch.Tensor, show: int = 8, nan_payloads: bool = True
) -> MismatchReport | None:
    """None when every bit pattern matches (NaN payloads and signed zeros included).

    ``nan_payloads=False`` counts two NaNs as equal whatever their bits: only for comparing CPU
    implementations, whose float converters define no NaN payload.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"dtype {actual.dtype} != expected {expected.dtype}")
    int_dtype = _INT_VIEW[actual.dtype]
    a = actual.contiguous().view(int_dtype)
    e = expected.contiguous().view(int_dtype)
    diff = a != e
    if not nan_payloads:
        diff &= ~(torch.isnan(actual) & torch.isnan(expected))
    count = int(diff.sum())
    if count == 0:
        return None
    width = actual.element_size() * 8
    mask = (1 << width) - 1
    flat_idx = diff.reshape(-1).nonzero().reshape(-1)
    af, ef = actual.reshape(-1)[flat_idx].float(), expected.reshape(-1)[flat_idx].float()
    ab, eb = a.reshape(-1)[flat_idx], e.reshape(-1)[flat_idx]
    nan = torch.isnan(af) | torch.isnan(ef)
    inf = (torch.isinf(af) | torch.isinf(ef)) & ~nan
    finite = ~(nan | inf)
    ulp = (_ordered(ab, width) - _ordered(eb, width)).abs()
    max_ulp = int(ulp[finite].max()) if bool(finite.any()) else 0
    first = []
    for k in range(min(show, flat_idx.numel())):
        i = int(flat_idx[k])
        idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), actual.shape)) if actual.dim() else ()
        first.append((idx, int(ab[k]) & mask, int(eb[k]) & mask, float(af[k]), float(ef[k])))
    return MismatchReport(actual.numel(), count, int(nan.sum()), int(inf.sum()), max_ulp, first, width)


def assert_bit_exact(
    actual: torch.Tensor, expected: torch.Tensor, context: str = "", nan_payloads: bool = True
) -> None:
    report = compare_bits(actual, expected, nan_payloads=nan_payloads)
    if report is not None:
        raise AssertionError((context + "\n" if context else "") + str(report))
