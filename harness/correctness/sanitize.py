"""compute-sanitizer over our kernels: memcheck, racecheck, synccheck and initcheck (GPU).

    python -m harness.correctness.sanitize [--tools memcheck,initcheck] [--inputs raw,bnb] [--out DIR]

Each tool runs this module again under ``compute-sanitizer`` (``--cases``), which launches a
reduced matrix through the drop-in API: every variant (nf4/fp4 x fp16/bf16/fp32 x plain/nested),
launched by the compiled host path and by the Python path at both tilings (the large one forced
onto small tensors, which a sanitizer runs in seconds), with and without a tail (an odd element
count), and with a misaligned output (the scalar path); then the fused matmul (nf4/fp4 x fp16/bf16 x
plain/nested) with K split (its finish kernel) and not, one token tile and two, with a bias,
launched by the compiled host path and by the Python path.
Every error is attributed to the kernel it names: only errors in ours fail the run; errors in
other kernels (PyTorch's, bitsandbytes') and host API errors the libraries hit while probing
(``cuGetProcAddress`` and the like) are counted apart. memcheck, racecheck and synccheck check
our kernel alone (``--kernel-name``); initcheck checks every kernel, because it learns which bytes
are initialized only from the kernels it instruments: filtered to ours, it reports every byte
another kernel wrote (bitsandbytes' quantized data, say) as uninitialized.

Inputs: ``raw`` are random bytes and scales written by PyTorch; ``bnb`` quantizes random weights
with bitsandbytes. Both print every input buffer's address range, and each uninitialized read is
traced to the buffer and byte offset it hit.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

from harness.runtime import ops

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# Our kernels' entry points, and what the filtered tools select by (a substring of every one of
# them, and of no kernel the cases launch otherwise: PyTorch's and bitsandbytes' quantizer and
# dequantizer; tests/test_sanitize.py holds the two together).
KERNEL_FILTER = "_4bit_"
# Fused matmul cases (M, N, K), both kernels split and unsplit: the 8-token kernel with K in two
# splits ending in a partial step (one table per 64 k), and unsplit over one partial step (K % 64
# == 32: a table per 32-k half), and in 16 splits (on Hopper one cluster, past the portable size)
# and in 7 splits of 3 steps (on Hopper a cluster of an odd size); the 16-token one unsplit over 4
# steps; the wide kernel at 32 tokens split in two (no cluster epilogue: the finish adds them on any
# GPU), at 64 split in two and unsplit over two token tiles. The split rules decide these splits on
# any GPU that holds three blocks (tests/test_sanitize.py).
MATMUL_SHAPES = (
    (3, 40, 1856), (3, 40, 224), (5, 40, 16384), (5, 40, 5376), (9, 40, 1024), (20, 40, 1024), (40, 40, 1024),
    (70, 40, 256),
)  # fmt: skip
# Tools that check our kernel only; initcheck must instrument every kernel (module docstring).
FILTERED = ("memcheck", "racecheck", "synccheck")
# Shapes: several vectorized tiles with no tail, a tail (odd element count), a single byte.
SHAPES = ((64, 96), (37, 61), (1, 3))
# memcheck, synccheck and initcheck end with an ERROR SUMMARY; racecheck with a RACECHECK SUMMARY
# whose errors and warnings are both hazards in the checked kernel.
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
_RECORD = re.compile(r"^=+ (?! )(?!COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY)(\S.*)$")
_AT = re.compile(r"^=+\s+at (.*)$")
_ADDRESS = re.compile(r"Address (0x[0-9a-fA-F]+)")
_RANGES = re.compile(r"^case (?P<label>[^:]+): (?P<ranges>.*)$", re.M)
_RANGE = re.compile(r"(\w+) 0x([0-9a-f]+)\+(\d+)")


def run_cases(inputs: str) -> int:
    """Launch the reduced matrix once (under a sanitizer, from ``main``); 0 when every output equals
    bitsandbytes' bit for bit."""
    import bitsandbytes.functional as F
    import torch

    from harness.correctness import cases
    from harness.correctness.bitcompare import poison_
    from harness.runtime import api, dequantize_kernel, host_path

    device = torch.device("cuda", torch.cuda.current_device())
    mismatches = 0
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    # The compiled host path as it picks the launch, then the Python path with each tiling forced.
    host_paths = [contextlib.nullcontext] + [
        functools.partial(_python_path_tiled, host_path, dequantize_kernel, tiling)
        for tiling in dequantize_kernel.TILINGS
    ]
    for quant, dtype, nested, shape in itertools.product(("nf4", "fp4"), dtypes, (False, True), SHAPES):
        if inputs == "raw":
            case = cases.raw_case(shape, quant, 64, dtype, nested, seed=0, device=device, special_scales=False)
            A, qs = case.A, case.quant_state()
        else:
            A, qs = cases.quantize_weights(shape, quant, 64, nested, dtype, seed=0, device=device)
        _print_ranges(f"{quant} {dtype} nested={nested} {shape}", A, qs)
        expected = F.dequantize_4bit(A, qs)
        for path, misaligned in itertools.product(host_paths, (False, True)):
            buffer = torch.empty(expected.numel() + 1, dtype=dtype, device=device)
            out = buffer[1:].view(expected.shape) if misaligned else buffer[:-1].view(expected.shape)
            poison_(out)
            with path():
                api.dequantize_4bit(A, qs, out=out)
            mismatches += not torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    mismatches += _matmul_cases(inputs, device)
    torch.cuda.synchronize(device)
    print(f"cases: {mismatches} outputs differ from bitsandbytes (or leave the matmul's bound)", flush=True)
    return 1 if mismatches else 0


