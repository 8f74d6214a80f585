"""NVRTC compiles every kernel entry point for every checked arch, with no GPU present.

The compiles run in a fresh interpreter, as `nox -s compile` does: in a process where a CUDA
context is current, NVRTC 13.0 left the ptxas report out of the log for that GPU's own arch (seen
on an H100), and earlier GPU tests in the same pytest process create one.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from harness import settings
from harness.runtime import jit, matmul_kernel
from harness.runtime.dequantize_kernel import ENTRY, all_variants

_COMPILE_ALL = """
import json
import re
from harness.compile_check.resource_record import compiled_modules
from harness.runtime import jit
out = {}
for arch in jit.CHECKED_ARCHS:
    for name, c in compiled_modules(arch):
        out[name + "@" + arch] = {
            "elf": c.cubin[:4] == b"\\x7fELF",
            "resources": [r.as_dict() for r in c.resources],
            "log": c.log,
        }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled_all():
    done = subprocess.run([sys.executable, "-c", _COMPILE_ALL], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", jit.CHECKED_ARCHS)
@pytest.mark.parametrize("variant", all_variants(), ids=lambda v: v.name)
def test_every_variant_compiles_for_every_arch(compiled_all, variant, arch):
    compiled = compiled_all[f"{variant.name}@{arch}"]
    assert compiled["elf"]
    assert len(compiled["resources"]) == 1, compiled["log"]
    (res,) = compiled["resources"]
    assert (res["kernel"], res["arch"]) == (ENTRY, arch)
    assert 0 < res["registers"] <= 255
    assert res["spill_store_bytes"] == res["spill_load_bytes"] == res["stack_frame_bytes"] == 0
    # The code table lives in shared memory: 64 bytes, plus 1 KiB for the nested 256-entry table.
    assert res["shared_bytes"] == (64 + 1024 if variant.nested else 64)


@pytest.mark.parametrize(
    ("variant", "arch"),
    [(v, arch) for arch in jit.CHECKED_ARCHS for v in matmul_kernel.all_variants(arch)],
    ids=lambda p: getattr(p, "name", p),
)
def test_every_matmul_variant_compiles_for_every_arch_it_is_built_for(compiled_all, variant, arch):
    compiled = compiled_all[f"{variant.name}@{arch}"]
    assert compiled["elf"]
    resources = {r["kernel"]: r for r in compiled["resources"]}
    assert set(resources) == {matmul_kernel.ENTRY, matmul_kernel.FINISH}, compiled["log"]
    source, target = variant.build(arch)
    for res in resources.values():
        assert res["arch"] == target and 0 < res["registers"] <= 255
        assert res["spill_store_bytes"] == res["spill_load_bytes"] == res["stack_frame_bytes"] == 0
    # The wide tiles' 16-entry code table (the wgmma kernel's from 64 tokens: a pair table of 256
    # entries of 8 bytes, 16 copies each), the nested decode kernel's pair table (256 entries of 4
    # bytes, 32 copies each; the plain one's codes are immediates), nested: the scales' 256-entry code
    # book, and two stages of the activation tile (a step's k of every token, 2 bytes each; the
    # decode and wgmma kernels' tiles have padded strides: their own rules). Static shared memory and
    # the launch's dynamic bytes together (the pair-table kernel at 16 tokens passes 48 KB).
    table = {matmul_kernel.SOURCE_M8: 0, matmul_kernel.SOURCE_M8_PAIRS: 256 * 4 * 32}.get(source, 64)
    if source == matmul_kernel.SOURCE_SM90 and variant.tokens >= 64:  # 256 fp32 pairs, 16 copies each
        table = 256 * 8 * 16
    # The columns build holds only the rows it reads (COLUMNS_ROWS: ACT_TILE_ROWS).
    rows = matmul_kernel.COLUMNS_ROWS if variant.columns else variant.tokens
    activations = 2 * rows * matmul_kernel.step_k(variant.grid_rule(arch)) * 2
    tables = table + (1024 if variant.nested else 0)
    # The register-table kernel pads a 16-byte slot after every 8 chunks (128 bytes) of a row: 4 to
    # a row of 32 16-byte pieces, as the pair-table one's 8-token tile does; its 16-token tile 8 (rows
    # start 128-byte lines: ALIGNED_ROWS), its columns build 6 (a slot every 8 pieces, rows 38 slots
    # apart: compute_pair_columns).
    if source in (matmul_kernel.SOURCE_M8, matmul_kernel.SOURCE_M8_PAIRS):
        aligned = source == matmul_kernel.SOURCE_M8_PAIRS and variant.tokens != matmul_kernel.DECODE_TILES[0]
        pads = 6 if variant.columns else 8 if aligned else 4
        activations += activations * pads // 32
    if source == matmul_kernel.SOURCE_SM90:  # 8 slices of 16 k, each padded by 16 bytes, from a 128-byte boundary
        # three stages in the nested 8-warp build of the 128-token tile (WIDE_STAGES)
        stages = 3 if (variant.tokens, variant.warps, variant.nested) == (128, 8, True) else 2
        activations = stages * 8 * (variant.tokens * 16 * 2 + 16)
        tables = -(-tables // 128) * 128
    dynamic = variant.dynamic_shared_bytes(arch)
    assert resources[matmul_kernel.ENTRY]["shared_bytes"] + dynamic == tables + activations
    assert dynamic == 0 or resources[matmul_kernel.ENTRY]["shared_bytes"] + dynamic > 48 * 1024


# An sm_90 SM's 256 KB are split between shared memory and L1 in these steps (KB of shared memory); the
# driver reserves 1 KB of shared memory a block and takes the smallest step its blocks fit.
SM90_CARVEOUTS_KB = (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)
RESERVED_SHARED_BYTES = 1024


def carveout_kb(blocks: int, shared_bytes: int) -> int:
    """The sm_90 carveout step ``blocks`` blocks of ``shared_bytes`` static shared memory take."""
    return next(kb for kb in SM90_CARVEOUTS_KB if blocks * (shared_bytes + RESERVED_SHARED_BYTES) <= kb * 1024)


def test_the_carveout_step_is_the_smallest_that_holds_the_blocks():
    assert carveout_kb(4, 43520) == 196 and carveout_kb(4, 38656) == 164 and carveout_kb(5, 43520) == 228


@pytest.mark.parametrize("variant", [v for v in matmul_kernel.all_variants("sm_90") if v.columns], ids=lambda v: v.name)
def test_the_columns_build_leaves_l1_room_for_the_scale_codes(compiled_all, variant):
    """The columns build (an H200's 1-4-row calls) holds 4 blocks an SM by its registers and fits them in
    the 164 KB carveout, so L1 keeps 92 KB for the scale codes' lines: at 60 KB (the 196 KB step, its
    8-row tile) the gate weight's one-row call took 1.5% more time and the down weight's 5%; at 28 KB 12%
    more (kernels/NOTES.md, "The columns build's tile of 4 rows: more L1 for the scale codes")."""
    (res,) = [r for r in compiled_all[f"{variant.name}@sm_90"]["resources"] if r["kernel"] == matmul_kernel.ENTRY]
    threads = matmul_kernel.threads(variant.tokens, variant.warps)
    assert 65536 // (threads * res["registers"]) >= 4, res["registers"]
    assert carveout_kb(4, res["shared_bytes"]) <= 164, res["shared_bytes"]


def test_every_kernel_takes_the_code_tables_from_the_one_header():
    """The tables are written as bits once, in kernels/format_4bit.cuh (tests/test_reference_cpu.py
    holds them to the reference); no kernel carries a copy."""
    import re

    table_bits = set(re.findall(r"0x[0-9a-f]{8}u", (jit.kernels_dir() / "format_4bit.cuh").read_text()))
    assert len(table_bits) >= 16
    includes = {"dequantize_4bit.cu": "format_4bit.cuh", "matmul_4bit_common.cuh": "format_4bit.cuh"}
    includes |= {"matmul_4bit_m8.cu": "matmul_4bit_common.cuh", "matmul_4bit_m8_pairs.cu": "matmul_4bit_common.cuh"}
    includes |= {"matmul_4bit_step128.cuh": "matmul_4bit_common.cuh"}
    includes |= {source: "matmul_4bit_step128.cuh" for source in (matmul_kernel.SOURCE_WIDE, matmul_kernel.SOURCE_SM90)}
    for source, header in includes.items():
        text = (jit.kernels_dir() / source).read_text()
        assert f'#include "{header}"' in text and not table_bits & set(re.findall(r"0x[0-9a-f]{8}u", text)), source


def test_every_entry_point_in_the_sources_belongs_to_an_op_of_the_registry():
    """What the compile check, the record and the sanitizer iterate (``ops.OPS``) is every kernel
    the sources define, but the perf timer's stream blocker: a new entry point outside an op's
    descriptor fails here."""
    from harness.runtime import ops

    pattern = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(')
    defined = {name for path in jit.kernels_dir().glob("*.cu*") for name in pattern.findall(path.read_text())}
    assert defined == {*ops.entries(), "block_stream"}
    assert len(ops.entries()) == len(set(ops.entries()))
