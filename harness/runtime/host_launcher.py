"""The drop-in's compiled host path (``host_launcher.cpp``): built once per machine with
``torch.utils.cpp_extension``, then bound to this process' CUDA driver and PyTorch.

Why: on an H100 host a drop-in call through Python costs ~16 µs of host time: tensor property
reads, PyTorch's Python allocation path and the cuda-python binding around a ~2 µs driver call.
The compiled path does the same checks, allocation and launch in C++ (kernels/NOTES.md has the
breakdown and the measurements).

It is one interpreter of launch recipes (``recipe``) that names no op: an op binds an entry point
with its ``HostOp`` (its arguments and compiled form), which the entry asks once per call
signature; a call the form declines, or whose tensors are not as the kernels read them, runs the
op's Python path, which owns every error message.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness import settings
from harness.errors import HostLauncherUnavailable
from harness.runtime import jit, launcher, operands, recipe

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


@dataclass(frozen=True)
class HostOp:
    """What the compiled path needs of an op: a name, its entry's arguments in order, and its
    compiled form, ``form(*args) -> recipe.Recipe | None``: the launches of a call whose every
    tensor is as the kernels read it, raising the op's InputError for a bad call and answering None
    for anything its Python path must take (a conversion, a fallback). The form may decide only from
    what a call's signature holds (``recipe``'s docstring)."""

    name: str
    args: tuple[str, ...]
    form: Callable


def configure(
    module,
    op: HostOp,
    form: Callable | None = None,
    *,
    context_of: Callable[[int], int] | None = None,
    launch_kernel=None,
    launch_kernel_ex=None,
    ctx_get_current=None,
    raw_stream=None,
):
    """The module's entry point for ``op``, bound to the driver entry points, PyTorch's stream lookup
    and the op's compiled form (``form`` in its place, and ``context_of(device index)`` for the GPU's
    primary context, where tests run recipes of stand-in plans); it takes tensors of the device type
    the Python path takes (``operands.DEVICE_TYPE``, read now). Tests bind inert driver entry points
    where there is no GPU."""
    import torch

    form = form or op.form
    context_of = context_of or launcher.primary_context

    def compiled(*args):
        r = form(*args)
        return recipe.encoded(r, context_of(r.device) if r is not None and r.launches else 0)

    return module.configure(
        launch_kernel or _driver_entry("cuLaunchKernel"),
        launch_kernel_ex or _driver_entry("cuLaunchKernelEx"),
        ctx_get_current or _driver_entry("cuCtxGetCurrent"),
        raw_stream or torch._C._cuda_getCurrentRawStream,
        subclass_ok,
        compiled,
        len(op.args),
        operands.DEVICE_TYPE,
        recipe.KEY_ALIGN,
        recipe.ALLOC_ALIGN,
    )


def bind(op: HostOp):
    """The compiled entry point of ``op`` ready to call, or None where the Python path is to be used."""
    chosen = mode()
    if chosen == "python":
        return None
    try:
        entry = configure(build(), op)
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
