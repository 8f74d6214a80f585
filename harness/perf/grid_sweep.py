"""Whether the fused matmul's grid rules pick a fast grid on this GPU.

The rules that split K (``matmul_kernel.grid_for``: how many splits, finished by a second kernel or
added inside a thread block cluster) were fit to H100 measurements of a few models' weights
(kernels/NOTES.md). For each weight of the shapes catalog and each row count, this times the rules'
grid against every other grid the kernel runs (K in 1 to ``MAX_SPLITS`` splits, each finished or,
where the GPU holds such clusters, clustered), GPU time with a cold L2, and judges every grid's
output against the fp64 reference of its tile's arithmetic (``tile_reference``): a grid the rules
never pick must still compute the right result (a case records any that did not, with its worst
error over the bound, as ``out of bound``).
Where a call may run more than one token tile (``matmul_kernel.tile_choices``: 17-32 rows, two
16-token tiles or one of 32, by the weight's size), every grid of each tile is timed, so a replay
judges the rule that picks the tile (``tile_for``) as well as the grid's.

    python -m harness.perf.grid_sweep --out DIR [--weights catalog|held-out|all | --shape NAME=NxK ...]
                                      [--rows 1,8,64] [--tolerance 0.05] [--geomean-tolerance 0.05]
                                      [--confirm-within 0.02]
    python -m harness.perf.grid_sweep --out DIR --replay RECORDED/grid-sweep.json   (no GPU)
    python -m harness.perf.grid_sweep --out DIR --replay NEW/grid-sweep.json \
                                      --merge-into baselines/grid-sweep-GPU.json --machine-key "1-row machine"

Exit status 1 where the rules' grids take more than ``--geomean-tolerance`` longer than the fastest
grids (geometric mean over the cases), or any grid's output is out of bound: on a GPU the rules
were not fit on, run this before trusting them. Each case's row says whether its own pick is
within ``--tolerance`` of the fastest.
Grids within ``--confirm-within`` of a case's fastest are timed again in turns, and the case is
judged by those times (``confirmed``): the first pass's short budget cannot order grids 1-2% apart.
Where the rules' grid is not among them, it is timed again in turns with the fastest (``to_confirm``):
a grid's first-pass time can be 10% off, which would judge the rules by one sample.
Each case is recorded with every grid's time and what the rules read of the GPU, so ``--replay``
judges a changed rule against a recorded sweep without a GPU; a sweep cut short leaves the cases it
finished in ``grid-sweep.partial.json`` (``record_cases``), which ``--replay`` judges as well. A sweep
of some weights or row counts (after a kernel change, or one cut short) goes into a committed record
with ``--merge-into`` (``merge_record``): its cases replace the record's of the same weight and rows,
its machine is kept under ``--machine-key``, and the record's note, which says what was timed where,
is left for a person to extend. The
report ends with each kernel's fastest times at each row count fit as a fixed cost plus the bytes at
a streaming rate (``cost_lines``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from scipy import stats
from tabulate import tabulate

from harness.correctness import cases, shapes
from harness.correctness import matmul_reference as mr
from harness.correctness.op_checks import matmul as matmul_checks
from harness.perf import gpu_info, gpu_timer
from harness.runtime import jit, launcher, matmul, matmul_kernel

# The decode kernels at one and two token tiles; both tiles of 32 rows; the wide 64- and 128-token tiles.
ROWS = (1, 8, 16, 32, 64, 128)
TOLERANCE = 0.05  # a case's row is ok where the rules' grid is at most this much slower than the fastest
# The exit status: the rules' grids together (geometric mean of rules ÷ fastest) may take this much
# longer. On the kernels they were fit to they took 1.02-1.03x, with single cases up to 1.49x; on
# the pair-table decode kernels at 1 and 8 rows 1.045x (H100, 16-byte loads) and 1.043x (H200,
# 8-byte loads) (baselines/grid-sweep-*.json, kernels/NOTES.md).
GEOMEAN_TOLERANCE = 0.05
# A case times 10-30 grids: a shorter budget than the timer's default (a median of at least 10
# cold-L2 samples; the grids that matter differ by more than their noise).
STOP = gpu_timer.StopRule(max_noise=0.01, min_samples=10, budget_s=0.25)
# Grids within this much of a case's fastest under STOP are timed again, in turns, under CONFIRM_STOP
# for CONFIRM_ROUNDS rounds (each round in another order), and judged by the median of their rounds:
# under STOP alone the 32-token tile's 4 and 5 splits of 8192x8192 at 32 rows read 37.71 and 37.87
# µs, where side by side 4 ran 1.5% slower in two perf gates and 3.9% interleaved (kernels/NOTES.md,
# "The 32-token tile's price: a tie the sweep could not see").
CONFIRM_WITHIN = 0.02
CONFIRM_ROUNDS = 4
CONFIRM_STOP = gpu_timer.StopRule(max_noise=0.003, min_samples=30, budget_s=0.5)


def candidate_grids(plan: matmul_kernel.Plan, M: int, N: int, K: int, tokens: int) -> list[matmul_kernel.Grid]:
    """The rules' grid first, then every other grid ``plan``'s kernel runs for the call: K in 1 to
    ``MAX_SPLITS`` splits of whole steps (no empty one), each finished, and clustered where
    ``plan.runs`` allows it."""
    groups, tiles = -(-N // matmul_kernel.features_per_block(tokens, plan.warps)), -(-M // tokens)
    steps = matmul_kernel.steps_of(K, plan.rule)
    grids = [plan.grid(M, N, K, tokens)]
    for wanted in range(1, min(matmul_kernel.MAX_SPLITS, steps) + 1):
        per_split = -(-steps // wanted)
        for clustered in (False, True):
            grid = matmul_kernel.Grid((groups, -(-steps // per_split), tiles), per_split, clustered)
            if grid not in grids and plan.runs(grid, M, N, K, tokens):
                grids.append(grid)
    return grids


def tile_prefix(tokens: int, tiled: bool) -> str:
    """What a grid's name starts with in a case that timed several token tiles: ``m16 ``."""
    return f"m{tokens} " if tiled else ""


