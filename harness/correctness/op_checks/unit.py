"""What the judge knows of one op, as one descriptor (``OpChecks``): how a perf case of it is
staged, called and judged (``Staging``), which cases the perf gate times (``PerfCase``) and what
the sanitizer launches. The machinery that uses them (``harness.perf.stage``, ``catalog``,
``report``, ``harness.correctness.sanitize``) names no op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from harness.correctness import shapes


class Staging(Protocol):
    """How a perf case of the op is staged by the judge and judged (``harness.perf.stage``)."""

    def inputs(self, spec: dict, A, qs, dtype, device, variants: int) -> tuple:
        """(activations or None, ``variants`` versions of the live input, the output buffer)."""

    def live(self, lent) -> object:
        """The input a fresh version overwrites before each sample."""

    def call(self, lent, drop_ins, into_out: bool = True) -> Callable[[], object]:
        """The op's drop-in from ``drop_ins`` called on the lent buffers, as a user calls it."""

    def references(self, lent: dict) -> list[object] | None:
        """Each variant's reference, or None: the first prepared side's outputs are."""

    def agrees(self, output, expected) -> bool:
        """Whether an output is what its variant's reference demands."""

    def bitsandbytes_calls(self, lent: dict, names: list[str], device) -> dict[str, Callable[[], object]]:
        """bitsandbytes' calls of those ``names`` (``bnb_kernel``, ``bnb_full``) it has."""


def packed_bytes(numel: int, blocksize: int, nested: bool) -> int:
    """Bytes of a 4-bit weight with its scales: the packed codes, and one fp32 absmax per block or
    (nested) one code byte per block, one fp32 per 256 blocks and the 256-entry code book."""
    blocks = -(-numel // blocksize)
    scales = blocks + -(-blocks // 256) * 4 + 1024 if nested else blocks * 4
    return (numel + 1) // 2 + scales


@dataclass(frozen=True)
class PerfCase:
    """A timed call of one quantized weight in one format. Each op's case (a subclass) names its
    op (``kind``), its id and the fewest bytes its call moves."""

    weight: shapes.WeightShape
    dtype: str  # fp16 / bf16 / fp32
    scales: str  # nested / plain
    quant: str = "nf4"
    blocksize: int = 64

    kind = ""  # the op's name (the subclass's)

    @property
    def weight_id(self) -> str:
        return f"{self.weight.id}-{self.quant}-{self.dtype}-bs{self.blocksize}-{self.scales}"

    @property
    def id(self) -> str:
        raise NotImplementedError

    @property
    def numel(self) -> int:
        return self.weight.numel

    @property
    def nested(self) -> bool:
        return self.scales == "nested"

    @property
    def itemsize(self) -> int:
        """Bytes per element of the output (and, for a matmul, of the activations)."""
        return 4 if self.dtype == "fp32" else 2

    def spec(self, seed: int) -> dict:
        """What a measuring process needs to build this case's inputs (JSON)."""
        return {
            "shape": list(self.weight.shape),
            "quant": self.quant,
            "blocksize": self.blocksize,
            "nested": self.nested,
            "dtype": self.dtype,
            "seed": seed,
            "bytes": self.bytes_moved(),
            "kind": self.kind,
        }

    def bytes_moved(self) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class OpChecks:
    name: str  # the op's name in ``harness.runtime.ops.OPS``
    title: str  # what a report calls it
    staging: Staging
    perf_cases: Callable[[], list[PerfCase]]  # what the perf gate times, in order
    sanitize: Callable[[str, object], int]  # (inputs "raw" or "bnb", device) -> how many outputs were wrong