def _matmul_cases(inputs: str, device) -> int:
    """The fused matmul over the same formats; each result judged against the fp64 bound."""
    import torch

    from harness.correctness import cases
    from harness.correctness import matmul_reference as mr
    from harness.correctness.bitcompare import poison_
    from harness.runtime import api, host_path, matmul

    wrong = 0
    shapes = itertools.product(("nf4", "fp4"), (torch.float16, torch.bfloat16), (False, True), MATMUL_SHAPES)
    for quant, dtype, nested, (M, N, K) in shapes:
        if inputs == "raw":
            case = cases.raw_case((N, K), quant, 64, dtype, nested, seed=0, device=device, special_scales=False)
            B, qs = case.A, case.quant_state()
        else:
            B, qs = cases.quantize_weights((N, K), quant, 64, nested, dtype, seed=0, device=device)
        _print_ranges(f"matmul {quant} {dtype} nested={nested} {M}x{N}x{K}", B, qs)
        g = cases.seeded_generator(M, device)
        A = torch.randn(M, K, generator=g, device=device).to(dtype)
        bias = torch.randn(N, generator=g, device=device).to(dtype)
        expected = mr.fused_reference(A, B, qs, api.dequantize_4bit(B, qs), bias, dtype)
        for path in (contextlib.nullcontext, host_path.python_path_only):  # the compiled entry, then Python's
            out = poison_(torch.empty(M, N, dtype=dtype, device=device))
            with path():
                matmul.fused_matmul(A, B.t(), qs, bias=bias, out=out)
            wrong += not mr.judge(out, expected).ok
    return wrong


@contextlib.contextmanager
def _python_path_tiled(host_path, dequantize_kernel, tiling):
    with host_path.python_path_only(), mock.patch.object(dequantize_kernel, "tiling_for", lambda n: tiling):
        yield


def _print_ranges(label: str, A, qs) -> None:
    import torch

    buffers = {"A": A, "absmax": qs.absmax}
    if qs.nested:
        buffers |= {"code2": qs.state2.code, "absmax2": qs.state2.absmax}
        if isinstance(qs.offset, torch.Tensor) and qs.offset.is_cuda:
            buffers["offset"] = qs.offset
    ranges = ", ".join(f"{k} 0x{t.data_ptr():x}+{t.numel() * t.element_size()}" for k, t in buffers.items())
    print(f"case {label}: {ranges}", flush=True)


def _ours(where: str) -> bool:
    return any(k in where for k in ops.entries())


