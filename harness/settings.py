"""Every ``NF4_HARNESS_*`` environment variable, in one place. Each is read when used, never at
import, so a test or a session can set one after the harness is imported.

Standard library only: the noxfile loads this file too, outside any virtualenv.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class SettingError(RuntimeError):
    """A setting holds a value it cannot take. Not a ValueError: no caller may take it for bad
    input and carry on quietly (the bitsandbytes patch falls back on bad input)."""


@dataclass(frozen=True)
class Setting:
    name: str
    default: str | None
    meaning: str
    choices: tuple[str, ...] | None = None

    def get(self) -> str | None:
        value = os.environ.get(self.name, self.default)
        if self.choices is not None and value not in self.choices:
            raise SettingError(f"{self.name} must be one of {self.choices}, got {value!r}")
        return value


CACHE_DIR = Setting("NF4_HARNESS_CACHE_DIR", None, "compiled-kernel cache directory (default: the user cache dir)")
KERNELS_DIR = Setting("NF4_HARNESS_KERNELS_DIR", None, "CUDA sources to compile instead of the package's kernels/")
SEED = Setting("NF4_HARNESS_SEED", None, "the run's random seed; a failure prints the one that replays it")
REQUIRE_GPU = Setting("NF4_HARNESS_REQUIRE_GPU", None, "1: a skipped GPU test fails the run (as --require-gpu)")
GPUS = Setting("NF4_HARNESS_GPUS", None, "how many GPUs nox assumes (default: counted by nvidia-smi)")
WORKER_GPUS = Setting("NF4_HARNESS_WORKER_GPUS", None, "set by nox: the GPUs its pytest-xdist workers pin, one each")
PERF_OUT = Setting("NF4_HARNESS_PERF_OUT", "perf-out", "where the GPU report sessions write their tables and logs")
TORCH_SPEC = Setting("NF4_HARNESS_TORCH_SPEC", "torch", "the PyTorch requirement nox installs where none is present")
TORCH_INDEX = Setting(
    "NF4_HARNESS_TORCH_INDEX",
    None,
    "the index that PyTorch comes from (default: PyTorch's CPU-only index where no GPU is visible, "
    "pip's configured index on a GPU machine; empty: pip's configured index)",
)
HOST_LAUNCHER = Setting(
    "NF4_HARNESS_HOST_LAUNCHER",
    "auto",
    "the drop-in's host path: auto (compiled where a C++ toolchain builds it, else Python with a warning), "
    "compiled (a failed build is an error), python",
    choices=("auto", "compiled", "python"),
)

ALL = (CACHE_DIR, KERNELS_DIR, SEED, REQUIRE_GPU, GPUS, WORKER_GPUS, PERF_OUT, TORCH_SPEC, TORCH_INDEX, HOST_LAUNCHER)
