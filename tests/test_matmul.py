"""harness.matmul_4bit: bitsandbytes' semantics, the fused kernel's exact part and its bound.

No GPU: the launch plan (token tile, split of K), what the fused kernel takes, and every error
raised before a launch. On a GPU: one-hot rows give the dequantization kernel's bits exactly;
random rows stay inside the derived bound and no farther from the fp64 reference than
bitsandbytes' own result; the fallback (large M, misaligned, gradients) is our dequantization
and F.linear bit for bit; bias, out=, [K, N] weights, empty and 3-D inputs as bitsandbytes.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re
from types import SimpleNamespace

import pytest
import torch

import harness
from harness.correctness import cases
from harness.correctness import matmul_reference as mr
from harness.correctness.bitcompare import assert_bit_exact, poison_
from harness.errors import InputError, KernelCompileError
from harness.runtime import api, dequantize, dtypes, host_path, launcher, matmul, matmul_kernel
from harness.runtime.matmul import CROSSOVER_M, DEFAULT_CROSSOVER_M, crossover_m
from tests import hopper_plans as hopper

# The grid rules by the kernel that follows them (matmul_kernel.GRID_RULES); the wide tiles ignore it.
BUSIEST, WAVES = matmul_kernel.BUSIEST_SM, matmul_kernel.WAVES
WIDE = matmul_kernel.WAVES_WIDE

# A weight past the size that runs 17-32 rows as two 16-token tiles (matmul_kernel.tile_for): its
# calls take the smallest token tile that holds them.
LARGE = 28672 * 8192


def features_past_two_tiles(K: int) -> int:
    """The fewest features of a weight with K columns past ``matmul_kernel.TWO_TILE_ELEMENTS``: its
    17-32-row calls take the wide 32-token tile."""
    return matmul_kernel.TWO_TILE_ELEMENTS // K + 1


# Rows every GPU fuses, whatever the weight: the smallest entry of any crossover table.
FUSED_EVERYWHERE = min(most for table in (*CROSSOVER_M.values(), DEFAULT_CROSSOVER_M) for _, most in table)

# --- no GPU needed -----------------------------------------------------------------------------


def test_a_token_tile_holds_the_rows_and_the_largest_covers_the_rest():
    rows = (1, 8, 9, 16, 17, 33, 64, 65, 128, 129, 1000)
    assert [matmul_kernel.token_tile(m) for m in rows] == [8, 8, 16, 16, 32, 64, 64, 128, 128, 128, 128]


def test_the_few_rows_build_runs_the_nested_one_tile_calls_of_at_most_few_rows_only():
    few = matmul_kernel.FEW_ROWS
    calls = itertools.product(matmul_kernel.DTYPES, matmul_kernel.QUANT_TYPES, (False, True), range(1, 20))
    for dtype, quant, nested, m in calls:
        v = matmul_kernel.variant_for(dtype, quant, nested, m, LARGE)
        assert (v.dtype, v.quant_type, v.nested, v.tokens) == (dtype, quant, nested, matmul_kernel.token_tile(m))
        assert v.few_rows == (nested and m <= few), (nested, m)
        assert v in matmul_kernel.all_variants(), "the compile check and the resource record cover every build"
        macros = dict(v.macros("sm_90"))
        assert macros.get("MM_FEW_ROWS") == (str(few) if v.few_rows else None)
        # Its own name (the compile cache and the resource record are keyed by it), its own kernel source.
        plain = dataclasses.replace(v, few_rows=False)
        assert (v.name != plain.name) == v.few_rows and v.build("sm_90") == plain.build("sm_90")
    assert 1 <= few <= matmul_kernel.DECODE_TILES[0]
    names = [v.name for v in matmul_kernel.all_variants()]
    assert len(names) == len(set(names))
    for bad in ((False, 8), (True, 16), (True, 64)):  # plain scales, or a tile past one mma's tokens
        with pytest.raises(ValueError, match="few-rows build"):
            matmul_kernel.MatmulVariant("bf16", "nf4", bad[0], bad[1], True)


def test_the_columns_form_is_the_one_tile_nested_builds_where_the_gpu_pays_for_it_only():
    """The nested one-tile builds of the tile's WARPS, and only they, have a columns form
    (``columns_form``, which ``plan_for_rows`` gives their calls of up to ``COLUMNS_ROWS`` rows on a
    GPU of ``columns_on``): its own name and macros, the same kernel source, built for sm_90 only;
    the rule's two measured GPUs fall on its two sides."""
    calls = itertools.product(matmul_kernel.DTYPES, matmul_kernel.QUANT_TYPES, (False, True), range(1, 20))
    for dtype, quant, nested, m in calls:
        without = matmul_kernel.variant_for(dtype, quant, nested, m, LARGE)
        v = without.columns_form()
        assert (v is not None) == (nested and without.tokens == matmul_kernel.DECODE_TILES[0]), (nested, m)
        if v is None:
            with pytest.raises(ValueError, match="columns form"):
                dataclasses.replace(without, columns=True)
            continue
        assert v == dataclasses.replace(without, few_rows=True, columns=True) and v.columns_form() is None
        assert v in matmul_kernel.all_variants("sm_90")
        macros = dict(v.macros("sm_90"))
        assert macros["MM_COLUMNS"] == "1" and "MM_COLUMNS" not in dict(without.macros("sm_90"))
        assert macros["MM_FEW_ROWS"] == str(matmul_kernel.COLUMNS_ROWS)
        assert v.build("sm_90") == without.build("sm_90")
        assert v.name == dataclasses.replace(without, few_rows=True).name + "-cols"
        assert not any(v.builds_on(arch) for arch in ("sm_80", "sm_86", "sm_89"))
    # Two chunks of each row in an mma's 8 token columns; the kernel refuses more (#error).
    assert matmul_kernel.FEW_ROWS <= matmul_kernel.COLUMNS_ROWS == matmul_kernel.DECODE_TILES[0] // 2
    with pytest.raises(ValueError, match="columns form"):
        matmul_kernel.MatmulVariant("bf16", "nf4", True, 8, False, columns=True)
    wide = matmul_kernel.MatmulVariant("bf16", "nf4", True, 128, warps=matmul_kernel.WIDE_WARPS[128])
    assert wide.columns_form() is None
    # DRAM bandwidth (NVML's theoretical, as the grid sweeps recorded it), SMs, SM clock.
    assert matmul_kernel.columns_pay(4814.304e9, 132, 1980e6)  # H200: 18.4 bytes an SM cycle
    assert not matmul_kernel.columns_pay(3352.32e9, 132, 1980e6)  # H100 SXM: 12.8
    assert not matmul_kernel.columns_pay(2039e9, 108, 1410e6)  # A100 SXM 80 GB: 13.4 (and not sm_90)


@pytest.mark.parametrize("runs_columns", [False, True])
def test_a_call_runs_the_columns_form_at_up_to_columns_rows_where_its_gpu_runs_it(monkeypatch, runs_columns):
    """``plan`` names the columns form in a build's plan where the GPU runs it (``columns_of``, the
    one place the GPU is asked); ``pick_plan`` gives it the nested calls of up to ``COLUMNS_ROWS``
    rows, and every other call its own build's plan. (Plans stood in: no GPU is asked.)"""
    monkeypatch.setattr(matmul_kernel, "columns_on", lambda device_index: runs_columns)

    built = {}  # id of a plan -> the build it is of

    def plan_of(variant, device_index):  # what plan gives, less the kernels
        cols = matmul_kernel.columns_of(variant, device_index)
        p = matmul_kernel.Plan(None, None, 0, 2, 132, (), variant.grid_rule("sm_90"), variant.warps,
                               variant.alternative("sm_90"), cols)  # fmt: skip
        built[id(p)] = variant
        return p

    calls = itertools.product(matmul_kernel.DTYPES, matmul_kernel.QUANT_TYPES, (False, True), range(1, 20))
    for dtype, quant, nested, m in calls:
        variant = matmul_kernel.variant_for(dtype, quant, nested, m, LARGE)
        ran = built[id(matmul_kernel.pick_plan(variant, 7, m, 4096, 4096, plan_of))]
        columns = runs_columns and nested and m <= matmul_kernel.COLUMNS_ROWS
        assert ran == (variant.columns_form() if columns else variant), (nested, m, ran.name)


@pytest.mark.gpu
def test_this_gpu_runs_the_columns_form_by_its_own_figures(cuda):
    """``columns_on`` reads the driver's DRAM clock, bus width, SMs and SM clock; on the two GPUs the
    choice was measured on it gives the measured answer, and the calls of up to ``COLUMNS_ROWS`` rows,
    and no more, run that form."""
    name = torch.cuda.get_device_name(cuda.index)
    measured = {"NVIDIA H200": True, "NVIDIA H100 80GB HBM3": False}
    if name not in measured:
        pytest.skip(f"the columns form was measured on {sorted(measured)}, not on {name}")
    assert matmul_kernel.columns_on(cuda.index) == measured[name]
    B, qs, _ = _weights(64, 512, "nf4", 64, True, torch.bfloat16, 0, cuda)
    for m in range(1, matmul_kernel.DECODE_TILES[0] + 1):
        A = torch.randn(m, 512, device=cuda, dtype=torch.bfloat16)
        decided = matmul.decide(A, B.t(), *dequantize.quant_state_args(qs), None, None, matmul_kernel.plan)
        cols = measured[name] and m <= matmul_kernel.COLUMNS_ROWS
        assert decided.plan.main.label.endswith("-cols") == cols, (m, decided.plan.main.label)


def test_17_to_32_rows_of_a_small_nested_weight_run_as_two_16_token_tiles_of_the_pair_table_kernel():
    """Where a launch is mostly its fixed cost (kernels/NOTES.md, "17-32 rows of a small weight as two
    16-token tiles"): nested weights of at most TWO_TILE_ELEMENTS, 17-32 rows; not plain ones, not
    larger weights, not other row counts. The larger nested weights run the pair-table kernel's own
    32-token tile there, on every arch; plain ones the wide kernels'."""
    small, last = 1024 * 8192, matmul_kernel.TWO_TILE_ELEMENTS
    for m, nested, elements in itertools.product(range(1, 70), (False, True), (small, last, last + 1, LARGE)):
        v = matmul_kernel.variant_for("bf16", "nf4", nested, m, elements)
        two_tiles = nested and 16 < m <= 32 and elements <= last
        assert v.tokens == (16 if two_tiles else matmul_kernel.token_tile(m)), (m, nested, elements)
        if two_tiles:
            assert v.build("sm_90")[0] == matmul_kernel.SOURCE_M8_PAIRS and not v.few_rows
            assert v in matmul_kernel.all_variants("sm_90") and matmul_kernel.steps_of(8192, v.grid_rule("sm_90")) == 32
        elif 16 < m <= 32:
            pairs = nested and v.tokens == 32
            for arch, wide in (("sm_80", matmul_kernel.SOURCE_WIDE), ("sm_90", matmul_kernel.SOURCE_SM90)):
                assert v.build(arch)[0] == (matmul_kernel.SOURCE_M8_PAIRS if pairs else wide), (m, nested, arch)
                assert v.grid_rule(arch) == (matmul_kernel.WAVES if pairs else WIDE)
    # The weights swept on both sides of the line: Llama-3.3-70B's k 1024x8192 and Phi-3-mini's o 3072x3072.
    assert 1024 * 8192 <= last < 3072 * 3072


def test_every_token_tile_has_a_grid_rule_and_the_32_token_tile_splits_the_large_gate_weights():
    """The decode tiles follow their rules, the wider ones the wide waves rule (``grid_for`` has no other
    branch). On an H100 or H200 (5 blocks of the Hopper 32-token tile an SM, no cluster epilogue; plain
    scales' since the pair-table kernel's own 32-token tile runs the nested ones) the
    gate weights at 32 rows run in finished splits, as the H200 sweep measured fastest (28672x8192:
    4 of 16 steps 112 µs, unsplit 122), and 4096x4096 in 8, not the finished pair (1.35x)."""
    assert set(matmul_kernel.TOKEN_TILES) == set(matmul_kernel.DECODE_TILES) | set(matmul_kernel.WAVES_WIDE_TILES)
    grid = matmul_kernel.grid_for(32, 28672, 8192, 32, 5, 132, (), rule=WIDE)
    assert grid.blocks == (448, 4, 1) and grid.steps_per_split == 16 and grid.finished
    grid = matmul_kernel.grid_for(32, 4096, 4096, 32, 5, 132, (), rule=WIDE)
    assert grid.splits == 8 and grid.steps_per_split == 4


