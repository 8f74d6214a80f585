"""How the sanitizer session reads compute-sanitizer's reports (CPU); the session itself is
``nox -s sanitize`` on a GPU machine."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from harness.correctness import op_checks, sanitize
from harness.runtime import matmul_kernel, ops
from tests import hopper_plans as hopper

RULES = (matmul_kernel.BUSIEST_SM, matmul_kernel.WAVES)  # the plain and nested decode kernels'


def tile_and_rule(M: int, N: int, K: int, rule: str) -> tuple[int, str]:
    """The token tile of a call of the kernel family whose decode tiles follow ``rule`` (nested
    scales: WAVES), and the rule that tile's grid follows (a wide tile's: WAVES_WIDE)."""
    variant = matmul_kernel.variant_for("bf16", "nf4", rule == matmul_kernel.WAVES, M, N * K)
    return variant.tokens, variant.grid_rule("sm_90")


REPORT = """========= COMPUTE-SANITIZER
========= Program hit CUDA_ERROR_NOT_FOUND (error 500) due to "not found" on CUDA API call to cuGetProcAddress.
=========     Saved host backtrace up to driver entry point at error
========= Uninitialized __global__ memory read of size 4 bytes
=========     at dequantize_4bit_kernel+0x1f0
=========     by thread (0,0,0) in block (0,0,0)
========= Program hit cudaErrorInvalidValue (error 1) due to "invalid argument" on CUDA API call to cudaGetLastError.
========= ERROR SUMMARY: 3 errors
"""


def test_report_counts_kernel_errors_apart_from_host_api_noise():
    assert sanitize.count_errors(REPORT) == {
        "errors in our kernel": 1,
        "errors in other kernels": 0,
        "host API errors": 2,
    }
    clean = "========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n"
    assert sanitize.count_errors(clean) == {
        "errors in our kernel": 0,
        "errors in other kernels": 0,
        "host API errors": 0,
    }


def test_racecheck_hazards_count_as_errors_in_our_kernel():
    report = "========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)\n"
    assert sanitize.count_errors(report)["errors in our kernel"] == 3
    clean = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
    assert sanitize.count_errors(clean)["errors in our kernel"] == 0


def test_a_report_without_a_summary_is_not_read_as_clean():
    report = "========= COMPUTE-SANITIZER\nTraceback (most recent call last):\n"
    assert sanitize.count_errors(report)["errors in our kernel"] is None


INITCHECK = """========= COMPUTE-SANITIZER
case nf4 torch.float16 nested=True (37, 61): A 0x7f0000001000+1129, absmax 0x7f0000002000+36, code2 0x7f0000003000+1024
========= Uninitialized __global__ memory read of size 1 bytes
=========     at dequantize_4bit_kernel+0x2a0
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x7f0000002003
=========
========= Uninitialized __global__ memory read of size 4 bytes
=========     at void kQuantizeBlockwise<float, 256, 2, 0, 0>(float *, float *)+0x80
=========     by thread (5,0,0) in block (0,0,0)
=========     Address 0x7f0000009000
=========
========= ERROR SUMMARY: 2 errors
"""


def test_errors_in_other_kernels_are_counted_apart_from_ours():
    assert sanitize.count_errors(INITCHECK) == {
        "errors in our kernel": 1,
        "errors in other kernels": 1,
        "host API errors": 0,
    }


def test_an_uninitialized_read_is_traced_to_its_buffer_and_offset():
    (traced,) = sanitize.trace_reads(INITCHECK)
    assert traced["buffer"] == "absmax" and traced["byte offset"] == 3
    assert traced["case"] == "nf4 torch.float16 nested=True (37, 61)"
    outside = INITCHECK.replace("0x7f0000002003", "0x7f0000008000")
    assert sanitize.trace_reads(outside)[0]["buffer"] == "outside every input buffer"


def test_errors_in_each_of_our_kernels_are_ours_and_the_filter_selects_each():
    for name in ops.entries():
        report = REPORT.replace("dequantize_4bit_kernel", name)
        assert sanitize.count_errors(report)["errors in our kernel"] == 1, name
        assert sanitize.KERNEL_FILTER in name  # what --kernel-name selects for the filtered tools
    other = REPORT.replace("dequantize_4bit_kernel", "kDequantizeBlockwise")
    assert sanitize.count_errors(other)["errors in other kernels"] == 1
    assert sanitize.KERNEL_FILTER not in "kDequantizeBlockwise"


@pytest.mark.parametrize(("blocks_per_sm", "sms"), [(1, 3), (2, 46), (4, 132), (8, 108), (32, 144)])
def test_the_matmul_cases_run_both_kernels_split_and_unsplit_with_partial_steps(blocks_per_sm, sms):
    """Each fused kernel under the sanitizer with and without the split of K (the partial slices
    and the finish kernel), and the 8-token kernel's last step past K (its zero tables), on any
    GPU that holds three blocks."""
    seen = set()
    for (M, N, K), rule in itertools.product(op_checks.matmul.SANITIZE_SHAPES, RULES):
        tokens, tile_rule = tile_and_rule(M, N, K, rule)
        grid = matmul_kernel.grid_for(M, N, K, tokens, blocks_per_sm, sms, rule=tile_rule)
        partial_step = K % matmul_kernel.step_k(tile_rule) != 0
        m8 = tile_rule != matmul_kernel.WAVES_WIDE  # else a wide tile (matmul_4bit.cu, matmul_4bit_sm90.cu on Hopper)
        seen.add(("m8" if m8 else "wide", grid.splits > 1, partial_step))
        if m8:
            seen.add(("one table per 64 k" if K % 64 == 0 else "a table per 32-k half", partial_step))
    assert {("m8", True, True), ("m8", False, True), ("wide", True, False), ("wide", False, False)} <= seen
    assert {("one table per 64 k", True), ("a table per 32-k half", True)} <= seen


def test_on_a_gpu_with_clusters_the_matmul_cases_run_the_cluster_and_the_finish():
    """On Hopper the split cases of both kernels with the cluster epilogue (8 and 64 tokens) add
    their splits inside a cluster (the 8-token one also in a cluster past the portable size and
    in one of an odd size) and the 32- and 128-token ones' (no cluster epilogue) through the finish, so the
    sanitizer sees both ways of adding them (the clusters at once and blocks an SM an H100 and an
    H200 report); and the 128-token calls run both of that tile's Hopper builds."""
    plans = {
        8: (hopper.M8_PER_SM, hopper.M8_CLUSTERS),
        64: (hopper.WIDE64_PER_SM, hopper.WIDE64_CLUSTERS),
        (32, matmul_kernel.WAVES): (hopper.PAIRS32_PER_SM, hopper.PAIRS32_CLUSTERS),  # nested: the pair-table kernel's
        (32, matmul_kernel.WAVES_WIDE): (hopper.WIDE32_PER_SM, ()),
        128: (hopper.WIDE128_PER_SM, ()),
    }
    for rule in RULES:  # the pair-table (nested) and register-table (plain) 8-token kernels' rules
        ways = set()
        for M, N, K in op_checks.matmul.SANITIZE_SHAPES:
            tokens, tile_rule = tile_and_rule(M, N, K, rule)
            per_sm, clusters = plans.get((tokens, tile_rule), plans.get(tokens, (4, ())))
            grid = matmul_kernel.grid_for(M, N, K, tokens, per_sm, hopper.SMS, clusters, rule=tile_rule)
            ways.add((tokens, "cluster" if grid.clustered else "finish" if grid.finished else "unsplit"))
            if grid.clustered and grid.splits > matmul_kernel.PORTABLE_CLUSTER_BLOCKS:
                ways.add((tokens, "cluster past the portable size"))
            if grid.clustered and grid.splits % 2:
                ways.add((tokens, "cluster of an odd size"))
        assert {(8, "cluster"), (64, "cluster"), (8, "unsplit"), (64, "unsplit")} <= ways, rule
        # The 32-token tile: the wide kernel's (plain) split by the finish, the pair-table kernel's unsplit.
        assert (32, "unsplit" if rule == matmul_kernel.WAVES else "finish") in ways, rule
        assert {(128, "finish"), (128, "unsplit")} <= ways, rule
        assert {(8, "cluster past the portable size"), (8, "cluster of an odd size")} <= ways, rule
    # The 128-token tile's calls in both of its Hopper builds (matmul_kernel.pick_plan).
    builds = hopper.wide128_plans()
    picked = {
        matmul_kernel.cheapest(tuple(builds.values()), M, N, K, 128).warps
        for M, N, K in op_checks.matmul.SANITIZE_SHAPES
        if matmul_kernel.token_tile(M) == 128
    }
    assert picked == set(builds)


