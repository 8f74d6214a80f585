"""A perf case's inputs, built once by the judge and lent to every side's measuring process.

The judge's process builds the case (bitsandbytes quantizes seeded random weights; a matmul case
adds seeded activations) and the output buffer, and lends them to each side's process over CUDA
IPC: both sides read the same input buffers, write the same output buffer and flush the L2 by
reading the same buffer, so what differs between them is their code. (Measured on an H100: sides
that built their own inputs, each in its own process, were up to 4% apart on identical code, on
small nested-scale weights whose tensors each process placed differently.)

Every sample gets fresh inputs: one small input, the *live* one (its op's ``Staging`` in
``harness.correctness.op_checks`` names it: the absmax of a dequantization, the activations of a
matmul), is overwritten with one of ``VARIANTS`` versions before
each sample, never the same one twice in a row, so a drop-in that hands back a result it kept
from an earlier call hands back the wrong one. A side copies what chosen calls returned into an
evidence buffer of its own, lent to it alone, and the judge checks that evidence in its own
process: a dequantization must give the base's bits for the same variant, a matmul must lie
inside the fp64 reference's bound (its summation order is the kernel's to choose).
"""

from __future__ import annotations

import base64
import io
import pickle
import random
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # registers the CUDA IPC reductions with ForkingPickler

from harness.correctness import cases, op_checks

VARIANTS = 3  # versions of the live input, one per sample in turn
CHECKED = 3  # samples per batch whose output the judge checks
SLOTS = max(VARIANTS, CHECKED)  # evidence slots: one per variant when a side is prepared


@dataclass
class Lent:
    """What a side's process borrows: the case's buffers, and its own evidence buffer."""

    kind: str
    A: torch.Tensor
    qs: object  # bitsandbytes' QuantState
    x: torch.Tensor | None  # activations (matmul cases)
    out: torch.Tensor
    variants: torch.Tensor  # [VARIANTS, *live.shape]
    flush: torch.Tensor  # the judge's L2 flush buffer: every side leaves the L2 in the same state
    evidence: torch.Tensor  # [SLOTS, *out.shape]

    @property
    def staging(self) -> op_checks.unit.Staging:
        return op_checks.CHECKS[self.kind].staging

    @property
    def live(self) -> torch.Tensor:
        return self.staging.live(self)

    def refresh(self, variant: int) -> None:
        self.live.copy_(self.variants[variant])

    def call(self, drop_ins) -> Callable[[], torch.Tensor]:
        """The timed call of the case's drop-in from ``drop_ins`` (a side, or a ``harness``
        package), as a user makes it, writing into the lent output buffer."""
        return self.staging.call(self, drop_ins)

    def host_calls(self, drop_ins) -> dict[str, Callable[[], object]]:
        """The calls whose host time a session reports: the case's drop-in allocating its output
        and writing into the lent one, and bitsandbytes' full call, as its kind makes them."""
        staging = self.staging
        bitsandbytes_full = staging.bitsandbytes_calls(vars(self), ["bnb_full"], self.out.device)["bnb_full"]
        return {
            "ours": staging.call(self, drop_ins, into_out=False),
            "ours out=": staging.call(self, drop_ins),
            "bnb full": bitsandbytes_full,
        }


def borrow(lent: str) -> Lent:
    """The side's end of ``Stage.lend``: the judge's buffers, mapped into this process."""
    return pickle.loads(base64.b64decode(lent))


@dataclass(frozen=True)
class BatchPlan:
    """Which variant each sample of a batch gets, and which samples' outputs are checked."""

    variants: list[int]
    checked: list[int]

    @classmethod
    def draw(cls, rng: random.Random, samples: int) -> BatchPlan:
        variants = [rng.randrange(VARIANTS)]
        while len(variants) < samples:
            variants.append((variants[-1] + 1 + rng.randrange(VARIANTS - 1)) % VARIANTS)  # never the same twice
        return cls(variants, sorted(rng.sample(range(samples), min(CHECKED, samples))))


class Stage:
    """The judge's end: builds the case once, lends it, and checks what each side returned."""

    def __init__(self, spec: dict, device: torch.device, flush: torch.Tensor):
        self.spec, self.device = spec, device
        self.kind = spec["kind"]
        self.staging = op_checks.CHECKS[self.kind].staging
        dtype = cases.dtype_of(spec["dtype"])
        A, qs = cases.quantize_weights(
            spec["shape"], spec["quant"], spec["blocksize"], spec["nested"], dtype, spec["seed"], device=device
        )
        x, variants, out = self.staging.inputs(spec, A, qs, dtype, device, VARIANTS)
        self.lent = {"kind": self.kind, "A": A, "qs": qs, "x": x, "out": out, "variants": variants, "flush": flush}
        self.evidence: dict[str, torch.Tensor] = {}
        self.expected: list[object] | None = self.staging.references(self.lent)
        # Whether the case has a reference of its own (a side's prepared outputs are judged even
        # without another side), or its first prepared side's outputs are the reference.
        self.own_reference = self.expected is not None

    def lent_to(self, side: str) -> Lent:
        """The case's buffers with a new evidence buffer of ``side``'s own."""
        out = self.lent["out"]
        self.evidence[side] = torch.empty((SLOTS, *out.shape), dtype=out.dtype, device=self.device)
        return Lent(**self.lent, evidence=self.evidence[side])

    def lend(self, side: str) -> str:
        """``lent_to(side)`` as text for the pipe: CUDA IPC handles the side's process maps."""
        lent = self.lent_to(side)
        torch.cuda.synchronize(self.device)  # the buffers are complete before another process reads them
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(lent)
        return base64.b64encode(buffer.getvalue()).decode()

    def _agrees(self, output: torch.Tensor, variant: int) -> bool:
        return self.staging.agrees(output, self.expected[variant])

    def check_prepared(self, side: str) -> bool:
        """After ``side`` was prepared (slot v holds its output for variant v): is every output
        what the case demands? A dequantization's first prepared side (the base in an A/B
        session) sets the bits every other output must have."""
        evidence = self.evidence[side]
        if self.expected is None:
            self.expected = [evidence[v].clone() for v in range(VARIANTS)]
            return True
        return all(self._agrees(evidence[v], v) for v in range(VARIANTS))

    def check_batch(self, side: str, plan: BatchPlan) -> bool:
        """After a timed batch: is each checked sample's output what its variant demands?"""
        evidence = self.evidence[side]
        return all(self._agrees(evidence[slot], plan.variants[i]) for slot, i in enumerate(plan.checked))

    def reference_calls(self, names: list[str], copy_bytes: int) -> dict[str, Callable[[], object]]:
        """Other implementations on this case's inputs, for the report: bitsandbytes' (its kernel
        alone where the op has one, ``bnb_kernel``, and its full call, ``bnb_full``), a device copy
        of ``copy_bytes`` (read + written)."""
        calls = self.staging.bitsandbytes_calls(self.lent, names, self.device)
        if "same_size_copy" in names:
            src = torch.empty(copy_bytes // 2, dtype=torch.uint8, device=self.device)
            dst = torch.empty_like(src)
            calls["same_size_copy"] = lambda: dst.copy_(src)
        return calls
