"""Load any kernel of ``kernels/*.cu`` onto a GPU (cuda.core) and launch it on a raw stream handle.

Generic: a kernel is named by its source, entry point, macros and parameter kinds; nothing here
knows what a kernel computes (``dequantize_kernel`` owns that for the dequantization kernel).

Launches go straight to ``cuLaunchKernel`` (cuda.bindings; ``cuLaunchKernelEx`` for a grid of
clusters) with the arguments packed by a precompiled ``struct`` layout into one reusable buffer:
measured on an H100 host, building numpy scalars and cuda.core's per-call argument holder cost more
than the driver call itself, and the drop-in API's budget is a few microseconds per call.
"""

from __future__ import annotations

import contextlib
import functools
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from harness.errors import KernelLaunchError
from harness.runtime import jit


def device_arch(device_index: int) -> str:
    """``sm_XY`` of a visible GPU, read from the device itself."""
    from cuda.core import Device

    major, minor = Device(device_index).compute_capability
    return f"sm_{major}{minor}"


def source_spec(source: str, arch: str, macros: tuple[tuple[str, str], ...], label: str) -> jit.CompileSpec:
    """The compile spec of ``kernels/<source>`` for one arch."""
    return jit.CompileSpec(source=jit.kernels_dir() / source, arch=arch, macros=macros, label=label)


# struct codes of the kernel parameter kinds; each parameter gets its own 8-byte slot.
_SLOT = {"ptr": "Q", "u64": "Q", "i64": "q", "i32": "i4x", "f32": "f4x"}


class ArgPacker:
    """Packs one launch's arguments into a fixed buffer whose slot addresses form the
    ``kernelParams`` array cuLaunchKernel reads (it copies them before returning)."""

    def __init__(self, kinds: tuple[str, ...]):
        self.kinds = tuple(kinds)
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
    """One entry point loaded into one GPU's primary context, with its argument buffer."""

    label: str
    device_index: int
    kernel: object  # cuda.core Kernel
    packer: ArgPacker = field(compare=False, repr=False)
    handle: object = field(compare=False, repr=False)  # the driver's handle, read once
    shared_bytes: int = 0  # dynamic shared memory every launch passes
    # Keeps the shared argument buffer unchanged while the driver (which releases the GIL) reads it.
    lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)


_lock = threading.Lock()
_loaded: dict[tuple, LoadedKernel] = {}


def load(
    label: str,
    source: str,
    entry: str,
    device_index: int,
    kinds: tuple[str, ...],
    macros: tuple[tuple[str, str], ...] = (),
) -> LoadedKernel:
    """Compile (through the cache) and load entry point ``entry`` of ``kernels/<source>``, whose
    parameters have the types ``kinds`` ("ptr", "u64", "i64", "i32", "f32", in order), for one
    GPU; memoised per process."""
    return load_spec(
        label, functools.partial(source_spec, source, macros=macros, label=label), entry, device_index, kinds
    )


def load_spec(
    label: str,
    spec_of: Callable[[str], jit.CompileSpec],
    entry: str,
    device_index: int,
    kinds: tuple[str, ...],
    shared_bytes: int = 0,
) -> LoadedKernel:
    """``load`` for a kernel whose compile spec depends on the GPU: ``spec_of(arch)`` gives it for
    the GPU's ``sm_XY``; ``label`` names one kernel (memoised per label, entry and GPU)."""
    key = (label, entry, device_index, kinds)
    if (hit := _loaded.get(key)) is not None:
        return hit
    with _lock:
        if (hit := _loaded.get(key)) is not None:
            return hit
        from cuda.core import ObjectCode

        with device_context(device_index):
            compiled = jit.compile_kernel(spec_of(device_arch(device_index)))
            kernel = ObjectCode.from_cubin(compiled.cubin, name=label).get_kernel(entry)
            if shared_bytes:
                _allow_dynamic_shared(kernel.handle, device_index, shared_bytes, label)
        loaded = _loaded[key] = LoadedKernel(label, device_index, kernel, ArgPacker(kinds), kernel.handle, shared_bytes)
        return loaded


