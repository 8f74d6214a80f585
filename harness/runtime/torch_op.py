"""Registered PyTorch ops, so ``torch.compile``d graphs run our kernels; names no op.

TorchDynamo cannot trace the launcher (it passes raw pointers to the driver), so an op's drop-in,
while being traced, calls the op's registered ops instead: one opaque ``nf4_harness::<name>`` node
each, whose fake implementation checks the call against eager mode's rules (metadata only) and
gives the compiler the output's shape and dtype. Each op declares its registered ops as
``TorchOp`` data (its call module's ``TORCH_OPS``) and registers them as that module loads.

Registered once per process: a second copy of ``harness`` loaded beside this one (the perf gate's
A/B process holds two) finds a name registered and keeps the first copy's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

NAMESPACE = "nf4_harness"


@dataclass(frozen=True)
class TorchOp:
    name: str  # registered as NAMESPACE::name
    fn: Callable  # what the graph runs, called with the schema's arguments in order
    fake: Callable  # checks a traced call and returns its output's metadata
    schema: str  # the arguments and result, e.g. "(Tensor A, int n) -> Tensor"
    mutates_args: tuple[str, ...] = ()


def register(ops: Iterable[TorchOp]) -> None:
    """Registers each op not registered yet in this process."""
    for op in ops:
        if not hasattr(getattr(torch.ops, NAMESPACE), op.name):
            registered_op = torch.library.custom_op(
                f"{NAMESPACE}::{op.name}", op.fn, mutates_args=op.mutates_args, schema=op.schema
            )
            registered_op.register_fake(op.fake)


def registered(name: str):
    """The registered op ``NAMESPACE::name`` (whichever copy of ``harness`` registered it)."""
    return getattr(getattr(torch.ops, NAMESPACE), name)
