"""A call's launches as data: which kernels, on which grids, with which arguments, into which
output. Each op turns a checked call into a ``Recipe``; both host paths run recipes and know no op.

The Python path builds one per call with its arguments' values and runs it (:func:`run`). The
compiled host path (``host_launcher.cpp``) asks the op once per *signature* of a call (every
tensor's dtype, device, sizes, alignment class and gradient flag, every other argument's value but
a float's) for a recipe whose arguments name the call's tensors (``Ref``) instead of holding
their addresses, keeps it, and fills the addresses of each later call of that signature itself.
So an op's compiled form may decide only from what a signature holds: pointers' alignment up to
``KEY_ALIGN`` bytes, never their values, and a Python float only as a kernel argument (``number``).

Importable without PyTorch (the recipes of the compiled path are tested on the CPU).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from harness.runtime import launcher

# A signature records a pointer's alignment up to this many bytes (the largest power of two
# dividing it, capped): an op's decisions may read ``ptr % a`` for any ``a`` dividing it.
KEY_ALIGN = 256
# Where an output or workspace is allocated, the recipe assumes this alignment (PyTorch's CUDA
# caching allocator gives 512 bytes, its CPU allocator 64); the compiled path checks it.
ALLOC_ALIGN = 16


@dataclass(frozen=True)
class Ref:
    """A kernel argument the call supplies: the data pointer of entry argument ``index`` (0 for
    None), its Python number as fp32, the output's or the workspace's data pointer."""

    source: str  # one of SOURCES
    index: int = 0


SOURCES = ("const", "ptr", "out", "workspace", "number")  # the compiled path's codes, in order
OUT = Ref("out")
WORKSPACE = Ref("workspace")


def ptr(index: int) -> Ref:
    return Ref("ptr", index)


def number(index: int) -> Ref:
    return Ref("number", index)


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``args`` in the order of the kernel's parameter kinds, each a constant or a ``Ref``."""

    kernel: launcher.LoadedKernel
    grid: tuple[int, int, int]
    threads: int
    args: tuple
    cluster_y: int = 1  # blocks a thread block cluster holds along y (1: no clusters)


@dataclass(frozen=True)
class Recipe:
    """A call's launches on one GPU, in order on its current stream. The output is entry argument
    ``out`` (an int), or allocated as ``out = (sizes, dtype)`` on the device of entry argument
    ``like``; the workspace holds ``workspace`` fp32 elements (0: none), every one written before
    it is read. No launches: the output alone (an empty result)."""

    device: int
    out: int | tuple
    like: int
    workspace: int
    launches: tuple[Launch, ...]


def values(recipe: Recipe, args, out_ptr: int, workspace_ptr: int) -> list[tuple]:
    """Each launch's argument values for a call's ``args`` (the entry's argument list)."""

    def value(a):
        if a.__class__ is not Ref:
            return a
        if a.source == "ptr":
            t = args[a.index]
            return 0 if t is None else t.data_ptr()
        if a.source == "number":
            return float(args[a.index])
        return out_ptr if a.source == "out" else workspace_ptr

    return [tuple(value(a) for a in launch.args) for launch in recipe.launches]


def run(recipe: Recipe, args=()):
    """Allocate what ``recipe`` allocates and enqueue its launches on the current stream of its GPU
    (the Python path); returns the output. A refused launch raises KernelLaunchError naming it."""
    import torch

    if isinstance(recipe.out, int):
        out = args[recipe.out]
    else:
        sizes, dtype = recipe.out
        out = args[recipe.like].new_empty(sizes, dtype=dtype)
    workspace = args[recipe.like].new_empty(recipe.workspace, dtype=torch.float32) if recipe.workspace else None
    if not recipe.launches:
        return out
    filled = values(recipe, args, out.data_ptr(), workspace.data_ptr() if workspace is not None else 0)

    def enqueue(stream: int) -> None:
        for launch, launch_args in zip(recipe.launches, filled, strict=False):
            launcher.launch(launch.kernel, launch.grid, launch.threads, stream, launch_args, launch.cluster_y)

    launcher.on_gpu(recipe.device, enqueue)
    return out


# -- The compiled path's form ------------------------------------------------------------------------
_KINDS = {"ptr": 0, "u64": 0, "i64": 1, "i32": 2, "f32": 3}  # how host_launcher.cpp writes a slot
_CONST_BITS = {"ptr": "<Q", "u64": "<Q", "i64": "<q", "i32": "<i", "f32": "<f"}


def encoded(recipe: Recipe | None, context: int):
    """``recipe`` as the compiled path reads it (plain tuples of ints), or None: (context (the GPU's
    primary context, which its kernels are loaded into; the entry checks it is current), device,
    out argument (-1: allocate), out sizes, out dtype, like, workspace elements, launches), a
    launch (kernel handle, gx, gy, gz, threads, dynamic shared bytes, cluster y, slots), a slot
    (kind, source, value): a constant's value as its little-endian bits, else the argument index."""
    if recipe is None:
        return None
    given = isinstance(recipe.out, int)
    sizes, dtype = ((), None) if given else recipe.out
    launches = []
    for launch in recipe.launches:
        kinds = launch.kernel.packer.kinds
        if len(kinds) != len(launch.args):
            raise ValueError(f"{launch.kernel.label} takes {len(kinds)} arguments, the recipe gives {len(launch.args)}")
        slots = []
        for kind, a in zip(kinds, launch.args, strict=False):
            if a.__class__ is Ref:
                slots.append((_KINDS[kind], SOURCES.index(a.source), a.index))
            else:
                slots.append((_KINDS[kind], 0, slot_bits(kind, a)))
        launches.append(
            (int(launch.kernel.handle), *launch.grid, launch.threads, launch.kernel.shared_bytes, launch.cluster_y,
             tuple(slots))
        )  # fmt: skip
    return (
        context, recipe.device, recipe.out if given else -1, tuple(sizes), dtype, recipe.like,
        recipe.workspace, tuple(launches),
    )  # fmt: skip


def slot_bits(kind: str, value) -> int:
    """A filled argument as the compiled path writes it into its 8-byte slot (what ``describe`` answers)."""
    return int.from_bytes(struct.pack(_CONST_BITS[kind], value).ljust(8, b"\0"), "little")