def _allow_dynamic_shared(handle, device_index: int, shared_bytes: int, label: str) -> None:
    """Let ``handle`` take ``shared_bytes`` of dynamic shared memory on GPU ``device_index`` (past 48 KB
    the driver needs the leave; a library-loaded kernel takes it per device)."""
    driver = _driver or _bind_driver()
    err, device = driver.cuDeviceGet(device_index)
    if not err:
        attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        (err,) = driver.cuKernelSetAttribute(attribute, shared_bytes, handle, device)
    if err:
        raise launch_error(label, err)


@contextlib.contextmanager
def device_context(device_index: int):
    """GPU ``device_index``'s primary context (the one PyTorch uses) current on this thread inside,
    the thread's own after: what loading a kernel and asking the driver about it (occupancy,
    clusters at once) need, from any thread, whatever context it has or lacks."""
    from cuda.core import Device

    with _current_context_kept():
        Device(device_index).set_current()
        yield


@contextlib.contextmanager
def _current_context_kept():
    """Give the calling thread back the CUDA context it had: loading a kernel for another GPU
    must not move the caller's current device (PyTorch reads it from the current context)."""
    driver = _driver or _bind_driver()
    err, previous = driver.cuCtxGetCurrent()
    if err:
        raise RuntimeError(f"cuCtxGetCurrent failed: {_error_name(err)}")
    try:
        yield
    finally:
        (err,) = driver.cuCtxSetCurrent(previous)
        if err:
            raise RuntimeError(f"cuCtxSetCurrent could not restore the caller's context: {_error_name(err)}")


# Per call, everything below is a lookup: an import statement in the launch path measured 0.5 µs
# (a bare launch is about 4 µs on an H100 host), so the driver module is bound once.
_streams: dict[int, object] = {}
_driver = None


def _bind_driver():
    global _driver
    from cuda.bindings import driver

    _driver = driver
    return driver


_contexts: dict[int, int] = {}


def primary_context(device_index: int) -> int:
    """The handle of a GPU's primary context (the one PyTorch and ``load`` use), retained for the
    life of the process."""
    if (ctx := _contexts.get(device_index)) is None:
        driver = _driver or _bind_driver()
        err, device = driver.cuDeviceGet(device_index)
        if not err:
            err, handle = driver.cuDevicePrimaryCtxRetain(device)
        if err:
            raise RuntimeError(f"GPU {device_index} has no primary context: {_error_name(err)}")
        ctx = _contexts.setdefault(device_index, int(handle))
    return ctx


def _error_name(err) -> str:
    driver = _driver or _bind_driver()
    _, name = driver.cuGetErrorName(driver.CUresult(int(err)))
    return name.decode() if name else str(err)


def launch_error(label: str, err) -> KernelLaunchError:
    """The exception for a launch the driver refused with CUresult ``err``."""
    return KernelLaunchError(label, _error_name(err), f"the launch returned {int(err)}")


def launch(
    loaded: LoadedKernel, grid: int | tuple[int, int, int], block: int, stream_handle: int, args, cluster_y: int = 1
) -> None:
    """Enqueue one launch of ``loaded`` with ``args`` (in the order of its parameter kinds) on a
    raw CUDA stream handle (e.g. PyTorch's current stream); ``grid`` is a block count or (x, y, z);
    ``cluster_y`` > 1 runs the blocks as thread block clusters of (1, cluster_y, 1) (sm_90 on).
    A refused launch raises KernelLaunchError with the CUDA error name."""
    driver = _driver or _bind_driver()
    if (stream := _streams.get(stream_handle)) is None:
        stream = _streams[stream_handle] = driver.CUstream(stream_handle)
    gx, gy, gz = grid if grid.__class__ is tuple else (grid, 1, 1)
    packer = loaded.packer
    with loaded.lock:
        packer.pack(args)
        if cluster_y == 1:
            (err,) = driver.cuLaunchKernel(
                loaded.handle, gx, gy, gz, block, 1, 1, loaded.shared_bytes, stream, packer.params, 0
            )
        else:
            config = cluster_launch_config(
                driver, (gx, gy, gz), block, stream_handle, stream, cluster_y, loaded.shared_bytes
            )
            (err,) = driver.cuLaunchKernelEx(config, loaded.handle, packer.params, 0)
    if err:  # CUresult is an int enum: CUDA_SUCCESS is 0
        raise launch_error(loaded.label, err)