def grid_name(grid: matmul_kernel.Grid, warps: int = 0, tokens: int = 0, tiled: bool = False) -> str:
    """``4c x 8``: 4 splits of 8 steps, added in a cluster (c) or by the finish kernel (f); of a build
    with other than the token tile's WARPS (``MatmulVariant.alternative``), ``w12 4c x 8``; in a case
    that timed several token tiles (``tiled``), the tile first: ``m16 2c x 16``."""
    build = tile_prefix(tokens, tiled) + (f"w{warps} " if warps and warps != matmul_kernel.WARPS.get(tokens) else "")
    if grid.splits == 1:
        return f"{build}1 x {grid.steps_per_split}"
    return f"{build}{grid.splits}{'c' if grid.clustered else 'f'} x {grid.steps_per_split}"


def plan_inputs(plan: matmul_kernel.Plan) -> dict:
    """What ``grid_for`` and ``Plan.cost`` read of a plan besides the call: recorded with each case,
    so a rule can be replayed against the recorded times on any machine (``--replay``)."""
    inputs = {"blocks_per_sm": plan.blocks_per_sm, "sms": plan.sms, "max_clusters": list(plan.max_clusters)}
    return inputs | {"warps": plan.warps}


def _replayed(inputs: dict, rule: str) -> matmul_kernel.Plan:
    """A recorded plan's stand-in: what the rules read of it (``plan_inputs``), no kernels."""
    clusters = tuple(inputs["max_clusters"])
    return matmul_kernel.Plan(
        None, None, 0, inputs["blocks_per_sm"], inputs["sms"], clusters, rule, inputs.get("warps", 0)
    )


