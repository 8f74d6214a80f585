"""Load compiled variants onto a GPU (cuda.core) and launch them on a raw stream handle.

Launches go straight to ``cuLaunchKernel`` (cuda.bindings) with the arguments packed by a
precompiled ``struct`` layout into one reusable buffer: measured on an H100 host, building numpy
scalars and cuda.core's per-call argument holder cost more than the driver call itself, and the
drop-in API's budget is a few microseconds per call.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field

import numpy as np

from harness import jit
from harness.errors import KernelLaunchError
from harness.variants import ENTRY, SOURCE, KernelVariant


def device_arch(device_index: int) -> str:
    """``sm_XY`` of a visible GPU, read from the device itself."""
    from cuda.core import Device

    major, minor = Device(device_index).compute_capability
    return f"sm_{major}{minor}"


def source_spec(source: str, arch: str, macros: tuple[tuple[str, str], ...], label: str) -> jit.CompileSpec:
    """The compile spec of ``kernels/<source>`` for one arch."""
    return jit.CompileSpec(source=jit.kernels_dir() / source, arch=arch, macros=macros, label=label)


def spec_for(variant: KernelVariant, arch: str) -> jit.CompileSpec:
    return source_spec(SOURCE, arch, variant.macros(), variant.name)


# struct codes of the kernel parameter kinds; each parameter gets its own 8-byte slot.
_SLOT = {"ptr": "Q", "u64": "Q", "i64": "q", "i32": "i4x", "f32": "f4x"}


class ArgPacker:
    """Packs one launch's arguments into a fixed buffer whose slot addresses form the
    ``kernelParams`` array cuLaunchKernel reads (it copies them before returning)."""

    def __init__(self, kinds: tuple[str, ...]):
        self._struct = struct.Struct("<" + "".join(_SLOT[k] for k in kinds))
        self._buf = np.zeros(len(kinds), dtype=np.uint64)
        base = self._buf.__array_interface__["data"][0]
        self._slots = np.array([base + 8 * i for i in range(len(kinds))], dtype=np.uint64)
        self.params = int(self._slots.__array_interface__["data"][0])
        self._view = memoryview(self._buf).cast("B")

    def pack(self, args) -> None:
        self._struct.pack_into(self._view, 0, *args)


@dataclass(frozen=True)
class LoadedKernel:
    variant: KernelVariant | None
    device_index: int
    kernel: object  # cuda.core Kernel
    # Per parameter-kinds packing buffer, and the lock that keeps it unchanged during a launch.
    packers: dict = field(default_factory=dict, compare=False, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)


_lock = threading.Lock()
_loaded: dict[tuple, LoadedKernel] = {}
_by_variant: dict[tuple[KernelVariant, int], LoadedKernel] = {}


def load(variant: KernelVariant, device_index: int) -> LoadedKernel:
    """Compile (through the cache) and load ``variant`` for one GPU; memoised per process.

    Called on every launch, so a hit is one dict lookup (no name or macro formatting).
    """
    if (hit := _by_variant.get((variant, device_index))) is None:
        hit = load_source(variant.name, SOURCE, ENTRY, device_index, variant.macros(), variant)
        _by_variant[(variant, device_index)] = hit
    return hit


def load_source(
    label: str,
    source: str,
    entry: str,
    device_index: int,
    macros: tuple[tuple[str, str], ...] = (),
    variant: KernelVariant | None = None,
) -> LoadedKernel:
    """Compile and load entry point ``entry`` of ``kernels/<source>``; memoised per process."""
    key = (label, source, entry, device_index, macros)
    if (hit := _loaded.get(key)) is not None:
        return hit
    with _lock:
        if (hit := _loaded.get(key)) is not None:
            return hit
        from cuda.core import Device, ObjectCode

        device = Device(device_index)
        device.set_current()  # the primary context, which PyTorch uses too
        arch = device_arch(device_index)
        compiled = jit.compile_kernel(source_spec(source, arch, macros, label))
        kernel = ObjectCode.from_cubin(compiled.cubin, name=label).get_kernel(entry)
        loaded = LoadedKernel(variant, device_index, kernel)
        _loaded[key] = loaded
        return loaded


_streams: dict[int, object] = {}


def _stream(handle: int):
    if (hit := _streams.get(handle)) is None:
        from cuda.bindings import driver

        hit = _streams[handle] = driver.CUstream(handle)
    return hit


def launch(loaded: LoadedKernel, grid: int, block: int, stream_handle: int, kinds: tuple[str, ...], args) -> None:
    """Enqueue one launch of ``loaded`` on a raw CUDA stream handle (e.g. PyTorch's current
    stream). ``kinds`` names each parameter's type ("ptr", "u64", "i64", "i32", "f32"), in order.
    A refused launch raises KernelLaunchError with the CUDA error name."""
    from cuda.bindings import driver

    if (packer := loaded.packers.get(kinds)) is None:
        packer = loaded.packers.setdefault(kinds, ArgPacker(kinds))
    with loaded.lock:  # the driver releases the GIL; the shared buffer must not change under it
        packer.pack(args)
        (err,) = driver.cuLaunchKernel(
            loaded.kernel.handle, grid, 1, 1, block, 1, 1, 0, _stream(stream_handle), packer.params, 0
        )
    if err != driver.CUresult.CUDA_SUCCESS:
        name = loaded.variant.name if loaded.variant else "kernel"
        _, err_name = driver.cuGetErrorName(err)
        raise KernelLaunchError(name, err_name.decode() if err_name else str(err), f"cuLaunchKernel returned {err}")