def _cheapest_waves_grid(groups: int, steps: int, plan: tuple, *priced) -> matmul_kernel.Grid:
    """The waves rule's cheapest grid of 1-16 splits for one token tile, priced by ``priced`` (the
    tile's WavesPrice and a split's MB of partial sums; none: the flat price), before any cap."""
    options = [matmul_kernel.waves_grid(groups, 1, steps, s, *plan, *priced) for s in range(1, 17)]
    return min(options, key=lambda option: option[0])[1]


@pytest.mark.parametrize(
    ("N", "K", "splits", "steps"),
    [
        (8192, 8192, 5, 13),  # llama-3.3-70b o: 4 of 16 read 1.5% slower side by side in two perf gates
        (28672, 8192, 4, 16),  # its gate: 0.914x the one-wave rule's unsplit grid side by side
        (3584, 18944, 9, 17),  # qwen2.5-7b down: 39.8 µs on the sweep against 40.2 for 7 of 22
    ],
)
def test_the_32_token_tile_prices_a_shared_block_below_the_64_token_tiles(N, K, splits, steps):
    """At 32 rows on Hopper (5 blocks of the 32-token tile an SM, no clusters) the waves rule's
    finished grids under its ``WAVES_PRICES``; under the 64-token tile's price 8192x8192 took 4
    splits of 16 steps, which the sweep's coarse timing put 0.4% ahead of 5 of 13 and side by side
    ran 1.5% slower (kernels/NOTES.md, "The 32-token tile's price: a tie the sweep could not see")."""
    g = matmul_kernel.grid_for(32, N, K, 32, 5, 132, (), rule=WIDE)
    assert (g.splits, g.steps_per_split, g.finished) == (splits, steps, True)
    mine, wide = matmul_kernel.waves_price(32, WIDE), matmul_kernel.waves_price(64, WIDE)
    assert mine.shared_sm_step < wide.shared_sm_step and mine.finish_steps_per_mb > wide.finish_steps_per_mb
    groups, all_steps, split_mb = g.blocks[0], matmul_kernel.steps_of(K, WIDE), matmul_kernel.partial_sums_mb(32 * N)
    assert _cheapest_waves_grid(groups, all_steps, (5, 132, ()), mine, split_mb) == g
    if (N, K) == (8192, 8192):  # what the 64-token tile's price picked
        old = _cheapest_waves_grid(groups, all_steps, (5, 132, ()), wide, split_mb)
        assert (old.splits, old.steps_per_split) == (4, 16)


def test_a_calls_tile_is_one_of_its_tile_choices_and_only_17_to_32_nested_rows_have_two():
    """``tile_choices`` lists what ``tile_for`` may give a call whatever the weight's size (the grid
    sweep times each): two tiles for 17-32 rows of a nested weight, the smaller first; one elsewhere."""
    last = matmul_kernel.TWO_TILE_ELEMENTS
    for m, nested in itertools.product(range(1, 300), (False, True)):
        choices = matmul_kernel.tile_choices(m, nested)
        assert len(choices) == (2 if nested and 16 < m <= 32 else 1), (m, nested)
        assert choices == tuple(sorted(set(choices))) and choices[-1] == matmul_kernel.token_tile(m)
        picked = {matmul_kernel.tile_for(m, nested, e) for e in (1, last, last + 1, LARGE)}
        assert picked == set(choices), (m, nested)
        for tile in choices:  # a chosen tile (the grid sweep's), the same build as the rules give it
            assert matmul_kernel.variant_for("bf16", "nf4", nested, m, LARGE, tokens=tile).tokens == tile
    with pytest.raises(ValueError, match="does not run the 32-token tile"):
        matmul_kernel.variant_for("bf16", "nf4", True, 1, LARGE, tokens=32)


