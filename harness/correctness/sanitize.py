"""compute-sanitizer over the kernel: memcheck, racecheck, synccheck and initcheck (GPU).

    python -m harness.correctness.sanitize [--tools memcheck,initcheck] [--inputs raw|bnb] [--out DIR]

Each tool runs this module again under ``compute-sanitizer`` (``--cases``), which launches a
reduced matrix through the drop-in API: every variant (nf4/fp4 x fp16/bf16/fp32 x plain/nested)
at both tilings, a tail (an odd element count), and a misaligned output (the scalar path). Only
our kernel is checked (``--kernel-name kns=dequantize_4bit_kernel``); host API errors the
libraries hit while probing (``cuGetProcAddress`` and the like) are counted separately. The run
fails when any tool reports an error in our kernel.

Inputs: ``raw`` (the gate) are random bytes and scales written by PyTorch, so every byte the
kernel may read was written. ``bnb`` quantizes random weights with bitsandbytes instead, and
prints every buffer's address range, so an uninitialized read can be traced to the buffer it
hit: bitsandbytes leaves bytes it never writes (see kernels/NOTES.md).
"""

from __future__ import annotations

import argparse
import itertools
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
KERNEL = "dequantize_4bit_kernel"
# (shape, why): the small tiling with and without a tail, the large one (>= 16M elements) with one.
SHAPES = (((64, 96), "small"), ((37, 61), "small, odd tail"), ((4096, 4097), "large, odd tail"))
# memcheck, synccheck and initcheck end with an ERROR SUMMARY; racecheck with a RACECHECK SUMMARY
# whose errors and warnings are both hazards in the checked kernel.
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
_API_ERROR = re.compile(r"^=+ Program hit ", re.M)


def run_cases(inputs: str) -> int:
    """Launch the reduced matrix once (under a sanitizer, from ``main``); 0 when every output equals
    bitsandbytes' bit for bit."""
    import bitsandbytes.functional as F
    import torch

    from harness.correctness import cases
    from harness.correctness.bitcompare import poison_
    from harness.runtime import api

    device = torch.device("cuda", torch.cuda.current_device())
    mismatches = 0
    matrix = itertools.product(("nf4", "fp4"), (torch.float16, torch.bfloat16, torch.float32), (False, True), SHAPES)
    for quant, dtype, nested, (shape, _) in matrix:
        if inputs == "raw":
            case = cases.raw_case(shape, quant, 64, dtype, nested, seed=0, device=device, special_scales=False)
            A, qs = case.A, case.quant_state()
        else:
            A, qs = cases.quantize_weights(shape, quant, 64, nested, dtype, seed=0, device=device)
            _print_ranges(f"{quant} {dtype} nested={nested} {shape}", A, qs)
        expected = F.dequantize_4bit(A, qs)
        for misaligned in (False, True) if shape != SHAPES[-1][0] else (False,):
            buffer = torch.empty(expected.numel() + 1, dtype=dtype, device=device)
            out = buffer[1:].view(expected.shape) if misaligned else buffer[:-1].view(expected.shape)
            poison_(out)
            api.dequantize_4bit(A, qs, out=out)
            same = torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
            mismatches += not same
    torch.cuda.synchronize(device)
    return 1 if mismatches else 0


def _print_ranges(label: str, A, qs) -> None:
    buffers = {"A": A, "absmax": qs.absmax}
    if qs.nested:
        buffers |= {"code2": qs.state2.code, "absmax2": qs.state2.absmax, "offset": qs.offset}
    ranges = ", ".join(f"{k} 0x{t.data_ptr():x}+{t.numel() * t.element_size()}" for k, t in buffers.items())
    print(f"case {label}: {ranges}", flush=True)


def count_errors(report: str) -> dict:
    """Errors in a compute-sanitizer report: in our kernel (the only one checked) and host API
    errors (``Program hit ...`` lines, which the ERROR SUMMARY counts too)."""
    api = len(_API_ERROR.findall(report))
    if races := _RACE_SUMMARY.findall(report):
        return {"errors in our kernel": sum(int(e) + int(w) for e, w in races), "host API errors": api}
    summaries = _SUMMARY.findall(report)
    if not summaries:
        return {"errors in our kernel": None, "host API errors": api}  # the sanitizer did not finish
    total = sum(int(n) for n in summaries)
    return {"errors in our kernel": total - api, "host API errors": api}


def sanitize(tool: str, inputs: str, log: Path) -> dict:
    """One tool over the matrix: errors in our kernel, host API errors, exit status, seconds."""
    cmd = [
        "compute-sanitizer",
        f"--tool={tool}",
        f"--kernel-name=kns={KERNEL}",
        "--report-api-errors=all",
        "--print-limit=200",
        sys.executable,
        "-m",
        "harness.correctness.sanitize",
        "--cases",
        f"--inputs={inputs}",
    ]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    text = done.stdout + done.stderr
    log.write_text(text)
    return {
        "tool": tool,
        **count_errors(text),
        "cases exit status": done.returncode,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.correctness.sanitize", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--inputs", choices=("raw", "bnb"), default="raw")
    parser.add_argument("--out", type=Path, default=Path("sanitize-out"))
    parser.add_argument("--cases", action="store_true", help=argparse.SUPPRESS)  # the sanitized process
    args = parser.parse_args(argv)
    if args.cases:
        return run_cases(args.inputs)
    if shutil.which("compute-sanitizer") is None:
        print("compute-sanitizer is not on PATH (it ships with the CUDA toolkit)", file=sys.stderr)
        return 2
    from tabulate import tabulate

    args.out.mkdir(parents=True, exist_ok=True)
    tools = args.tools.split(",")
    # One process per tool, all at once: the sanitizers' cost is mostly on the host.
    with ThreadPoolExecutor(len(tools)) as pool:
        rows = list(pool.map(lambda tool: sanitize(tool, args.inputs, args.out / f"{tool}-{args.inputs}.log"), tools))
    print(tabulate(rows, headers="keys", tablefmt="github"))
    failed = any(r["errors in our kernel"] != 0 or r["cases exit status"] for r in rows)
    print(f"sanitize ({args.inputs} inputs): {'FAIL' if failed else 'PASS'}; logs in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
