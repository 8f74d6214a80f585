"""GPU time of our dequantize_4bit against bitsandbytes, per case, gated against the baseline.

Every case measures, in one session: our entry point, bitsandbytes' full dequantize_4bit, and
bitsandbytes' kernel alone (fp32 scales), each as GPU time per launch with a cold L2; and the
per-call time a caller sees (host work included) for ours and bitsandbytes' full path.
pytest-benchmark records our kernel's kept GPU samples (a replaying timer feeds them in), with
everything else in ``extra_info``.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

import harness
from harness import cases, launcher, shapes
from harness.perf import verdict
from harness.perf.gpu_timer import StopRule, per_call_seconds
from harness.variants import KERNEL_PARAMS, KernelVariant

from .conftest import RESULTS, SESSION, Replay, replay_into

pytestmark = pytest.mark.gpu

MAX_REMEASURE = 2


def _cases():
    out = []
    for w in shapes.model_shapes():
        for dtype in ("fp16", "bf16"):
            for scales in ("nested", "plain"):
                out.append((w, dtype, scales, "nf4", 64))
    by_id = {w.id: w for w in shapes.model_shapes()}
    gate = by_id["llama-3.3-70b.gate_proj"]
    q = by_id["qwen3-32b.q_proj"]
    k = by_id["qwen3-32b.k_proj"]
    out += [
        (gate, "fp16", "nested", "fp4", 64),
        (gate, "fp32", "nested", "nf4", 64),
        (q, "fp16", "nested", "nf4", 128),
        (q, "fp16", "nested", "nf4", 4096),
        (k, "fp16", "nested", "fp4", 64),
        (k, "fp32", "plain", "nf4", 64),
    ]
    return out


CASES = _cases()


def case_id(c) -> str:
    w, dtype, scales, quant, bs = c
    return f"{w.id}-{quant}-{dtype}-bs{bs}-{scales}"


def _bytes_moved(n: int, dtype: torch.dtype, blocksize: int, nested: bool) -> int:
    nblocks = math.ceil(n / blocksize)
    scales = nblocks + math.ceil(nblocks / 256) * 4 + 1024 if nested else nblocks * 4
    return (n + 1) // 2 + n * dtype.itemsize + scales


def _peers(A, qs, shape, dtype, quant, blocksize, seed, device) -> dict:
    """Each peer's launch callable, or the reason it can't run here (shown in the summary)."""
    peers = {}
    try:
        from harness.peers import triton_dequantize
    except ImportError as exc:
        peers["triton"] = f"not run: {exc}"
    else:
        peers["triton"] = lambda: triton_dequantize.dequantize_4bit(A, qs)
    if quant != "nf4":
        peers["torchao"] = "not run: torchao's NF4 tensor has no fp4"
    else:
        try:
            from harness.peers import torchao_nf4

            peers["torchao"] = torchao_nf4.dequantizer(shape, dtype, blocksize, seed, device)
        except ImportError as exc:
            peers["torchao"] = f"not run: {exc}"
    return peers


def _host_overhead(A, qs, bnb) -> dict:
    """Host time per call on a small weight, queue never full: ours (validation + launch, with and
    without allocating the output), bitsandbytes' full path, and the two floors every caller pays
    here: allocating the output alone, and one bare kernel launch (n = 0, no validation)."""
    out_buf = torch.empty(qs.shape, dtype=qs.dtype, device=A.device)
    variant = KernelVariant(qs.quant_type, cases.dtype_name(qs.dtype), nested=False)  # n = 0 reads nothing
    loaded = launcher.load(variant, A.device.index)
    bare_args = (0, 0, 0, 0, 0, 0.0, 0, 0, 6, 0, 1)
    stream = torch.cuda.current_stream(A.device).cuda_stream
    out = {}
    calls = (
        ("ours", lambda: harness.dequantize_4bit(A, qs)),
        ("ours out=", lambda: harness.dequantize_4bit(A, qs, out=out_buf)),
        ("bnb full", lambda: bnb.dequantize_4bit(A, qs)),
        ("floor: new_empty", lambda: A.new_empty(qs.shape, dtype=qs.dtype)),
        ("floor: bare launch", lambda: launcher.launch(loaded, 1, variant.threads, stream, KERNEL_PARAMS, bare_args)),
    )
    for name, fn in calls:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            fn()
        out[name] = (time.perf_counter() - t0) / 500 * 1e6
        torch.cuda.synchronize()
    return out


@pytest.mark.benchmark(timer=Replay.clock, disable_gc=True, warmup=False)
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_dequantize_speed(benchmark, bnb, perf_device, timer, copy_gbps, baseline, run_seed, case):
    w, dtype_name, scales, quant, blocksize = case
    dtype = cases.dtype_of(dtype_name)
    nested = scales == "nested"
    A, qs = cases.quantize_weights(w.shape, quant, blocksize, nested, dtype, run_seed, device=perf_device)
    n = qs.shape.numel()
    plain_absmax = bnb.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset if nested else qs.absmax
    bnb_out = torch.empty(qs.shape, dtype=dtype, device=perf_device)

    def ours():
        return harness.dequantize_4bit(A, qs)

    def bnb_full():
        return bnb.dequantize_4bit(A, qs)

    def bnb_kernel():
        torch.ops.bitsandbytes.dequantize_4bit.out(A, plain_absmax, blocksize, quant, qs.shape, dtype, out=bnb_out)

    if "host_overhead_us" not in SESSION and w.numel < 8_000_000:
        SESSION["host_overhead_us"] = _host_overhead(A, qs, bnb)

    ours_m = timer.measure(ours)
    full_m = timer.measure(bnb_full)
    kern_m = timer.measure(bnb_kernel)
    peer_x = {}
    for name, peer in _peers(A, qs, w.shape, dtype, quant, blocksize, run_seed, perf_device).items():
        if isinstance(peer, str):
            SESSION.setdefault("peers_not_run", {})[name] = peer
            peer_x[name] = None
        else:
            peer_x[name] = timer.measure(peer).median_s / ours_m.median_s
    # The roofline at this size: a device copy moving the same bytes (half read, half written).
    # Small tensors can't reach the large-copy bandwidth; this says how close the kernel gets.
    nbytes = _bytes_moved(n, dtype, blocksize, nested)
    copy_src = torch.empty(nbytes // 2, dtype=torch.uint8, device=perf_device)
    copy_dst = torch.empty_like(copy_src)
    same_copy_m = timer.measure(lambda: copy_dst.copy_(copy_src))
    calls = 50 if n > 50_000_000 else 200
    ours_call = per_call_seconds(ours, perf_device, calls)
    full_call = per_call_seconds(bnb_full, perf_device, calls)

    cid = case_id(case)
    result_verdict, delta, base_us = None, None, None
    if baseline is not None:
        base = verdict.baseline_case(baseline, cid)
        for attempt in range(MAX_REMEASURE + 1):
            ratio = ours_m.median_s / kern_m.median_s
            ratio_noise = math.hypot(ours_m.noise, kern_m.noise)
            n_ours, n_ratio = len(ours_m.samples_s), min(len(ours_m.samples_s), len(kern_m.samples_s))
            v_time = verdict.judge(
                ours_m.median_s * 1e6, ours_m.noise, n_ours, base["median_us"], base["noise"], base["samples"]
            )
            v_ratio = verdict.judge(
                ratio, ratio_noise, n_ratio, base["ratio_bnb_kernel"], base["ratio_noise"], base["ratio_samples"]
            )
            result_verdict = verdict.worst(v_time, v_ratio)
            if result_verdict.name != "AMBIGUOUS" or attempt == MAX_REMEASURE:
                break
            # Can't tell yet: measure both again with a longer budget before deciding.
            longer = StopRule(budget_s=timer.stop.budget_s * 2 ** (attempt + 1))
            ours_m = timer.measure_with(ours, longer)
            kern_m = timer.measure_with(bnb_kernel, longer)
        delta, base_us = v_time.delta, base["median_us"]

    gbps = nbytes / ours_m.median_s / 1e9
    row = {
        "case": cid,
        "median_us": ours_m.median_s * 1e6,
        "noise": ours_m.noise,
        "gbps": gbps,
        "pct_copy": 100 * gbps / copy_gbps,
        "pct_same_size_copy": 100 * same_copy_m.median_s / ours_m.median_s,
        "per_call_us": ours_call * 1e6,
        "x_bnb_kernel": kern_m.median_s / ours_m.median_s,
        "x_bnb_full": full_m.median_s / ours_m.median_s,
        "x_bnb_full_per_call": full_call / ours_call,
        "x_triton": peer_x["triton"],
        "x_torchao": peer_x["torchao"],
        "bnb_kernel_pct_copy": 100 * nbytes / kern_m.median_s / 1e9 / copy_gbps,
        "bnb_full_pct_copy": 100 * nbytes / full_m.median_s / 1e9 / copy_gbps,
        "baseline_us": base_us,
        "delta": delta,
        "verdict": str(result_verdict) if result_verdict else "recorded",
        "ratio_delta": v_ratio.delta if result_verdict else None,
        "baseline_record": {
            "median_us": ours_m.median_s * 1e6,
            "noise": ours_m.noise,
            "gbps": gbps,
            "ratio_bnb_kernel": ours_m.median_s / kern_m.median_s,
            "ratio_noise": math.hypot(ours_m.noise, kern_m.noise),
            "ratio_samples": min(len(ours_m.samples_s), len(kern_m.samples_s)),
            "x_bnb_full": full_m.median_s / ours_m.median_s,
            "samples": len(ours_m.samples_s),
        },
    }
    RESULTS.append(row)

    benchmark.extra_info.update(
        {k: v for k, v in row.items() if k not in ("baseline_record",)}
        | {
            "bytes_moved": nbytes,
            "copy_gbps": copy_gbps,
            "ours": ours_m.summary(),
            "bnb_full": full_m.summary(),
            "bnb_kernel": kern_m.summary(),
            "ours_per_call_us": ours_call * 1e6,
            "bnb_full_per_call_us": full_call * 1e6,
        }
    )
    replay_into(benchmark, ours_m.samples_s)

    if result_verdict is not None and result_verdict.name == "SLOWER":
        pytest.fail(f"{cid}: SLOWER than the baseline ({delta * 100:+.1f}%, {base_us:.1f} µs before)")