@pytest.mark.parametrize(
    ("M", "N", "K"),
    [(1, 28672, 8192), (16, 28672, 8192), (1, 8192, 8192), (1, 1024, 8192), (64, 8192, 8192), (8, 48, 96)],
)
@pytest.mark.parametrize(("per_sm", "sms"), [(8, 108), (4, 132), (3, 132)])
@pytest.mark.parametrize("rule", [matmul_kernel.BUSIEST_SM, matmul_kernel.WAVES])
def test_the_grid_covers_every_step_once_and_spreads_the_work(M, N, K, per_sm, sms, rule):
    tokens = matmul_kernel.token_tile(M)
    rule = rule if tokens in matmul_kernel.DECODE_TILES else WIDE  # the wide tiles have their own
    g = matmul_kernel.grid_for(M, N, K, tokens, per_sm, sms, rule=rule)
    groups, splits, tiles = g.blocks
    steps = matmul_kernel.steps_of(K, rule)
    assert (splits - 1) * g.steps_per_split < steps <= splits * g.steps_per_split  # no empty split, none missing
    assert groups * matmul_kernel.features_per_block(tokens) >= N and tiles * tokens >= M
    assert splits <= matmul_kernel.MAX_SPLITS and not g.clustered  # no clusters on this GPU
    assert g.workspace_elements(M, N) == (splits * M * N if splits > 1 else 0)
    # The partial sums stay within their share of the weights' bytes; a split's pipeline fill pays.
    assert 4 * splits * M * N <= matmul_kernel.PARTIAL_SHARE * N * K / 2 or splits == 1
    assert g.steps_per_split >= matmul_kernel.min_split_steps(tokens, rule) or splits == 1
    blocks = groups * splits * tiles
    if rule == WIDE:  # wide tiles: one wave, never a nearly empty second
        assert splits == 1 or blocks <= per_sm * sms
        return
    busiest = matmul_kernel.busiest_sm_steps(blocks, g.steps_per_split, sms)
    if rule == matmul_kernel.WAVES or per_sm < matmul_kernel.BUSIEST_SM_BLOCKS:
        # No fewer splits cost the waves rule less; or, at 4 or more blocks an SM, two splits replace
        # the unsplit grid it picked, their busiest SM running no more steps.
        price = (matmul_kernel.waves_price(tokens, rule), matmul_kernel.partial_sums_mb(M * N))
        costs = [
            matmul_kernel.waves_grid(groups, tiles, steps, s, per_sm, sms, (), *price)[0][0]
            for s in range(1, splits + 1)
        ]
        if matmul_kernel.waves_grid(groups, tiles, steps, splits, per_sm, sms, (), *price)[0][0] > min(costs):
            assert splits == 2 and per_sm >= matmul_kernel.BUSIEST_SM_BLOCKS, g
            assert busiest <= matmul_kernel.busiest_sm_steps(groups * tiles, steps, sms)
        return
    assert busiest <= matmul_kernel.busiest_sm_steps(groups * tiles, steps, sms)  # never worse than unsplit
    cap = min(steps // matmul_kernel.min_split_steps(tokens, rule), matmul_kernel.MAX_SPLITS)
    if blocks >= sms and splits < -(-steps // -(-steps // cap)):  # fewer splits than the most the caps reach
        # Work to spread and splits to spare: the busiest SM runs at most 15% more steps than the average.
        assert busiest <= 1.15 * groups * tiles * steps / sms, (g, busiest)


@pytest.mark.parametrize(
    ("units", "splits", "steps", "fits"),
    [
        (448, 2, 16, True),  # Llama-3.3-70B gate at one row: 264 clusters at once, 2 waves either way
        (128, 2, 16, True),  # its o at 2 splits: 2 x 128 blocks, one wave
        (128, 4, 8, False),  # its o at 4: 124 clusters at once, 4 would run as a second wave
        (80, 4, 4, True),  # 5120x4096: 320 blocks, 2.4 an SM: 16.4 -> 14.5 µs (grid sweep, H100)
        (400, 4, 5, False),  # qwen3-32b gate_proj: 1600 blocks, 12 an SM
        (80, 8, 13, False),  # qwen3-32b down_proj: splits of 13 steps
        (16, 8, 4, True),  # its k: 128 blocks, at most one an SM
        (8, 16, 7, True),  # 512x28672: 128 blocks, at most one an SM, whatever the split: 15.7 -> 15.4 µs
        (32, 8, 4, True),  # 2048x8192: 256 blocks, 2 an SM, splits of 4 steps: 14.5 -> 14.2 µs
        (16, 16, 4, True),  # Llama-3.1-405B's k: 256 blocks in 16 non-portable clusters: 16.6 -> 14.4 µs
        (16, 16, 8, False),  # 1024x32768: 256 blocks, splits of 8 steps: 21.3 -> 22.0 µs
        (80, 3, 4, True),  # 5120x3072: 240 blocks in 80 clusters: 0.92-1.06x the finish's time
        (16, 17, 4, False),  # more splits than the largest cluster
        (16, 1, 32, False),  # nothing to add
    ],
)
def test_splits_run_as_clusters_only_where_they_measured_faster(units, splits, steps, fits):
    """On a Hopper GPU's clusters at once."""
    plan = (hopper.M8_PER_SM, hopper.SMS)
    assert matmul_kernel.clusters_fit(units, splits, steps, *plan, hopper.M8_CLUSTERS) == fits
    assert not matmul_kernel.clusters_fit(units, splits, steps, *plan, ())  # a GPU without clusters


@pytest.mark.parametrize(
    ("N", "K", "splits", "clustered"),
    [
        (8192, 8192, 2, True),  # finished, 4 splits of 8 steps; 2 in a cluster measured 7% faster
        (4096, 4096, 2, True),  # 4 of 4 -> 2 of 8: 13% faster
        (8192, 5120, 2, True),  # 4 of 5 -> 2 of 10: 7% faster
        (4096, 14336, 8, False),  # 2 of 28 steps, as many on the busiest SM: 5% slower
        (8192, 28672, 4, False),  # 2 of 56: 1-4% slower
        (5120, 8192, 8, True),  # 2 would put 32 steps on the busiest SM against 20; 8 clustered: 24.3 -> 21.9 µs
        (1024, 8192, 8, True),  # clusters of 8 already
    ],
)
def test_two_splits_in_a_cluster_replace_the_finish_where_they_measured_faster(N, K, splits, clustered):
    """The busiest-SM rule (the register-table kernel's) at one and at 8 rows, on a Hopper GPU's
    clusters at once (measured on an H100 on the 8-token kernel of that day, kernels/NOTES.md)."""
    for M in (1, 8):
        g = matmul_kernel.grid_for(M, N, K, 8, hopper.M8_PER_SM, hopper.SMS, hopper.M8_CLUSTERS, rule=BUSIEST)
        assert (g.splits, g.clustered) == (splits, clustered)
        # Without clusters the grid is the finish's, whatever its size.
        assert not matmul_kernel.grid_for(M, N, K, 8, hopper.M8_PER_SM, hopper.SMS, rule=BUSIEST).clustered


# The pair-table kernel's 32-token tile on an H200, every grid of 1-16 splits it ran, each as its time
# over the fastest's (bf16, nested nf4, blocks of 64; 32 rows, 24 alike): kernels/NOTES.md, "The
# pair-table kernel's 32-token tile at two blocks an SM". "2c": 2 clustered splits, "3f": 3 finished.
PAIRS32_TIMED = {
    (28672, 8192): {"1": 1.009, "2c": 1.052, "2f": 1.0, "3c": 1.234, "3f": 1.049, "4c": 1.194, "4f": 1.042},
    (8192, 28672): {"1": 1.268, "2c": 1.0, "2f": 1.028, "3c": 1.335, "3f": 1.113, "4c": 1.331, "4f": 1.032},
    (8192, 8192): {"1": 1.195, "2c": 1.0, "2f": 1.094, "3c": 1.373, "3f": 1.312, "4c": 1.412, "4f": 1.137},
    (25600, 5120): {"1": 1.0, "2c": 1.112, "2f": 1.04, "3c": 1.294, "3f": 1.021, "4c": 1.233, "4f": 1.069},
    (8192, 5376): {"1": 1.147, "2c": 1.0, "2f": 1.059, "3c": 1.331, "3f": 1.282, "4c": 1.509, "4f": 1.221},
}


@pytest.mark.parametrize(("N", "K"), list(PAIRS32_TIMED))
def test_the_pair_table_kernel_at_32_tokens_takes_a_grid_within_1_percent_of_the_fastest_timed(N, K):
    """At 32 rows on Hopper (2 blocks of the pair-table kernel's 32-token tile an SM, clusters) the
    waves rule picks the fastest grid timed, or one within 1% (its price does not move these picks)."""
    g = matmul_kernel.grid_for(32, N, K, 32, hopper.PAIRS32_PER_SM, hopper.SMS, hopper.PAIRS32_CLUSTERS, rule=WAVES)
    name = f"{g.splits}{'c' if g.clustered else 'f'}" if g.splits > 1 else "1"
    assert PAIRS32_TIMED[N, K][name] <= 1.01, (name, g)
    plan = (hopper.PAIRS32_PER_SM, hopper.SMS, hopper.PAIRS32_CLUSTERS)
    assert matmul_kernel.grid_for(24, N, K, 32, *plan, rule=WAVES) == g


@pytest.mark.parametrize(
    ("N", "K", "splits", "clustered"),
    [
        (8192, 8192, 2, True),  # llama-3.3-70b q/o: the pair 27.2 µs (H200), 3 finished splits 28.0
        (8192, 5120, 2, True),  # qwen3-32b q: the pair 19.7 (H200), 3 finished 20.0; H100's sweep 22.1 against 22.0
        (8192, 28672, 3, False),  # llama-3.3-70b down: 3 finished splits, the fastest on both GPUs
        (28672, 8192, 2, True),  # llama-3.3-70b gate: the pair, the fastest on both GPUs
    ],
)
def test_the_16_token_tile_prices_its_finish_at_what_it_cost(N, K, splits, clustered):
    """At 16 rows on Hopper the pair-table kernel's grids under the waves rule with the finish at
    ``WAVES_PRICES[16]`` steps (the recorded sweeps' 16-row cases); the 8-token tile keeps
    ``FINISH_STEPS``, under which the 8192x8192 weight took 3 finished splits."""
    plan = (hopper.PAIRS16_PER_SM, hopper.SMS, hopper.PAIRS16_CLUSTERS)
    g = matmul_kernel.grid_for(16, N, K, 16, *plan, rule=matmul_kernel.WAVES)
    assert (g.splits, g.clustered) == (splits, clustered)
    flat = matmul_kernel.waves_price(8, WAVES)
    assert matmul_kernel.waves_price(16, WAVES).finish_steps > flat.finish_steps == matmul_kernel.FINISH_STEPS
    groups, steps = g.blocks[0], matmul_kernel.steps_of(K, WAVES)
    three = matmul_kernel.waves_grid(groups, 1, steps, 3, *plan, flat)
    if (N, K) == (8192, 8192):  # what the flat finish picked: 3 finished splits cost it less
        assert not three[1].clustered and three[0][0] < matmul_kernel.waves_grid(groups, 1, steps, 2, *plan)[0][0]


@pytest.mark.parametrize(
    ("N", "K", "splits", "clustered"),
    [
        (14336, 4096, 2, True),  # llama-3.1-8b gate: the pair 41.8 µs, the fastest grid
        (14336, 5120, 2, True),  # mistral-nemo-12b gate: the pair 48.5, the fastest
        (21504, 5376, 3, False),  # gemma-3-27b gate: 3 finished splits 69.4 against the pair's 78.3
        (18944, 3584, 3, False),  # qwen2.5-7b gate: 50.5 against 57.1
        (28672, 8192, 1, False),  # llama-3.3-70b gate unsplit: 128.6 against 140.8
        (8192, 8192, 4, False),  # its q: 42.1 against 47.3
        (8192, 28672, 4, False),  # its down: 117.7 against 142.1
    ],
)
def test_the_64_token_tile_takes_a_clustered_pair_where_it_measured_faster(N, K, splits, clustered):
    """At 64 rows on Hopper, the waves rule's grids (the H100 grid sweep's 64-row cases in
    baselines/); without clusters the grid is the finished one of as many splits or, where the pair
    was picked, another finished one."""
    g = matmul_kernel.grid_for(64, N, K, 64, hopper.WIDE64_PER_SM, hopper.SMS, hopper.WIDE64_CLUSTERS, rule=WIDE)
    assert (g.splits, g.clustered) == (splits, clustered)
    unclustered = matmul_kernel.grid_for(64, N, K, 64, hopper.WIDE64_PER_SM, hopper.SMS, rule=WIDE)
    assert not unclustered.clustered and (unclustered.splits == splits or clustered)


@pytest.mark.parametrize(
    ("N", "K", "old", "new"),
    [
        (3072, 3072, (8, 3), (5, 5)),  # phi-3-mini o: 16.4 -> 14.9 µs (H100), 17.3 -> 15.5 (H200)
        (5120, 4096, (6, 6), (3, 11)),  # mistral-nemo-12b o: 23.2 -> 22.0, 23.2 -> 21.7
        (2048, 5376, (14, 3), (7, 6)),  # gemma-3-27b k: 17.5 -> 17.2, 17.5 -> 16.2
        (3584, 3584, (7, 4), (4, 7)),  # qwen2.5-7b q: 19.0 -> 17.0, 18.3 -> 17.8
    ],
)
def test_the_64_token_tile_prices_a_shared_sm_and_the_partial_sums(N, K, old, new):
    """At 64 rows on Hopper (2 blocks an SM) a second block on an SM lengthens each step and the
    finish costs its partial sums' MB (``WAVES_PRICES[64]``): fewer finished splits of more steps,
    one block an SM, where the recorded sweeps timed them faster on both GPUs; priced as the other
    tiles are (flat finish, no sharing), the rule takes the old grid."""
    plan = (hopper.WIDE64_PER_SM, hopper.SMS, hopper.WIDE64_CLUSTERS)
    g = matmul_kernel.grid_for(64, N, K, 64, *plan, rule=WIDE)
    assert (g.splits, g.steps_per_split, g.clustered) == (*new, False)
    assert g.blocks[0] * g.splits <= hopper.SMS < g.blocks[0] * old[0]  # one block an SM, against two
    groups, steps, price = g.blocks[0], matmul_kernel.steps_of(K, WIDE), matmul_kernel.waves_price(64, WIDE)
    assert price.shared_sm_step > 0 and price.finish_steps_per_mb == matmul_kernel.FINISH_STEPS_PER_MB

    assert _cheapest_waves_grid(groups, steps, plan, price, matmul_kernel.partial_sums_mb(64 * N)) == g
    flat = _cheapest_waves_grid(groups, steps, plan)
    assert (flat.splits, flat.steps_per_split) == old


@pytest.mark.parametrize(
    ("N", "K", "splits", "steps"),
    [
        (1024, 16384, 16, 4),  # Llama-3.1-405B's k and v: 16.6 -> 14.4 µs at one row
        (512, 14336, 14, 4),  # 13.5 -> 11.1
        (1536, 8192, 8, 4),  # 14.1 -> 11.7
        (2048, 5376, 7, 3),  # gemma-3-27b k_proj, 3 steps a split: 12.5 -> 10.7 (grid sweep)
        (5376, 4096, 4, 4),  # its o_proj, 336 blocks: 17.2 -> 14.3
        (5120, 8192, 8, 4),  # qwen3-32b o_proj, 640 blocks: 24.3 -> 21.9
    ],
)
def test_more_splits_run_as_a_cluster_where_the_grid_holds_at_most_6_blocks_an_sm(N, K, splits, steps):
    """Finished grids of 3-16 splits of 3-5 steps at up to 6 blocks an SM measured faster as
    clusters on an H100 (kernels/NOTES.md, and the grid sweep of the shapes catalog); with more
    blocks or longer splits, and where a pair pays, they do not become clusters (the busiest-SM
    rule's grids)."""
    for M in (1, 8):
        g = matmul_kernel.grid_for(M, N, K, 8, hopper.M8_PER_SM, hopper.SMS, hopper.M8_CLUSTERS, rule=BUSIEST)
        assert (g.splits, g.steps_per_split, g.clustered) == (splits, steps, True)
        assert g.blocks[0] * splits <= matmul_kernel.LARGE_CLUSTER_BLOCKS_PER_SM * hopper.SMS
        portable = hopper.M8_CLUSTERS[: matmul_kernel.PORTABLE_CLUSTER_BLOCKS + 1]  # without the driver's leave
        g8 = matmul_kernel.grid_for(M, N, K, 8, hopper.M8_PER_SM, hopper.SMS, portable, rule=BUSIEST)
        assert g8.splits == splits and g8.clustered == (splits <= matmul_kernel.PORTABLE_CLUSTER_BLOCKS)
    # 256 blocks with splits of 7 steps; 1600 blocks (12 an SM) of 5 steps.
    for N, K, splits in ((1024, 28672, 16), (25600, 5120, 4)):
        g = matmul_kernel.grid_for(1, N, K, 8, hopper.M8_PER_SM, hopper.SMS, hopper.M8_CLUSTERS, rule=BUSIEST)
        assert (g.splits, g.clustered) == (splits, False), (N, K)


@pytest.mark.parametrize(
    ("N", "K", "pairs", "plain"),
    [
        # gate: 2 clustered splits either way (pair-table 81.8 µs; one unsplit wave and an eighth 104)
        (28672, 8192, (2, 16, True), (2, 16, True)),
        # down: 3 finished splits of 38 steps for the pair-table kernel (78.6 µs; 4 of 28: 94.3)
        (8192, 28672, (3, 38, False), (4, 28, False)),
    ],
)
def test_at_16_rows_the_grid_follows_the_waves_with_3_blocks_an_sm_and_the_busiest_sm_with_4(N, K, pairs, plain):
    """The 16-token pair-table kernel (3 blocks an SM) against the register-table one (4), on their
    Hopper plans (measured on an H100, kernels/NOTES.md)."""
    g = matmul_kernel.grid_for(16, N, K, 16, hopper.PAIRS16_PER_SM, hopper.SMS, hopper.PAIRS16_CLUSTERS, rule=WAVES)
    assert (g.splits, g.steps_per_split, g.clustered) == pairs
    g = matmul_kernel.grid_for(16, N, K, 16, hopper.M8_PER_SM, hopper.SMS, hopper.M8_CLUSTERS, rule=BUSIEST)
    assert (g.splits, g.steps_per_split, g.clustered) == plain


@pytest.mark.parametrize(
    ("N", "K", "grid", "busiest"),
    [
        # H100 grid sweep of the 16-byte-load kernel (µs at one row / 8 rows, the pick against the
        # busiest-SM rule's): the waves rule alone would leave the gate weight unsplit (59.7 / 64.3
        # µs); its clustered pair is the fastest grid (54.7 / 58.9), as on 8192x8192 (21.8 / 23.4).
        (28672, 8192, (2, 16, True), (2, 16, True)),
        (8192, 8192, (2, 16, True), (2, 16, True)),
        (4096, 5376, (7, 3, True), (2, 11, True)),  # gemma-3-27b q_proj: 11.8 / 12.4 against 14.3 / 15.3
        (9216, 3072, (3, 4, True), (4, 3, True)),  # phi-3-mini qkv_proj: 12.8 / 13.7 against 15.6 / 19.0
        (14336, 4096, (2, 8, True), (4, 4, False)),  # llama-3.1-8b gate_proj: 19.6 / 20.9 against 21.3 / 25.8
        # Recorded sweeps, µs at one row on the H100 / H200 (kernels/NOTES.md, "The waves rule's
        # clusters refit on the recorded sweeps"): small weights take clustered splits past the cap,
        # down to one step, while the grid holds at most 2 blocks an SM: llama-3.3-70b k_proj 9.18 /
        # 8.90 against 8 of 4 steps' 9.76 / 9.44, qwen2.5-7b k_proj 7.58 / 7.14 against 8.80 / 8.64;
        # qwen3-32b o_proj clusters of 5 of 7 steps in one wave 18.4 / 18.5 against 6 finished 20.1 / 18.6;
        # qwen3-32b q_proj keeps its pair (15.8 / 15.2) over the 3 clusters of 7 the one wave admits
        # (17.5 / 17.6), and gemma-3-27b k_proj its 7 of 3 (9.2 / 8.9) over 11 of 2 (10.1 / 9.9).
        (1024, 8192, (16, 2, True), (8, 4, True)),
        (512, 3584, (14, 1, True), (4, 4, True)),
        (5120, 8192, (5, 7, True), (8, 4, True)),
        (8192, 5120, (2, 10, True), (2, 10, True)),
        (2048, 5376, (7, 3, True), (7, 3, True)),
        # mistral-nemo down_proj, µs at one / 8 rows: 5 clustered splits of 12 in one wave 26.1 / 27.6
        # (H100) and 26.5 / 28.0 (H200), the 6 finished of 10 before 26.7 / 27.3 and 26.2 / 28.0; 4 of
        # 14 was the fastest on both (23.2 / 25.1, 24.0 / 25.7): the waves cost counts no cluster's size
        (5120, 14336, (5, 12, True), (8, 7, False)),
    ],
)
def test_the_pair_table_kernel_follows_its_waves_and_a_clustered_pair_where_that_runs_as_few_steps(N, K, grid, busiest):
    """The 8-token pair-table kernel's rule (WAVES, 4 blocks an SM): the waves rule's grid, or two
    splits in a cluster where that grid is not clustered and the pair's busiest SM runs no more
    steps (the busiest-SM rule's own pair). On the recorded sweeps (tests/test_grid_sweep.py) the
    busiest-SM rule picked 1.101x the fastest grid on the H100's sweep of this kernel and 1.067 /
    1.077x on the H100's and H200's of the 8-byte-load one; this rule 1.045, 1.031 and 1.043x
    before its clusters' refit, 1.022x on the H100's sweep and 1.014x on the H200's after."""
    for M in (1, 8):
        g = matmul_kernel.grid_for(M, N, K, 8, hopper.M8_PER_SM, hopper.SMS, hopper.M8_CLUSTERS, rule=WAVES)
        assert (g.splits, g.steps_per_split, g.clustered) == grid, M
        g = matmul_kernel.grid_for(M, N, K, 8, hopper.M8_PER_SM, hopper.SMS, hopper.M8_CLUSTERS, rule=BUSIEST)
        assert (g.splits, g.steps_per_split, g.clustered) == busiest, M


@pytest.mark.gpu
def test_the_stand_in_hopper_plans_are_what_the_driver_reports_on_a_hopper_gpu(cuda):
    """tests/hopper_plans.py holds the grid tests' plans: on an H100 or H200 the live plans match (on
    a GPU without clusters, no plan has any)."""
    hopper_gpu = launcher.device_arch(cuda.index) == "sm_90"
    if not hopper_gpu or torch.cuda.get_device_properties(cuda).multi_processor_count != hopper.SMS:
        for rows, nested in itertools.product((1, *matmul_kernel.TOKEN_TILES), (False, True)):
            plan = matmul_kernel.plan(matmul_kernel.variant_for("bf16", "nf4", nested, rows, LARGE), cuda.index)
            assert hopper_gpu or plan.max_clusters == (), (rows, nested)
        return
    expected = {  # by the rows of a call: its variant (1 row of nested weights: the few-rows build)
        (1, True): (hopper.M8_PER_SM, hopper.M8_CLUSTERS),
        (8, True): (hopper.M8_PER_SM, hopper.M8_CLUSTERS),
        (16, False): (hopper.M8_PER_SM, hopper.M8_CLUSTERS),
        (16, True): (hopper.PAIRS16_PER_SM, hopper.PAIRS16_CLUSTERS),
        (32, True): (hopper.PAIRS32_PER_SM, hopper.PAIRS32_CLUSTERS),
        (32, False): (hopper.WIDE32_PER_SM, ()),
        (64, True): (hopper.WIDE64_PER_SM, hopper.WIDE64_CLUSTERS),
        (128, True): (hopper.WIDE128_PER_SM, ()),
    }
    for (rows, nested), (per_sm, clusters) in expected.items():
        plan = matmul_kernel.plan(matmul_kernel.variant_for("bf16", "nf4", nested, rows, LARGE), cuda.index)
        assert (plan.blocks_per_sm, plan.sms, plan.max_clusters) == (per_sm, hopper.SMS, clusters), (rows, nested)


@pytest.mark.gpu
def test_a_plan_made_on_a_thread_without_a_cuda_context_leaves_it_without_one(cuda, monkeypatch):
    """The driver answers a plan's questions (blocks an SM, clusters at once) only in a context: a
    thread that never used CUDA has none, and has none after. Its plan is the one made here."""
    import threading

    from cuda.bindings import driver

    variant = matmul_kernel.MatmulVariant("bf16", "nf4", True, 8)
    seen: dict = {}

    def plan_on_a_new_thread():
        try:
            seen["before"] = int(driver.cuCtxGetCurrent()[1])
            seen["plan"] = matmul_kernel.plan(variant, cuda.index)
            seen["after"] = int(driver.cuCtxGetCurrent()[1])
        except Exception as e:  # raised again on the test's thread
            seen["error"] = e

    monkeypatch.setattr(matmul_kernel, "_plans", {})  # asked again, not read from the cache
    thread = threading.Thread(target=plan_on_a_new_thread)
    thread.start()
    thread.join()
    if "error" in seen:
        raise seen["error"]
    assert seen["before"] == 0 and seen["after"] == 0
    monkeypatch.setattr(matmul_kernel, "_plans", {})
    here = matmul_kernel.plan(variant, cuda.index)
    assert (seen["plan"].blocks_per_sm, seen["plan"].max_clusters) == (here.blocks_per_sm, here.max_clusters)


def test_the_kernels_with_the_cluster_epilogue_and_their_cluster_sizes():
    """The decode kernels (8 and 16 tokens, plain and nested scales; the pair-table kernel's 32-token
    tile too) add up to 16 splits in a cluster from sm_90 on, the Hopper kernel at 64 tokens pairs;
    the others never (the compile spec tells the kernel, MM_CLUSTER_SPLITS)."""
    from harness.runtime import jit

    for nested in (False, True):
        sizes = {
            (tokens, arch): matmul_kernel.MatmulVariant("fp16", "fp4", nested, tokens).cluster_splits(arch)
            for tokens, arch in itertools.product(matmul_kernel.TOKEN_TILES, jit.CHECKED_ARCHS)
        }
        decode = {(8, "sm_90"): 16, (16, "sm_90"): 16} | ({(32, "sm_90"): 16} if nested else {})
        assert {key: n for key, n in sizes.items() if n} == decode | {(64, "sm_90"): 2}


def test_a_kernel_asked_for_clusters_below_sm_90_does_not_compile():
    """The cluster epilogue's PTX needs sm_90: the kernel refuses the macro rather than the driver."""
    from harness.runtime import jit

    variant = matmul_kernel.MatmulVariant("bf16", "nf4", True, 8)
    spec = matmul_kernel.spec_for(variant, "sm_80")
    asked = dataclasses.replace(spec, macros=tuple((k, "8" if k == "MM_CLUSTER_SPLITS" else v) for k, v in spec.macros))
    with pytest.raises(KernelCompileError, match="thread block clusters need sm_90"):
        jit.compile_kernel(asked, use_cache=False)


def test_a_grid_of_448_groups_on_132_sms_is_split_in_two():
    """Unsplit, some SMs would run 4 blocks and others 3 (the measured case, kernels/NOTES.md)."""
    assert all(matmul_kernel.grid_for(1, 28672, 8192, 8, 4, 132, rule=rule).splits == 2 for rule in (BUSIEST, WAVES))


def test_the_12_warp_build_of_the_128_token_tile_is_built_and_offered_on_hopper_only():
    """The wgmma kernel's second build (WIDE_WARPS) is compiled for sm_90 alone (sm_80's kernel would
    spill) and offered there as the 8-warp build's alternative, never the other way round; no other
    tile has one."""
    from harness.runtime import jit

    wide = {v for v in matmul_kernel.all_variants() if v.warps != matmul_kernel.WARPS[v.tokens]}
    assert {(v.tokens, v.warps) for v in wide} == {(128, 12)} and len(wide) == 8
    for arch in jit.CHECKED_ARCHS:
        built = set(matmul_kernel.all_variants(arch))
        assert (wide <= built) == (arch in matmul_kernel.WGMMA_TARGETS) == bool(wide & built), arch
    for v in wide:
        first = dataclasses.replace(v, warps=0)
        assert first.warps == 8 and first.alternative("sm_90") == v and first.alternative("sm_89") is None
        assert (
            v.alternative("sm_90") is None and v.name.endswith("-w12") and dict(v.macros("sm_90"))["MM_WARPS"] == "12"
        )
    for tokens in (8, 16, 32, 64):
        assert matmul_kernel.MatmulVariant("bf16", "nf4", True, tokens).alternative("sm_90") is None
        with pytest.raises(ValueError, match="no 12-warp build"):
            matmul_kernel.MatmulVariant("bf16", "nf4", True, tokens, warps=12)


# Weights at 128 rows and the build the cost picks on an H100 (132 SMs, one block an SM), as the
# sweep of both builds measured the faster (kernels/NOTES.md, "Twelve warps at 128 tokens").
PICKS_128 = {
    (28672, 8192): 8, (21504, 5376): 12, (18944, 3584): 12, (8192, 28672): 12, (8192, 8192): 12,
    (1024, 8192): 8, (16384, 3072): 8, (14336, 4096): 8, (4096, 4096): 8, (512, 3584): 8,
}  # fmt: skip


def test_a_128_row_call_takes_the_build_whose_grid_costs_less():
    """``pick_plan`` compares the waves cost of each build's grid times its step time: the wider
    blocks win where their grid divides among the SMs no worse (and tie goes to the first)."""
    plans = hopper.wide128_plans()
    assert set(plans) == {8, 12}
    for (N, K), warps in PICKS_128.items():
        assert matmul_kernel.cheapest((plans[8], plans[12]), 128, N, K, 128).warps == warps, (N, K)
        cost = {w: p.cost(128, N, K, 128) for w, p in plans.items()}
        assert (cost[12] < cost[8]) == (warps == 12)
        grid = plans[12].grid(128, N, K, 128)
        partial_mb = grid.workspace_elements(128, N) * 4 / 1e6
        assert cost[12] == pytest.approx(matmul_kernel.waves_cost(grid, 1, hopper.SMS) * 1.24 + 0.2 * partial_mb)
    # The gate weight: the 12-warp build's own grid (4 splits, 59 MB of partial sums) costs less
    # by the waves alone, more with the finish's read of the sums (the measured order).
    grid = plans[12].grid(128, 28672, 8192, 128)
    assert grid.splits == 4 and matmul_kernel.waves_cost(grid, 1, hopper.SMS) * 1.24 < plans[8].cost(
        128, 28672, 8192, 128
    )
    small = {w: p.cost(128, 48, 96, 128) for w, p in plans.items()}  # one block either way
    assert small[12] > small[8] and matmul_kernel.cheapest((plans[8], plans[12]), 128, 48, 96, 128) is plans[8]
    variant = matmul_kernel.MatmulVariant("bf16", "nf4", True, 128)
    offered = dataclasses.replace(plans[8], alternative=variant.alternative("sm_90"))

    def plan_of(v, device):
        assert device == 3
        return offered if v == variant else plans[v.warps]

    assert matmul_kernel.pick_plan(variant, 3, 128, 21504, 5376, plan_of) is plans[12]
    assert matmul_kernel.pick_plan(variant, 3, 128, 1024, 8192, plan_of) is offered
    assert matmul_kernel.pick_plan(variant, 3, 128, 21504, 5376, lambda v, d: plans[8]) is plans[8]  # none offered


def test_the_grid_steps_k_as_each_kernel_source_does():
    """The grid's steps must be the kernel's own, or splits would cover too much or too little of K."""
    import re

    from harness.runtime import jit

    for tokens, arch, nested in itertools.product(matmul_kernel.TOKEN_TILES, jit.CHECKED_ARCHS, (False, True)):
        variant = matmul_kernel.MatmulVariant("bf16", "nf4", nested, tokens)
        source, _ = variant.build(arch)
        defined = re.search(r"^#define STEP_K (\d+)", (jit.kernels_dir() / source).read_text(), re.MULTILINE)
        assert defined and int(defined.group(1)) == matmul_kernel.step_k(variant.grid_rule(arch)), source


def test_the_kernel_takes_k_in_multiples_of_32_and_blocks_of_32_or_more():
    assert matmul_kernel.takes_shape(8192, 64) and matmul_kernel.takes_shape(96, 32)
    assert not matmul_kernel.takes_shape(100, 64) and not matmul_kernel.takes_shape(0, 64)


def _host_state(N=48, K=96, nested=False, device="cpu"):
    return SimpleNamespace(
        absmax=torch.ones(N * K // 64, device=device), shape=torch.Size([N, K]), dtype=torch.bfloat16, blocksize=64,
        quant_type="nf4", nested=nested, state2=None, offset=None,
    )  # fmt: skip


# Bad out and bias (N = 48 output features, A [3, 96] bf16): rejected before anything runs,
# on host tensors as on the GPU (the fallback used to fail inside F.linear or the copy into out,
# after its kernels ran).
OUT_AND_BIAS = {
    "out-shape": ({"out": (4, 48)}, r"Expected out.shape == \(3, 48\), got torch.Size\(\[4, 48\]\)"),
    "out-flat": ({"out": (144,)}, r"Expected out.shape == \(3, 48\)"),
    "bias-short": (
        {"bias": (47,)},
        r"bias must hold the weight's 48 output features \(or one value\), got shape \(47,\)",
    ),
    "bias-2d": ({"bias": (1, 48)}, "bias must hold the weight's 48 output features"),
    "bias-fp32": (
        {"bias": (48,), "bias_dtype": torch.float32},
        "bias must be torch.bfloat16 like A, got torch.float32",
    ),
    "bias-list": ({"bias": "list"}, "bias must be a torch.Tensor, got list"),
    "out-list": ({"out": "list"}, "out must be a torch.Tensor, got list"),
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", list(OUT_AND_BIAS))
def test_a_bad_out_or_bias_is_an_input_error_before_anything_runs(monkeypatch, case, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible")
    what, message = OUT_AND_BIAS[case]
    A = torch.zeros(3, 96, dtype=torch.bfloat16, device=device)
    B = torch.zeros(48 * 96 // 2, 1, dtype=torch.uint8, device=device)
    out = what.get("out")
    if out == "list":
        out = [[0.0] * 48] * 3
    elif out is not None:
        out = torch.empty(out, dtype=A.dtype, device=device)
    bias = what.get("bias")
    if bias == "list":
        bias = [0.0] * 48
    elif bias is not None:
        bias = torch.zeros(bias, dtype=what.get("bias_dtype", A.dtype), device=device)

    def ran(*args, **kwargs):
        raise AssertionError("a kernel path ran before the input error")

    # api binds dequantize_packed by name when first imported: imported above (never while this
    # patch stands, which would leave it bound for the rest of the process), and patched here too.
    monkeypatch.setattr(matmul, "try_fused", ran)
    monkeypatch.setattr(dequantize, "dequantize_packed", ran)
    monkeypatch.setattr(api, "dequantize_packed", ran)
    with pytest.raises(InputError, match=message):
        harness.matmul_4bit(A, B.t(), _host_state(device=device), out=out, bias=bias)


def test_the_out_and_bias_rules_are_read_in_the_order_the_check_hands_them_over():
    assert [operand.arg for operand in matmul_kernel.OPERANDS] == ["out", "bias"]


def test_a_bias_of_one_value_and_an_out_of_another_dtype_are_still_taken():
    """What bitsandbytes takes stays taken: a bias of one value (F.linear broadcasts it), and an
    out the result is copied into."""
    A = torch.zeros(3, 96, dtype=torch.bfloat16)
    matmul.check_out_and_bias(A, 48, torch.empty(3, 48, dtype=torch.float32), torch.zeros(1, dtype=A.dtype))
    matmul.check_out_and_bias(A, 48, None, torch.zeros((), dtype=A.dtype))
    # Neither needs to be dense (F.linear and the copy take any layout), nor out on A's device.
    matmul.check_out_and_bias(A, 48, torch.empty(3, 48, device="meta"), None)
    matmul.check_out_and_bias(A, 48, torch.empty(48, 3, dtype=A.dtype).t(), torch.zeros(96, dtype=A.dtype)[::2])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda A, B, qs: harness.matmul_4bit(A, B, None), "quant_state is required"),
        (lambda A, B, qs: harness.matmul_4bit(A.tolist(), B, qs), "A must be a torch.Tensor"),
        (lambda A, B, qs: harness.matmul_4bit(A, B, qs, out=[0]), "out must be a torch.Tensor"),
        (lambda A, B, qs: harness.matmul_4bit(A, B, SimpleNamespace(**{**vars(qs), "shape": (2, 48, 96)})), "2D"),
        (lambda A, B, qs: harness.matmul_4bit(A[:, :64], B, qs), "A has 64 features but the weight takes 96"),
        (
            lambda A, B, qs: harness.matmul_4bit(A, B, qs),
            "must be on a CUDA device, got cpu: the drop-ins are CUDA-only",
        ),
        (lambda A, B, qs: harness.matmul_4bit(A, B, "state"), "quant_state must be a bitsandbytes QuantState"),
    ],
    ids=["no-state", "A-list", "out-list", "3d-weight", "k-mismatch", "host", "not-a-state"],
)
def test_what_it_cannot_take_is_an_input_error_before_any_launch(call, message):
    A, B = torch.zeros(3, 96, dtype=torch.bfloat16), torch.zeros(48 * 96 // 2, 1, dtype=torch.uint8)
    with pytest.raises(InputError, match=message):
        call(A, B, _host_state())


def test_empty_input_gives_an_empty_result_as_bitsandbytes():
    B, qs = torch.zeros(48 * 96 // 2, 1, dtype=torch.uint8), _host_state()
    assert harness.matmul_4bit(torch.zeros(0, 96, dtype=torch.bfloat16), B, qs).shape == (0, 48)
    assert harness.matmul_4bit(torch.zeros(2, 0, 96, dtype=torch.bfloat16), B, qs).shape == (2, 0, 48)
    out = torch.empty(0, 48, dtype=torch.bfloat16)
    assert harness.matmul_4bit(torch.zeros(0, 96, dtype=torch.bfloat16), B, qs, out=out) is out


# --- on the GPU --------------------------------------------------------------------------------

DTYPES = [torch.bfloat16, torch.float16]


def _weights(N, K, quant_type, blocksize, nested, dtype, seed, device):
    A, qs = cases.quantize_weights((N, K), quant_type, blocksize, nested, dtype, seed, device=device)
    fields, nested_args = dequantize.quant_state_args(qs)
    absmax, bs, qt, shape, _ = fields
    W = dequantize.dequantize_packed(A, absmax, bs, qt, shape, dtype, **nested_args)  # our kernel's bits
    return A, qs, W


FORMATS = list(itertools.product(["nf4", "fp4"], DTYPES, [32, 64, 256], [False, True]))


@pytest.mark.gpu
@pytest.mark.parametrize(("quant_type", "dtype", "blocksize", "nested"), FORMATS, ids=str)
# K = 320: the 8-token kernel's partial last step with one table per 64 k (K % 64 == 0), and the
# wide kernel's; K = 384: the pair-table kernel's 16-byte weight loads (K % 128 == 0) ending in a
# half step; K = 4192: both kernels' partial steps with K % 64 == 32 (a table per 32-k half).
@pytest.mark.parametrize(("N", "K"), [(48, 320), (48, 384), (200, 4096 + 96)], ids=["48x320", "48x384", "200x4192"])
# Every build and tile, tails, several tiles (17 and 32: two 16-token tiles of these small weights).
@pytest.mark.parametrize("M", [1, 2, 5, 8, 12, 16, 17, 32, 33, 64, 100, 256])
def test_one_hot_rows_give_the_kernels_weights_bit_for_bit(
    cuda, run_seed, quant_type, dtype, blocksize, nested, N, K, M
):
    """A one-hot row gives each feature's weight as the kernel forms it: the dequantization
    kernel's bits, or round(fp32(scale * round(code))) (the pair-table kernel: nested weights up to 32 rows)."""
    B, qs, W = _weights(N, K, quant_type, blocksize, nested, dtype, run_seed, cuda)
    A, columns = mr.one_hot_rows(M, K, dtype, cuda, run_seed)
    out = poison_(torch.empty(M, N, dtype=dtype, device=cuda))
    matmul.fused_matmul(A, B.t(), qs, out=out)
    arithmetic = mr.arithmetic_of(M, nested)
    expected = mr.one_hot_weights(arithmetic, B, qs, W)[:, columns].t().contiguous()
    assert_bit_exact(out, expected, f"one-hot {arithmetic} {quant_type} {dtype} bs{blocksize} nested={nested} M={M}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("quant_type", "dtype", "blocksize"), [("nf4", torch.bfloat16, 64), ("fp4", torch.float16, 256)], ids=str
)
@pytest.mark.parametrize("M", [17, 32])
def test_17_to_32_rows_of_a_nested_weight_past_the_two_tile_size_run_the_pair_table_kernel_at_32_tokens(
    cuda, bnb, run_seed, quant_type, dtype, blocksize, M
):
    """The other side of ``matmul_kernel.tile_for``'s line (the small weights' side is the one-hot
    test above): the pair-table kernel's 32-token tile, whose one-hot rows give the scaled sums'
    weights (the 16-token tile's arithmetic), random rows in the bound and no farther from the fp64
    reference than bitsandbytes' own result (up to 1%), and whose output on any grid
    is two 16-token tiles' bit for bit on the same grid (the same fp32 sums, token for token)."""
    import bitsandbytes

    K = 4096 + 96
    N = features_past_two_tiles(K)
    variant = matmul_kernel.variant_for(dtypes.ACTIVATION_NAME[dtype], quant_type, True, M, N * K)
    assert variant.tokens == 32 and variant.build(launcher.device_arch(cuda.index))[0] == matmul_kernel.SOURCE_M8_PAIRS
    B, qs, W = _weights(N, K, quant_type, blocksize, True, dtype, run_seed, cuda)
    A, columns = mr.one_hot_rows(M, K, dtype, cuda, run_seed)
    out = matmul.fused_matmul(A, B.t(), qs, out=poison_(torch.empty(M, N, dtype=dtype, device=cuda)))
    assert mr.arithmetic_of(M, True) == "scaled-sums"
    expected = mr.one_hot_weights("scaled-sums", B, qs, W)[:, columns].t().contiguous()
    assert_bit_exact(out, expected, f"one-hot {quant_type} {dtype} M={M}, {N}x{K}")
    R = torch.randn(M, K, generator=cases.seeded_generator(run_seed + M, cuda), device=cuda).to(dtype)
    reference = mr.fused_reference(R, B, qs, W, None, dtype)
    judged = mr.judge(matmul.fused_matmul(R, B.t(), qs), reference)
    theirs = mr.judge(bitsandbytes.matmul_4bit(R, B.t(), qs), reference)
    assert judged.ok and judged.error_norm <= 1.01 * theirs.error_norm + 1e-6, (judged, theirs)
    steps = matmul_kernel.steps_of(K, matmul_kernel.WAVES)
    groups = -(-N // matmul_kernel.features_per_block(32))
    clusters = variant.cluster_splits(launcher.device_arch(cuda.index)) > 0
    for splits, clustered in ((1, False), (2, clusters), (3, False), (5, clusters)):
        per_split = -(-steps // splits)
        grids = {t: matmul_kernel.Grid((groups, splits, -(-M // t)), per_split, clustered) for t in (16, 32)}
        got = {t: matmul.fused_matmul_on_grid(R, B.t(), qs, grids[t], tokens=t) for t in (16, 32)}
        assert_bit_exact(got[32], got[16], f"32-token tile against two 16-token tiles, {splits} splits, M={M}")


# Columns where a one-row call's lanes, blocks and steps meet: both 32-k halves of a block, a 256-k
# step's four blocks, a step boundary, the first and last k.
_ONE_ROW_COLUMNS = (0, 31, 32, 63, 64, 127, 191, 255, 256, 2047)


@pytest.mark.gpu
@pytest.mark.parametrize(("quant_type", "dtype"), list(itertools.product(["nf4", "fp4"], DTYPES)), ids=str)
@pytest.mark.parametrize(
    ("K", "code_shift"), [(2048, 0), (2048, 1), (2048 + 128, 0)], ids=["k2048", "codes-odd", "k2176"]
)
def test_one_row_calls_give_the_emulated_bits_at_every_block_and_step_boundary(
    cuda, run_seed, quant_type, dtype, K, code_shift
):
    """One-hot rows at the columns where lanes, blocks and steps meet (and 16 random ones), one
    call of one row each (the few-rows build), give round(fp32(scale * round(code))) for all 200
    features (the last block's features past N clamped), also with the scale codes at an odd
    address (the kernel reads them a byte at a time) and K % 256 != 0; a random row stays in the
    fp64 bound. (The one-hot matrix above draws one column a row.)"""
    N = 200
    B, qs, W = _weights(N, K, quant_type, 64, True, dtype, run_seed, cuda)
    if code_shift:  # the same codes one byte further on
        moved = torch.empty(qs.absmax.numel() + code_shift, dtype=qs.absmax.dtype, device=cuda)[code_shift:]
        qs.absmax = moved.copy_(qs.absmax)
        assert qs.absmax.data_ptr() % 2 == 1
    expected = mr.one_hot_weights(mr.arithmetic_of(1, True), B, qs, W)
    g = torch.Generator().manual_seed(run_seed)
    columns = [c for c in _ONE_ROW_COLUMNS if c < K] + torch.randint(0, K, (16,), generator=g).tolist()
    for c in columns:
        A = torch.zeros(1, K, dtype=dtype, device=cuda)
        A[0, c] = 1.0
        out = poison_(torch.empty(1, N, dtype=dtype, device=cuda))
        matmul.fused_matmul(A, B.t(), qs, out=out)
        assert_bit_exact(out[0], expected[:, c].contiguous(), f"one-hot column {c}, K={K}, codes +{code_shift}")
    R = torch.randn(1, K, generator=cases.seeded_generator(run_seed, cuda), device=cuda).to(dtype)
    judged = mr.judge(matmul.fused_matmul(R, B.t(), qs), mr.fused_reference(R, B, qs, W, None, dtype))
    assert judged.ok, judged


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("quant_type", "dtype", "blocksize", "nested", "M"),
    [
        (*formats, M)
        for formats in [
            ("nf4", torch.bfloat16, 64, True),
            ("fp4", torch.float16, 32, False),
            ("nf4", torch.float16, 256, False),
        ]
        for M in (17, 64, 100, 130)  # the 32-, 64- and 128-token tiles, and two of 128
        if not (formats[3] and M <= 32)  # nested weights run 17-32 rows on the pair-table kernel
    ],
    ids=str,
)
def test_the_mma_sync_wide_kernel_runs_here_as_on_gpus_before_hopper(
    cuda, run_seed, monkeypatch, quant_type, dtype, blocksize, nested, M
):
    """kernels/matmul_4bit.cu, the wide tiles of GPUs without wgmma (A100, L4), built for this GPU
    with the wgmma build withheld, so that its code runs wherever the suite runs (on Hopper the
    drop-in takes matmul_4bit_sm90.cu): one-hot rows give the dequantization kernel's bits, random
    rows stay in the fp64 bound. Fresh plan and kernel caches: the two builds share a name."""
    monkeypatch.setattr(matmul_kernel, "WGMMA_TARGETS", {})
    monkeypatch.setattr(matmul_kernel, "_plans", {})
    monkeypatch.setattr(launcher, "_loaded", {})
    K, N = 4096 + 96, 200  # a partial last step
    variant = matmul_kernel.variant_for(dtypes.ACTIVATION_NAME[dtype], quant_type, nested, M, N * K)
    assert variant.build(launcher.device_arch(cuda.index))[0] == matmul_kernel.SOURCE_WIDE
    B, qs, W = _weights(N, K, quant_type, blocksize, nested, dtype, run_seed, cuda)
    A, columns = mr.one_hot_rows(M, K, dtype, cuda, run_seed)
    g = cases.seeded_generator(run_seed + M, cuda)
    R = torch.randn(M, K, generator=g, device=cuda).to(dtype)
    with host_path.python_path_only():
        one_hot = matmul.fused_matmul(A, B.t(), qs, out=poison_(torch.empty(M, N, dtype=dtype, device=cuda)))
        random_rows = matmul.fused_matmul(R, B.t(), qs)
    expected = mr.one_hot_weights(mr.arithmetic_of(M, nested), B, qs, W)[:, columns].t().contiguous()
    assert_bit_exact(one_hot, expected, f"one-hot, matmul_4bit.cu {quant_type} {dtype} bs{blocksize} M={M}")
    judged = mr.judge(random_rows, mr.fused_reference(R, B, qs, W, None, dtype))
    assert judged.ok, judged


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("quant_type", "dtype", "nested"), [("nf4", torch.bfloat16, True), ("fp4", torch.float16, False)], ids=str
)
# Full 128-token tiles over whole steps (the staging's path without predicates), two of them, a
# partial tile, and full and partial tiles ending in a partial k step; N = 200: a partial feature group.
@pytest.mark.parametrize(("M", "K"), [(128, 4096), (256, 4096), (100, 4096), (200, 4096 + 96), (128, 4096 + 96)])
def test_every_build_of_the_128_token_tile_gives_the_one_hot_bits(
    cuda, run_seed, monkeypatch, quant_type, dtype, nested, M, K
):
    """Each build of the 128-token tile this GPU has (on Hopper the 8-warp one and its 12-warp
    alternative, which ``pick_plan`` gives only some weights), forced in turn: one-hot rows give the
    dequantization kernel's bits, random rows stay in the bound."""
    N = 200
    variant = matmul_kernel.variant_for(dtypes.ACTIVATION_NAME[dtype], quant_type, nested, M, N * K)
    assert variant.tokens == 128
    arch = launcher.device_arch(cuda.index)
    builds = [variant] + [v for v in [variant.alternative(arch)] if v is not None]
    assert len(builds) == (2 if arch in matmul_kernel.WGMMA_TARGETS else 1), arch
    B, qs, W = _weights(N, K, quant_type, 64, nested, dtype, run_seed, cuda)
    A, columns = mr.one_hot_rows(M, K, dtype, cuda, run_seed)
    R = torch.randn(M, K, generator=cases.seeded_generator(run_seed + M, cuda), device=cuda).to(dtype)
    expected = mr.one_hot_weights(mr.arithmetic_of(M, nested), B, qs, W)[:, columns].t().contiguous()
    reference = mr.fused_reference(R, B, qs, W, None, dtype)
    for build in builds:
        forced, picked = matmul_kernel.plan(build, cuda.index), []
        monkeypatch.setattr(
            matmul_kernel, "pick_plan", lambda *args, plan_of=None, p=forced, seen=picked: seen.append(p) or p
        )
        with host_path.python_path_only():
            one_hot = matmul.fused_matmul(A, B.t(), qs, out=poison_(torch.empty(M, N, dtype=dtype, device=cuda)))
            random_rows = matmul.fused_matmul(R, B.t(), qs)
        label = f"{build.name} M={M} K={K}"
        assert len(picked) >= 2, f"{label}: the calls did not go through pick_plan"
        assert_bit_exact(one_hot, expected, f"one-hot, {label}")
        judged = mr.judge(random_rows, reference)
        assert judged.ok, (label, judged)


@pytest.mark.gpu
@pytest.mark.parametrize(("quant_type", "nested"), [("nf4", True), ("fp4", True), ("fp4", False)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", [1, 2, 3, 8, 16, 17, 32, 64, 65, 200, 1024])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_random_rows_stay_in_the_bound_and_no_worse_than_bitsandbytes(
    cuda, bnb, run_seed, quant_type, nested, dtype, M, with_bias
):
    import bitsandbytes

    N, K = 320, 2048
    B, qs, W = _weights(N, K, quant_type, 64, nested, dtype, run_seed, cuda)
    g = cases.seeded_generator(run_seed + M, cuda)
    A = torch.randn(M, K, generator=g, device=cuda).to(dtype)
    bias = torch.randn(N, generator=g, device=cuda).to(dtype) if with_bias else None
    ref = mr.fused_reference(A, B, qs, W, bias, dtype)
    ours = mr.judge(harness.matmul_4bit(A, B.t(), qs, bias=bias), ref)
    theirs = mr.judge(bitsandbytes.matmul_4bit(A, B.t(), qs, bias=bias), ref)
    assert ours.ok, ours
    # "No worse" up to 1%: two fp32 summation orders of equal accuracy differ by chance.
    assert ours.error_norm <= 1.01 * theirs.error_norm + 1e-6, (ours, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_fallback_is_our_dequantization_and_f_linear_bit_for_bit(cuda, run_seed, dtype):
    N, K = 96, 512
    B, qs, W = _weights(N, K, "nf4", 64, True, dtype, run_seed, cuda)
    g = cases.seeded_generator(run_seed, cuda)
    big = torch.randn(crossover_m(cuda.index, N * K) + 1, K, generator=g, device=cuda).to(dtype)
    misaligned = torch.randn(4 * K + 1, generator=g, device=cuda).to(dtype)[1:].view(4, K)
    for name, A in (("above the crossover", big), ("misaligned", misaligned)):
        assert_bit_exact(harness.matmul_4bit(A, B.t(), qs), torch.nn.functional.linear(A, W), name)
    A = big[:8].clone().requires_grad_(True)
    got = harness.matmul_4bit(A, B.t(), qs)
    assert_bit_exact(got.detach(), torch.nn.functional.linear(A.detach(), W), "with gradients")
    got.sum().backward()
    assert_bit_exact(A.grad, torch.ones(8, N, dtype=dtype, device=cuda) @ W, "input gradient")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 64])
def test_split_k_gives_the_same_bits_on_every_run(cuda, run_seed, M):
    """Splits of K are added in split order, never by atomics: blocks finishing in another order
    must not change a bit (the first version's atomic adds failed this)."""
    N, K = 320, 8192
    B, qs, _W = _weights(N, K, "nf4", 64, True, torch.bfloat16, run_seed, cuda)
    A = torch.randn(M, K, device=cuda).to(torch.bfloat16)
    assert matmul.fused_matmul(A, B.t(), qs) is not None
    variant = matmul_kernel.variant_for("bf16", "nf4", True, M, N * K)
    assert matmul_kernel.plan(variant, cuda.index).grid(M, N, K, variant.tokens).splits > 1, "the case must split K"
    first = matmul.fused_matmul(A, B.t(), qs)
    for run in range(20):
        assert_bit_exact(matmul.fused_matmul(A, B.t(), qs), first, f"run {run}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("M", "K", "dtype", "bias", "nested", "pair"),
    [
        (1, 4096, torch.bfloat16, False, True, False),
        (3, 4096, torch.float16, True, True, False),
        (8, 4096, torch.bfloat16, True, True, False),
        (5, 16384, torch.bfloat16, True, True, False),  # 16 splits: a cluster past the portable size of 8
        (40, 4096, torch.float16, True, True, False),  # the 64-token tile, 40 rows of it
        (100, 4096, torch.bfloat16, False, True, False),  # the 128-token tile (no cluster epilogue: the finish)
        # Clusters of two splits (the large weights' grid at 1-16 rows on an H200), every decode build:
        (1, 4096, torch.bfloat16, True, True, True),  # the columns form on a GPU that runs it
        (3, 8192, torch.float16, False, True, True),
        (8, 4096, torch.bfloat16, True, True, True),
        (12, 4096, torch.float16, True, True, True),  # the 16-token tile, 4 of its tokens past M
        (16, 8192, torch.bfloat16, False, True, True),
        (6, 4096, torch.bfloat16, True, False, True),  # the plain scales' kernel
        (16, 4096, torch.float16, True, False, True),
        # The pair-table kernel's 32-token tile (a weight past TWO_TILE_ELEMENTS: 330 x 40960), 8 rows past M
        (24, 40960, torch.bfloat16, True, True, False),
        (32, 40960, torch.float16, False, True, True),
    ],
)
def test_a_cluster_adds_the_splits_to_the_finish_kernels_bits(
    cuda, run_seed, monkeypatch, M, K, dtype, bias, nested, pair
):
    """Where the GPU has thread block clusters, the kernels with the cluster epilogue (the 8- and
    16-token ones with either scales, up to 16 splits; on Hopper the 64-token one, in pairs) add
    their splits of K inside their cluster, in split order with the finish kernel's fp32 adds: the
    same bits as the finish (features past N, tokens past M and the bias included), in clusters of
    the rule's size and in pairs, including the columns form's. Elsewhere, and for the other tiles,
    the finish adds them."""
    N = 330
    variant = matmul_kernel.variant_for(dtypes.ACTIVATION_NAME[dtype], "nf4", nested, M, N * K)
    tokens = variant.tokens
    plan = matmul_kernel.plan(variant, cuda.index)
    sizes = variant.cluster_splits(launcher.device_arch(cuda.index))
    assert len(plan.max_clusters) == (sizes + 1 if sizes else 0)
    # The driver took the 8-token kernel's leave to run clusters past the portable size.
    assert not sizes or plan.max_clusters[sizes] > 0, plan.max_clusters
    wide = matmul_kernel.plan(matmul_kernel.MatmulVariant(variant.dtype, "nf4", False, 32), cuda.index)
    assert wide.max_clusters == () and not wide.grid(32, N, K, 32).clustered
    grid = plan.grid(M, N, K, tokens)
    assert grid.splits > 1, "the case must split K"
    if not sizes:
        assert grid.finished, "a split K without the cluster epilogue is the finish's"
        return
    if pair or plan.rule == WIDE:  # (the wide tile's grid is 5 finished splits)
        steps = matmul_kernel.steps_of(K, plan.rule)
        grid = matmul_kernel.Grid((grid.blocks[0], 2, grid.blocks[2]), steps // 2, True)
        monkeypatch.setattr(matmul_kernel.Plan, "grid", lambda self, *args: grid)
    assert grid.clustered, "the case's splits must run as clusters"
    assert grid.splits > matmul_kernel.PORTABLE_CLUSTER_BLOCKS or K != 16384, grid
    assert not pair or grid.splits == 2, grid
    B, qs, _W = _weights(N, K, "nf4", 64, nested, dtype, run_seed, cuda)
    A = torch.randn(M, K, device=cuda).to(dtype)
    b = torch.randn(N, device=cuda).to(dtype) if bias else None
    with host_path.python_path_only():
        clustered = matmul.fused_matmul(A, B.t(), qs, bias=b, out=poison_(torch.empty(M, N, dtype=dtype, device=cuda)))
        finish_grid = dataclasses.replace(grid, clustered=False)  # the same splits, added by the finish
        monkeypatch.setattr(matmul_kernel.Plan, "grid", lambda self, *args: finish_grid)
        finished = matmul.fused_matmul(A, B.t(), qs, bias=b, out=poison_(torch.empty(M, N, dtype=dtype, device=cuda)))
    assert_bit_exact(clustered, finished, "cluster against finish")


@pytest.mark.gpu
def test_bitsandbytes_shapes_and_forms(cuda, bnb, run_seed):
    import bitsandbytes

    dtype, N, K = torch.bfloat16, 64, 256
    B, qs, W = _weights(N, K, "nf4", 64, False, dtype, run_seed, cuda)
    A = torch.randn(2, 3, K, device=cuda).to(dtype)  # [batch, tokens, features]
    got = harness.matmul_4bit(A, B.t(), qs)
    assert got.shape == (2, 3, N) and mr.judge(got, mr.fused_reference(A, B, qs, W, None, dtype)).ok
    out = poison_(torch.empty(2, 3, N, dtype=dtype, device=cuda))
    assert harness.matmul_4bit(A, B.t(), qs, out=out) is out
    assert_bit_exact(out, got, "out=")
    # A weight quantized from [K, N]: bitsandbytes uses it transposed (deprecated there).
    Bt, qst = cases.quantize_weights((K, N + 32), "nf4", 64, False, dtype, run_seed, device=cuda)
    A2 = torch.randn(4, K, device=cuda).to(dtype)
    with pytest.warns(DeprecationWarning):
        expected = bitsandbytes.matmul_4bit(A2, Bt.t(), qst)
    assert_bit_exact(harness.matmul_4bit(A2, Bt.t(), qst), expected, "[K, N] weight")
    assert harness.matmul_4bit(torch.empty(0, K, dtype=dtype, device=cuda), B.t(), qs).shape == (0, N)


def _lane_case(seed: int, M: int, N: int, K: int):
    """Random nf4 codes packed as bitsandbytes packs them, a scale per 32 k, fp64 activations:
    (A, packed bytes, scales, code table, the weights W they stand for)."""
    from harness.correctness.bitcompare import floats_from_bits
    from harness.correctness.reference import NF4_BITS

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), generator=g)
    packed = bytes((codes[:, 0::2] * 16 + codes[:, 1::2]).flatten().tolist())  # element 2i: high nibble
    scales = torch.rand(N, K // 32, generator=g, dtype=torch.float64) + 0.5
    code = floats_from_bits(NF4_BITS).double().tolist()
    W = torch.tensor(code, dtype=torch.float64)[codes] * scales.repeat_interleave(32, dim=1)
    return torch.randn(M, K, generator=g, dtype=torch.float64), packed, scales, code, W


# The nested 8-token kernel runs chunks of 64 k where K % 64 == 0 (and blocks of 64 or more), else of 32;
# with 16-byte weight loads where K % 128 == 0.
_LANE_CASES = [(3, 40, 256), (9, 16, 96 + 128), (2, 24, 320), (5, 24, 384)]
_LANE_KERNELS = {  # kernel: K a multiple of (the _A layouts: the 16-token tile's activation rows)
    "M8": 32, "M8P_64": 64, "M8P_32": 32, "M8P_W": 128, "M8P_64_A": 64, "M8P_32_A": 32, "M8P_W_A": 128, "WIDE": 32,
}  # fmt: skip


@pytest.mark.parametrize(
    ("M", "N", "K", "kernel"),
    [(*case, kernel) for case in _LANE_CASES for kernel, multiple in _LANE_KERNELS.items() if case[2] % multiple == 0],
)
def test_the_kernels_lanes_load_decode_and_place_every_weight_once(run_seed, M, N, K, kernel):
    """tests/matmul_lanes.py transcribes each kernel's per-lane loads, nibble order, table
    lookups, activation tile (staged, padded, NaN in the rows past M), fragment slots and
    epilogue; assembled by the PTX fragment layouts, they must compute A · Wᵀ (K = 224 and 320 end
    in a partial step of either kernel)."""
    from tests import matmul_lanes

    A, packed, scales, code, W = _lane_case(run_seed, M, N, K)
    got = matmul_lanes.emulate(A, packed, scales, code, N, K, getattr(matmul_lanes, kernel))
    torch.testing.assert_close(got, A @ W.t(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["M8P_64_A", "M8P_32_A", "M8P_W_A"])
def test_the_16_token_tile_stages_each_quarter_warps_pieces_into_one_128_byte_line(kernel):
    """In the pair-table kernel's 16-token tile (ALIGNED_ROWS) every row starts a 128-byte line, so
    a quarter warp's cp.async of 8 consecutive pieces writes one line (one wavefront; rows starting
    mid-line took 2.75x the staging's ideal wavefronts on an H200, kernels/NOTES.md)."""
    from tests import matmul_lanes

    layout = getattr(matmul_lanes, kernel)
    row_chunks = layout.step_k // 8
    for row, quarter in itertools.product(range(16), range(row_chunks // 8)):
        lines = {layout.slot(row, 8 * quarter + e, row_chunks) // 8 for e in range(8)}
        assert len(lines) == 1, (row, quarter, lines)
    assert layout.tile_slots(16, row_chunks) % 8 == 0  # and the second stage starts a line too


@pytest.mark.parametrize("kernel", list(_LANE_KERNELS))
def test_the_activation_tile_is_read_and_written_without_bank_conflicts(kernel):
    """Every quarter warp's 16-byte accesses to the staged activation tile hit 8 different bank
    groups: each mma's reads (every token tile of 64 rows) and stage_activations' writes of
    consecutive chunks (tests/matmul_lanes.py reads the slot and chunk arithmetic from the kernels)."""
    from tests import matmul_lanes

    layout = getattr(matmul_lanes, kernel)
    row_chunks = layout.step_k // 8
    for j in range(layout.mmas):
        for i in range(8):
            slots = [layout.slot(8 * i + lane // 4, layout.chunk(j, lane % 4), row_chunks) for lane in range(32)]
            assert all(len(groups) == 8 for groups in matmul_lanes.bank_groups_of_quarter_warps(slots)), (j, i)
    for first in range(0, 64 * row_chunks, 32):  # a warp's writes: chunks first .. first + 31 in row order
        slots = [layout.slot(e // row_chunks, e % row_chunks, row_chunks) for e in range(first, first + 32)]
        assert all(len(groups) == 8 for groups in matmul_lanes.bank_groups_of_quarter_warps(slots)), first


def test_16_byte_loads_leave_each_lane_16_k_of_both_chunks_at_its_run_position(run_seed):
    """kernels/matmul_4bit_m8_pairs.cu's trade_halves: after the quad's lanes load a row's 64 bytes
    16 bytes each and trade halves, lane t holds the 8 bytes (16 k) of each chunk at run position
    WIDE_POS(t), the positions cover each chunk once, and every mma's 16 k come from one chunk (one
    scale block)."""
    from tests import matmul_lanes as ml

    pair = bytes(torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(run_seed)).tolist())
    runs = ml.traded_runs(pair)
    assert sorted(ml.WIDE_POS(t) for t in range(4)) == [0, 1, 2, 3]
    for t, (first, second) in enumerate(runs):
        at = 8 * ml.WIDE_POS(t)
        assert (first, second) == (pair[at : at + 8], pair[32 + at : 32 + at + 8]), t


@pytest.mark.parametrize(("M", "N", "K"), [(1, 40, 256), (2, 24, 384), (2, 16, 640), (3, 40, 384), (4, 24, 640)])
def test_the_few_rows_columns_path_places_every_weight_and_chunk_once(run_seed, M, N, K):
    """kernels/matmul_4bit_m8_pairs.cu's columns build with 16-byte loads (compute_pair_columns,
    columns_to_tokens): each lane's runs as loaded, an mma's column 2m + s fed row m of chunk s by the
    lanes of that chunk, each column scaled by its chunk's scale, then gathered for the epilogue, as
    tests/matmul_lanes.py transcribes them from the source, must compute A · Wᵀ with one scale per
    64 k (K = 640 ends in a partial step; N = 24, 40: features past N)."""
    from tests import matmul_lanes

    A, packed, scales, code, W = _lane_case(run_seed, M, N, K)
    chunk_scales = scales[:, 0::2]  # this path's blocks hold 64 or more
    W = W / scales.repeat_interleave(32, dim=1) * chunk_scales.repeat_interleave(64, dim=1)
    got = matmul_lanes.emulate_pair_columns(A, packed, chunk_scales, code, N, K)
    torch.testing.assert_close(got, A @ W.t(), rtol=1e-12, atol=1e-12)


def test_the_columns_path_reads_and_writes_the_activation_tile_without_bank_conflicts():
    """In the columns build with 16-byte loads, the lanes that read the tile (4 a row) take the
    fewest wavefronts their bytes allow for every word of every chunk pair, at each row count the
    build runs (one for up to 8 lanes: every lane its own 16-byte bank group; two for 9-16: no group
    hit more than twice), and stage_activations' writes of a row's consecutive pieces hit 8 groups a
    quarter warp."""
    from tests import matmul_lanes as ml

    row_chunks = matmul_kernel.STEP_K_M8 // 8
    for rows in range(1, matmul_kernel.COLUMNS_ROWS + 1):
        firsts = [f for lane in range(32) if (f := ml.columns_first_slot(lane, rows)) is not None]
        assert len(firsts) == 4 * rows
        fewest = -(-len(firsts) // 8)
        for c, j in itertools.product(range(0, matmul_kernel.STEP_K_M8 // 64, 2), range(4)):
            groups = collections.Counter((f + ml._COLS_OFFSET(c, j)) % 8 for f in firsts)
            assert max(groups.values()) == fewest, (rows, c, j, groups)
    for r in range(8):
        slots = [ml.COLS_SLOT(r, p, row_chunks) for p in range(row_chunks)]
        assert all(len(groups) == 8 for groups in ml.bank_groups_of_quarter_warps(slots)), r


def test_the_pair_table_gives_every_lane_its_bytes_entry_from_its_own_bank(run_seed):
    """kernels/matmul_4bit_m8_pairs.cu's lookup: for any packed word, lane l's address for byte b holds
    that byte's entry, in bank l (a warp's 32 lookups never conflict), inside the table; the
    table, as the block's threads store it, holds every entry once per bank, each where
    pair_entry puts it."""
    from tests import matmul_lanes as ml

    table = ml.PAIR_TABLE  # as stage_pair_table's threads store it
    assert table == ml.pair_table_as_defined(), "the build stores some slot another entry than pair_entry's"
    assert len(table) * 4 == ml.PAIR_ROWS * ml.PAIR_ROW_WORDS * 4 <= 48 * 1024
    assert sorted((entry, word % 32) for word, entry in enumerate(table)) == sorted(
        itertools.product(range(256), range(32))
    )
    g = torch.Generator().manual_seed(run_seed)
    words = [0, 0xFFFFFFFF, 0x80808080, 0x7F7F7F7F, *torch.randint(0, 2**32, (200,), generator=g).tolist()]
    for word, byte, lane in itertools.product(words, range(4), range(32)):
        address = ml.pair_address(word, byte, lane)
        assert table[address // 4] == (word >> (8 * byte)) & 0xFF and (address // 4) % 32 == lane, (word, byte, lane)


def test_the_hopper_pair_table_gives_every_lane_its_bytes_entry_without_a_bank_conflict(run_seed):
    """kernels/matmul_4bit_sm90.cu's table of fp32 code pairs (64 tokens up): for any packed word,
    thread l's address for byte b holds that byte's entry, 8-byte aligned, inside the table; each
    half-warp's 16 lanes (a 64-bit shared load's phase) read 32 different banks; the table holds
    every entry 16 times and is the size the launch passes (``WIDE_PAIR_TABLE_BYTES``)."""
    from tests import matmul_lanes as ml

    table = ml.WIDE_PAIR_TABLE
    assert len(table) * 8 == ml.WIDE_PAIR_TABLE_BYTES == matmul_kernel.WIDE_PAIR_TABLE_BYTES
    assert sorted(table) == sorted(list(range(256)) * 16)
    assert ml.WIDE_PAIRS_TOKENS == matmul_kernel.WIDE_PAIRS_TILE
    g = torch.Generator().manual_seed(run_seed)
    words = [0, 0xFFFFFFFF, 0x80808080, 0x7F7F7F7F, *torch.randint(0, 2**32, (200,), generator=g).tolist()]
    for word, byte in itertools.product(words, range(4)):
        for half_warp in (range(16), range(16, 32)):
            banks = set()
            for tid in half_warp:
                address = ml.pair_address(word, byte, 0, ml.wide_lane_bytes(tid))
                assert address % 8 == 0 and table[address // 8] == (word >> (8 * byte)) & 0xFF, (word, byte, tid)
                banks |= {address // 4 % 32, address // 4 % 32 + 1}
            assert len(banks) == 32, (word, byte)


@pytest.mark.parametrize(
    ("M", "N", "K", "tokens"),
    [(3, 40, 256, 16), (9, 70, 96 + 128, 16), (20, 24, 320, 32), (70, 130, 160, 64), (100, 70, 160, 128)],
)
def test_the_hopper_kernels_operands_meet_in_wgmmas_layouts(run_seed, M, N, K, tokens):
    """kernels/matmul_4bit_sm90.cu: the lanes' decoded operand A (as WIDE's; from 64 tokens through
    the pair table) and the activations as store_chunks stages them, read back by wgmma's K-major
    layout with the kernel's strides, must compute A · Wᵀ: the staging undoes the k permutation the
    weights' side keeps (K = 224 and 320 end in a partial step; M = 70 fills a second 64-token tile
    partly, M = 100 a 128-token one)."""
    from tests import matmul_lanes

    A, packed, scales, code, W = _lane_case(run_seed, M, N, K)
    for warps in {matmul_kernel.WARPS[tokens], matmul_kernel.WIDE_WARPS.get(tokens, 0)} - {0}:
        got = matmul_lanes.emulate_sm90(A, packed, scales, code, N, K, tokens, warps)
        torch.testing.assert_close(got, A @ W.t(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tokens", [t for t in matmul_kernel.TOKEN_TILES if t > matmul_kernel.DECODE_TILES[0]])
def test_the_hopper_kernels_staging_stores_hit_32_banks_and_stay_in_its_stage(tokens):
    """Each warp-wide 4-byte store of store_chunks lands in 32 different banks, inside the stage,
    and every slice starts 16-byte aligned (a wgmma descriptor's address unit)."""
    from tests import matmul_lanes

    for warps in {matmul_kernel.WARPS[tokens], matmul_kernel.WIDE_WARPS.get(tokens, 0)} - {0}:
        lay = matmul_lanes.sm90_layout(tokens, warps)
        assert lay["SLICE_BYTES"] % 16 == 0 and lay["CORE_LBO"] % 16 == 0 and lay["CORE_SBO"] % 16 == 0
        stored = 0
        for warp, i, q in itertools.product(range(lay["THREADS"] // 32), range(lay["CHUNKS"]), range(4)):
            lanes = [lane for lane in range(32) if matmul_lanes.sm90_stores(32 * warp + lane, i, lay)]
            assert len(lanes) in (0, 32), (warps, warp, i)  # a warp's 32 lanes store a chunk or none do
            addresses = [matmul_lanes.sm90_store_address(32 * warp + lane, i, q, lay) for lane in lanes]
            assert len({a // 4 % 32 for a in addresses}) == len(lanes), (warps, warp, i, q)
            assert all(0 <= a and a + 4 <= 8 * lay["SLICE_BYTES"] for a in addresses)
            stored += len(lanes)
        assert stored == 4 * tokens * matmul_kernel.STEP_K_WIDE // 8, warps  # every chunk of the tile once


def test_it_traces_in_one_graph_to_the_ops_checks():
    """torch.compile(fullgraph=True) of a function calling harness.matmul_4bit: TorchDynamo must
    trace into the registered op (a graph break raises Unsupported), whose fake implementation
    then rejects host tensors with eager mode's message."""
    A, B = torch.zeros(3, 96, dtype=torch.bfloat16), torch.zeros(48 * 96 // 2, 1, dtype=torch.uint8)
    qs = _host_state()
    torch._dynamo.reset()
    with pytest.raises(
        Exception, match=r"InputError\(.A must be on a CUDA device, got cpu: the drop-ins are CUDA-only"
    ) as info:
        torch.compile(lambda a: harness.matmul_4bit(a, B.t(), qs), backend="eager", fullgraph=True)(A)
    assert not isinstance(info.value, torch._dynamo.exc.Unsupported)


@pytest.mark.parametrize("case", ["out-list", "out-shape", "bias-fp32", "bias-short"])
def test_a_traced_call_meets_the_same_out_and_bias_rules(case):
    """Under torch.compile(fullgraph=True) the drop-in checks out and bias while tracing, with the
    same operand table and messages as eager mode (OUT_AND_BIAS), before any op is reached.
    TorchDynamo reports an exception raised in the code it traces as its own error whose cause
    names it (with its message, in the PyTorch builds that carry it)."""
    what, message = OUT_AND_BIAS[case]
    A, B = torch.zeros(3, 96, dtype=torch.bfloat16), torch.zeros(48 * 96 // 2, 1, dtype=torch.uint8)
    out = what.get("out")
    out = [[0.0] * 48] * 3 if out == "list" else torch.empty(out, dtype=A.dtype) if out else None
    bias = torch.zeros(what["bias"], dtype=what.get("bias_dtype", A.dtype)) if "bias" in what else None
    qs = _host_state()
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(lambda a: harness.matmul_4bit(a, B.t(), qs, out=out, bias=bias), backend="eager", fullgraph=True)(
            A
        )
    cause = str(info.value.__cause__)
    assert "InputError" in cause, cause
    # Some PyTorch builds (2.11) name the exception's class only; where the message is there, it is the rule's.
    assert "InputError(" not in cause or re.search(r"InputError\(.*" + message, cause), cause


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, FUSED_EVERYWHERE, "above the crossover"])
def test_the_compiled_call_gives_the_eager_bits(cuda, run_seed, rows):
    dtype, N, K = torch.bfloat16, 96, 512
    M = crossover_m(cuda.index, N * K) + 1 if rows == "above the crossover" else rows
    B, qs, _W = _weights(N, K, "nf4", 64, True, dtype, run_seed, cuda)
    A = torch.randn(M, K, device=cuda).to(dtype)
    bias = torch.randn(N, device=cuda).to(dtype)
    eager = harness.matmul_4bit(A, B.t(), qs, bias=bias)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a: harness.matmul_4bit(a, B.t(), qs, bias=bias), fullgraph=True)(A)
    assert_bit_exact(compiled, eager, f"compiled M={M}")
    A.requires_grad_(True)
    torch.compile(lambda a: harness.matmul_4bit(a, B.t(), qs).sum(), fullgraph=True)(A).backward()
    assert A.grad is not None and A.grad.shape == A.shape


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, FUSED_EVERYWHERE])
def test_the_matmul_mode_of_the_patch_routes_gemm_4bit_to_the_fused_kernel(cuda, bnb, run_seed, M):
    """patch_bitsandbytes(matmul=True): bitsandbytes' matmul_4bit (inference, and the training
    forward through its gemm_4bit op) runs ours for few rows; the default mode runs its own kernel."""
    import bitsandbytes

    from harness.runtime import patch

    dtype, N, K = torch.bfloat16, 320, 1024
    B, qs, _W = _weights(N, K, "nf4", 64, True, dtype, run_seed, cuda)
    A = torch.randn(M, K, device=cuda).to(dtype)
    unpatched = bitsandbytes.matmul_4bit(A, B.t(), qs)
    with harness.bitsandbytes_patched():
        assert_bit_exact(bitsandbytes.matmul_4bit(A, B.t(), qs), unpatched, "default mode")
    before = patch.routed_calls().get("gemm_4bit fused: ours", 0)
    with harness.bitsandbytes_patched(matmul=True):
        got = bitsandbytes.matmul_4bit(A, B.t(), qs)
        trained = bitsandbytes.matmul_4bit(A.clone().requires_grad_(True), B.t(), qs)
    assert patch.routed_calls().get("gemm_4bit fused: ours", 0) - before == 2
    assert_bit_exact(got, harness.matmul_4bit(A, B.t(), qs), "matmul mode")
    assert_bit_exact(trained.detach(), got, "training forward")


def test_the_measured_crossover_is_read_off_the_table_per_weight_as_the_last_m_that_won_throughout():
    from harness.perf.bnb_paths import MATMUL_SHAPES, crossover_table_of, measured_crossovers

    def row(layer, m, fused, linear):
        return {"layer": f"{layer} 1x1", "M": m, "ours fused µs": fused, "ours dequantize + F.linear µs": linear}

    rows = [row("gate", 1, 1, 2), row("o", 1, 1, 2), row("gate", 8, 1, 2), row("o", 8, 3, 2), row("gate", 16, 1, 2)]
    assert measured_crossovers(rows) == {"gate": 16, "o": 1}  # o lost at 8: what wins later does not count
    assert measured_crossovers([row("gate", 1, 3, 2)]) == {"gate": 0}
    size = {layer: n * k for layer, (n, k) in MATMUL_SHAPES.items()}
    assert crossover_table_of(rows) == ((0, 1), (size["gate"], 16))  # o is the smaller weight
    three = [row(layer, m, 1, 2) for layer, m in (("gate", 1), ("gate", 8), ("gate", 16), ("o", 1), ("o", 8))]
    three += [row("k", 1, 1, 2), row("k", 8, 3, 2)]
    assert crossover_table_of(three) == ((0, 1), (size["o"], 8), (size["gate"], 16))
    # A larger weight that wins less caps every smaller one; an entry that repeats is left out.
    assert crossover_table_of([row("gate", 1, 3, 2), row("o", 1, 1, 2), row("k", 1, 1, 2)]) == ((0, 0),)
    assert crossover_table_of([row("gate", 1, 1, 2), row("o", 1, 1, 2)]) == ((0, 1),)


def test_every_gpus_crossover_is_a_table_the_matmul_table_measures():
    """A crossover table is read off `bnb-paths --only matmul` (``crossover_table_of``): it starts
    at 0, its sizes are those of the weights that table times, in increasing order, and its rows are
    row counts it times (above the largest token tile, 64, the grid repeats the tile, and a
    crossover may lie there), growing with the size."""
    from harness.perf.bnb_paths import MATMUL_SHAPES, MATMUL_TOKENS
    from harness.runtime import matmul

    sizes = {n * k for n, k in MATMUL_SHAPES.values()}
    for table in (*matmul.CROSSOVER_M.values(), matmul.DEFAULT_CROSSOVER_M):
        starts, rows = [size for size, _ in table], [most for _, most in table]
        assert starts[0] == 0 and set(starts[1:]) <= sizes and starts == sorted(set(starts)), table
        assert set(rows) <= set(MATMUL_TOKENS) and rows == sorted(set(rows)), table


def test_a_weights_crossover_is_its_tables_last_entry_not_larger_than_it():
    from harness.runtime.matmul import rows_within

    table = ((0, 32), (100, 128))
    assert [rows_within(table, e) for e in (0, 99, 100, 1 << 40)] == [32, 32, 128, 128]
    assert rows_within(((0, 16),), 5) == 16
