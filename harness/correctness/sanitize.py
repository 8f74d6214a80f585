"""compute-sanitizer over our kernels: memcheck, racecheck, synccheck and initcheck (GPU).

    python -m harness.correctness.sanitize [--tools memcheck,initcheck] [--inputs raw,bnb] [--out DIR]

Each tool runs this module again under ``compute-sanitizer`` (``--cases``), which launches every
op's reduced matrix of calls through its public path (its ``OpChecks.sanitize`` in
``harness.correctness.op_checks``, for every op of ``harness.runtime.ops.OPS``: for the
dequantization every variant by both host paths and both tilings, with a tail and a misaligned
output; for the fused matmul every format, K split and not, one token tile and two, with a bias,
by both host paths).
Every error is attributed to the kernel it names: only errors in ours fail the run; errors in
other kernels (PyTorch's, bitsandbytes') and host API errors the libraries hit while probing
(``cuGetProcAddress`` and the like) are counted apart. memcheck, racecheck and synccheck check
our kernel alone (``--kernel-name``); initcheck checks every kernel, because it learns which bytes
are initialized only from the kernels it instruments: filtered to ours, it reports every byte
another kernel wrote (bitsandbytes' quantized data, say) as uninitialized.

Inputs (``sanitize_inputs``): ``raw`` random bytes and scales, ``bnb`` weights quantized by
bitsandbytes. Every case prints its input buffers' address ranges, and each uninitialized read is
traced to the buffer and byte offset it hit.
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

from harness.correctness import op_checks, sanitize_inputs
from harness.runtime import ops

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# Our kernels' entry points, and what the filtered tools select by (a substring of every one of
# them, and of no kernel the cases launch otherwise: PyTorch's and bitsandbytes' quantizer and
# dequantizer; tests/test_sanitize.py holds the two together).
KERNEL_FILTER = "_4bit_"
# Tools that check our kernel only; initcheck must instrument every kernel (module docstring).
FILTERED = ("memcheck", "racecheck", "synccheck")
# memcheck, synccheck and initcheck end with an ERROR SUMMARY; racecheck with a RACECHECK SUMMARY
# whose errors and warnings are both hazards in the checked kernel.
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)")
_RECORD = re.compile(r"^=+ (?! )(?!COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY)(\S.*)$")
_AT = re.compile(r"^=+\s+at (.*)$")
_ADDRESS = re.compile(r"Address (0x[0-9a-fA-F]+)")


def run_cases(inputs: str) -> int:
    """Launch every op's reduced matrix once (under a sanitizer, from ``main``): each op's cases in
    ``op_checks.CHECKS``; 0 when every output is right (bitsandbytes' bits, or inside the fused
    matmul's fp64 bound)."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    wrong = sum(op_checks.CHECKS[op.name].sanitize(inputs, device) for op in ops.OPS)
    torch.cuda.synchronize(device)
    print(f"cases: {wrong} outputs differ from bitsandbytes (or leave the matmul's bound)", flush=True)
    return 1 if wrong else 0


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
    for m in sanitize_inputs.RANGES.finditer(report):
        for name, start, size in sanitize_inputs.RANGE.findall(m.group("ranges")):
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
    parser.add_argument("--inputs", default="raw,bnb", help="raw, bnb or raw,bnb (the inputs of sanitize_inputs)")
    parser.add_argument("--out", type=Path, default=Path("sanitize-out"))
    parser.add_argument("--cases", action="store_true", help=argparse.SUPPRESS)  # the sanitized process
    args = parser.parse_args(argv)
    if args.cases:
        return run_cases(args.inputs)
    inputs = args.inputs.split(",")
    if not set(inputs) <= {"raw", "bnb"}:
        parser.error(f"--inputs takes raw, bnb or raw,bnb, got {args.inputs!r}")
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
