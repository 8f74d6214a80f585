"""Load compiled variants onto a GPU and launch them on PyTorch's current stream (cuda.core)."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np

from harness import jit
from harness.errors import KernelLaunchError
from harness.ptxas_report import KernelResources
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


@dataclass(frozen=True)
class LoadedKernel:
    variant: KernelVariant | None
    device_index: int
    arch: str
    kernel: object  # cuda.core Kernel
    resources: tuple[KernelResources, ...]
    sm_count: int


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
        loaded = LoadedKernel(
            variant, device_index, arch, kernel, tuple(compiled.resources), device.properties.multiprocessor_count
        )
        _loaded[key] = loaded
        return loaded


def _error_name(exc: BaseException) -> str:
    """The CUDA error name (CUDA_ERROR_...) cuda.core put in its message, else the exception type."""
    text = str(exc)
    for token in text.replace(":", " ").replace(",", " ").split():
        if token.startswith(("CUDA_ERROR_", "cudaError")):
            return token.strip("()'\"")
    return type(exc).__name__


@functools.cache
def _launch_config(grid: int, block: int):
    from cuda.core import LaunchConfig

    return LaunchConfig(grid=grid, block=block)


_streams: dict[int, object] = {}


def stream_for(handle: int):
    """A cuda.core Stream borrowing a raw CUDA stream handle (e.g. ``torch.cuda.Stream.cuda_stream``)."""
    if (hit := _streams.get(handle)) is None:
        from cuda.core import Stream

        hit = _streams[handle] = Stream.from_handle(handle)
    return hit


def launch(loaded: LoadedKernel, grid: int, block: int, stream_handle: int, args: tuple) -> None:
    """Enqueue one launch on a raw stream handle; a refused launch raises KernelLaunchError
    with the CUDA error name."""
    from cuda.core import launch as cu_launch

    try:
        cu_launch(stream_for(stream_handle), _launch_config(grid, block), loaded.kernel, *args)
    except Exception as exc:
        name = loaded.variant.name if loaded.variant else "kernel"
        raise KernelLaunchError(name, _error_name(exc), str(exc)) from exc


def pointer(value: int) -> np.uint64:
    return np.uint64(value)