def error_records(report: str) -> list[tuple[str, str, str | None]]:
    """Each error record of a report as (what, where: the ``at`` line, address or None)."""
    records: list[list] = []
    for line in report.splitlines():
        if m := _RECORD.match(line):
            records.append([m.group(1).strip(), "", None])
        elif records and (m := _AT.match(line)) and not records[-1][1]:
            records[-1][1] = m.group(1)
        elif records and (m := _ADDRESS.search(line)) and records[-1][2] is None:
            records[-1][2] = m.group(1)
    return [tuple(r) for r in records if not r[0].startswith("Saved host backtrace")]


def trace_reads(report: str) -> list[dict]:
    """Uninitialized reads in our kernel, each traced to (case, buffer, byte offset) through the
    address ranges the cases printed."""
    ranges = []
    for m in _RANGES.finditer(report):
        for name, start, size in _RANGE.findall(m.group("ranges")):
            ranges.append((int(start, 16), int(size), m.group("label"), name))
    traced = []
    for what, where, address in error_records(report):
        if not _ours(where) or address is None or not what.startswith("Uninitialized"):
            continue
        a = int(address, 16)
        # The latest case whose buffer holds the address (the allocator reuses memory).
        hit = next(((label, name, a - s) for s, size, label, name in reversed(ranges) if s <= a < s + size), None)
        label, name, offset = hit or ("?", "outside every input buffer", None)
        traced.append({"read": what, "case": label, "buffer": name, "byte offset": offset})
    return traced


def count_errors(report: str) -> dict:
    """Errors in a compute-sanitizer report: in our kernel, in other kernels, and host API errors
    (``Program hit ...``). ``None`` for our kernel when the report has no summary (the sanitizer
    did not finish)."""
    records = error_records(report)
    api = sum(what.startswith("Program hit") for what, _, _ in records)
    ours = sum(_ours(where) for what, where, _ in records if not what.startswith("Program hit"))
    others = len(records) - api - ours
    if races := _RACE_SUMMARY.findall(report):
        ours = sum(int(e) + int(w) for e, w in races)  # hazards are summarised, not all printed
    elif not _SUMMARY.findall(report):
        ours = None
    return {"errors in our kernel": ours, "errors in other kernels": others, "host API errors": api}


def sanitize(tool: str, inputs: str, log: Path) -> dict:
    """One tool over the matrix: errors in our kernel, host API errors, exit status, seconds."""
    cmd = [
        "compute-sanitizer",
        f"--tool={tool}",
        *([f"--kernel-name=kns={KERNEL_FILTER}"] if tool in FILTERED else []),
        "--report-api-errors=all",
        "--print-limit=1000",
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
    traced = trace_reads(text)
    if traced:
        from tabulate import tabulate

        log.with_suffix(".traced.txt").write_text(tabulate(traced, headers="keys", tablefmt="github") + "\n")
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
    parser.add_argument("--inputs", default="raw,bnb", help="raw, bnb or both (comma-separated)")
    parser.add_argument("--out", type=Path, default=Path("sanitize-out"))
    parser.add_argument("--cases", action="store_true", help=argparse.SUPPRESS)  # the sanitized process
    args = parser.parse_args(argv)
    if args.cases:
        return run_cases(args.inputs)
    inputs = args.inputs.split(",")
    if not set(inputs) <= {"raw", "bnb"}:
        parser.error(f"--inputs takes raw, bnb or both, got {args.inputs!r}")
    if shutil.which("compute-sanitizer") is None:
        print("compute-sanitizer is not on PATH (it ships with the CUDA toolkit)", file=sys.stderr)
        return 2
    from tabulate import tabulate

    args.out.mkdir(parents=True, exist_ok=True)
    runs = list(itertools.product(args.tools.split(","), inputs))
    # One process per run, all at once: the sanitizers' cost is mostly on the host.
    with ThreadPoolExecutor(len(runs)) as pool:
        rows = list(pool.map(lambda r: {"inputs": r[1], **sanitize(*r, args.out / f"{r[0]}-{r[1]}.log")}, runs))
    print(tabulate(rows, headers="keys", tablefmt="github"))
    failed = any(r["errors in our kernel"] != 0 or r["cases exit status"] for r in rows)
    print(f"sanitize: {'FAIL' if failed else 'PASS'}; logs in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
