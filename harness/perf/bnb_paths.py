"""Which bitsandbytes path gains how much from ``harness.patch_bitsandbytes()``, measured side by
side in one process on one GPU: every row's two columns come from interleaved rounds.

    python -m harness.perf.bnb_paths --out DIR [--quick]

Tables (printed, and written to DIR as bnb-paths.md and bnb-paths.json):

- layers: ``bnb.matmul_4bit`` as ``Linear4bit`` calls it, Llama-3.3-70B gate and o shapes, nf4
  nested, bf16, M tokens; forward (inference) and forward+backward (the input's gradient, as
  QLoRA needs), patched vs unpatched, ABBA rounds of cold-L2 batches; outputs compared bit for bit.
- dequantize: the 28672x8192 gate weight alone: bitsandbytes' ``F.dequantize_4bit``, Unsloth's
  call path (``harness.correctness.peers.unsloth_style``), ours through the patched ``F.dequantize_4bit``.
- host: host time per call, queue never full, against one bare cuda-python launch (the floor
  every launch from Python pays on this host; the perf session reports the same): the
  dequantization, and one decode row's 4-bit matmul (bitsandbytes', ours fused, matmul mode).
- matmul: the 4-bit matmul at Llama-3.3-70B gate, o and k shapes (nf4 nested bf16), M tokens:
  bitsandbytes' ``matmul_4bit`` (its own path), ours fused (``harness.runtime.matmul.fused_matmul``)
  and ours dequantize + ``F.linear``, against the packed-weight roofline: the fewest bytes the
  matmul must move (packed weights, scale codes, second-level scales, activations, output) over
  the copy bandwidth measured in the same run. Each fused result is judged against the fp64
  reference's bound.
- sequence: one decoder layer's seven 4-bit matmuls (Llama-3.3-70B's q, k, v, o, gate, up, down,
  nf4 nested bf16) back to back at M = 1, 8, 16 rows, as a decode step runs them: bitsandbytes'
  ``matmul_4bit`` and ours fused, each as the seven calls timed alone (summed), eagerly in sequence
  and captured as one CUDA graph (a cold L2 before each), against the sum of the seven rooflines;
  whether each graph's replay equals its eager sequence bit for bit.
- generate: transformers ``generate`` (greedy, 64 new tokens after 32) on a 4-layer model at
  Llama-3.3-70B's sizes (vocabulary 4096, so the bf16 output layer weighs what it does beside 80
  layers), batch 1 and 8, tokens per second unpatched vs ``patch_bitsandbytes(matmul=True)``,
  wall time of whole synchronised calls, interleaved; and the share of tokens equal to unpatched.
- graphed: the same decode with the host out of the step: each mode's greedy step captured once
  as a CUDA graph over a static KV cache (``harness.perf.graphed_decode``) and replayed, as
  transformers' static-cache compile path runs it; and whether the replays equal the eager steps.
- compiled: transformers' own greedy ``generate`` as users run it, eager (unpatched, matmul mode)
  and with transformers' compiled decode (``patch_bitsandbytes(compiled_decode=True)``, default and
  matmul mode), batch 1, 8 and 32, on 4 layers of Llama-3.3-70B's and Qwen3-32B's sizes; tokens per
  second, each round printed.
- qlora: a QLoRA training step (2 layers at Llama-3.3-70B sizes, 8192 tokens), wall time per
  synchronised step, interleaved; the dequantization's share of GPU time from the profiler and
  the Amdahl prediction that share and the measured kernel speedup allow.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from harness.correctness.bitcompare import int_view
from harness.correctness.op_checks import matmul as matmul_checks
from harness.perf import gpu_info, gpu_timer, graphed_decode
from harness.runtime import patch

LAYER_SHAPES = {"gate": (28672, 8192), "o": (8192, 8192)}
TOKENS = (16, 64, 256, 1024, 4096)
ROUNDS = 6  # ABBA: each side measured first in half of them
SAMPLES = 10  # kept cold-L2 samples per batch
QLORA_TOKENS = (4, 2048)  # batch x sequence
QLORA_ROUNDS = 5
GENERATE_LAYERS = 4
GENERATE_BATCHES = (1, 8)
GENERATE_PROMPT, GENERATE_NEW = 32, 64
HOST_CALLS = 2000
MATMUL_SHAPES = {"gate": (28672, 8192), "o": (8192, 8192), "k": (1024, 8192)}
MATMUL_TOKENS = (1, 4, 8, 16, 32, 64, 128, 256)
# A decoder layer's 4-bit weights [N, K] in the order a decode step multiplies them (Llama-3.3-70B).
SEQUENCE_SHAPES = {
    "q": (8192, 8192), "k": (1024, 8192), "v": (1024, 8192), "o": (8192, 8192),
    "gate": (28672, 8192), "up": (28672, 8192), "down": (8192, 28672),
}  # fmt: skip
SEQUENCE_TOKENS = (1, 8, 16)
# Kernel names the profiler attributes to 4-bit dequantization: bitsandbytes' blockwise decode
# (the 8-bit absmax decode and the 4-bit one) and ours.
DEQUANT_KERNELS = ("kDequantizeBlockwise", "dequantize_4bit_kernel")


def interleaved(measure: Callable[[bool], float], rounds: int, matmul: bool = False) -> dict:
    """Median of per-round values for unpatched and patched (``matmul``: in matmul mode), the
    patch toggled between batches."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for patched in (False, True) if r % 4 in (0, 3) else (True, False):
            if patched:
                with patch.bitsandbytes_patched(matmul=matmul):
                    times[True].append(measure(True))
            else:
                times[False].append(measure(False))
    ratios = [u / p for u, p in zip(times[False], times[True], strict=True)]
    return {
        "unpatched_us": statistics.median(times[False]) * 1e6,
        "patched_us": statistics.median(times[True]) * 1e6,
        "speedup": statistics.median(times[False]) / statistics.median(times[True]),
        "round_speedups": (min(ratios), max(ratios)),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return int_view(t.detach().contiguous()).clone()


def _same_bits(run: Callable[[], torch.Tensor]) -> bool:
    expected = _bits(run())
    with patch.bitsandbytes_patched():
        got = _bits(run())
    return bool(torch.equal(got, expected))


def layer_rows(timer: gpu_timer.ColdL2Timer, device: torch.device, tokens, rounds: int) -> list[dict]:
    import bitsandbytes as bnb

    from harness.correctness import cases

    rows = []
    for layer, shape in LAYER_SHAPES.items():
        W, qs = cases.quantize_weights(shape, "nf4", 64, True, torch.bfloat16, seed=0, device=device)
        for m in tokens:
            x = torch.randn(m, shape[1], device=device, dtype=torch.bfloat16)
            xg = x.clone().requires_grad_()
            gy = torch.randn(m, shape[0], device=device, dtype=torch.bfloat16)

            def forward(x=x, W=W, qs=qs):
                with torch.no_grad():
                    return bnb.matmul_4bit(x, W.t(), qs)

            def forward_backward(xg=xg, gy=gy, W=W, qs=qs):
                (grad,) = torch.autograd.grad(bnb.matmul_4bit(xg, W.t(), qs), xg, gy)
                return grad

            for pass_name, fn in (("forward", forward), ("forward+backward", forward_backward)):
                row = interleaved(lambda _p, fn=fn: timer.batch(fn, SAMPLES).median_s, rounds)
                before = patch.routed_calls()
                row["bit-identical"] = _same_bits(fn)
                after = patch.routed_calls()
                seams = [k.split(":")[0] for k in after if k.endswith(": ours") and after[k] != before.get(k, 0)]
                rows.append(
                    {"layer": f"{layer} {shape[0]}x{shape[1]}", "M": m, "pass": pass_name, **row, "ours via": seams}
                )
        del W, qs
        torch.cuda.empty_cache()
    return rows


def dequantize_rows(timer: gpu_timer.ColdL2Timer, device: torch.device) -> list[dict]:
    import bitsandbytes.functional as F

    from harness.correctness import cases
    from harness.correctness.peers import unsloth_style

    A, qs = cases.quantize_weights(LAYER_SHAPES["gate"], "nf4", 64, True, torch.bfloat16, seed=1, device=device)
    expected = _bits(F.dequantize_4bit(A, qs))
    unsloth, _ = unsloth_style.dequantizer(A, qs)
    calls = {"bitsandbytes F.dequantize_4bit": lambda: F.dequantize_4bit(A, qs), "Unsloth's call path": unsloth}
    results = {}
    for name, fn in calls.items():
        results[name] = (timer.measure(fn), torch.equal(_bits(fn()), expected))
    with patch.bitsandbytes_patched():
        fn = calls["ours (patched F.dequantize_4bit)"] = lambda: F.dequantize_4bit(A, qs)
        results["ours (patched F.dequantize_4bit)"] = (timer.measure(fn), torch.equal(_bits(fn()), expected))
    base = results["bitsandbytes F.dequantize_4bit"][0].median_s
    nbytes = A.numel() + qs.absmax.numel() + 2 * qs.shape.numel()
    return [
        {
            "path": name,
            "median_us": m.median_s * 1e6,
            "noise": m.noise,
            "GB/s": nbytes / m.median_s / 1e9,
            "vs bitsandbytes": base / m.median_s,
            "bit-identical": same,
        }
        for name, (m, same) in results.items()
    ]


def host_rows(timer: gpu_timer.ColdL2Timer, device: torch.device) -> list[dict]:
    """Host microseconds per call, against one bare cuda-python launch (the perf session's floor)."""
    import bitsandbytes.functional as F

    from harness.correctness import cases
    from harness.runtime import api, host_path

    A, qs = cases.quantize_weights((1024, 4096), "nf4", 64, True, torch.bfloat16, seed=2, device=device)
    out = torch.empty(qs.shape, dtype=qs.dtype, device=device)
    sync = lambda: torch.cuda.synchronize(device)  # noqa: E731
    calls = {
        "floor: bare cuda-python launch": timer.bare_launch(),
        "of which cuLaunchKernel alone": timer.driver_launch(),
        "floor: new_empty": lambda: A.new_empty(qs.shape, dtype=qs.dtype),
        "ours, out=": lambda: api.dequantize_4bit(A, qs, out=out),
        "ours": lambda: api.dequantize_4bit(A, qs),
        "bitsandbytes F.dequantize_4bit": lambda: F.dequantize_4bit(A, qs),
    }
    times = gpu_timer.host_us_per_call(calls, sync, HOST_CALLS, warmup=50)
    with host_path.python_path_only():  # the same calls without the compiled host path, for comparison
        python_path = {
            "ours, Python path, out=": lambda: api.dequantize_4bit(A, qs, out=out),
            "ours, Python path": lambda: api.dequantize_4bit(A, qs),
        }
        times |= gpu_timer.host_us_per_call(python_path, sync, HOST_CALLS, warmup=50)
    with patch.bitsandbytes_patched():
        patched = {"ours via patched F.dequantize_4bit": lambda: F.dequantize_4bit(A, qs)}
        times |= gpu_timer.host_us_per_call(patched, sync, HOST_CALLS, warmup=50)
    times |= _matmul_host_us(A, qs, sync)
    floor = times["floor: bare cuda-python launch"]
    return [{"call": k, "host_us": v, "x floor": v / floor} for k, v in times.items()]


def _matmul_host_us(B: torch.Tensor, qs, sync: Callable[[], object]) -> dict[str, float]:
    """Host microseconds of one decode row's 4-bit matmul: bitsandbytes' own, ours fused through
    the compiled host path and through the Python path, and bitsandbytes' in matmul mode."""
    import bitsandbytes as bnb

    from harness.runtime import host_path, matmul

    x = torch.randn(1, qs.shape[1], device=B.device, dtype=qs.dtype)
    calls = {
        "bitsandbytes matmul_4bit, 1 row": lambda: bnb.matmul_4bit(x, B.t(), qs),
        "ours fused_matmul, 1 row": lambda: matmul.fused_matmul(x, B.t(), qs),
    }
    times = gpu_timer.host_us_per_call(calls, sync, HOST_CALLS, warmup=50)
    with host_path.python_path_only():
        python_path = {"ours fused_matmul, Python path, 1 row": lambda: matmul.fused_matmul(x, B.t(), qs)}
        times |= gpu_timer.host_us_per_call(python_path, sync, HOST_CALLS, warmup=50)
    with patch.bitsandbytes_patched(matmul=True):
        patched = {"bitsandbytes matmul_4bit in matmul mode, 1 row": lambda: bnb.matmul_4bit(x, B.t(), qs)}
        times |= gpu_timer.host_us_per_call(patched, sync, HOST_CALLS, warmup=50)
    return times


def _matmul_calls(x: torch.Tensor, B: torch.Tensor, qs) -> dict[str, Callable[[], torch.Tensor]]:
    import bitsandbytes as bnb

    from harness.runtime import api, matmul

    return {
        "bitsandbytes": lambda: bnb.matmul_4bit(x, B.t(), qs),
        "ours fused": lambda: matmul.fused_matmul(x, B.t(), qs),
        "ours dequantize + F.linear": lambda: torch.nn.functional.linear(x, api.dequantize_4bit(B, qs)),
    }


def matmul_rows(timer: gpu_timer.ColdL2Timer, device: torch.device, tokens=MATMUL_TOKENS) -> list[dict]:
    from harness.correctness import cases
    from harness.correctness import matmul_reference as mr
    from harness.runtime import matmul

    copy_gbps, copy = gpu_timer.copy_bandwidth(timer)
    rows = []
    for layer, B, qs, W, x in cases.report_matmul_inputs(MATMUL_SHAPES, tokens, seed=3, device=device):
        (m, K), N = x.shape, W.shape[0]
        calls = _matmul_calls(x, B, qs)
        with torch.no_grad():
            us = {name: timer.measure(fn).median_s * 1e6 for name, fn in calls.items()}
            verdict = mr.judge(calls["ours fused"](), mr.fused_reference(x, B, qs, W, None, torch.bfloat16))
        roofline_us = matmul_checks.matmul_bytes(N, K, m) / copy_gbps / 1e3
        rows.append(
            {
                "layer": f"{layer} {N}x{K}",
                "M": m,
                **{f"{name} µs": v for name, v in us.items()},
                "roofline µs": roofline_us,
                "fused ÷ roofline": us["ours fused"] / roofline_us,
                "bnb ÷ roofline": us["bitsandbytes"] / roofline_us,
                "fused speedup vs bnb": us["bitsandbytes"] / us["ours fused"],
                "vs dequant+linear": us["ours dequantize + F.linear"] / us["ours fused"],
                "in bound": verdict.ok,
            }
        )
    rows.append({"layer": f"copy bandwidth {copy_gbps:.0f} GB/s (noise {copy.noise:.4f})"})
    measured = ", ".join(f"{layer} {m}" for layer, m in measured_crossovers(rows).items())
    used = matmul.crossover_table(device.index)
    rows.append(
        {"layer": f"crossover M measured: {measured}; table {crossover_table_of(rows)} (the harness uses {used})"}
    )
    return rows


def measured_crossovers(rows: list[dict]) -> dict[str, int]:
    """Per weight of the matmul table, the largest M up to which the fused kernel beat
    dequantize + F.linear at every measured M (0 where it never did)."""
    best: dict[str, int] = {}
    for layer in dict.fromkeys(r["layer"].split()[0] for r in rows if "M" in r):
        best[layer] = 0
        for r in sorted((r for r in rows if "M" in r and r["layer"].split()[0] == layer), key=lambda r: r["M"]):
            if r["ours fused µs"] >= r["ours dequantize + F.linear µs"]:
                break
            best[layer] = r["M"]
    return best


def crossover_table_of(rows: list[dict]) -> tuple[tuple[int, int], ...]:
    """The crossover table (``matmul.CROSSOVER_M``'s form) the matmul table measures: from each
    measured weight's size up, the smallest crossover of it and every larger weight, the smallest
    weight's from 0 (a weight between two measured ones takes the smaller one's entry); an entry
    that repeats the one before is left out."""
    crossovers = measured_crossovers(rows)
    by_size = sorted(crossovers, key=lambda layer: MATMUL_SHAPES[layer][0] * MATMUL_SHAPES[layer][1])
    table: list[tuple[int, int]] = []
    for i, layer in enumerate(by_size):
        most = min(crossovers[larger] for larger in by_size[i:])
        if not table or table[-1][1] != most:
            table.append((MATMUL_SHAPES[layer][0] * MATMUL_SHAPES[layer][1] if table else 0, most))
    return tuple(table)


@contextlib.contextmanager
def _decode_model():
    """The generate tables' model: ``GENERATE_LAYERS`` layers at Llama-3.3-70B's sizes, random
    weights, quantized on load (nf4 nested bf16), in eval mode."""
    from harness.correctness import qlora

    tmp = qlora.temporary_checkpoint(layers=GENERATE_LAYERS)
    try:
        yield qlora.load_quantized(tmp.name).eval()
    finally:
        torch.cuda.empty_cache()
        tmp.cleanup()


def _decode_row(batch: int, row: dict, equal: float, tokens: int) -> dict:
    return {
        "batch": batch,
        "layers": GENERATE_LAYERS,
        "unpatched tokens/s": tokens / row["unpatched_us"] * 1e6,
        "matmul mode tokens/s": tokens / row["patched_us"] * 1e6,
        "speedup": row["speedup"],
        "round speedups": row["round_speedups"],
        "tokens equal to unpatched": equal,
    }


def generate_rows(rounds: int, batches=GENERATE_BATCHES) -> list[dict]:
    from harness.correctness import qlora

    with _decode_model() as model:
        kwargs = {"max_new_tokens": GENERATE_NEW, "min_new_tokens": GENERATE_NEW, "do_sample": False, "pad_token_id": 0}
        rows = []
        for batch in batches:
            ids = qlora.random_tokens(model.config.vocab_size, batch, GENERATE_PROMPT, seed=batch)

            def run(ids=ids):
                return model.generate(ids, **kwargs)

            unpatched = run()
            with patch.bitsandbytes_patched(matmul=True):
                fused = run()
            row = interleaved(lambda _p, run=run: statistics.median(qlora.wall_times(run, 2)), rounds, matmul=True)
            equal = float((fused == unpatched).double()[:, GENERATE_PROMPT:].mean())
            rows.append(_decode_row(batch, row, equal, batch * GENERATE_NEW))
        return rows


def sequence_rows(timer: gpu_timer.ColdL2Timer, device: torch.device, tokens=SEQUENCE_TOKENS) -> list[dict]:
    """One row per row count and implementation: the layer's seven matmuls alone (summed), eagerly
    in sequence and as one CUDA graph; the graphs timed in ABBA order."""
    import bitsandbytes as bnb

    from harness.correctness import cases
    from harness.runtime import matmul

    copy_gbps, copy = gpu_timer.copy_bandwidth(timer)
    weights = [
        cases.quantize_weights(shape, "nf4", 64, True, torch.bfloat16, seed=i, device=device)
        for i, shape in enumerate(SEQUENCE_SHAPES.values())
    ]
    sides = {"bitsandbytes": bnb.matmul_4bit, "ours fused": matmul.fused_matmul}
    rows = []
    for m in tokens:
        inputs = {K: torch.randn(m, K, device=device, dtype=torch.bfloat16) for _, K in SEQUENCE_SHAPES.values()}
        roofline_us = sum(matmul_checks.matmul_bytes(N, K, m) for N, K in SEQUENCE_SHAPES.values()) / copy_gbps / 1e3
        measured = {}
        with torch.no_grad():
            for side, fn in sides.items():
                calls = [
                    functools.partial(fn, inputs[K], B.t(), qs)
                    for (B, qs), (_, K) in zip(weights, SEQUENCE_SHAPES.values(), strict=True)
                ]

                def sequence(calls=calls) -> list[torch.Tensor]:
                    return [call() for call in calls]

                eager = sequence()
                graph, replayed = graphed_decode.capture(sequence, device)
                graph.replay()
                measured[side] = {
                    "graph": graph,
                    "equal": all(torch.equal(int_view(a), int_view(b)) for a, b in zip(eager, replayed, strict=True)),
                    "alone": sum(timer.measure(call).median_s for call in calls) * 1e6,
                    "eager": timer.measure(sequence).median_s * 1e6,
                }
            graph_us = {side: [] for side in sides}
            for side in ("bitsandbytes", "ours fused", "ours fused", "bitsandbytes"):
                graph_us[side].append(timer.measure(measured[side]["graph"].replay).median_s * 1e6)
        for side, r in measured.items():
            graph = statistics.mean(graph_us[side])
            rows.append(
                {
                    "M": m,
                    "implementation": side,
                    "seven alone µs": r["alone"],
                    "eager sequence µs": r["eager"],
                    "graph µs": graph,
                    "rooflines µs": roofline_us,
                    "graph ÷ rooflines": graph / roofline_us,
                    "graph = eager": r["equal"],
                }
            )
        rows[-1]["bitsandbytes ÷ ours (graph)"] = rows[-2]["graph µs"] / rows[-1]["graph µs"]
    rows.append({"M": f"copy bandwidth {copy_gbps:.0f} GB/s (noise {copy.noise:.4f})"})
    return rows


def graphed_rows(rounds: int, batches=GENERATE_BATCHES) -> list[dict]:
    """The generate table's decode with the host out of the step (``graphed_decode``): one CUDA
    graph per mode, each replayed ``GENERATE_NEW`` times a round; and whether the matmul mode's
    replays give the tokens its eager steps give (the capture kept every launch's arguments)."""
    from harness.correctness import qlora

    with _decode_model() as model:
        rows = []
        for batch in batches:
            ids = qlora.random_tokens(model.config.vocab_size, batch, GENERATE_PROMPT, seed=batch)
            decoders = {False: graphed_decode.GraphedDecode(model, ids, GENERATE_NEW)}
            with patch.bitsandbytes_patched(matmul=True):
                decoders[True] = graphed_decode.GraphedDecode(model, ids, GENERATE_NEW)
                eager = decoders[True].run(graphed=False)
            fused, unpatched = decoders[True].run(), decoders[False].run()
            row = interleaved(
                lambda p, d=decoders: statistics.median(qlora.wall_times(d[p].run, 3)), rounds, matmul=True
            )
            equal = float((fused == unpatched).double().mean())
            rows.append(
                {
                    **_decode_row(batch, row, equal, batch * GENERATE_NEW),
                    "replays equal eager": bool(torch.equal(fused, eager)),
                }
            )
        return rows


COMPILED_BATCHES = (1, 8, 32)
COMPILED_ARCHITECTURES = ("llama", "qwen3")
# (label, patch mode or None for unpatched, decode compiled)
COMPILED_LOOPS = (
    ("eager, unpatched", None, False),
    ("eager, matmul mode", {"matmul": True}, False),
    ("compiled, default mode", {"matmul": False, "compiled_decode": True}, True),
    ("compiled, matmul mode", {"matmul": True, "compiled_decode": True}, True),
)


def compiled_rows(rounds: int, batches=COMPILED_BATCHES, architectures=COMPILED_ARCHITECTURES) -> list[dict]:
    """transformers' own greedy ``generate`` as users run it, tokens per second: eager (the
    default, unpatched and in matmul mode) and with its compiled decode
    (``cache_implementation="static"``, let through by ``patch_bitsandbytes(compiled_decode=True)``;
    the default mode runs bitsandbytes' own matmul kernels), ``GENERATE_LAYERS`` layers of each
    architecture at its real sizes. Each compiled loop has a model of its own: a compiled decode
    step keeps the kernels its CUDA graphs captured, so one model must not serve two modes. The
    four loops interleave, in a rotating order, each round printed."""
    import tempfile

    from harness.correctness import qlora

    kwargs = {"max_new_tokens": GENERATE_NEW, "min_new_tokens": GENERATE_NEW, "do_sample": False, "pad_token_id": 0}
    rows = []
    for architecture in architectures:
        with tempfile.TemporaryDirectory(prefix="nf4-harness-compiled-") as tmp:
            qlora.save_random_model(tmp, architecture, GENERATE_LAYERS)
            compiled_models = {label: qlora.load_quantized(tmp).eval() for label, _, c in COMPILED_LOOPS if c}
            eager_model = next(iter(compiled_models.values()))
            for batch in batches:
                ids = qlora.random_tokens(eager_model.config.vocab_size, batch, GENERATE_PROMPT, seed=batch)

                def run(label, mode, compiled, timed, ids=ids, models=compiled_models, eager=eager_model):
                    """One generate of a loop, patched as the loop is outside the timed call."""
                    model = models[label] if compiled else eager
                    extra = {"cache_implementation": "static"} if compiled else {}
                    with patch.bitsandbytes_patched(**mode) if mode else contextlib.nullcontext():
                        if timed:
                            return qlora.wall_times(lambda: model.generate(ids, **kwargs, **extra), 1)[0]
                        return model.generate(ids, **kwargs, **extra)

                outputs = {loop[0]: run(*loop, timed=False) for loop in COMPILED_LOOPS}  # warm-up: compiles
                for label, model in compiled_models.items():
                    if not hasattr(model, "_compiled_call"):
                        raise RuntimeError(f"{architecture}, batch {batch}: transformers did not compile ({label})")
                times: dict[str, list[float]] = {loop[0]: [] for loop in COMPILED_LOOPS}
                for r in range(rounds):
                    for loop in COMPILED_LOOPS[r % 4 :] + COMPILED_LOOPS[: r % 4]:
                        times[loop[0]].append(run(*loop, timed=True))
                    print(
                        f"{architecture} batch {batch} round {r}: "
                        + ", ".join(f"{label} {batch * GENERATE_NEW / t[-1]:.0f}" for label, t in times.items())
                        + " tokens/s",
                        flush=True,
                    )
                unpatched = times[COMPILED_LOOPS[0][0]]
                baseline, reference = statistics.median(unpatched), outputs[COMPILED_LOOPS[0][0]]
                for label, samples in times.items():
                    rows.append(
                        {
                            "model": f"{architecture} ({GENERATE_LAYERS} layers)",
                            "batch": batch,
                            "decode loop": label,
                            "tokens/s": batch * GENERATE_NEW / statistics.median(samples),
                            "x eager unpatched": baseline / statistics.median(samples),
                            "rounds x": [round(u / t, 3) for u, t in zip(unpatched, samples, strict=True)],
                            "tokens equal to eager unpatched": float(
                                (outputs[label] == reference).double()[:, GENERATE_PROMPT:].mean()
                            ),
                        }
                    )
            compiled_models.clear()
            torch.cuda.empty_cache()
    return rows


def _dequant_gpu_us(step: Callable[[], object]) -> tuple[float, float]:
    """(GPU µs in 4-bit dequantization kernels, GPU µs in all kernels) of one call, by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    total = dequant = 0.0
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", 0.0)
        total += us
        if any(k in event.key for k in DEQUANT_KERNELS):
            dequant += us
    return dequant, total


def qlora_rows(rounds: int, tokens=QLORA_TOKENS) -> list[dict]:
    from harness.correctness import qlora

    tmp = qlora.temporary_checkpoint()
    try:
        m = qlora.load_qlora(tmp.name, batch=tokens[0], seq=tokens[1])

        def step():
            return qlora.train_step(m)

        step()
        row = interleaved(lambda _p: statistics.median(qlora.wall_times(step, 2)), rounds)
        dq_u, total_u = _dequant_gpu_us(step)
        with patch.bitsandbytes_patched():
            dq_p, total_p = _dequant_gpu_us(step)
        share = dq_u / total_u
        kernel_speedup = dq_u / dq_p
        predicted = 1 / ((1 - share) + share / kernel_speedup)
        row.update(
            {
                "tokens": f"{tokens[0]}x{tokens[1]}",
                "dequant share (unpatched)": share,
                "dequant GPU ms unpatched / patched": (dq_u / 1e3, dq_p / 1e3),
                "step GPU ms unpatched / patched": (total_u / 1e3, total_p / 1e3),
                "kernel speedup": kernel_speedup,
                "Amdahl prediction": predicted,
                "ceiling (dequant free)": 1 / (1 - share),
                "gain achieved / predicted": (row["speedup"] - 1) / (predicted - 1) if predicted > 1 else None,
            }
        )
        return [row]
    finally:
        torch.cuda.empty_cache()
        tmp.cleanup()


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    if isinstance(value, tuple):
        return " / ".join(_fmt(v) for v in value)
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "—"
    return str(value)


def render(tables: dict[str, list[dict]]) -> str:
    from tabulate import tabulate

    parts = []
    for name, rows in tables.items():
        if rows:
            parts.append(
                f"### {name}\n\n"
                + tabulate([{k: _fmt(v) for k, v in r.items()} for r in rows], headers="keys", tablefmt="github")
            )
    return "\n\n".join(parts) + "\n"


TABLES = ("dequantize", "host", "layers", "matmul", "sequence", "generate", "graphed", "compiled", "qlora")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.perf.bnb_paths", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--quick", action="store_true", help="M = 256 (layers), 1 and 64 (matmul), 2 rounds, no QLoRA or generate"
    )
    parser.add_argument("--no-qlora", action="store_true", help="skip the QLoRA step")
    parser.add_argument("--only", choices=TABLES, action="append", help="these tables only (repeatable)")
    args = parser.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    timer = gpu_timer.ColdL2Timer(device, clock=gpu_info.sm_clock_reader(gpu_info.nvml_device(device.index)))
    rounds = 2 if args.quick else ROUNDS
    slow = {"qlora", "generate", "graphed", "compiled"} if args.quick else {"qlora"} if args.no_qlora else set()
    wanted = set(args.only or TABLES) - slow
    builders = {
        "dequantize": lambda: dequantize_rows(timer, device),
        "host": lambda: host_rows(timer, device),
        "layers": lambda: layer_rows(timer, device, (256,) if args.quick else TOKENS, rounds),
        "matmul": lambda: matmul_rows(timer, device, (1, 64) if args.quick else MATMUL_TOKENS),
        "sequence": lambda: sequence_rows(timer, device, (1,) if args.quick else SEQUENCE_TOKENS),
        "generate": lambda: generate_rows(rounds),
        "graphed": lambda: graphed_rows(rounds),
        "compiled": lambda: compiled_rows(rounds),
        "qlora": lambda: qlora_rows(QLORA_ROUNDS),
    }
    tables = {"machine": [gpu_info.machine_info(gpu_info.nvml_device(device.index))]}
    for name in TABLES:
        if name in wanted:
            tables[name] = builders[name]()
    args.out.mkdir(parents=True, exist_ok=True)
    text = render({k: v for k, v in tables.items() if k != "machine"})
    (args.out / "bnb-paths.md").write_text(text)
    (args.out / "bnb-paths.json").write_text(json.dumps(tables, indent=1, default=str) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