def case_tiles(case: dict) -> list[dict]:
    """The token tiles a recorded case timed, each with its ``tokens``, ``kernel``, ``plan`` (and
    ``alternative plans``): the case's ``tiles``, or, where it timed one tile, the case itself."""
    return case.get("tiles", [case])


def rules_choice(case: dict) -> str:
    """The grid (``grid_name``) the rules of this checkout pick for a recorded case: the token tile
    ``tile_for`` gives (the sweep's weights have nested scales) where the case timed several, its
    kernel's grid rule, and between its builds where it recorded the alternative's plan
    (``pick_plan``)."""
    M, N, K = case["M"], case["N"], case["K"]
    tiles = case_tiles(case)
    tokens = matmul_kernel.tile_for(M, True, N * K) if len(tiles) > 1 else case["tokens"]
    tile = next(t for t in tiles if t["tokens"] == tokens)
    rule = matmul_kernel.grid_rule_of(tile["kernel"])
    plans = [_replayed(tile["plan"], rule)] + [_replayed(p, rule) for p in tile.get("alternative plans", [])]
    chosen = matmul_kernel.cheapest(plans, M, N, K, tokens)
    return grid_name(chosen.grid(M, N, K, tokens), chosen.warps, tokens, len(tiles) > 1)


def case_times(case: dict) -> dict[str, float]:
    """A recorded case's µs by grid: the first pass (``µs by grid``), with the grids timed again in
    turns (``confirmed``, where the case has them) at their confirmed time."""
    return case["µs by grid"] | case.get("confirmed", {})


def case_row(case: dict, tolerance: float) -> dict:
    """A case's verdict: the rules' grid (``rules_choice``) against the fastest of its timed grids
    (``case_times``); not ok where that grid is slower than the tolerance allows, was not timed, or
    any grid's output was out of bound."""
    times = case_times(case)
    rule = rules_choice(case)
    best = min(times, key=times.get)
    rule_us = times.get(rule, math.nan)
    ratio = rule_us / times[best]
    return {
        "layer": case["layer"],
        "M": case["M"],
        "rules' grid": rule,
        "rules µs": rule_us,
        "fastest grid": best,
        "fastest µs": times[best],
        "rules ÷ fastest": ratio,
        "grids": len(times),
        "all in bound": case["all in bound"],
        "ok": ratio <= 1 + tolerance and case["all in bound"],  # a NaN ratio (rules' grid not timed) is not ok
    }


def summary(rows: list[dict], tolerance: float) -> dict:
    """How often the rules' grid is within the tolerance of the fastest, and how far off at worst."""
    ratios = [row["rules ÷ fastest"] for row in rows]
    return {
        "cases": len(rows),
        f"rules within {tolerance:.0%} of the fastest": sum(r <= 1 + tolerance for r in ratios),
        "rules' grid the fastest": sum(row["rules' grid"] == row["fastest grid"] for row in rows),
        "worst rules ÷ fastest": max(ratios, default=math.nan),
        "geomean rules ÷ fastest": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else math.nan,
        "cases out of bound": sum(not row["all in bound"] for row in rows),
    }


def cost_lines(recorded_cases: list[dict]) -> list[dict]:
    """For each kernel and row count with three weights or more, the fastest grids' times fit (least
    squares over the weights) as a fixed cost plus the call's bytes (``op_checks.matmul.matmul_bytes``) at a
    streaming rate: what a call pays whatever its size (launch, ramp, tail, and the timer's own
    floor) and how fast the rest goes (kernels/NOTES.md, "The pair-table kernel's time as a fixed
    cost plus a streaming rate")."""
    groups: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for case in recorded_cases:
        nbytes, tiles = matmul_checks.matmul_bytes(case["N"], case["K"], case["M"]), case_tiles(case)
        for tile in tiles:
            prefix = tile_prefix(tile["tokens"], len(tiles) > 1)
            fastest = min(us for name, us in case_times(case).items() if name.startswith(prefix))
            groups.setdefault((tile["kernel"], case["M"]), []).append((nbytes, fastest))
    lines = []
    for (kernel, rows), points in sorted(groups.items()):
        if len(points) < 3:
            continue
        nbytes, us = zip(*points, strict=True)
        fit = stats.linregress(nbytes, us)
        residuals = [t - fit.intercept - fit.slope * b for b, t in points]
        lines.append({
            "kernel": kernel, "rows": rows, "weights": len(points), "fixed µs": fit.intercept,
            "rate TB/s": 1e-6 / fit.slope, "worst residual µs": max(map(abs, residuals)),
        })  # fmt: skip
    return lines