# cuLaunchKernelEx's configurations by (grid, block, stream handle, cluster): building one is a
# dozen binding calls (an attribute, a config, their fields) every clustered launch paid. The driver
# only reads a config, so threads share them. The keys a model uses are few (its weight shapes
# times its token counts); past the bound the cache starts over.
_cluster_configs: dict[tuple, object] = {}
_CLUSTER_CONFIGS_KEPT = 1024


def cluster_launch_config(
    driver, grid: tuple[int, int, int], block: int, stream_handle: int, stream, cluster_y: int, shared_bytes: int = 0
):
    """The configuration of a launch of ``grid`` as (1, cluster_y, 1) clusters on ``stream``
    (the CUstream of ``stream_handle``), built once per key."""
    key = (*grid, block, stream_handle, cluster_y, shared_bytes)
    if (config := _cluster_configs.get(key)) is None:
        if len(_cluster_configs) >= _CLUSTER_CONFIGS_KEPT:
            _cluster_configs.clear()
        config = _cluster_configs[key] = _cluster_config(driver, *grid, block, stream, cluster_y, shared_bytes)
    return config


def max_clusters(loaded: LoadedKernel, block: int, cluster: tuple[int, int, int]) -> int:
    """Clusters of ``cluster`` blocks of ``loaded`` the GPU holds at once (0: none; sm_90 on)."""
    driver = _driver or _bind_driver()
    config = _cluster_config(driver, *cluster, block, None, cluster[1], loaded.shared_bytes)
    # The binding takes a CUfunction here; a loaded CUkernel is one to the driver.
    err, count = driver.cuOccupancyMaxActiveClusters(driver.CUfunction(int(loaded.handle)), config)
    return 0 if err else int(count)


def allow_nonportable_clusters(loaded: LoadedKernel) -> bool:
    """Let ``loaded`` run as clusters of more than the portable 8 blocks (sm_90 on: an H100 holds
    clusters of up to 16). Whether the driver took it: where it did not, ``max_clusters`` reads 0
    for those sizes, so no grid asks for them."""
    driver = _driver or _bind_driver()
    err, device = driver.cuDeviceGet(loaded.device_index)
    if not err:
        # A library-loaded kernel takes its attributes per device (cuFuncSetAttribute refuses it).
        attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
        (err,) = driver.cuKernelSetAttribute(attribute, 1, loaded.handle, device)
    return not err


def _cluster_config(driver, gx: int, gy: int, gz: int, block: int, stream, cluster_y: int, shared_bytes: int = 0):
    """cuLaunchKernelEx's configuration for a grid of (1, cluster_y, 1) clusters."""
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attribute.value.clusterDim.x, attribute.value.clusterDim.y, attribute.value.clusterDim.z = 1, cluster_y, 1
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
    config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
    config.sharedMemBytes = shared_bytes
    if stream is not None:
        config.hStream = stream
    config.attrs, config.numAttrs = [attribute], 1
    return config


# -- PyTorch's current stream, with the GPU's context current ---------------------------------------
@functools.cache
def _torch_hooks():
    """(current device, raw current-stream handle, torch) bound once: PyTorch's raw calls without
    building Stream objects or re-checking lazy init (what Triton's launcher uses), the public
    calls as the fallback."""
    import torch

    current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    stream = raw or (lambda index: torch.cuda.current_stream(index).cuda_stream)
    return current_device, stream, torch


_bound = threading.local()  # device indexes whose primary context this thread has made current


def on_gpu(device_index: int, launch: Callable[[int], None]) -> None:
    """Call ``launch(stream)`` with PyTorch's current stream of GPU ``device_index`` while that
    GPU's primary context (the one kernels are loaded into) is current on this thread; the
    caller's current device is the same after."""
    current_device, stream, torch = _torch_hooks()
    if device_index != current_device():
        with torch.cuda.device(device_index):
            launch(stream(device_index))
        return
    bound = getattr(_bound, "devices", None)
    if bound is None or device_index not in bound:
        # A thread that has not used CUDA yet may have no current context, though PyTorch calls
        # device 0 current; its device switch makes the primary context current.
        torch.cuda.set_device(device_index)
        _bound.devices = (bound or frozenset()) | {device_index}
    launch(stream(device_index))
