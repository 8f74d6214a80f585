"""What a call's tensors must be, stated once as data: each op has a table of ``Operand`` rules.

:func:`check` raises ``InputError`` naming the operand and the rule it breaks; both host paths
reach it (the compiled one through the op's compiled form, once per call signature), so a rule
is stated and checked in one place. A test runs one battery of bad calls through both paths on
the CPU.

Sizes are written as ``Count(num, den)``: ceil(num / den) elements, where ``num`` and ``den``
name quantities of the call that each op defines (the element count ``n``, the number of
scale blocks, the output features ``N``, a constant such as 2 nibbles a byte). Importable without
PyTorch.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from harness.errors import InputError

# The device type both host paths take tensors on: one value, read by the Python path at every call
# and by the compiled path when it is bound (``host_launcher.configure``). The rule tests
# (tests/test_call_rules.py) set it to "cpu" for both, to run the call battery without a GPU.
DEVICE_TYPE = "cuda"

BYTES = "bytes"  # any dtype, counted in bytes: packed data in whatever quant_storage holds it
OUT = "out"  # the call's output dtype (bitsandbytes' message for ``out``)
LIKE_A = "like A"  # the call's output dtype, which is A's (an operand F.linear adds to the result)
ANY = "any"  # any dtype, not counted: an output filled by a copy where the kernel cannot write it


@dataclass(frozen=True)
class Count:
    """The operand holds ceil(num / den) elements (bytes for a ``BYTES`` operand), or at least that."""

    num: str
    den: str = "one"
    at_least: bool = False
    or_one: bool = False  # or a single element (broadcast)

    def required(self, quantities: Mapping[str, int]) -> int:
        return -(-quantities[self.num] // quantities[self.den])

    def met(self, have: int, need: int) -> bool:
        return have >= need if self.at_least else have == need or (self.or_one and have == 1)


@dataclass(frozen=True)
class Operand:
    """One tensor of a call: dense, on the call's device, of one dtype, of a size the call fixes
    (each but the size may be waived where the op's fallback takes any)."""

    label: str  # how messages name it
    arg: str  # the call's argument that holds it
    dtype: str  # a torch dtype's name ("uint8"), BYTES, OUT, LIKE_A or ANY
    count: Count | None  # None: its shape is the call's shape (an output)
    min_dims: int = 0
    dense: bool = True  # must be contiguous
    same_device: bool = True  # must be on the call's device
    # What the count is, in its message ("{need}" stands for the number); such an operand's
    # shape is checked with its count, before its dtype, at most ``max_dims`` dimensions.
    holds: str = ""
    max_dims: int | None = None


def _fail(message: str):
    raise InputError(message)


# PyTorch, bound at the first check (this module imports without PyTorch).
_torch = None


def _bind_torch():
    global _torch
    import torch

    _torch = torch
    return torch


@functools.cache
def torch_dtype(name: str):
    """The torch.dtype an operand's dtype name stands for."""
    return getattr(_torch or _bind_torch(), name)


def check(
    operand: Operand,
    t: Any,
    device: Any,
    quantities: Mapping[str, int],
    dtype: Any = None,
    shape: Any = None,
) -> None:
    """Raise InputError if ``t`` breaks ``operand``'s rule. ``device`` is the call's
    ``torch.device``; ``dtype`` and ``shape`` are the call's output dtype and shape."""
    torch = _torch or _bind_torch()
    label, count, kind = operand.label, operand.count, operand.dtype
    if not isinstance(t, torch.Tensor):
        _fail(f"{label} must be a torch.Tensor, got {type(t).__name__}")
    if count is None:
        if t.shape != shape:  # bitsandbytes' own messages for ``out``
            _fail(f"Expected {label}.shape == {tuple(shape)}, got {t.shape}")
    else:
        need = count.required(quantities)
        if operand.holds and (  # a count in its own words: the shape's rule and the size's in one
            not count.met(t.numel(), need) or (operand.max_dims is not None and t.dim() > operand.max_dims)
        ):
            _fail(f"{label} must hold {operand.holds.format(need=need)}, got shape {tuple(t.shape)}")
    if kind == OUT or kind == LIKE_A:
        if t.dtype != dtype:
            _fail(
                f"Expected {label}.dtype == {dtype}, got {t.dtype}"
                if kind == OUT
                else f"{label} must be {dtype} like A, got {t.dtype}"
            )
    elif kind != BYTES and kind != ANY and t.dtype != torch_dtype(kind):
        _fail(f"{label} must be torch.{kind}, got {t.dtype}")
    if operand.same_device and t.device != device:
        _fail(f"{label} is on {t.device}, but A is on {device}; all tensors must be on the same device")
    if operand.min_dims and t.dim() < operand.min_dims:
        _fail(f"{label} must have at least {operand.min_dims} dimension")
    if operand.dense and not t.is_contiguous():
        _fail(f"{label} must be contiguous")
    if count is not None and not operand.holds:
        if kind == BYTES:
            have = t.numel() * t.element_size()
            if not count.met(have, need):
                _fail(f"{label} holds {have} bytes but shape {tuple(shape)} needs {need}")
        elif not count.met(t.numel(), need):
            _fail(f"{label} must hold {need} elements for this shape and block size, got {t.numel()}")
