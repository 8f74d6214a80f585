"""The fused matmul's battery of calls: which calls its kernel takes (every format, token tile,
split and unsplit K, bias, out) and which it leaves to the fallback or refuses, each rule of
``matmul.takes`` and of the weight's dequantization call. A call is a dict of the compiled entry's
arguments (``matmul.ENTRY_ARGS``). Apart from ``matmul.py`` here for the reason
``dequantize_battery`` gives.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from harness.correctness.op_checks import dequantize_battery
from harness.runtime import dequantize_kernel, matmul


def positional(call: dict) -> list:
    """A matmul call as the compiled entry point takes it (``matmul.ENTRY_ARGS``)."""
    return [call[name] for name in matmul.ENTRY_ARGS]


def make_call(
    rows=(3,), N=96, K=128, dtype=torch.bfloat16, quant_type="nf4", nested=True, blocksize=64, device="cpu", max_rows=64
) -> dict:
    """Activations of shape (*rows, K) times a weight quantized from [N, K]
    (``dequantize_battery.make_call``'s), no bias, no out, at most ``max_rows`` rows fused (None:
    the GPU's crossover)."""
    weight = dequantize_battery.make_call((N, K), quant_type, dtype, blocksize, nested, device)
    return with_weight(dict(A=torch.zeros(*rows, K, dtype=dtype, device=device), bias=None, out=None), weight) | {
        "max_rows": max_rows
    }


def with_weight(call: dict, weight: dict) -> dict:
    """``call`` with the weight of a dequantization call (``dequantize_battery``'s)."""
    names = ("absmax", "code2", "absmax2", "offset", "shape", "blocksize", "blocksize2", "quant_type")
    return call | {"W": weight["A"]} | {name: weight[name] for name in names}


def calls(device="cpu") -> Iterator[tuple[str, dict]]:
    """Calls the fused kernel takes (every dtype, quant type and scale kind, each token tile, split
    and unsplit K, bias, out, 3-D activations) and calls it leaves to the fallback or refuses:
    every rule of ``matmul.takes``, a weight breaking a dequantization rule, an out it cannot write."""
    for quant, dtype, nested in itertools.product(
        dequantize_kernel.QUANT_TYPES, (torch.float16, torch.bfloat16), (False, True)
    ):
        yield (
            f"{quant}-{dtype}-{'nested' if nested else 'plain'}",
            make_call(dtype=dtype, quant_type=quant, nested=nested, device=device),
        )
    for m in (1, 8, 9, 16, 17, 32, 33, 64, 65, 300):
        yield f"rows-{m}", make_call((m,), N=200, K=4096, max_rows=1 << 62, device=device)
    # 17-32 rows of a small nested weight run two 16-token tiles (matmul_kernel.tile_for); plain, the 32-token one.
    yield "rows-17-plain", make_call((17,), N=200, K=4096, nested=False, max_rows=1 << 62, device=device)
    yield "rows-3d", make_call((2, 5), device=device)
    yield "K-one-step", make_call(K=32, blocksize=32, device=device)
    yield "blocksize-4096", make_call(K=8192, blocksize=4096, device=device)
    base = make_call(device=device)
    A, N, dtype = base["A"], base["shape"][0], base["A"].dtype
    yield "bias", base | {"bias": torch.zeros(N, dtype=dtype, device=device)}
    yield "out", base | {"out": torch.empty(*A.shape[:-1], N, dtype=dtype, device=device)}
    yield "at-max-rows", base | {"max_rows": 3}
    yield "crossover", base | {"max_rows": None}
    # The same rows on a smaller weight: where the GPU's crossover steps between their sizes, one
    # side of the step each.
    yield "crossover-smaller-weight", make_call(N=64, device=device, max_rows=None)
    # Left to the fallback (or refused there).
    yield "over-max-rows", base | {"max_rows": 2}
    yield "A-fp32", base | {"A": A.float()}
    yield "A-misaligned", base | {"A": dequantize_battery.misaligned(A.shape, dtype, device)}
    yield "A-not-contiguous", base | {"A": torch.zeros(A.shape[1], A.shape[0], dtype=dtype, device=device).t()}
    yield "A-requires-grad", base | {"A": A.clone().requires_grad_()}
    yield "A-0-dim", base | {"A": A[0, 0]}
    yield "A-empty", base | {"A": A[:0]}
    yield "A-K-differs", base | {"A": torch.zeros(3, 64, dtype=dtype, device=device)}
    K_N = make_call(N=128, K=96, device=device)
    yield "weight-K-N", K_N | {"A": torch.zeros(3, 128, dtype=dtype, device=device)}
    yield "K-not-multiple-of-32", make_call(K=48, device=device)
    yield "shape-3d", base | {"shape": torch.Size((2, 48, 128))}
    yield "W-misaligned", base | {"W": dequantize_battery.misaligned(base["W"].shape, torch.uint8, device)}
    yield "bias-fp32", base | {"bias": torch.zeros(N, device=device)}
    yield "bias-short", base | {"bias": torch.zeros(N - 1, dtype=dtype, device=device)}
    yield "bias-misaligned", base | {"bias": dequantize_battery.misaligned((N,), dtype, device)}
    yield "bias-requires-grad", base | {"bias": torch.zeros(N, dtype=dtype, device=device, requires_grad=True)}
    yield "out-shape", base | {"out": torch.empty(A.shape[0] * N, dtype=dtype, device=device)}
    yield "out-dtype", base | {"out": torch.empty(*A.shape[:-1], N, device=device)}
    yield "out-not-contiguous", base | {"out": torch.empty(N, A.shape[0], dtype=dtype, device=device).t()}
    # A weight that breaks one of the dequantization call's rules.
    yield "weight-packed-short", base | {"W": base["W"][:-1]}
    yield "weight-codes-fp32", base | {"absmax": base["absmax"].float()}
    yield "weight-codes-short", base | {"absmax": base["absmax"][:-1]}
    yield "weight-code2-short", base | {"code2": base["code2"][:255]}
    yield "weight-absmax2-short", base | {"absmax2": base["absmax2"][:0]}
    yield "weight-offset-vector", base | {"offset": torch.ones(2, device=device)}
    plain = make_call(nested=False, device=device)
    yield "weight-absmax-short", plain | {"absmax": plain["absmax"][:-1]}
    yield "weight-quant-int4", plain | {"quant_type": "int4"}
