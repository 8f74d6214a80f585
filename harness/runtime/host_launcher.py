"""The drop-in's compiled host path (``host_launcher.cpp``): built once per machine with
``torch.utils.cpp_extension``, then bound to this process' CUDA driver and PyTorch.

Why: on an H100 host a drop-in call through Python costs ~16 µs of host time: tensor property
reads, PyTorch's Python allocation path and the cuda-python binding around a ~2 µs driver call.
The compiled path does the same checks, allocation and launch in C++ (kernels/NOTES.md has the
breakdown and the measurements).

It takes a call only when every tensor is already in the form the kernel reads; for anything
else it answers None and ``api`` runs the Python path, which owns every error message. It knows
no facts of its own: the quant types, output dtypes, block sizes, tiling threshold and plans
come from ``dequantize_kernel`` through :func:`configure`.

``NF4_HARNESS_HOST_LAUNCHER`` picks what happens: ``auto`` (default) builds it and falls back to
the Python path with a warning where it cannot be built (no C++ compiler, no Python headers);
``compiled`` makes that an error (the GPU sessions use it, so a missing toolchain is never a
silent slowdown); ``python`` never builds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import warnings
from pathlib import Path

from harness import settings
from harness.errors import HostLauncherUnavailable
from harness.runtime import dequantize_kernel, jit, launcher, operands

SOURCE = Path(__file__).with_name("host_launcher.cpp")
MODULE_NAME = "nf4_harness_host"
MODES = settings.HOST_LAUNCHER.choices
# -Wall: a failed build's log (which cpp_extension's error carries) shows every warning too.
CFLAGS = ("-O2", "-Wall")


def mode() -> str:
    """The chosen mode; a value outside MODES raises SettingError (never a silent fallback)."""
    return settings.HOST_LAUNCHER.get()


def build_dir() -> Path:
    """Where this source is built for this PyTorch and this Python: a build for another one is
    another directory, never overwritten (the C++ ABI of both is part of the binary)."""
    import torch

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    python = f"{sys.implementation.cache_tag}{sysconfig.get_config_var('abiflags') or ''}"
    return jit.cache_dir() / "host" / f"{MODULE_NAME}-torch{torch.__version__}-{python}-{digest}"


def build():
    """Import the module, compiling it first where its build directory holds none (once per
    machine; parallel processes wait on one lock)."""
    import filelock
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(directory / "build.lock")), _ninja_on_path():
        # The directory's name is a digest of the source, its flags, PyTorch's version and Python's
        # ABI, so a library in it was built from exactly this source: import it without running the
        # build, whose ninja file names the source's path and would build again for every checkout
        # (or copy of the cache) at another path.
        built = _import_built(directory)
        if built is not None:
            return built
        # cpp_extension's own lock is a plain file a killed build leaves behind, and then every later
        # load waits forever; while we hold ours, no other build of this directory is running.
        (directory / "lock").unlink(missing_ok=True)
        return cpp_extension.load(
            name=MODULE_NAME,
            sources=[str(SOURCE)],
            extra_cflags=list(CFLAGS),
            build_directory=str(directory),
            with_cuda=False,
            verbose=False,
        )


def _import_built(directory: Path):
    """The module from a library a finished build left in ``directory``; None where there is none
    (or it does not load: a build killed while linking leaves a broken one, built again)."""
    library = directory / f"{MODULE_NAME}.so"
    if not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location(MODULE_NAME, library)
    try:
        module = importlib.util.module_from_spec(spec)  # loads the library
        spec.loader.exec_module(module)
    except ImportError:
        return None
    return module


@contextlib.contextmanager
def _ninja_on_path():
    """cpp_extension runs ``ninja`` from PATH; a virtualenv used without activating it has the ninja
    wheel's binary but not on PATH, so it is added for the build and taken away after."""
    if shutil.which("ninja"):
        yield
        return
    try:
        import ninja
    except ImportError:
        yield  # cpp_extension then says that ninja is missing
        return
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, saved])
    try:
        yield
    finally:
        os.environ["PATH"] = saved


def _driver_entry(name: str) -> int:
    """The address of a driver entry point, with legacy default-stream semantics (PyTorch's stream 0)."""
    from cuda.bindings import driver

    flags = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM
    # 12000: the ABI of these entry points has not changed since CUDA 4; any driver this runs on is newer.
    err, address, status = driver.cuGetProcAddress(name.encode(), 12000, flags)
    if err or not address or status != driver.CUdriverProcAddressQueryResult.CU_GET_PROC_ADDRESS_SUCCESS:
        raise HostLauncherUnavailable(f"the driver has no {name} ({err}, {status})")
    return int(address)


def _resolve_plan(quant: int, dtype: int, nested: int, tiling: int, device: int) -> tuple[int, ...]:
    """What the compiled path needs of one plan, loading it on first use."""
    p = dequantize_kernel.plan_tiled(
        dequantize_kernel.QUANT_TYPES[quant],
        dequantize_kernel.OUT_DTYPES[dtype],
        bool(nested),
        dequantize_kernel.TILINGS[tiling],
        device,
    )
    return (int(p.kernel.handle), launcher.primary_context(device), *plan_geometry(p.geometry))


def plan_geometry(g: dequantize_kernel.Geometry) -> tuple[int, int, int, int]:
    """A plan's geometry as the compiled path reads it: threads, tile, packed and output alignment."""
    return g.threads, g.tile_elems, g.packed_align, dequantize_kernel.OUT_ALIGN


