"""Run-time compilation of ``kernels/*.cu`` with NVRTC (cuda.bindings) and an on-disk cubin cache.

The cache key hashes everything that can change the machine code: the kernel source and every
header it includes (found by scanning ``#include``), the target arch, every NVRTC option and
macro, the NVRTC version and this module's ``CACHE_SCHEMA``. An entry is a ``.cubin`` plus a
``.json`` metadata file written after it (temp file + ``os.replace``, metadata last), so a reader
that finds valid metadata finds a complete cubin. A file lock with a re-check keeps parallel
pytest workers from compiling the same entry twice; an entry whose metadata is unreadable or whose
cubin digest disagrees is rebuilt, never fatal.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness import settings
from harness.errors import KernelCompileError, ToolchainMissingError
from harness.runtime.ptxas_report import KernelResources, parse_ptxas_log

# Bump when the cache layout or anything else outside the key's inputs changes what is stored.
CACHE_SCHEMA = 1
# Architectures the CPU-side compile check covers (Ampere, consumer Ampere, Ada, Hopper).
CHECKED_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")

# NVRTC options every kernel is built with, as NVRTC spells them (they go into the cache key
# verbatim). --fmad=false: no fp32 multiply-add contraction anywhere, since bit-exactness against
# bitsandbytes depends on separately rounded products and sums. -v makes ptxas print its
# resource report (registers, spills, stack, shared memory) into the program log. --no-cache:
# NVRTC 12.9+ keeps its own on-disk cache and, on a hit, returns an empty log (no ptxas report,
# seen with NVRTC 13.0); ours already avoids recompiles, and an option (unlike CUDA_CACHE_DISABLE,
# which NVRTC reads once per process) changes nothing outside this compile.
DEFAULT_OPTIONS: tuple[str, ...] = (
    "--std=c++17",
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
    "--ptxas-options=-v",
    "--no-cache",
)

# Line-bound: \s would span newlines and retry the pattern across the headers' blank lines.
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"\n]+)[>"]', re.MULTILINE)


# Where a wheel puts the CUDA sources, beside the package (pyproject.toml's force-include).
INSTALLED_KERNELS = "nf4-harness-kernels"


# Set by pin_paths: the directories this module keeps whatever the environment says later.
_pinned: dict[str, Path] = {}


def pin_paths() -> None:
    """Fix this module's kernels and cache directories at what they are now: a later change to the
    environment (code of another checkout loaded into the same process, as a perf session's shared
    measuring process does) no longer moves them."""
    _pinned.update(kernels=kernels_dir(), cache=cache_dir())


def kernels_dir() -> Path:
    """Directory holding the CUDA sources: where ``pin_paths`` fixed it; an override; in a source
    checkout (run from the tree or installed editable) its own ``kernels/``; else the copy the wheel
    installed beside the package. A checkout never reads an installed copy, so nothing added beside
    it can stand in for its kernels/."""
    if pinned := _pinned.get("kernels"):
        return pinned
    if env := settings.KERNELS_DIR.get():
        return Path(env)
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file():
        return root / "kernels"
    return root / INSTALLED_KERNELS


def cache_dir() -> Path:
    if pinned := _pinned.get("cache"):
        return pinned
    if env := settings.CACHE_DIR.get():
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("nf4-harness"))


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - exercised only without cuda-python
        raise ToolchainMissingError("cuda.bindings is not installed: pip install cuda-bindings") from exc
    return nvrtc


@functools.cache
def nvrtc_version() -> str:
    try:
        err, major, minor = _nvrtc().nvrtcVersion()
    except ToolchainMissingError:
        raise
    except Exception as exc:  # the library is loaded lazily: any failure means it is not there
        raise ToolchainMissingError(f"NVRTC could not be loaded ({exc}): pip install nvidia-cuda-nvrtc") from exc
    if int(err) != 0:
        raise ToolchainMissingError(f"nvrtcVersion failed ({err}): reinstall nvidia-cuda-nvrtc")
    return f"{major}.{minor}"


@functools.cache
def cuda_include_dir() -> Path:
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError as exc:
        raise ToolchainMissingError("cuda.pathfinder is not installed: pip install cuda-pathfinder") from exc
    found = find_nvidia_header_directory("cudart")
    if not found:
        raise ToolchainMissingError("CUDA runtime headers (cuda_fp16.h) not found: pip install nvidia-cuda-runtime")
    return Path(found)


def _resolve_include(name: str, including: Path, search: list[Path]) -> Path | None:
    for base in (including.parent, *search):
        candidate = base / name
        if candidate.is_file():
            return candidate
    return None


def source_digest(source: Path, search: list[Path]) -> str:
    """SHA-256 over the source and, recursively, every include it resolves to (by content)."""
    digest = hashlib.sha256()
    seen: set[Path] = set()
    stack = [source]
    while stack:
        path = stack.pop()
        if path in seen:
            continue
        seen.add(path)
        text = path.read_bytes()
        content = hashlib.sha256(text).digest()
        digest.update(path.name.encode() + b"\0" + content)
        for name in _includes(content, text):
            if found := _resolve_include(name, path, search):
                stack.append(found.resolve())
    return digest.hexdigest()


_includes_by_content: dict[bytes, list[str]] = {}


def _includes(content: bytes, text: bytes) -> list[str]:
    """The names a file includes, found once per content (its SHA-256): the CUDA headers are read
    for every key, and scanning them is most of a compile-cache hit's time."""
    if (names := _includes_by_content.get(content)) is None:
        names = _includes_by_content[content] = _INCLUDE.findall(text.decode("utf-8", "replace"))
    return names


