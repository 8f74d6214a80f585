"""The "which bitsandbytes path gains how much" report runs end to end and finds every patched
path bit-identical to bitsandbytes and every fused matmul inside its bound (a quick run: M = 256,
matmul M = 1 and 64, a decoder layer's sequence at M = 1, two rounds, no QLoRA step or generate)."""

from __future__ import annotations

import json

import pytest

from harness.perf import bnb_paths

pytestmark = pytest.mark.gpu


def test_quick_report_is_bit_identical_and_routes_each_layer_through_our_kernel(bnb, cuda, tmp_path):
    assert bnb_paths.main(["--quick", f"--out={tmp_path}"]) == 0
    tables = json.loads((tmp_path / "bnb-paths.json").read_text())
    layers, peers, host = tables["layers"], tables["dequantize"], tables["host"]
    assert len(layers) == 2 * 2 and all(row["bit-identical"] for row in layers)
    assert all(row["ours via"] for row in layers), "every layer at M = 256 dequantizes somewhere ours runs"
    assert [row["path"] for row in peers] == [
        "bitsandbytes F.dequantize_4bit",
        "Unsloth's call path",
        "ours (patched F.dequantize_4bit)",
    ]
    assert all(row["bit-identical"] and row["median_us"] > 0 for row in peers)
    assert {row["call"] for row in host} >= {"floor: bare cuda-python launch", "ours", "ours, out="}
    timed = [row for row in tables["matmul"] if "M" in row]
    expected = [(layer, m) for layer in ("gate", "o", "k") for m in (1, 64)]
    assert [(row["layer"].split()[0], row["M"]) for row in timed] == expected
    assert all(row["in bound"] and row["ours fused µs"] > 0 and row["roofline µs"] > 0 for row in timed)
    assert any(row["layer"].startswith("crossover M measured") for row in tables["matmul"])
    sequence = [row for row in tables["sequence"] if "implementation" in row]
    assert [(row["M"], row["implementation"]) for row in sequence] == [(1, "bitsandbytes"), (1, "ours fused")]
    assert all(row["graph = eager"] and 0 < row["rooflines µs"] < row["graph µs"] for row in sequence)
    assert sequence[-1]["bitsandbytes ÷ ours (graph)"] > 0
    assert "| layer" in (tmp_path / "bnb-paths.md").read_text()
