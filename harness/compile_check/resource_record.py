"""The committed ptxas resource record: registers, spills, stack and shared memory per kernel and arch.

``python -m harness.compile_check.resource_record`` compiles every entry point for every checked arch (no GPU
needed) and fails when a kernel newly spills, grows its stack frame or uses more registers than
recorded; ``--update`` rewrites the record.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness.perf.gpu_info import installed_version
from harness.runtime import jit, ops

DEFAULT_RECORD = Path(__file__).resolve().parents[2] / "baselines" / "ptxas-resources.json"
FIELDS = ("registers", "spill_store_bytes", "spill_load_bytes", "stack_frame_bytes", "shared_bytes")
UPDATE_COMMAND = "nox -s compile -- --update"


def _compiled(spec: jit.CompileSpec) -> jit.CompiledKernel:
    """Through the compile cache (its key is every input of the cubin, the compiler's version
    included, so an entry is this very compile's result), except an entry without a ptxas report:
    NVRTC leaves the report out in a process where a CUDA context for that arch is current."""
    compiled = jit.compile_kernel(spec)
    return compiled if compiled.resources else jit.compile_kernel(spec, use_cache=False)


def compiled_modules(arch: str) -> list[tuple[str, jit.CompiledKernel]]:
    """(record name, compiled module) of every variant of every op for one arch, compiled on
    every core (NVRTC runs without the GIL)."""
    names, specs = zip(*ops.compile_specs(arch), strict=True)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(zip(names, pool.map(_compiled, specs), strict=True))


def measure() -> dict:
    kernels = {}
    for arch in jit.CHECKED_ARCHS:
        for name, compiled in compiled_modules(arch):
            if not compiled.resources:
                raise RuntimeError(f"no ptxas report for {name} on {arch}:\n{compiled.log}")
            for res in (r.as_dict() for r in compiled.resources):
                # One record line per entry point; a module of one entry keeps its variant's name.
                entry = "" if len(compiled.resources) == 1 else f":{res['kernel']}"
                kernels[f"{name}{entry}@{arch}"] = {f: res[f] for f in FIELDS}
    return {
        "nvrtc": jit.nvrtc_version(),
        "nvidia_cuda_nvrtc_wheel": installed_version("nvidia-cuda-nvrtc"),
        "options": list(jit.DEFAULT_OPTIONS),
        "kernels": kernels,
    }


def compare(recorded: dict, current: dict) -> tuple[list[str], list[str]]:
    """(failures, notes): growth in registers, spills or stack fails; anything unrecorded fails too."""
    failures, notes = [], []
    if recorded.get("nvrtc") != current["nvrtc"]:
        notes.append(f"recorded with NVRTC {recorded.get('nvrtc')}, measured with {current['nvrtc']}")
    old = recorded.get("kernels", {})
    for name, now in sorted(current["kernels"].items()):
        if name not in old:
            failures.append(f"{name}: not in the record")
            continue
        was = old[name]
        for field in ("spill_store_bytes", "spill_load_bytes", "stack_frame_bytes", "registers"):
            if now[field] > was.get(field, 0):
                failures.append(f"{name}: {field} {was.get(field, 0)} -> {now[field]}")
        if now["shared_bytes"] != was.get("shared_bytes"):
            notes.append(f"{name}: shared_bytes {was.get('shared_bytes')} -> {now['shared_bytes']}")
    for name in sorted(set(old) - set(current["kernels"])):
        notes.append(f"{name}: recorded but no longer built")
    return failures, notes


def table(current: dict) -> str:
    lines = [f"{'kernel@arch':44} {'regs':>5} {'spill st/ld':>12} {'stack':>6} {'smem':>6}"]
    for name, r in sorted(current["kernels"].items()):
        spills = f"{r['spill_store_bytes']}/{r['spill_load_bytes']}"
        lines.append(f"{name:44} {r['registers']:5d} {spills:>12} {r['stack_frame_bytes']:6d} {r['shared_bytes']:6d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the record with this build's figures")
    parser.add_argument("--record", type=Path, default=DEFAULT_RECORD)
    parser.add_argument("-v", "--verbose", action="store_true", help="print the table even when nothing changed")
    args = parser.parse_args(argv)

    current = measure()
    if args.update:
        print(table(current))
        args.record.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
        print(f"wrote {args.record}")
        return 0
    if not args.record.exists():
        print(f"no resource record at {args.record}; create it with: {UPDATE_COMMAND}")
        return 1
    failures, notes = compare(json.loads(args.record.read_text()), current)
    if failures or notes or args.verbose:  # quiet when every kernel matches its record
        print(table(current))
    for note in notes:
        print(f"note: {note}")
    for failure in failures:
        print(f"FAIL: {failure}")
    if failures:
        print(f"resource check failed; if the growth is intended, re-record with: {UPDATE_COMMAND}")
        return 1
    print(f"resource check passed: {len(current['kernels'])} kernels within the record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
