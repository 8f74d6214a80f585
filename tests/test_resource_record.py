"""The ptxas record check: what fails the build and what is only reported."""

import copy
import json
import subprocess
import sys
from pathlib import Path

from harness.compile_check import resource_record
from harness.compile_check.resource_record import DEFAULT_RECORD, compare

BASE = {
    "nvrtc": "13.5",
    "kernels": {
        "k@sm_90": {
            "registers": 32,
            "spill_store_bytes": 0,
            "spill_load_bytes": 0,
            "stack_frame_bytes": 0,
            "shared_bytes": 64,
        }
    },
}


def _with(**changes):
    current = copy.deepcopy(BASE)
    current["kernels"]["k@sm_90"].update(changes)
    return current


def test_identical_build_passes():
    assert compare(BASE, copy.deepcopy(BASE)) == ([], [])


def test_register_growth_fails_and_shrink_passes():
    failures, _ = compare(BASE, _with(registers=40))
    assert failures == ["k@sm_90: registers 32 -> 40"]
    assert compare(BASE, _with(registers=24))[0] == []


def test_new_spills_and_stack_fail():
    failures, _ = compare(BASE, _with(spill_store_bytes=8, spill_load_bytes=8, stack_frame_bytes=8))
    assert len(failures) == 3


def test_unrecorded_kernel_fails_and_dropped_kernel_is_noted():
    current = copy.deepcopy(BASE)
    current["kernels"]["new@sm_80"] = current["kernels"].pop("k@sm_90")
    failures, notes = compare(BASE, current)
    assert failures == ["new@sm_80: not in the record"]
    assert notes == ["k@sm_90: recorded but no longer built"]


def test_compiler_change_and_shared_memory_change_are_noted():
    current = _with(shared_bytes=1088)
    current["nvrtc"] = "13.6"
    failures, notes = compare(BASE, current)
    assert failures == [] and len(notes) == 2


def test_committed_record_covers_every_variant_and_arch():
    from harness.runtime import dequantize_kernel, matmul_kernel
    from harness.runtime.jit import CHECKED_ARCHS

    recorded = json.loads(DEFAULT_RECORD.read_text())["kernels"]
    dequantize = {f"{v.name}@{a}" for v in dequantize_kernel.all_variants() for a in CHECKED_ARCHS}
    matmul = {
        f"{v.name}:{entry}@{a}"
        for a in CHECKED_ARCHS
        for v in matmul_kernel.all_variants(a)
        for entry in (matmul_kernel.ENTRY, matmul_kernel.FINISH)
    }
    assert set(recorded) == dequantize | matmul


def test_cli_fails_against_a_tighter_record(tmp_path):
    """In its own process, as `nox -s compile` runs it (see tests/test_compile.py for why)."""
    tight = json.loads(DEFAULT_RECORD.read_text())
    for entry in tight["kernels"].values():
        entry["registers"] = 1
    path = tmp_path / "record.json"
    path.write_text(json.dumps(tight))
    done = subprocess.run(
        [sys.executable, "-m", "harness.compile_check.resource_record", "--record", str(path)],
        capture_output=True, text=True, check=False, cwd=Path(resource_record.__file__).parents[2],
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "registers" in done.stdout and "nox -s compile -- --update" in done.stdout


def test_cli_prints_the_table_only_when_something_changed_or_asked(tmp_path, monkeypatch, capsys):
    current = {"nvrtc": "13.0", "kernels": {"k@sm_90": dict.fromkeys(resource_record.FIELDS, 0) | {"registers": 32}}}
    monkeypatch.setattr(resource_record, "measure", lambda: current)
    path = tmp_path / "record.json"
    path.write_text(json.dumps(current))
    assert resource_record.main(["--record", str(path)]) == 0
    quiet = capsys.readouterr().out
    assert quiet.strip() == "resource check passed: 1 kernels within the record"
    assert resource_record.main(["--record", str(path), "-v"]) == 0
    assert "kernel@arch" in capsys.readouterr().out
    current["kernels"]["k@sm_90"]["registers"] = 40
    assert resource_record.main(["--record", str(path)]) == 1
    assert "kernel@arch" in capsys.readouterr().out