def time_grids(
    timer: gpu_timer.ColdL2Timer,
    x,
    B,
    qs,
    reference: mr.Reference,
    grids,
    tokens: int,
    warps: int = 0,
    tiled: bool = False,
) -> tuple[dict, dict, dict]:
    """({grid name: GPU µs}, {grid name: its call}, {grid name: its worst |error| ÷ bound} for the
    grids whose output left ``reference``'s bound) for one call on ``grids`` of the build of
    ``tokens`` a tile with ``warps`` a block (0: the token tile's WARPS); ``tiled``: the case times
    several tiles (``grid_name``)."""
    times, runs, outside = {}, {}, {}
    with torch.no_grad():
        for grid in grids:

            def run(grid=grid):
                return matmul.fused_matmul_on_grid(x, B.t(), qs, grid, warps, tokens)

            name = grid_name(grid, warps, tokens, tiled)
            judged = mr.judge(run(), reference)
            if not judged.ok:  # a NaN or a wrong infinity reads inf
                finite = math.isfinite(judged.worst_ratio) and judged.nonfinite_mismatch == 0
                outside[name] = judged.worst_ratio if finite else math.inf
            times[name], runs[name] = timer.measure(run).median_s * 1e6, run
    return times, runs, outside


def near_ties(times: dict[str, float], within: float) -> list[str]:
    """The grids within ``within`` of the fastest, fastest first (none where it has no rival there)."""
    fastest = min(times.values())
    close = sorted((name for name, us in times.items() if us <= fastest * (1 + within)), key=times.get)
    return close if len(close) > 1 else []


def to_confirm(times: dict[str, float], rules_grid: str, within: float) -> list[str]:
    """The grids a case times again in turns: its near ties (``near_ties``), and the rules' grid with
    the fastest where the rules' is not among them, so that the case's verdict (rules ÷ fastest)
    rests on times taken side by side, not on one first-pass time each (on an H200 one 2-split grid
    read 28.1 and 25.0 µs in two sweeps of one build on one GPU, the fastest 24.6 and 24.9:
    kernels/NOTES.md, "The pair table's build with fewer constant loads")."""
    close = near_ties(times, within)
    fastest = min(times, key=times.get)
    if rules_grid in times and rules_grid != fastest and rules_grid not in close:
        close = (close or [fastest]) + [rules_grid]
    return close


def confirm(measure_us: Callable[[Callable[[], object]], float], runs: dict, rounds: int) -> dict[str, float]:
    """{name: median µs of ``rounds`` rounds} for calls timed in turns by ``measure_us``, round r
    starting r places further along, so no call is always timed first or after the same one."""
    names, samples = list(runs), {name: [] for name in runs}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(measure_us(runs[name]))
    return {name: statistics.median(us) for name, us in samples.items()}


def tile_reference(variant: matmul_kernel.MatmulVariant, x, B, qs, W) -> mr.Reference:
    """The reference a sweep judges ``variant``'s grids by: its token tile's arithmetic
    (``matmul_reference.arithmetic_of``), not the one the rules' tile for the call would run
    (the 16-token tile judged as a large weight's 32-token tile: one output of 9216x3072 at 32 rows
    read 1.12x that bound, H200)."""
    return mr.kernel_reference(mr.arithmetic_of(variant.tokens, variant.nested), x, B, qs, W, None, x.dtype)


