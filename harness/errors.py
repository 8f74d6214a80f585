"""Exceptions the harness raises, so callers can tell bad input from a broken toolchain or GPU."""

# Defined beside the settings, which the noxfile loads without the package; raised from here too.
from harness.settings import SettingError  # noqa: F401


class InputError(ValueError):
    """Arguments a drop-in (``dequantize_4bit``, ``matmul_4bit``) does not take; raised before
    anything is launched.

    A ValueError, as bitsandbytes raises for bad block sizes, quant types and dtypes.
    """


# The name it had while dequantization was the only drop-in; kept for code that catches it.
DequantizeInputError = InputError


class ToolchainMissingError(RuntimeError):
    """NVRTC, the CUDA headers or cuda-python itself is not installed; the message names the package."""


class HostLauncherUnavailable(RuntimeError):
    """The compiled host launcher could not be built or bound where the settings require it."""


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel; the message carries NVRTC's log."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(f"{message}\n--- NVRTC log ---\n{log}" if log else message)
        self.log = log


class KernelLaunchError(RuntimeError):
    """The CUDA driver refused or failed a launch; ``cuda_error`` is the CUDA error name."""

    def __init__(self, kernel: str, cuda_error: str, detail: str = ""):
        super().__init__(f"launch of {kernel} failed with {cuda_error}" + (f": {detail}" if detail else ""))
        self.kernel = kernel
        self.cuda_error = cuda_error
