"""Who measured: the GPU's identity and settings read through NVML (``pynvml``, nvidia-ml-py),
plus the software versions that shape the numbers. Without NVML (a CPU box) it says so."""

from __future__ import annotations

import functools
import os
import re
from importlib import metadata


def installed_version(dist: str) -> str | None:
    """Version of an installed distribution, or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def software_versions() -> dict:
    info = {
        name: installed_version(name)
        for name in ("torch", "bitsandbytes", "cuda-core", "cuda-bindings", "nvidia-ml-py")
    }
    try:
        from harness.runtime.jit import nvrtc_version

        info["nvrtc"] = nvrtc_version()
    except Exception as exc:  # a CPU box without NVRTC still gets its machine info
        info["nvrtc"] = f"unavailable: {exc}"
    return info


def slug(name: str) -> str:
    """File-name form of an NVML GPU name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _call(fn, *args):
    try:
        return fn(*args)
    except Exception:  # NVML_ERROR_NOT_SUPPORTED and friends: the field is simply unknown
        return None


def nvml_device(cuda_index: int = 0) -> int | str:
    """NVML's name for CUDA device ``cuda_index`` of this process: CUDA numbers the GPUs that
    ``CUDA_VISIBLE_DEVICES`` leaves visible, NVML all of them (an index, or a UUID if given so)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return cuda_index
    entry = visible[cuda_index]
    return int(entry) if entry.isdigit() else entry


def _handle(pynvml, device: int | str):
    if isinstance(device, str):
        return pynvml.nvmlDeviceGetHandleByUUID(device)
    return pynvml.nvmlDeviceGetHandleByIndex(device)


@functools.cache
def gpu_identity(index: int | str = 0) -> dict:
    """NVML facts about NVML device ``index`` (see ``nvml_device``); ``{"nvml": "unavailable: ..."}``
    where NVML is missing."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:
        return {"nvml": f"unavailable: {exc}"}
    h = _handle(pynvml, index)
    text = lambda v: v.decode() if isinstance(v, bytes) else v  # noqa: E731 - older bindings return bytes
    bus_width = _call(pynvml.nvmlDeviceGetMemoryBusWidth, h)
    mem_clock = _call(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_MEM)
    cc = _call(pynvml.nvmlDeviceGetCudaComputeCapability, h)
    ecc = _call(pynvml.nvmlDeviceGetEccMode, h)
    mig = _call(pynvml.nvmlDeviceGetMigMode, h)
    power = _call(pynvml.nvmlDeviceGetPowerManagementLimit, h)
    cuda_driver = _call(pynvml.nvmlSystemGetCudaDriverVersion)
    name = text(pynvml.nvmlDeviceGetName(h))
    return {
        "nvml": "ok",
        "name": name,
        "slug": slug(name),
        "uuid": text(_call(pynvml.nvmlDeviceGetUUID, h)),
        "pci_bus_id": text(_call(lambda: pynvml.nvmlDeviceGetPciInfo(h).busId)),
        "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
        "driver": text(_call(pynvml.nvmlSystemGetDriverVersion)),
        "cuda_driver": f"{cuda_driver // 1000}.{cuda_driver % 1000 // 10}" if cuda_driver else None,
        "memory_bus_width_bits": bus_width,
        "max_memory_clock_mhz": mem_clock,
        # DDR: two transfers per clock.
        "theoretical_gbps": bus_width * mem_clock * 2 / 8 / 1000 if bus_width and mem_clock else None,
        "max_sm_clock_mhz": _call(pynvml.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_SM),
        "default_sm_clock_mhz": _call(pynvml.nvmlDeviceGetDefaultApplicationsClock, h, pynvml.NVML_CLOCK_SM),
        "power_limit_w": power / 1000 if power else None,
        "ecc": bool(ecc[0]) if ecc else None,
        "mig": bool(mig[0]) if mig else None,
        "persistence": bool(_call(pynvml.nvmlDeviceGetPersistenceMode, h)),
    }


def sm_clock_reader(index: int | str = 0):
    """A callable returning (current SM MHz, default SM MHz) through NVML, or (None, None)."""
    ident = gpu_identity(index)
    if ident.get("nvml") != "ok":
        return lambda: (None, None)
    import pynvml

    h = _handle(pynvml, index)
    default = ident["default_sm_clock_mhz"]
    return lambda: (_call(pynvml.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM), default)


def machine_info(index: int | str = 0) -> dict:
    """What the benchmark JSON's machine_info gets: GPU identity plus software versions."""
    return {"gpu": gpu_identity(index), "software": software_versions()}