def tile_variants(M: int, N: int, K: int) -> list[matmul_kernel.MatmulVariant]:
    """The builds a sweep times for a call of ``M`` rows of an N x K weight (nested nf4, bf16): the
    rules' variant first, then one of each other token tile the call may run (``tile_choices``)."""
    chosen = matmul_kernel.tile_for(M, True, N * K)
    tiles = [chosen] + [t for t in matmul_kernel.tile_choices(M, True) if t != chosen]
    return [matmul_kernel.variant_for("bf16", "nf4", True, M, N * K, tokens=t) for t in tiles]


def sweep(
    timer: gpu_timer.ColdL2Timer,
    device: torch.device,
    weights: dict[str, tuple[int, int]],
    rows,
    within: float = CONFIRM_WITHIN,
) -> Iterator[dict]:
    """Every case (weight, rows) with its plan's inputs, every grid's time, and the confirmed times
    (``confirm``) of its near ties and rules' grid (``to_confirm``), one at a time."""

    def measure_us(run) -> float:
        return timer.measure_with(run, CONFIRM_STOP).median_s * 1e6

    for layer, B, qs, W, x in cases.report_matmul_inputs(weights, rows, seed=5, device=device):
        (M, K), N = x.shape, W.shape[0]
        variants = tile_variants(M, N, K)
        times, runs, outside, tiles = {}, {}, {}, []
        for variant in variants:
            reference = tile_reference(variant, x, B, qs, W)  # each tile by its own arithmetic
            plans = [matmul_kernel.plan_for_rows(variant, device.index, M)]
            if plans[0].alternative:  # the rules pick between the two builds: both are timed
                plans.append(matmul_kernel.plan(plans[0].alternative, device.index))
            for p in plans:
                grids = candidate_grids(p, M, N, K, variant.tokens)
                timed, calls, left = time_grids(
                    timer, x, B, qs, reference, grids, variant.tokens, p.warps, len(variants) > 1
                )
                times, runs, outside = times | timed, runs | calls, outside | left
            kernel = variant.build(launcher.device_arch(device.index))[0]  # its rule is replayed with it
            tile = {"tokens": variant.tokens, "kernel": kernel, "plan": plan_inputs(plans[0])}
            tiles.append(tile | ({"alternative plans": [plan_inputs(p) for p in plans[1:]]} if plans[1:] else {}))
        case = {"layer": f"{layer} {N}x{K}", "M": M, "N": N, "K": K} | tiles[0]  # the rules' tile
        if len(tiles) > 1:
            case["tiles"] = tiles
        case |= {"µs by grid": times, "all in bound": not outside} | ({"out of bound": outside} if outside else {})
        close = to_confirm(times, rules_choice(case), within) if within else []
        if close:
            with torch.no_grad():
                case["confirmed"] = confirm(measure_us, {name: runs[name] for name in close}, CONFIRM_ROUNDS)
        print(json.dumps(case), flush=True)
        yield case


PARTIAL = "grid-sweep.partial.json"


def record_cases(machine: dict, swept: Iterable[dict], out: Path) -> dict:
    """The record of ``swept``'s cases on ``machine``. After each case the record so far is
    rewritten to ``out / PARTIAL``, so a sweep cut short (a runner's time limit) keeps every case it
    finished, which ``--replay`` judges; the file goes once the record is complete."""
    out.mkdir(parents=True, exist_ok=True)
    partial, recorded = out / PARTIAL, {"machine": machine, "cases": []}
    for case in swept:
        recorded["cases"].append(case)
        write_record(partial, recorded)
    partial.unlink(missing_ok=True)
    return recorded


