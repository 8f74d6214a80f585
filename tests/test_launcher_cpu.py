"""The launch path's CPU-side pieces: argument packing, the clustered launches' configurations,
the kernel signature it packs for, and the size-based tiling choice. No GPU needed."""

from __future__ import annotations

import itertools
import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from harness.runtime import jit
from harness.runtime.dequantize_kernel import (
    KERNEL_PARAMS,
    LARGE_MIN_ELEMENTS,
    LARGE_TILING,
    OUT_DTYPES,
    QUANT_TYPES,
    SMALL_TILING,
    SOURCE,
    KernelArgs,
    KernelVariant,
    all_variants,
    tiling_for,
)
from harness.runtime.launcher import ArgPacker


def _slot(packer: ArgPacker, i: int) -> bytes:
    return packer._buf.tobytes()[8 * i : 8 * i + 8]


def test_each_argument_lands_in_its_own_slot_little_endian():
    kinds = ("ptr", "u64", "i64", "i32", "f32", "ptr")
    packer = ArgPacker(kinds)
    packer.pack((0x7F00_DEAD_BEEF, 2**64 - 1, -5, -7, 1.5, 0))
    assert _slot(packer, 0) == (0x7F00_DEAD_BEEF).to_bytes(8, "little")
    assert _slot(packer, 1) == b"\xff" * 8
    assert _slot(packer, 2) == (-5).to_bytes(8, "little", signed=True)
    assert _slot(packer, 3)[:4] == (-7).to_bytes(4, "little", signed=True)
    assert _slot(packer, 4)[:4] == struct.pack("<f", 1.5)
    assert _slot(packer, 5) == bytes(8)


def test_params_array_points_at_the_slots():
    packer = ArgPacker(KERNEL_PARAMS)
    base = packer._buf.__array_interface__["data"][0]
    slots = np.frombuffer(packer._slots.tobytes(), dtype=np.uint64)
    assert packer.params == packer._slots.__array_interface__["data"][0]
    assert slots.tolist() == [base + 8 * i for i in range(len(KERNEL_PARAMS))]


def test_a_cluster_launch_config_is_reused_only_for_its_own_grid_block_stream_and_cluster():
    from harness.runtime import launcher

    driver = launcher._bind_driver()
    streams = {h: driver.CUstream(h) for h in (0, 0x1234)}

    def config(grid=(4, 8, 1), block=128, handle=0, cluster_y=2):
        return launcher.cluster_launch_config(driver, grid, block, handle, streams[handle], cluster_y)

    def fields(c):
        dims = c.attrs[0].value.clusterDim
        return (c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, int(c.hStream), (dims.x, dims.y, dims.z))

    first = config()
    assert config() is first
    assert fields(first) == (4, 8, 1, 128, 0, (1, 2, 1))
    others = {
        (4, 8, 2, 128, 0, (1, 2, 1)): config(grid=(4, 8, 2)),
        (4, 8, 1, 256, 0, (1, 2, 1)): config(block=256),
        (4, 8, 1, 128, 0x1234, (1, 2, 1)): config(handle=0x1234),
        (4, 8, 1, 128, 0, (1, 4, 1)): config(cluster_y=4),
    }
    for expected, other in others.items():
        assert other is not first and fields(other) == expected


def test_out_of_range_values_are_refused_not_truncated():
    packer = ArgPacker(("i32",))
    with pytest.raises(struct.error):
        packer.pack((2**31,))


_C_KIND = {
    "i64": "i64",
    "int": "i32",
    "float": "f32",
    "unsigned long long": "u64",
}


def _kinds_of(signature: str) -> tuple[str, ...]:
    kinds = []
    for param in signature.split(","):
        param = re.sub(r"\b(const|__restrict__)\b", " ", param).strip()
        ctype = " ".join(param.split()[:-1]).replace(" *", "*")
        kinds.append("ptr" if "*" in param else _C_KIND[ctype])
    return tuple(kinds)


def test_kernel_params_match_the_kernel_signature():
    source = (jit.kernels_dir() / SOURCE).read_text()
    match = re.search(r"dequantize_4bit_kernel\(([^)]*)\)", source)
    assert match, "entry point not found"
    assert _kinds_of(match.group(1)) == KERNEL_PARAMS
    names = [re.findall(r"\w+", p)[-1] for p in match.group(1).split(",")]
    assert len(KernelArgs._fields) == len(names), (KernelArgs._fields, names)


def test_matmul_params_match_the_one_parameter_list_every_fused_kernel_takes():
    from harness.runtime import matmul_kernel

    common = (jit.kernels_dir() / "matmul_4bit_common.cuh").read_text()
    match = re.search(r"#define MM_MAIN_PARAMS\s*\\\n(.*?)\n\n", common, re.DOTALL)
    assert match, "MM_MAIN_PARAMS not found"
    assert _kinds_of(match.group(1).replace("\\", " ")) == matmul_kernel.MAIN_PARAMS
    for source in (
        matmul_kernel.SOURCE_M8,
        matmul_kernel.SOURCE_M8_PAIRS,
        matmul_kernel.SOURCE_WIDE,
        matmul_kernel.SOURCE_SM90,
    ):
        text = (jit.kernels_dir() / source).read_text()
        assert re.findall(r"matmul_4bit_kernel\(([^)]*)\)", text) == ["MM_MAIN_PARAMS"], source


def test_blocker_params_match_the_blocker_signature():
    from harness.perf.gpu_timer import BLOCKER_PARAMS

    source = (jit.kernels_dir() / "block_stream.cu").read_text()
    match = re.search(r"block_stream\(([^)]*)\)", source)
    assert _kinds_of(match.group(1)) == BLOCKER_PARAMS


def test_tiling_switches_at_the_measured_crossover():
    assert tiling_for(0) == tiling_for(LARGE_MIN_ELEMENTS - 1) == SMALL_TILING
    assert tiling_for(LARGE_MIN_ELEMENTS) == tiling_for(1 << 34) == LARGE_TILING
    assert SMALL_TILING[0] * SMALL_TILING[1] == LARGE_TILING[0] * LARGE_TILING[1]  # same tile, NOTES.md


def test_every_kernel_the_api_can_launch_is_in_the_compile_record():
    """What the drop-in launches for any size (its tiling rule, every format and dtype) is a
    variant the compile check compiled and recorded for every arch: none reaches a user unchecked."""
    record = json.loads((Path(__file__).resolve().parents[1] / "baselines" / "ptxas-resources.json").read_text())
    sizes = (0, 1, LARGE_MIN_ELEMENTS - 1, LARGE_MIN_ELEMENTS, 1 << 34)
    picked = {
        KernelVariant(q, d, nested, *tiling_for(n)).name
        for q, d, nested, n in itertools.product(QUANT_TYPES, OUT_DTYPES, (False, True), sizes)
    }
    for arch in jit.CHECKED_ARCHS:
        assert {f"{name}@{arch}" for name in picked} <= set(record["kernels"]), arch
    assert picked == {v.name for v in all_variants()}  # and nothing compiled that no call launches
