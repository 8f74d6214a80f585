"""The ops this package ships, each behind one descriptor: its kernels (variants, compile specs,
entry points) and its call module (the module that holds its ``HostOp`` for the compiled host
path and its ``TORCH_OPS`` for torch.compile). The shared machinery that compiles, records or
sanitizes every kernel (``harness.compile_check``, ``harness.correctness.sanitize``) iterates
``OPS`` instead of naming ops. This is the op's product half; its judge half (how it is staged,
timed, judged and sanitized) is one ``OpChecks`` under the same name in
``harness.correctness.op_checks``, which the base owns (tests/test_op_registry.py fails for an op
missing from either). Another op is its own kernel and call modules and one line here, and its
judge module and one line there.

Importable without PyTorch (the compile check runs on machines without it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from harness.runtime import dequantize_kernel, jit, matmul_kernel


@dataclass(frozen=True)
class Op:
    name: str
    variants: Callable[[str | None], list]  # (arch) -> every variant a call can launch on a GPU of it: compiled
    spec_for: Callable[[object, str], jit.CompileSpec]  # (variant, GPU arch) -> its compile spec
    entries: tuple[str, ...]  # the kernels' entry points (a sanitizer report names them)
    call_module: str  # the op's call module (imported by name: this module loads without PyTorch)


OPS = (
    Op(
        "dequantize",
        dequantize_kernel.all_variants,
        dequantize_kernel.spec_for,
        (dequantize_kernel.ENTRY,),
        "harness.runtime.dequantize",
    ),
    Op(
        "matmul",
        matmul_kernel.all_variants,
        matmul_kernel.spec_for,
        (matmul_kernel.ENTRY, matmul_kernel.FINISH),
        "harness.runtime.matmul",
    ),
)


def compile_specs(arch: str) -> list[tuple[str, jit.CompileSpec]]:
    """(variant name, compile spec) of every variant of every op for a GPU of ``arch``."""
    return [(v.name, op.spec_for(v, arch)) for op in OPS for v in op.variants(arch)]


def entries() -> tuple[str, ...]:
    """Every op's entry points."""
    return tuple(e for op in OPS for e in op.entries)
