"""nf4-harness: a fast NF4/FP4 dequantization kernel and the harness that proves and times it."""

from harness.api import dequantize_4bit
from harness.errors import DequantizeInputError, KernelCompileError, KernelLaunchError, ToolchainMissingError

__all__ = [
    "DequantizeInputError",
    "KernelCompileError",
    "KernelLaunchError",
    "ToolchainMissingError",
    "dequantize_4bit",
]