def subclass_ok(cls: type) -> bool:
    """May the compiled path read a Tensor subclass directly? Only where reading it through Python
    would do the same: the subclass keeps PyTorch's own __torch_function__ and __torch_dispatch__."""
    import torch

    def underlying(attr):
        return getattr(attr, "__func__", attr)

    function = underlying(getattr(cls, "__torch_function__", None))
    dispatch = underlying(getattr(cls, "__torch_dispatch__", None))
    return function in (underlying(torch.Tensor.__torch_function__), torch._C._disabled_torch_function_impl) and (
        dispatch is underlying(torch.Tensor.__torch_dispatch__)
    )


# The entry point's tensor arguments, in the order host_launcher.cpp takes them (checked at bind).
ENTRY_ARGS = ("A", "absmax", "code2", "absmax2", "offset", "out")


def configure(
    module,
    resolve_plan=_resolve_plan,
    *,
    launch_kernel=None,
    ctx_get_current=None,
    raw_stream=None,
    devices=None,
):
    """The module's dequantize entry point bound to the driver entry points, PyTorch's stream
    lookup, the operand rules and the kernel's facts (each bound entry point has its own plans),
    taking tensors of the device type the Python path takes (``operands.DEVICE_TYPE``, read
    now). Tests replace the plan resolver, or bind inert driver entry points where there is no GPU."""
    import torch

    from harness.runtime.dtypes import DTYPES

    if module.entry_args()[: len(ENTRY_ARGS)] != ENTRY_ARGS:
        raise HostLauncherUnavailable(f"host_launcher.cpp takes {module.entry_args()}, expected {ENTRY_ARGS} first")

    def rules(*table):
        return operands.encoded(table, ENTRY_ARGS, dequantize_kernel.QUANTITIES)

    return module.configure(
        launch_kernel or _driver_entry("cuLaunchKernel"),
        ctx_get_current or _driver_entry("cuCtxGetCurrent"),
        raw_stream or torch._C._cuda_getCurrentRawStream,
        resolve_plan,
        subclass_ok,
        dequantize_kernel.QUANT_TYPES,
        tuple(DTYPES[name] for name in dequantize_kernel.OUT_DTYPES),
        dequantize_kernel.BLOCKSIZES,
        dequantize_kernel.LARGE_MIN_ELEMENTS,
        dequantize_kernel.MAX_GRID,
        torch.cuda.device_count() if devices is None else devices,
        dequantize_kernel.QUANTITIES,
        rules(*dequantize_kernel.PLAIN_OPERANDS),
        rules(*dequantize_kernel.NESTED_OPERANDS),
        *rules(dequantize_kernel.OFFSET, dequantize_kernel.OUTPUT),
        operands.DEVICE_TYPE,
    )


# The matmul entry point's arguments, in the order host_launcher.cpp takes them (checked at bind).
MATMUL_ARGS = (
    "A", "W", "absmax", "code2", "absmax2", "offset", "bias", "out", "shape", "blocksize", "blocksize2", "quant_type",
    "max_rows",
)  # fmt: skip


def configure_matmul(module, dequantize_entry, resolve_plan=None, *, crossover, launch_kernel_ex=None):
    """The module's fused-matmul entry point beside a ``configure``d dequantize entry, whose driver
    entry points, stream lookup and weight rules it shares (and ``cuLaunchKernelEx``, for grids of
    clusters): the plans, grids, dtypes, token tiles and shape rules come from ``matmul_kernel``;
    ``crossover(device index)`` gives a GPU's crossover table (``matmul.crossover_table``), read
    once: the most rows it fuses by weight size where the caller names none. Tests replace the plan
    resolver, and bind an inert launch entry point, where there is no GPU."""
    from harness.runtime import matmul_kernel
    from harness.runtime.dtypes import DTYPES

    if module.matmul_args() != MATMUL_ARGS:
        raise HostLauncherUnavailable(f"host_launcher.cpp's matmul takes {module.matmul_args()}, not {MATMUL_ARGS}")
    return module.configure_matmul(
        dequantize_entry,
        resolve_plan or matmul_kernel.host_plan,
        matmul_kernel.host_grid,
        crossover,
        tuple(DTYPES[name] for name in matmul_kernel.DTYPES),
        matmul_kernel.TOKEN_TILES,
        matmul_kernel.K_MULTIPLE,
        matmul_kernel.ALIGN,
        launch_kernel_ex or _driver_entry("cuLaunchKernelEx"),
    )


def bind_matmul(dequantize_entry, crossover):
    """The compiled matmul entry beside a bound dequantize entry (``bind``'s): the module is built by then."""
    return configure_matmul(build(), dequantize_entry, crossover=crossover)


def bind():
    """The compiled entry point ready to call, or None where the Python path is to be used."""
    chosen = mode()
    if chosen == "python":
        return None
    try:
        entry = configure(build())
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if chosen == "compiled":
            raise HostLauncherUnavailable(
                f"the compiled host launcher could not be built or bound ({reason}); "
                f"{settings.HOST_LAUNCHER.name}=compiled requires it"
            ) from exc
        warnings.warn(
            f"nf4-harness: the compiled host launcher is unavailable ({reason}); using the Python path, "
            f"which costs several times the host time per call. {settings.HOST_LAUNCHER.name}=python "
            "skips the attempt.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return entry