@dataclass(frozen=True)
class CompileSpec:
    """What to compile and how; ``key`` changes when any input that shapes the cubin changes."""

    source: Path
    arch: str
    macros: tuple[tuple[str, str], ...] = ()
    options: tuple[str, ...] = DEFAULT_OPTIONS
    label: str = "kernel"

    def __post_init__(self):
        if not re.fullmatch(r"sm_\d{2,3}[af]?", self.arch):
            raise ValueError(f"arch must look like sm_90, got {self.arch!r}")

    def key_material(self) -> dict:
        return {
            "schema": CACHE_SCHEMA,
            "source": source_digest(Path(self.source), [cuda_include_dir()]),
            "arch": self.arch,
            "macros": sorted(self.macros),
            "options": list(self.options),
            "nvrtc": nvrtc_version(),
        }

    @property
    def key(self) -> str:
        return _digest(self.key_material())

    def artifact_stem(self, key: str | None = None) -> str:
        """The cache entry's file stem: label, arch and key (pass ``key`` when already computed)."""
        return f"{self.label}-{self.arch}-{(key or self.key)[:20]}"


def _digest(key_material: dict) -> str:
    return hashlib.sha256(json.dumps(key_material, sort_keys=True).encode()).hexdigest()


@dataclass
class CompiledKernel:
    spec_key: str
    cubin: bytes
    resources: list[KernelResources]
    log: str
    path: Path | None = None
    from_cache: bool = False


def _nvrtc_compile(spec: CompileSpec) -> tuple[bytes, str]:
    """One NVRTC compile (cuda.bindings): the cubin and the program log, ptxas report included."""
    nvrtc = _nvrtc()
    source = Path(spec.source)
    options = [
        *spec.options,
        f"--gpu-architecture={spec.arch}",
        f"--include-path={cuda_include_dir()}",
        f"--include-path={source.parent}",
        *(f"-D{k}={v}" for k, v in spec.macros),
    ]
    return _nvrtc_compile_program(nvrtc, spec, source, options)


def _nvrtc_compile_program(nvrtc, spec: CompileSpec, source: Path, options: list[str]) -> tuple[bytes, str]:
    err, prog = nvrtc.nvrtcCreateProgram(source.read_bytes(), source.name.encode(), 0, [], [])
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KernelCompileError(f"nvrtcCreateProgram failed for {spec.label}: {err.name}")
    try:
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log_text = log.decode("utf-8", "replace").rstrip("\0")
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(f"NVRTC failed to compile {spec.label} for {spec.arch} ({result.name})", log_text)
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(f"nvrtcGetCUBIN failed for {spec.label}: {err.name}", log_text)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return cubin, log_text


def atomic_write(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole or stays as it was, whenever the process stops (a unique
    temporary file beside it, renamed over it; removed if the write fails)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_entry(stem_path: Path, key: str) -> CompiledKernel | None:
    meta_path = stem_path.with_suffix(".json")
    cubin_path = stem_path.with_suffix(".cubin")
    try:
        meta = json.loads(meta_path.read_text())
        cubin = cubin_path.read_bytes()
    except (OSError, ValueError):
        return None
    if meta.get("key") != key or meta.get("cubin_sha256") != hashlib.sha256(cubin).hexdigest():
        return None  # stale or torn: rebuild
    try:
        resources = [KernelResources(**r) for r in meta["resources"]]
    except (KeyError, TypeError):
        return None
    return CompiledKernel(key, cubin, resources, meta.get("log", ""), cubin_path, True)


def compile_kernel(spec: CompileSpec, use_cache: bool = True) -> CompiledKernel:
    """Compile ``spec`` to a cubin, through the on-disk cache unless ``use_cache`` is False."""
    material = spec.key_material()  # digests the source and its includes: once per compile
    key = _digest(material)
    if not use_cache:
        cubin, log = _nvrtc_compile(spec)
        return CompiledKernel(key, cubin, parse_ptxas_log(log), log)

    root = cache_dir() / f"nvrtc-{nvrtc_version()}" / spec.arch
    stem_path = root / spec.artifact_stem(key)
    if hit := _read_entry(stem_path, key):
        return hit

    root.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(stem_path.with_suffix(".lock"))):
        if hit := _read_entry(stem_path, key):  # another worker built it while we waited
            return hit
        cubin, log = _nvrtc_compile(spec)
        resources = parse_ptxas_log(log)
        meta = {
            "key": key,
            "key_material": material,
            "label": spec.label,
            "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
            "resources": [r.as_dict() for r in resources],
            "log": log,
        }
        atomic_write(stem_path.with_suffix(".cubin"), cubin)
        atomic_write(stem_path.with_suffix(".json"), json.dumps(meta, indent=1).encode())
    return CompiledKernel(key, cubin, resources, log, stem_path.with_suffix(".cubin"), False)