def merge_record(record: dict, swept: dict, machine_key: str) -> tuple[dict, list[str], list[str]]:
    """``record`` with ``swept``'s cases in place of its cases of the same layer and rows (in the
    record's order; cases it lacks appended) and ``swept``'s machine under ``machine_key``: (the merged
    record, the cases replaced, the cases added), each named "layer @ M". Refused: a sweep with a grid
    whose output left the bound (a kernel to fix, not a time to keep), a sweep that times a case twice,
    or a machine key the record already gives another machine (each case's times must stay traceable to
    the GPU that took them)."""
    if wrong := [_case_name(case) for case in swept["cases"] if not case["all in bound"]]:
        raise ValueError(f"a grid's output left the bound in {', '.join(wrong)}: not recorded")
    fresh = {_case_key(case): case for case in swept["cases"]}
    if len(fresh) != len(swept["cases"]):
        raise ValueError("the sweep holds a case twice (the same layer and rows)")
    if machine_key in ("cases", "note") or record.get(machine_key, swept["machine"]) != swept["machine"]:
        raise ValueError(f"the record already names {machine_key!r}: choose a key for this sweep's machine")
    cases = [fresh.get(_case_key(case), case) for case in record["cases"]]
    held = {_case_key(case) for case in record["cases"]}
    added = [case for k, case in fresh.items() if k not in held]
    merged = record | {machine_key: swept["machine"], "cases": cases + added}
    return merged, [_case_name(c) for k, c in fresh.items() if k in held], [_case_name(c) for c in added]


def _case_key(case: dict) -> tuple[str, int]:
    """A recorded case's identity: its weight (layer) and its rows."""
    return case["layer"], case["M"]


def _case_name(case: dict) -> str:
    return f"{case['layer']} @ {case['M']}"


def write_record(path: Path, record: dict) -> None:
    """A record as the repository keeps it (one-space indent, characters as written), whole or not at
    all: a sweep's partial record, its report's record, a committed record a sweep merged into."""
    jit.atomic_write(path, (json.dumps(record, indent=1, default=str, ensure_ascii=False) + "\n").encode())


def report(recorded: dict, tolerance: float, geomean_tolerance: float, out: Path) -> int:
    """Judge the recorded cases with this checkout's rules; write the report beside them; 0 where
    every output was in bound and the rules' grids take at most ``geomean_tolerance`` longer than
    the fastest in geometric mean."""
    rows = [case_row(case, tolerance) for case in recorded["cases"]]
    result = recorded | {"summary": summary(rows, tolerance), "verdicts": rows}
    out.mkdir(parents=True, exist_ok=True)
    write_record(out / "grid-sweep.json", result)
    text = tabulate(rows, headers="keys", floatfmt=".4g", tablefmt="github")
    text += "\n\n" + tabulate([result["summary"]], headers="keys", floatfmt=".4g", tablefmt="github")
    text += "\n\n" + tabulate(cost_lines(recorded["cases"]), headers="keys", floatfmt=".3g", tablefmt="github")
    outside = [
        {"layer": case["layer"], "M": case["M"], "grid out of bound": name, "worst |error| ÷ bound": ratio}
        for case in recorded["cases"]
        for name, ratio in case.get("out of bound", {}).items()
    ]
    if outside:
        text += "\n\n" + tabulate(outside, headers="keys", floatfmt=".4g", tablefmt="github")
    (out / "grid-sweep.md").write_text(text + "\n")
    print(text)
    good = result["summary"]["geomean rules ÷ fastest"] <= 1 + geomean_tolerance
    return 0 if good and all(row["all in bound"] for row in rows) else 1


def catalog_weights() -> dict[str, tuple[int, int]]:
    """Every distinct 2-D weight shape of the shapes catalog's models: what the rules were fit to."""
    return {s.id: s.shape for s in shapes.model_shapes() if len(s.shape) == 2}


