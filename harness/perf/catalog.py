"""The perf session's cases: which calls, weights, dtypes and formats the gate times.

Dequantization: every unique weight shape of the paper's three models at the deployed
configurations (nf4, block size 64, fp16 and bf16 output, nested and plain scales), plus fp4,
fp32 output and other block sizes on a few shapes. Matmul: ``harness.matmul_4bit`` as a user
calls it (the fused kernel up to the GPU's crossover, dequantize + F.linear above) on
Llama-3.3-70B's gate, o and k weights at M = 1, 8, 32, 128 and 256 tokens. The judge reads this
list from the base revision.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.correctness import shapes
from harness.perf import policy


def packed_bytes(numel: int, blocksize: int, nested: bool) -> int:
    """Bytes of a 4-bit weight with its scales: the packed codes, and one fp32 absmax per block or
    (nested) one code byte per block, one fp32 per 256 blocks and the 256-entry code book."""
    blocks = -(-numel // blocksize)
    scales = blocks + -(-blocks // 256) * 4 + 1024 if nested else blocks * 4
    return (numel + 1) // 2 + scales


def matmul_bytes(n: int, k: int, tokens: int, blocksize: int = 64, nested: bool = True, itemsize: int = 2) -> int:
    """Fewest bytes a 4-bit matmul must move (its roofline's numerator): the packed weight with its
    scales, read once, the activations and the output."""
    return packed_bytes(n * k, blocksize, nested) + tokens * (k + n) * itemsize


@dataclass(frozen=True)
class KernelCase:
    """What every case kind shares: one quantized weight and its format. Each kind (a subclass)
    names the drop-in call it times (``kind``: ``harness.perf.stage.KINDS``), its id and its bytes."""

    weight: shapes.WeightShape
    dtype: str  # fp16 / bf16 / fp32
    scales: str  # nested / plain
    quant: str = "nf4"
    blocksize: int = 64

    kind = ""  # the subclass's

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
    def size_class(self) -> policy.SizeClass:
        return policy.size_class(self.numel)

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

    @property
    def itemsize(self) -> int:
        """Bytes per element of the output (and, for a matmul, of the activations)."""
        return 4 if self.dtype == "fp32" else 2


@dataclass(frozen=True)
class DequantizeCase(KernelCase):
    """``harness.dequantize_4bit(W, state)``."""

    kind = "dequantize"

    @property
    def id(self) -> str:
        return self.weight_id

    def bytes_moved(self) -> int:
        """Fewest bytes the dequantization must move: packed input, output, scales."""
        return packed_bytes(self.numel, self.blocksize, self.nested) + self.numel * self.itemsize


@dataclass(frozen=True)
class MatmulCase(KernelCase):
    """``harness.matmul_4bit(A, W.t(), state)`` with A of ``tokens`` rows; sized (its threshold
    class) by its weight, like the dequantization of that weight."""

    tokens: int = 1
    kind = "matmul"

    @property
    def id(self) -> str:
        return f"matmul-{self.weight_id}-m{self.tokens}"

    def spec(self, seed: int) -> dict:
        return super().spec(seed) | {"tokens": self.tokens}

    def bytes_moved(self) -> int:
        n, k = self.weight.shape
        return matmul_bytes(n, k, self.tokens, self.blocksize, self.nested, self.itemsize)


MATMUL_TOKENS = (1, 8, 32, 128, 256)


def matmul_cases() -> list[MatmulCase]:
    by_id = {w.id: w for w in shapes.model_shapes(unique=False)}
    weights = [by_id[f"llama-3.3-70b.{layer}"] for layer in ("gate_proj", "o_proj", "k_proj")]
    return [MatmulCase(w, "bf16", "nested", tokens=m) for w in weights for m in MATMUL_TOKENS]


def kernel_cases() -> list[DequantizeCase]:
    out = [
        DequantizeCase(w, dtype, scales)
        for w in shapes.model_shapes()
        for dtype in ("fp16", "bf16")
        for scales in ("nested", "plain")
    ]
    by_id = {w.id: w for w in shapes.model_shapes()}
    gate, q, k = by_id["llama-3.3-70b.gate_proj"], by_id["qwen3-32b.q_proj"], by_id["qwen3-32b.k_proj"]
    out += [
        DequantizeCase(gate, "fp16", "nested", "fp4"),
        DequantizeCase(gate, "fp32", "nested"),
        DequantizeCase(q, "fp16", "nested", blocksize=128),
        DequantizeCase(q, "fp16", "nested", blocksize=4096),
        DequantizeCase(k, "fp16", "nested", "fp4"),
        DequantizeCase(k, "fp32", "plain"),
    ]
    return out


def timed_cases() -> list[KernelCase]:
    """Every case a perf session times, of every op (``kind``: an op of ``harness.runtime.ops.OPS``)."""
    return [*kernel_cases(), *matmul_cases()]


# The end-to-end case: one QLoRA training step (forward, loss, backward) of a 2-layer
# Llama-3.3-70B-sized model with the patch applied; report-only (see policy and harness/perf/README.md).
E2E_STEP = "e2e-qlora-llama-3.3-70b-2layers-step"
