"""A perf case's inputs, built once by the judge and lent to every side's measuring process.

The judge's process builds the case (bitsandbytes quantizes seeded random weights; a matmul case
adds seeded activations) and the output buffer, and lends them to each side's process over CUDA
IPC: both sides read the same input buffers, write the same output buffer and flush the L2 by
reading the same buffer, so what differs between them is their code. (Measured on an H100: sides
that built their own inputs, each in its own process, were up to 4% apart on identical code, on
small nested-scale weights whose tensors each process placed differently.)

Every sample gets fresh inputs: one small input, the *live* one (the absmax of a dequantization
case, the activations of a matmul case), is overwritten with one of ``VARIANTS`` versions before
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

from harness.correctness import bitcompare, cases, matmul_reference

VARIANTS = 3  # versions of the live input, one per sample in turn
CHECKED = 3  # samples per batch whose output the judge checks
SLOTS = max(VARIANTS, CHECKED)  # evidence slots: one per variant when a side is prepared


class DequantizeCases:
    """What the stage needs of a dequantization case: the live input is the absmax (its blocks
    rotated: valid scales, nearly every block changed), the reference is the first prepared side's
    bits (the base's, in an A/B session), and an output must equal them bit for bit."""

    name = "dequantize"

    def inputs(self, spec: dict, A, qs, dtype: torch.dtype, device: torch.device) -> tuple:
        """(activations or None, the live input's variants, the output buffer)."""
        step = max(1, qs.absmax.numel() // VARIANTS)
        variants = torch.stack([qs.absmax.roll(v * step + v) for v in range(VARIANTS)])
        return None, variants, torch.empty(qs.shape, dtype=dtype, device=device)

    def live(self, lent: Lent) -> torch.Tensor:
        return lent.qs.absmax

    def call(self, lent: Lent, drop_ins, into_out: bool = True) -> Callable[[], torch.Tensor]:
        A, qs, out, entry = lent.A, lent.qs, lent.out, drop_ins.dequantize_4bit
        return (lambda: entry(A, qs, out=out)) if into_out else (lambda: entry(A, qs))

    def references(self, lent: dict) -> list[object] | None:
        return None  # the first prepared side's outputs

    def agrees(self, output: torch.Tensor, expected: torch.Tensor) -> bool:
        return torch.equal(bitcompare.int_view(output), bitcompare.int_view(expected))

    def bitsandbytes_calls(self, lent: dict, names: list[str], device: torch.device) -> dict:
        """bitsandbytes' kernel alone (fp32 scales) and its full ``dequantize_4bit``."""
        import bitsandbytes.functional as F

        A, qs, calls = lent["A"], lent["qs"], {}
        if "bnb_kernel" in names:
            absmax = F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset if qs.nested else qs.absmax
            out = torch.empty(qs.shape, dtype=qs.dtype, device=device)
            calls["bnb_kernel"] = lambda: torch.ops.bitsandbytes.dequantize_4bit.out(
                A, absmax, qs.blocksize, qs.quant_type, qs.shape, qs.dtype, out=out
            )
        if "bnb_full" in names:
            calls["bnb_full"] = lambda: F.dequantize_4bit(A, qs)
        return calls


class MatmulCases:
    """What the stage needs of a fused-matmul case: the live input is the activations (seeded
    variants), the reference each variant's fp64 product for the arithmetic its kernel runs, and an
    output must lie inside that reference's bound (the summation order is the kernel's)."""

    name = "matmul"

    def inputs(self, spec: dict, A, qs, dtype: torch.dtype, device: torch.device) -> tuple:
        tokens, K, seed = spec["tokens"], qs.shape[1], spec["seed"]
        variants = torch.stack([_activations(tokens, K, dtype, seed + 1 + v, device) for v in range(VARIANTS)])
        return variants[0].clone(), variants, torch.empty(tokens, qs.shape[0], dtype=dtype, device=device)

    def live(self, lent: Lent) -> torch.Tensor:
        return lent.x

    def call(self, lent: Lent, drop_ins, into_out: bool = True) -> Callable[[], torch.Tensor]:
        x, B, qs, out, entry = lent.x, lent.A.t(), lent.qs, lent.out, drop_ins.matmul_4bit
        return (lambda: entry(x, B, qs, out=out)) if into_out else (lambda: entry(x, B, qs))

    def references(self, lent: dict) -> list[object]:
        """Each variant's fp64 reference (bitsandbytes' dequantized weights where the kernel
        multiplies those), the weights formed once."""
        import bitsandbytes.functional as F

        W = F.dequantize_4bit(lent["A"], lent["qs"])
        variants = list(lent["variants"])
        return matmul_reference.fused_references(variants, lent["A"], lent["qs"], W, None, variants[0].dtype)

    def agrees(self, output: torch.Tensor, expected: object) -> bool:
        return matmul_reference.judge(output, expected).ok

    def bitsandbytes_calls(self, lent: dict, names: list[str], device: torch.device) -> dict:
        """bitsandbytes' full ``matmul_4bit`` (its kernel alone has no counterpart here)."""
        import bitsandbytes

        x, B, qs = lent["x"], lent["A"].t(), lent["qs"]
        return {"bnb_full": lambda: bitsandbytes.matmul_4bit(x, B, qs)} if "bnb_full" in names else {}


def _activations(tokens: int, K: int, dtype: torch.dtype, seed: int, device: torch.device) -> torch.Tensor:
    g = cases.seeded_generator(seed, device)
    return torch.randn(tokens, K, generator=g, device=device).to(dtype)


# The case kinds by the name a perf case's spec gives (``catalog``): the stage names no op.
KINDS = {k.name: k for k in (DequantizeCases(), MatmulCases())}


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
    def live(self) -> torch.Tensor:
        return KINDS[self.kind].live(self)

    def refresh(self, variant: int) -> None:
        self.live.copy_(self.variants[variant])

    def call(self, drop_ins) -> Callable[[], torch.Tensor]:
        """The timed call of the case's drop-in from ``drop_ins`` (a side, or a ``harness``
        package), as a user makes it, writing into the lent output buffer."""
        return KINDS[self.kind].call(self, drop_ins)

    def host_calls(self, drop_ins) -> dict[str, Callable[[], object]]:
        """The calls whose host time a session reports: the case's drop-in allocating its output
        and writing into the lent one, and bitsandbytes' full call, as its kind makes them."""
        kind = KINDS[self.kind]
        bitsandbytes_full = kind.bitsandbytes_calls(vars(self), ["bnb_full"], self.out.device)["bnb_full"]
        return {
            "ours": kind.call(self, drop_ins, into_out=False),
            "ours out=": kind.call(self, drop_ins),
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
        self.kind = spec.get("kind", "dequantize")
        self.cases = KINDS[self.kind]
        dtype = cases.dtype_of(spec["dtype"])
        A, qs = cases.quantize_weights(
            spec["shape"], spec["quant"], spec["blocksize"], spec["nested"], dtype, spec["seed"], device=device
        )
        x, variants, out = self.cases.inputs(spec, A, qs, dtype, device)
        self.lent = {"kind": self.kind, "A": A, "qs": qs, "x": x, "out": out, "variants": variants, "flush": flush}
        self.evidence: dict[str, torch.Tensor] = {}
        self.expected: list[object] | None = self.cases.references(self.lent)
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
        return self.cases.agrees(output, self.expected[variant])

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
        calls = self.cases.bitsandbytes_calls(self.lent, names, self.device)
        if "same_size_copy" in names:
            src = torch.empty(copy_bytes // 2, dtype=torch.uint8, device=self.device)
            dst = torch.empty_like(src)
            calls["same_size_copy"] = lambda: dst.copy_(src)
        return calls