# Weights of four models outside the catalog, to check a rule fit on it: Llama-3.1-8B,
# Qwen2.5-7B, Phi-3-mini (fused qkv and gate_up), Mistral-Nemo-12B.
HELD_OUT_WEIGHTS = {
    "llama-3.1-8b.q_proj": (4096, 4096), "llama-3.1-8b.k_proj": (1024, 4096),
    "llama-3.1-8b.gate_proj": (14336, 4096), "llama-3.1-8b.down_proj": (4096, 14336),
    "qwen2.5-7b.q_proj": (3584, 3584), "qwen2.5-7b.k_proj": (512, 3584),
    "qwen2.5-7b.gate_proj": (18944, 3584), "qwen2.5-7b.down_proj": (3584, 18944),
    "phi-3-mini.qkv_proj": (9216, 3072), "phi-3-mini.o_proj": (3072, 3072),
    "phi-3-mini.gate_up_proj": (16384, 3072), "phi-3-mini.down_proj": (3072, 8192),
    "mistral-nemo-12b.q_proj": (4096, 5120), "mistral-nemo-12b.o_proj": (5120, 4096),
    "mistral-nemo-12b.gate_proj": (14336, 5120), "mistral-nemo-12b.down_proj": (5120, 14336),
}  # fmt: skip
WEIGHT_SETS = {
    "catalog": catalog_weights,
    "held-out": lambda: dict(HELD_OUT_WEIGHTS),
    "all": lambda: catalog_weights() | HELD_OUT_WEIGHTS,
}


def _shape(text: str) -> tuple[str, tuple[int, int]]:
    name, _, dims = text.partition("=")
    n, _, k = dims.partition("x")
    return name, (int(n), int(k))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.perf.grid_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", type=_shape, action="append", help="NAME=NxK (repeatable; instead of --weights)")
    parser.add_argument("--weights", choices=WEIGHT_SETS, default="catalog", help="the weights to sweep")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated row counts")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="a case's ok column")
    parser.add_argument(
        "--confirm-within",
        type=float,
        default=CONFIRM_WITHIN,
        help="grids this near the fastest are timed again in turns (0: none)",
    )
    parser.add_argument("--geomean-tolerance", type=float, default=GEOMEAN_TOLERANCE, help="the exit status")
    parser.add_argument(
        "--replay", type=Path, help="a recorded grid-sweep.json: judge its times with this checkout's rules (no GPU)"
    )
    parser.add_argument(
        "--merge-into", type=Path, help="with --replay: a committed record its cases replace (merge_record)"
    )
    parser.add_argument("--machine-key", help="with --merge-into: the record's name for the sweep's machine")
    args = parser.parse_args(argv)
    if args.merge_into and not (args.replay and args.machine_key):
        parser.error("--merge-into takes the sweep as --replay and its machine's name as --machine-key")
    if args.replay:
        recorded = json.loads(args.replay.read_text())
        recorded = {k: recorded[k] for k in ("machine", "cases")}
        status = report(recorded, args.tolerance, args.geomean_tolerance, args.out)
        if args.merge_into:
            try:
                merged, replaced, added = merge_record(
                    json.loads(args.merge_into.read_text()), recorded, args.machine_key
                )
            except ValueError as e:
                parser.error(str(e))
            write_record(args.merge_into, merged)
            print(f"\n{args.merge_into}: {len(replaced)} cases replaced, {len(added)} added", *added, sep="\n  ")
            print("its note says what was timed on which machine: extend it for this sweep")
        return status
    device = torch.device("cuda", torch.cuda.current_device())
    nvml = gpu_info.nvml_device(device.index)
    timer = gpu_timer.ColdL2Timer(device, stop=STOP, clock=gpu_info.sm_clock_reader(nvml))
    weights = dict(args.shape) if args.shape else WEIGHT_SETS[args.weights]()
    swept = sweep(timer, device, weights, _rows(args.rows), args.confirm_within)
    recorded = record_cases(gpu_info.machine_info(nvml), swept, args.out)
    return report(recorded, args.tolerance, args.geomean_tolerance, args.out)


def _rows(text: str) -> list[int]:
    return [int(m) for m in text.split(",")]


if __name__ == "__main__":
    raise SystemExit(main())
