"""Parse the resource report ptxas prints under ``-v`` (registers, spills, stack, shared memory)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)' for '(?P<arch>[^']+)'")
_FRAME = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<spill_st>\d+) bytes spill stores, (?P<spill_ld>\d+) bytes spill loads"
)
_USED = re.compile(r"Used (?P<regs>\d+) registers")
_BARRIERS = re.compile(r"used (?P<bar>\d+) barriers")
_SMEM = re.compile(r"(?P<smem>\d+) bytes smem")


@dataclass(frozen=True)
class KernelResources:
    kernel: str
    arch: str
    registers: int
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int
    barriers: int

    def as_dict(self) -> dict:
        return asdict(self)


def parse_ptxas_log(log: str) -> list[KernelResources]:
    """One record per entry function found in the log, in order of appearance."""
    records: list[KernelResources] = []
    current: dict | None = None

    def flush():
        if current is not None and "registers" in current:
            records.append(KernelResources(**current))

    for line in log.splitlines():
        if m := _ENTRY.search(line):
            flush()
            current = {
                "kernel": m["name"],
                "arch": m["arch"],
                "stack_frame_bytes": 0,
                "spill_store_bytes": 0,
                "spill_load_bytes": 0,
                "shared_bytes": 0,
                "barriers": 0,
            }
        elif current is None:
            continue
        elif m := _FRAME.search(line):
            current["stack_frame_bytes"] = int(m["stack"])
            current["spill_store_bytes"] = int(m["spill_st"])
            current["spill_load_bytes"] = int(m["spill_ld"])
        elif m := _USED.search(line):
            current["registers"] = int(m["regs"])
            if b := _BARRIERS.search(line):
                current["barriers"] = int(b["bar"])
            if s := _SMEM.search(line):
                current["shared_bytes"] = int(s["smem"])
    flush()
    return records