def test_the_sanitized_process_runs_every_ops_cases_and_fails_on_any_wrong_output(monkeypatch, capsys):
    """The driver names no op: it runs each op's cases from the registry and fails when any op's
    cases report a wrong output."""
    import torch

    seen = []

    def cases_of(name, wrong):
        return lambda inputs, device: seen.append((name, inputs, device)) or wrong

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def checks(wrong_of):
        return {
            op.name: replace(op_checks.CHECKS[op.name], sanitize=cases_of(op.name, wrong_of(op.name))) for op in ops.OPS
        }

    monkeypatch.setattr(op_checks, "CHECKS", checks(lambda name: 0))
    assert sanitize.run_cases("raw") == 0
    assert seen == [(op.name, "raw", torch.device("cuda", 0)) for op in ops.OPS]
    last = ops.OPS[-1].name
    monkeypatch.setattr(op_checks, "CHECKS", checks(lambda name: name == last))
    assert sanitize.run_cases("bnb") == 1
    assert "cases: 1 outputs differ" in capsys.readouterr().out


@pytest.mark.parametrize("inputs", ["both", "raw,fp64", ""])
def test_inputs_outside_raw_and_bnb_are_refused_naming_what_it_takes(inputs, monkeypatch, capsys):
    """Refused before compute-sanitizer is looked for, with the forms it takes (the message once
    offered ``both``, which it then refused)."""
    monkeypatch.setattr(sanitize.shutil, "which", lambda name: pytest.fail("looked for compute-sanitizer"))
    with pytest.raises(SystemExit) as exit_:
        sanitize.main(["--inputs", inputs])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--inputs takes raw, bnb or raw,bnb" in err and repr(inputs) in err
