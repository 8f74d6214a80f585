"""nf4-harness: fast NF4/FP4 kernels (dequantization, fused matmul) and the harness that proves and times them.

Attributes load lazily so the compile layer (``harness.runtime.jit``) works without PyTorch installed.
"""

from harness.errors import (
    DequantizeInputError,
    HostLauncherUnavailable,
    InputError,
    KernelCompileError,
    KernelLaunchError,
    SettingError,
    ToolchainMissingError,
)

__all__ = [
    "DequantizeInputError",
    "HostLauncherUnavailable",
    "InputError",
    "KernelCompileError",
    "KernelLaunchError",
    "SettingError",
    "ToolchainMissingError",
    "bitsandbytes_patched",
    "dequantize_4bit",
    "matmul_4bit",
    "patch_bitsandbytes",
    "unpatch_bitsandbytes",
]

_PATCH_NAMES = ("bitsandbytes_patched", "patch_bitsandbytes", "unpatch_bitsandbytes")


def __getattr__(name):
    if name == "dequantize_4bit":
        from harness.runtime.api import dequantize_4bit

        return dequantize_4bit
    if name == "matmul_4bit":
        from harness.runtime.api import matmul_4bit

        return matmul_4bit
    if name in _PATCH_NAMES:
        from harness.runtime import patch

        return getattr(patch, name)
    raise AttributeError(f"module 'harness' has no attribute {name!r}")
