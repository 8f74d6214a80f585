"""The perf gate's logic on synthetic and recorded data, without a GPU: paired statistics,
session-level error control, verdicts and exit status, baselines (rounding, no churn, drift),
the summary, the sides' module handling, the judge's checks of what a side returns, the guard on
the judge's files, the timer's state order, the planted-slowdown and attack fixtures and the rate
summary."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from harness.correctness import op_checks
from harness.perf import baseline, catalog, gate, gpu_info, gpu_timer, policy, report, sides, stage, tree_guard
from harness.perf.gpu_timer import StopRule, ThrottleRule, relative_noise
from harness.perf.stats import PairedRatio, holm, relative_spread
from harness.runtime import ops

LARGE, SMALL = policy.size_class(200_000_000), policy.size_class(5_000_000)
GPU = {
    "nvml": "ok",
    "name": "NVIDIA H100 80GB HBM3",
    "slug": "nvidia-h100-80gb-hbm3",
    "driver": "580.159.04",
    "default_sm_clock_mhz": 1980,
    "max_sm_clock_mhz": 1980,
}


def _rounds(rng: random.Random, true_us: float, slowdown: float, noise: float, rounds: int, drift: float = 0.0):
    """Synthetic ABBA rounds: per-round medians of each side with independent noise; ``drift``
    moves the machine's speed through the session, the same for both sides of a round."""
    base, cand = [], []
    for r in range(rounds):
        machine = 1 + drift * r / rounds
        base.append(true_us * machine * (1 + rng.gauss(0, noise)))
        cand.append(true_us * machine * (1 + slowdown) * (1 + rng.gauss(0, noise)))
    return base, cand


def _session(rng, cases: int, slowdown: float, noise: float, machine_offset: float, rounds: int = 8):
    evidence = {}
    for i in range(cases):
        speed = 1 + machine_offset  # a slower runner: both sides of every pair pay it
        b, c = _rounds(rng, 100.0 * speed, slowdown, noise, rounds, drift=0.02)
        evidence[f"case{i}"] = (PairedRatio.from_rounds(b, c), LARGE if i % 2 else SMALL)
    return gate.judge(evidence)


# -- paired statistics ------------------------------------------------------------------------


def test_machine_offset_cancels_in_the_paired_ratio():
    """A runner 5% slower than the one anything was recorded on changes no verdict."""
    rng = random.Random(1)
    for _ in range(50):
        judgements = _session(rng, cases=62, slowdown=0.0, noise=0.002, machine_offset=0.05)
        assert gate.Verdict.SLOWER not in {j.verdict for j in judgements.values()}
        assert all(abs(j.ratio - 1) < 0.005 for j in judgements.values())


def test_interval_and_p_value_of_a_known_shift():
    paired = PairedRatio.from_rounds([100.0] * 4, [102.0, 102.2, 101.8, 102.0])
    assert paired.ratio == pytest.approx(1.02, abs=1e-4)
    low, high = paired.interval(0.99)
    assert low < 1.02 < high and high - low < 0.01
    assert paired.p_value() < 1e-3
    assert PairedRatio.from_rounds([1.0, 1.0], [1.0, 1.0]).p_value() == 1.0  # identical rounds
    assert PairedRatio.from_rounds([1.0], [2.0]).interval(0.99) == (0.0, math.inf)  # one round proves nothing
    with pytest.raises(ValueError, match="rounds"):
        PairedRatio.from_rounds([1.0, 2.0], [1.0])


def test_holm_adjustment():
    adjusted = holm({"a": 0.01, "b": 0.04, "c": 0.03})
    assert adjusted == pytest.approx({"a": 0.03, "b": 0.06, "c": 0.06})  # monotone step-down
    assert holm({"a": 0.9, "b": 0.8}) == {"a": 1.0, "b": 1.0}


def test_session_level_error_is_controlled_not_per_case():
    """400 null sessions of 62 noisy cases: without a correction about half the sessions would
    call some case significant at 1%; with Holm about 1% of sessions do."""
    rng = random.Random(7)
    uncorrected = corrected = 0
    for _ in range(400):
        p = {}
        for i in range(62):
            b, c = _rounds(rng, 10.0, 0.0, 0.02, 8)
            p[f"c{i}"] = PairedRatio.from_rounds(b, c).p_value()
        uncorrected += min(p.values()) < policy.FAMILY_ALPHA
        corrected += min(holm(p).values()) < policy.FAMILY_ALPHA
    assert uncorrected > 140  # 1 - 0.99 ** 62: about 46% of sessions
    assert corrected <= 400 * policy.FAMILY_ALPHA * 3


# -- verdicts ---------------------------------------------------------------------------------


def _judge_one(slowdown, noise, cls=LARGE, rounds=8, seed=3):
    b, c = _rounds(random.Random(seed), 100.0, slowdown, noise, rounds)
    return gate.judge({"x": (PairedRatio.from_rounds(b, c), cls)})["x"]


def test_verdicts_from_the_paired_ratio():
    assert _judge_one(0.0, 0.001).verdict is gate.Verdict.SAME
    assert _judge_one(0.02, 0.001).verdict is gate.Verdict.SLOWER  # 2% on a large weight (threshold 1%)
    assert _judge_one(-0.05, 0.001).verdict is gate.Verdict.FASTER
    assert _judge_one(0.005, 0.001).verdict is gate.Verdict.SAME  # real, but below the threshold
    assert _judge_one(0.02, 0.001, cls=SMALL).verdict is gate.Verdict.SAME  # small weights: 2.5%


def test_ambiguous_gets_more_rounds_until_the_cap():
    noisy = _judge_one(0.0, 0.03)
    assert noisy.verdict is gate.Verdict.AMBIGUOUS
    assert gate.rounds_to_add(noisy) == 8
    capped = _judge_one(0.0, 0.2, rounds=policy.SCHEDULE.max_rounds)
    assert capped.verdict is gate.Verdict.AMBIGUOUS and gate.rounds_to_add(capped) == 0
    assert gate.rounds_to_add(_judge_one(0.0, 0.001)) == 0


def test_a_case_proven_not_slower_passes_once_its_re_measurements_leave_it_so():
    """An interval inside +threshold at its upper end but past -threshold at its lower (the o weight
    at 16 rows, H200 2026-11-28: 0.9966 [0.9898, 1.0035] after 64 rounds) proves what the gate asks,
    no slowdown past the threshold: a pass once more rounds made it neither SAME nor FASTER. The
    mirror image, an interval reaching past +threshold, stays AMBIGUOUS: undecided, red."""
    faster_maybe = _judge_one(-0.005, 0.005)
    low, high = faster_maybe.interval
    assert faster_maybe.verdict is gate.Verdict.NOT_SLOWER and low < 1 / 1.01 and high <= 1.01
    assert gate.rounds_to_add(faster_maybe) == 8  # first re-measured, as AMBIGUOUS is
    capped = _judge_one(-0.005, 0.015, rounds=policy.SCHEDULE.max_rounds)
    assert capped.verdict is gate.Verdict.NOT_SLOWER and gate.rounds_to_add(capped) == 0
    assert gate.exit_status({"a": capped}) == gate.EXIT_OK
    slower_maybe = _judge_one(0.005, 0.015, rounds=policy.SCHEDULE.max_rounds)
    assert slower_maybe.verdict is gate.Verdict.AMBIGUOUS
    assert gate.exit_status({"a": capped, "b": slower_maybe}) == gate.EXIT_UNDECIDED
    # A slowdown past the threshold never reads as proven not slower, whatever the noise.
    for seed, (slowdown, noise) in itertools.product(range(100), [(0.012, 0.002), (0.02, 0.005), (0.05, 0.03)]):
        verdict = _judge_one(slowdown, noise, seed=seed).verdict
        assert verdict not in (gate.Verdict.NOT_SLOWER, gate.Verdict.SAME, gate.Verdict.FASTER), (seed, slowdown)


def test_exit_status_says_which_kind_of_red():
    same, slower, ambiguous = _judge_one(0, 0.001), _judge_one(0.05, 0.001), _judge_one(0.0, 0.03)
    assert gate.exit_status({"a": same}) == gate.EXIT_OK
    assert gate.exit_status({"a": same, "b": ambiguous}) == gate.EXIT_UNDECIDED
    assert gate.exit_status({"a": slower, "b": ambiguous}) == gate.EXIT_REGRESSION
    assert gate.exit_status({"a": same}, drifted=1) == gate.EXIT_REGRESSION
    assert gate.exit_status({"a": same}, errors=1) == gate.EXIT_ERROR
    # A different output is its own red, above a regression: its timing measured another computation.
    assert gate.exit_status({"a": slower}, drifted=1, differing=1) == gate.EXIT_OUTPUT_DIFFERS
    assert gate.exit_status({"a": same}, differing=1, errors=1) == gate.EXIT_ERROR
    # A judge whose files changed while the candidate ran judged nothing: above everything else.
    assert gate.exit_status({"a": slower}, errors=1, differing=1, judge_changed=1) == gate.EXIT_JUDGE_CHANGED
    assert "files changed" in report.STATUS_LINES[gate.EXIT_JUDGE_CHANGED]
    assert "output is not what the case demands" in report.STATUS_LINES[gate.EXIT_OUTPUT_DIFFERS]
    assert gate.counts({"a": same, "b": slower, "c": same}) == {"SAME": 2, "SLOWER": 1}


def test_size_classes_cover_every_case():
    ids = [c.id for c in op_checks.dequantize.perf_cases()]
    assert len(ids) == len(set(ids)) >= 62
    classes = {policy.size_class(c.numel).name for c in op_checks.dequantize.perf_cases()}
    assert classes == {"large", "mid", "small"}
    assert [c.name for c in policy.SIZE_CLASSES] == ["large", "mid", "small"]


@pytest.mark.parametrize(("arch", "columns"), [("sm_80", False), ("sm_90", False), ("sm_90", True)])
def test_the_matmul_cases_time_every_build_the_drop_in_picks(arch, columns):
    """On an A100, an H100 and an H200 (the Hopper builds, picked per weight: ``pick_plan``; the
    few-rows build's columns form where the GPU runs it: ``columns_on``), each fused build of the
    bf16 nf4 drop-in (token tile, scales, the few-rows build, the 128-token tile's two Hopper builds)
    is timed by some matmul case, and a case past the largest tile times dequantize + F.linear: a
    kernel the gate never times could get slower unseen."""
    from harness.runtime import matmul_kernel
    from tests import hopper_plans as hopper

    built = {}  # id of a plan -> the build it is of

    def plan_of(variant, _device):  # what the rules read of a plan on that GPU (132 SMs; A100 108)
        sms = hopper.SMS if arch == "sm_90" else 108
        per_sm, rule = hopper.WIDE128_PER_SM if variant.tokens == 128 else 2, variant.grid_rule(arch)
        cols = variant.columns_form() if columns else None  # as matmul_kernel.columns_of gives it
        p = matmul_kernel.Plan(None, None, 0, per_sm, sms, (), rule, variant.warps, variant.alternative(arch), cols)
        built[id(p)] = variant
        return p

    cases = op_checks.matmul.perf_cases()
    assert len({c.id for c in cases}) == len(cases)
    largest = matmul_kernel.TOKEN_TILES[-1]
    timed = set()
    for c in (c for c in cases if c.tokens <= largest):
        N, K = c.weight.shape
        variant = matmul_kernel.variant_for(c.dtype, c.quant, c.nested, c.tokens, N * K)
        picked = matmul_kernel.pick_plan(variant, 0, c.tokens, N, K, plan_of)
        timed.add(built[id(picked)])  # the build whose plan the call took
    builds = {
        v
        for v in matmul_kernel.all_variants(arch)
        if (v.dtype, v.quant_type) == ("bf16", "nf4") and not (v.few_rows and v.columns != columns)
    }
    assert timed == builds, sorted(v.name for v in builds - timed)
    assert any(c.tokens > largest for c in cases)


# -- stored baselines -------------------------------------------------------------------------


def _record(values: dict[str, float], numel=200_000_000, floor=None) -> dict:
    return baseline.session_record(GPU, {"torch": "2.11"}, values, dict.fromkeys(values, numel), floor)


def test_rounding():
    assert baseline.round_us(204.73) == 205.0 and baseline.round_us(7.9123) == 7.91
    assert baseline.round_us(1234.5) == 1230.0
    assert baseline.round_spread(0.0041) == 0.005 and baseline.round_spread(0.004) == 0.004
    assert relative_spread([100, 101, 99]) == pytest.approx(0.01)


def test_baseline_from_several_sessions_and_no_churn(tmp_path):
    path = baseline.save([_record({"a": 204.7, "b": 8.0}), _record({"a": 205.5, "b": 8.1})], tmp_path)
    data = json.loads(path.read_text())
    assert data["sessions"] == 2
    assert data["cases"]["a"] == {"us": 205.0, "spread": 0.002, "numel": 200_000_000, "gpus": 1}
    assert [line.strip()[:4] for line in path.read_text().splitlines() if '"us"' in line] == ['"a":', '"b":']
    text = path.read_text()
    # Re-recording unchanged code (values within the threshold, spread no wider) rewrites nothing.
    baseline.save([_record({"a": 205.9, "b": 8.02}), _record({"a": 205.4, "b": 8.05})], tmp_path)
    assert path.read_text() == text
    # A real change rewrites that case's line only.
    baseline.save([_record({"a": 230.0, "b": 8.05})], tmp_path)
    changed = [line for line in path.read_text().splitlines() if line not in text.splitlines()]
    assert len(changed) == 2 and '"a"' in changed[1]  # the session count and case a


def test_a_baseline_says_the_fewest_sessions_any_entry_stands_on(tmp_path):
    path = baseline.save([_record({"a": 200.0})] * 4, tmp_path)
    assert json.loads(path.read_text())["sessions"] == 4
    baseline.save([_record({"b": 10.0})] * 2, tmp_path)  # a new case from 2 sessions beside a's 4
    assert json.loads(path.read_text())["sessions"] == 2
    baseline.save([_record({"c": 10.0})] * 4, tmp_path)  # a and b keep theirs
    assert json.loads(path.read_text())["sessions"] == 2
    baseline.save([_record({"a": 300.0, "b": 20.0, "c": 20.0})] * 3, tmp_path)  # every entry re-recorded
    assert json.loads(path.read_text())["sessions"] == 3


def test_drift_tolerance_and_check(tmp_path):
    baseline.save([_record({"a": 200.0, "b": 100.0}), _record({"a": 200.0, "b": 110.0})], tmp_path)
    stored, line = baseline.load(GPU, tmp_path)
    assert "2 sessions" in line
    assert stored.cases["a"].tolerance() == LARGE.drift_floor
    assert stored.cases["b"].tolerance() == pytest.approx(policy.DRIFT_SPREAD_FACTOR * 0.048)  # its spread widens it
    rows = baseline.check_drift(stored, {"a": 200 * (1 + LARGE.drift_floor * 1.2), "b": 105.0, "c": 1.0})
    assert {c: r.status for c, r in rows.items()} == {"a": "DRIFTED", "b": "OK", "c": "MISSING"}
    assert baseline.check_drift(stored, {"a": 150.0})["a"].status == "STALE"


def _on_gpu(record: dict, uuid: str) -> dict:
    return {**record, "gpu": {**record["gpu"], "uuid": uuid}}


def test_an_entry_counts_the_gpus_its_sessions_ran_on(tmp_path):
    """Sessions on one GPU measure that GPU: the entry says how many GPUs it stands on, a drifted
    entry from one GPU is named in the drift line, and the command line warns when it writes one."""
    one = baseline.save([_on_gpu(_record({"a": 200.0, "b": 10.0}), "GPU-1")] * 3, tmp_path)
    assert {c: e["gpus"] for c, e in json.loads(one.read_text())["cases"].items()} == {"a": 1, "b": 1}
    assert "2 entries stand on sessions of one GPU (a, b)" in baseline.one_gpu_warning(one, [_record({"a": 1, "b": 1})])
    assert "1 entry stands on sessions of one GPU (a)" in baseline.one_gpu_warning(one, [_record({"a": 1.0})])
    stored, _ = baseline.load(GPU, tmp_path)
    rows = baseline.check_drift(stored, {"a": 230.0, "b": 10.0, "c": 1.0})
    assert rows["a"].gpus == 1 and rows["c"].gpus is None
    assert baseline.counts_line(rows) == "OK 1, DRIFTED 1 (1 stored from one GPU only: a), MISSING 1"
    # The same values from two GPUs replace the one-GPU entries (more evidence, no other change)...
    two = [_on_gpu(_record({"a": 200.5, "b": 10.0}), "GPU-1"), _on_gpu(_record({"a": 200.0, "b": 10.0}), "GPU-2")]
    baseline.save(two, tmp_path)
    assert {e["gpus"] for e in json.loads(one.read_text())["cases"].values()} == {2}
    assert baseline.one_gpu_warning(one, two) == ""
    stored, _ = baseline.load(GPU, tmp_path)
    assert baseline.counts_line(baseline.check_drift(stored, {"a": 230.0})) == "DRIFTED 1"
    # ...and a later one-GPU session of unchanged code leaves them standing on two.
    text = one.read_text()
    baseline.save([_on_gpu(_record({"a": 200.2, "b": 10.0}), "GPU-3")], tmp_path)
    assert one.read_text() == text


def test_entries_recorded_before_the_gpu_count_read_and_gain_it_when_re_recorded(tmp_path):
    path = tmp_path / "nvidia-h100-80gb-hbm3.json"
    path.write_text(baseline.render(GPU, 4, {"a": baseline.Entry(200.0, 0.01, 200_000_000)}))
    assert '"gpus"' not in path.read_text()
    stored, _ = baseline.load(GPU, tmp_path)
    rows = baseline.check_drift(stored, {"a": 260.0})
    assert rows["a"].gpus is None and baseline.counts_line(rows) == "DRIFTED 1"  # not counted as one GPU
    text = path.read_text()
    baseline.save([_on_gpu(_record({"a": 200.4}), "GPU-1")], tmp_path)  # one GPU's agreeing session
    assert path.read_text() == text
    baseline.save([_on_gpu(_record({"a": 200.4}), "GPU-1"), _on_gpu(_record({"a": 200.0}), "GPU-2")], tmp_path)
    assert json.loads(path.read_text())["cases"]["a"] == {"us": 200.0, "spread": 0.001, "numel": 200_000_000, "gpus": 2}


def test_the_baseline_cli_warns_when_it_writes_an_entry_of_one_gpu(tmp_path, capsys):
    record = tmp_path / "session-record.json"
    record.write_text(json.dumps(_on_gpu(_record({"a": 50.0}), "GPU-1")))
    assert baseline.main([str(record), "--dir", str(tmp_path / "b")]) == 0
    assert "1 entry stands on sessions of one GPU (a)" in capsys.readouterr().err
    other = tmp_path / "other-record.json"
    other.write_text(json.dumps(_on_gpu(_record({"a": 50.2}), "GPU-2")))
    assert baseline.main([str(record), str(other), "--dir", str(tmp_path / "b")]) == 0
    assert "warning" not in capsys.readouterr().err


# Two hosts of one H100 model, the same code (kernels/NOTES.md, "The drift guard across hosts"):
# the timer's empty interval and three cases' medians, µs.
ONE_HOST = {"floor": 1.248, "k dequantize": 9.152, "k matmul": 9.632, "gate matmul": 54.62}
OTHER_HOST = {"floor": 2.912, "k dequantize": 10.91, "k matmul": 11.30, "gate matmul": 56.00}
NUMELS = {"k dequantize": 8_388_608, "k matmul": 8_388_608, "gate matmul": 234_881_024}


def _host_record(host: dict) -> dict:
    times = {c: host[c] for c in NUMELS}
    return baseline.session_record(GPU, {"torch": "2.11"}, times, NUMELS, host["floor"])


def test_the_drift_check_moves_the_stored_times_by_the_difference_in_the_timers_floor(tmp_path):
    """Unchanged code timed on a host whose timer adds 1.66 µs more to every launch: red as
    measured (2.5% on the 55 µs call), green once the stored times move by the floors' difference; a real
    slowdown past the tolerance still shows."""
    baseline.save([_host_record(ONE_HOST)], tmp_path)
    stored, _ = baseline.load(GPU, tmp_path)
    assert stored.timer_floor_us == ONE_HOST["floor"]
    times = {c: OTHER_HOST[c] for c in NUMELS}
    assert {r.status for r in baseline.check_drift(stored, times).values()} == {"DRIFTED"}
    moved = baseline.check_drift(stored, times, OTHER_HOST["floor"])
    assert {r.status for r in moved.values()} == {"OK"}
    assert moved["k matmul"].baseline_us == pytest.approx(9.63 + OTHER_HOST["floor"] - ONE_HOST["floor"])
    slower = baseline.check_drift(stored, {"k matmul": OTHER_HOST["k matmul"] * 1.12}, OTHER_HOST["floor"])
    assert slower["k matmul"].status == "DRIFTED"
    assert "moved by +1.66 µs" in baseline.floor_line(stored, OTHER_HOST["floor"])
    assert "compared as measured" in baseline.floor_line(stored, None)


def test_records_from_another_host_merge_onto_the_files_timer_floor(tmp_path):
    """Re-recording unchanged code on a host with another floor rewrites no line; records of two
    hosts combine onto their common floor."""
    path = baseline.save([_host_record(ONE_HOST)], tmp_path)
    text = path.read_text()
    baseline.save([_host_record(OTHER_HOST)], tmp_path)
    assert path.read_text() == text
    both = tmp_path / "both"
    stored_path = baseline.save([_host_record(ONE_HOST), _host_record(OTHER_HOST)], both)
    data = json.loads(stored_path.read_text())
    middle = (ONE_HOST["floor"] + OTHER_HOST["floor"]) / 2
    assert data["timer_floor_us"] == pytest.approx(middle, abs=1e-3)
    # Each host's time moved onto the middle floor: the two agree within 0.1 µs, so the spread stays small.
    assert data["cases"]["k matmul"]["spread"] <= 0.01


def test_a_file_without_a_floor_is_compared_as_measured_and_gains_one_when_re_recorded(tmp_path):
    path = baseline.save([_record({"a": 200.0})], tmp_path)
    assert "timer_floor_us" not in json.loads(path.read_text())
    stored, _ = baseline.load(GPU, tmp_path)
    assert baseline.check_drift(stored, {"a": 200.0}, 2.9)["a"].baseline_us == 200.0
    assert "none stored" in baseline.floor_line(stored, 2.9)
    baseline.save([_record({"a": 200.4}, floor=1.25)], tmp_path)
    data = json.loads(path.read_text())
    assert data["timer_floor_us"] == 1.25 and data["cases"]["a"]["us"] == 200.0  # the entry kept as it was


def test_missing_or_foreign_baseline_is_one_clear_line(tmp_path):
    stored, line = baseline.load({**GPU, "name": "NVIDIA A100-SXM4-80GB", "slug": "nvidia-a100-sxm4-80gb"}, tmp_path)
    assert stored is None and "no stored baseline for NVIDIA A100-SXM4-80GB" in line and "A/B gate" in line
    stored, line = baseline.load({"nvml": "unavailable: no driver"}, tmp_path)
    assert stored is None and "NVML" in line
    (tmp_path / "nvidia-h100-80gb-hbm3.json").write_text('{"cases": {}}')
    assert "schema" in baseline.load(GPU, tmp_path)[1]
    with pytest.raises(ValueError, match="different GPU models"):
        baseline.combine([_record({"a": 1.0}), {**_record({"a": 1.0}), "gpu": {"name": "other"}}])


def test_baseline_cli(tmp_path):
    record = tmp_path / "session-record.json"
    record.write_text(json.dumps(_record({"a": 50.0})))
    assert baseline.main([str(record), "--dir", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "nvidia-h100-80gb-hbm3.json").exists()


def test_baseline_cli_merges_only_the_cases_asked_for(tmp_path):
    path = baseline.save([_record({"a-m1": 200.0, "a-m8": 210.0, "b-m1": 9.0})] * 3, tmp_path)
    record = tmp_path / "session-record.json"
    record.write_text(json.dumps(_record({"a-m1": 190.0, "a-m8": 230.0, "b-m1": 8.0})))
    assert baseline.main([str(record), "--dir", str(tmp_path), "--cases", "a-m1", "--cases", "x*"]) == 0
    cases = json.loads(path.read_text())["cases"]
    # a-m1 re-recorded; a-m8 moved as much but was not asked for; b-m1 not matched either.
    assert (cases["a-m1"]["us"], cases["a-m8"]["us"], cases["b-m1"]["us"]) == (190.0, 210.0, 9.0)
    assert json.loads(path.read_text())["sessions"] == 1  # a-m1 stands on one session now
    with pytest.raises(ValueError, match="no case of the record matches"):
        baseline.main([str(record), "--dir", str(tmp_path), "--cases", "nothing*"])


def test_committed_baselines_load(tmp_path):
    """Every baseline file in the repository reads with the current schema."""
    from harness.perf.session import JUDGE_ROOT

    for path in sorted((JUDGE_ROOT / "baselines").glob("nvidia-*.json")):
        data = json.loads(path.read_text())
        gpu = {**GPU, "name": data["gpu"]["name"], "slug": path.stem}
        stored, line = baseline.load(gpu, path.parent)
        assert stored is not None, line
        assert all(e.us > 0 and e.spread >= 0 for e in stored.cases.values())


# -- the summary ------------------------------------------------------------------------------


def _fake_session(ab: bool = True):
    case = next(c for c in op_checks.dequantize.perf_cases() if c.id == "llama-3.3-70b.gate_proj-nf4-fp16-bs64-nested")
    b, c = _rounds(random.Random(5), 204.7e-6, 0.0, 0.001, 8)
    result = SimpleNamespace(
        case=case,
        candidate_us=205.0,
        base_us=204.8 if ab else None,
        outputs_agree=True if ab else None,
        rejected_batches=[],
        references_s={"bnb_kernel": 270e-6, "bnb_full": 290e-6, "same_size_copy": 200e-6},
    )
    judgements = gate.judge({case.id: (PairedRatio.from_rounds(b, c), policy.size_class(case.numel))}) if ab else {}
    return SimpleNamespace(
        kernel={case.id: result},
        e2e={},
        judgements=judgements,
        copy_gbps=3000.0,
        gpu=GPU,
        host_overhead_us={"dequantize": {"ours": 19.0}, "matmul": {"ours": 21.5}},
        schedule=policy.SCHEDULE,
        started=0.0,
        judge_changed=[],
        describe_sides=lambda: ["candidate: here"],
    )


def test_the_plot_has_a_panel_per_op_titled_by_its_judge_half_with_the_series_every_case_has():
    rows = [
        {"kind": "dequantize", "case": "d1", "pct_copy": 90.0, "x_bnb_kernel": 1.5, "x_bnb_full": 1.8},
        {"kind": "matmul", "case": "m1", "pct_copy": 60.0, "x_bnb_kernel": None, "x_bnb_full": 2.0},
        {"kind": "dequantize", "case": "d2", "pct_copy": 80.0, "x_bnb_kernel": 2.0, "x_bnb_full": None},
    ]
    (d_title, d_cases, d_series), (m_title, m_cases, m_series) = report.plot_panels(rows)
    assert d_title.startswith(op_checks.CHECKS["dequantize"].title) and m_title.startswith(
        op_checks.CHECKS["matmul"].title
    )
    assert (d_cases, m_cases) == (["d1", "d2"], ["m1"])
    assert d_series == {"nf4-harness (candidate)": [90.0, 80.0], "bitsandbytes kernel": [60.0, 40.0]}
    assert m_series == {"nf4-harness (candidate)": [60.0], "bitsandbytes (full call)": [30.0]}


def test_summary_table_drops_columns_nobody_has(tmp_path, monkeypatch):
    step = tmp_path / "step.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step))
    session = _fake_session()
    out = report.write_outputs(session, {}, "drift check: not run", gate.EXIT_OK, tmp_path / "out")
    md = out["markdown"].read_text()
    assert "cand/base" in md and "SAME" in md and "gate: PASS" in md and "drift %" not in md
    assert "host time per call, dequantize (candidate" in md and "host time per call, matmul (candidate" in md
    assert "ours 21.5 µs" in md
    assert step.read_text() == md
    assert out["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    alone = report.render(_fake_session(ab=False), {}, "drift check: not run", gate.EXIT_OK, "simple")
    assert "cand/base" not in alone and "x bnb kernel" in alone
    verdicts = report.verdicts(session, {}, gate.EXIT_UNDECIDED)
    assert verdicts["status"] == gate.EXIT_UNDECIDED
    assert verdicts["cases"]["llama-3.3-70b.gate_proj-nf4-fp16-bs64-nested"]["verdict"] == "SAME"
    assert "undecided" in report.STATUS_LINES[gate.EXIT_UNDECIDED]


# -- sides ------------------------------------------------------------------------------------


def _fake_checkout(root, label: str):
    pkg = root / "harness"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        textwrap.dedent(f"""
        LABEL = {label!r}
        def dequantize_4bit(*args):
            from harness import late  # imported at call time: must be this side's module
            return late.LABEL
        def matmul_4bit(*args): pass
        def patch_bitsandbytes(): pass
        def unpatch_bitsandbytes(): pass
        """)
    )
    (pkg / "late.py").write_text(f"LABEL = {label!r}\n")
    return root


def test_sides_run_their_own_code_beside_the_judge(tmp_path):
    import harness

    judge_harness = sys.modules["harness"]
    base = sides.Side("base", _fake_checkout(tmp_path / "base", "base"))
    cand = sides.Side("candidate", _fake_checkout(tmp_path / "cand", "candidate"))
    assert sys.modules["harness"] is judge_harness is harness  # the judge's package is back
    with cand.active():
        assert cand.dequantize_4bit() == "candidate"
    with base.active():
        assert base.dequantize_4bit() == "base"
    assert sys.modules["harness"] is judge_harness and "harness.late" not in sys.modules
    with pytest.raises(FileNotFoundError, match="no harness package"):
        sides.Side("x", tmp_path)


def test_measuring_process_protocol_replies_per_line_and_reports_errors():
    import io

    from harness.perf.worker import serve

    class Fake:
        def op_measure(self, side, samples):
            return {"samples_s": [1e-6] * samples, "side": side}

        def op_release(self):
            raise RuntimeError("boom")

    requests = io.StringIO(
        '{"op": "measure", "side": "base", "samples": 2}\n{"op": "release"}\n{"op": "quit"}\n{"op": "x"}\n'
    )
    replies = io.StringIO()
    serve(Fake(), requests, replies)
    first, second = (json.loads(line) for line in replies.getvalue().splitlines())
    assert first == {"samples_s": [1e-6, 1e-6], "side": "base"}
    assert "RuntimeError: boom" in second["error"]  # and nothing after quit was read


# -- what a side returns, and the judge's files --------------------------------------------------


def _prepared_stage(kind: str) -> stage.Stage:
    """A small case on the CPU, prepared by two honest sides (bitsandbytes' CPU backend computes
    what a side's process would: each variant of the live input, into its evidence slot)."""
    spec = {"shape": [48, 256], "quant": "nf4", "blocksize": 64, "nested": True, "dtype": "bf16", "seed": 3}
    st = stage.Stage(spec | {"kind": kind, "tokens": 5}, torch.device("cpu"), torch.empty(64, dtype=torch.uint8))
    for side in ("base", "candidate"):
        lent = st.lent_to(side)
        for variant in range(stage.VARIANTS):
            lent.evidence[variant].copy_(_output(lent, variant))
        assert st.check_prepared(side), (kind, side)
    return st


def _output(lent: stage.Lent, variant: int) -> torch.Tensor:
    """What an honest side returns for ``variant`` of the live input."""
    import bitsandbytes.functional as F

    lent.refresh(variant)
    W = F.dequantize_4bit(lent.A, lent.qs)
    return torch.nn.functional.linear(lent.x, W) if lent.kind == "matmul" else W


def test_a_matmul_case_has_a_reference_of_its_own_and_a_dequantization_takes_its_first_sides():
    """What decides whether a session alone judges a side's prepared outputs (``own_reference``)."""
    own = {kind: _prepared_stage(kind).own_reference for kind in op_checks.CHECKS}
    assert own == {"dequantize": False, "matmul": True}


@pytest.mark.parametrize("kind", ["dequantize", "matmul"])
def test_a_lent_case_calls_its_own_drop_in_as_a_user_does(kind):
    lent = _prepared_stage(kind).lent_to("scratch")
    seen = []

    def drop_in(name):
        return lambda *args, **kwargs: seen.append((name, args, kwargs)) or lent.out

    sides_drop_ins = SimpleNamespace(dequantize_4bit=drop_in("dequantize_4bit"), matmul_4bit=drop_in("matmul_4bit"))
    assert lent.call(sides_drop_ins)() is lent.out
    [(name, args, kwargs)] = seen
    if kind == "matmul":  # bitsandbytes' orientation: the packed weight transposed, activations first
        assert name == "matmul_4bit" and args[0] is lent.x and args[1].data_ptr() == lent.A.data_ptr()
        assert args[1].shape == lent.A.t().shape and args[2] is lent.qs
    else:
        assert name == "dequantize_4bit" and args == (lent.A, lent.qs)
    assert kwargs == {"out": lent.out}


@pytest.mark.parametrize("kind", ["dequantize", "matmul"])
def test_the_judge_rejects_an_output_of_another_variant_or_one_bit_off(kind):
    st = _prepared_stage(kind)
    evidence, lent = st.evidence["candidate"], st.lent_to("scratch")
    variants = [o.value for o in st.expected] if kind == "matmul" else st.expected
    assert not any(torch.equal(variants[0], v) for v in variants[1:]), "every variant changes the output"
    # A batch: sample i had variant plan.variants[i]; slot j holds the output of sample plan.checked[j].
    plan = stage.BatchPlan.draw(random.Random(7), 12)
    for slot, i in enumerate(plan.checked):
        evidence[slot].copy_(_output(lent, plan.variants[i]))
    assert st.check_batch("candidate", plan)
    stale = plan.variants[plan.checked[0]]
    evidence[0].copy_(_output(lent, (stale + 1) % stage.VARIANTS))  # what an earlier call with other inputs gave
    assert not st.check_batch("candidate", plan)
    if kind == "dequantize":  # bit for bit, the base's: one flipped bit fails
        evidence[0].copy_(_output(lent, stale))
        evidence[0].view(-1)[5:6].view(torch.int16).bitwise_xor_(1)
        assert not st.check_batch("candidate", plan)


def test_a_batch_plan_never_repeats_a_variant_and_checks_distinct_samples():
    rng = random.Random(11)
    for _ in range(200):
        plan = stage.BatchPlan.draw(rng, 12)
        assert len(plan.variants) == 12 and set(plan.variants) <= set(range(stage.VARIANTS))
        assert all(a != b for a, b in zip(plan.variants, plan.variants[1:], strict=False))
        assert plan.checked == sorted(set(plan.checked)) and len(plan.checked) == stage.CHECKED
        assert all(0 <= i < 12 for i in plan.checked)


def test_the_timer_holds_fresh_inputs_behind_the_block_and_collects_right_after_the_stop():
    timer = object.__new__(gpu_timer.ColdL2Timer)  # only the order of the states, no GPU
    order = [state for state, _ in timer._steps(None, lambda: None, gpu_timer.Hooks())]
    S = gpu_timer.State
    assert order == [
        S.BLOCK, S.PREPARE, S.FLUSH_L2, S.RECORD_START, S.LAUNCH, S.RECORD_STOP, S.COLLECT, S.RELEASE, S.READ
    ]  # fmt: skip


@pytest.mark.gpu
def test_the_timers_l2_flush_reads_its_buffer_and_never_writes_it(cuda, run_seed):
    """A written flush leaves the L2 dirty, and the write-back lands in the timed call (a 12%
    kernel gain hidden: gpu_timer's docstring): across samples the flush buffer keeps its random
    bytes, and the timed work still runs."""
    timer = gpu_timer.ColdL2Timer(cuda)
    g = torch.Generator(device=cuda).manual_seed(run_seed)
    buffer = timer.flush_buffer
    buffer.copy_(torch.randint(0, 256, buffer.shape, generator=g, device=cuda, dtype=torch.uint8))
    before, counter = buffer.clone(), torch.zeros(1, device=cuda)
    # Through a batch, which warms the call up first as every caller of the timer does: sampled cold
    # in a fresh process, the add's kernel loaded lazily behind the hold and the spin timed out.
    times = timer.batch(lambda: counter.add_(1), samples=3, warmup=1).samples_s
    torch.cuda.synchronize(cuda)
    assert torch.equal(buffer, before), "the flush wrote its buffer"
    assert counter.item() == 4 and len(times) == 3 and all(t > 0 for t in times)


def test_the_guard_sees_any_change_to_the_judges_files_even_put_back(tmp_path):
    import os
    import time

    (tmp_path / "kernels").mkdir()
    (tmp_path / "harness" / "perf").mkdir(parents=True)
    (tmp_path / ".git").mkdir()
    (tmp_path / "perf-out").mkdir()
    source = tmp_path / "kernels" / "dequantize_4bit.cu"
    source.write_text("original\n")
    (tmp_path / "harness" / "perf" / "gate.py").write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("a file at the top\n")
    out = (tmp_path / "perf-out",)
    before = tree_guard.fingerprint([tmp_path], out)
    (tmp_path / ".git" / "index").write_text("hidden: not on any import path\n")
    (tmp_path / "perf-out" / "summary.md").write_text("the session's own output\n")
    assert tree_guard.changed(before, tree_guard.fingerprint([tmp_path], out)) == []
    stat = source.stat()
    time.sleep(0.01)
    source.write_text("planted\n")
    source.write_text("original\n")  # the same bytes back, the same modification time back
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert tree_guard.changed(before, tree_guard.fingerprint([tmp_path], out)) == [str(source)]
    # A package that shadows one the judge imports late, any other file: each is a change. Bytecode
    # is not (other processes of the checkout write it; the judge reads none from it: the test below).
    (tmp_path / "harness" / "perf" / "__pycache__").mkdir()
    (tmp_path / "harness" / "perf" / "__pycache__" / "gate.cpython-311.pyc").write_bytes(b"")
    assert tree_guard.changed(before, tree_guard.fingerprint([tmp_path], out)) == [str(source)]
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("")
    (tmp_path / "notes.txt").write_text("changed\n")
    seen = tree_guard.changed(before, tree_guard.fingerprint([tmp_path], out))
    assert {str(tmp_path / "transformers"), str(tmp_path / "transformers" / "__init__.py")} <= set(seen)
    assert str(tmp_path / "notes.txt") in seen


ATTACKED_FILES = {
    "memoise": ["harness/runtime/api.py"],
    "side-stream": ["harness/runtime/api.py"],
    "reach-base": ["harness/__init__.py"],
    "reach-judge": ["harness/__init__.py"],
    "edit-judge": ["harness/__init__.py"],
    "redirect": ["harness/__init__.py"],
    "rescale": ["harness/__init__.py"],
}


@pytest.mark.parametrize("attack", sorted(ATTACKED_FILES))
def test_each_attack_fixture_puts_valid_python_where_its_attack_runs(tmp_path, attack):
    from harness.perf.session import JUDGE_ROOT
    from tests.perf import adversarial

    assert sorted(adversarial.ATTACKS) == sorted(ATTACKED_FILES)
    root = adversarial.build(JUDGE_ROOT, tmp_path / attack, attack)
    candidates = ("harness/__init__.py", "harness/runtime/api.py", "harness/runtime/matmul.py")
    changed = [p for p in candidates if (root / p).read_text() != (JUDGE_ROOT / p).read_text()]
    assert changed == ATTACKED_FILES[attack]
    for path in changed:
        text = (root / path).read_text()
        assert "ADVERSARIAL" in text
        compile(text, path, "exec")


def test_the_rescale_attack_rescales_what_a_measuring_process_replies(tmp_path):
    """The attack's package loaded (as a side loads it) in a process whose main module defines the
    measuring process's ``Worker``: each side's samples come back times its factor, so the GPU
    self-test's FASTER verdict rests on an attack that really rescaled them."""
    from harness.perf.session import JUDGE_ROOT
    from tests.perf import adversarial

    candidate = adversarial.build(JUDGE_ROOT, tmp_path / "cand", "rescale")
    probe = (
        "import json\n"
        "class Worker:\n"
        "    def op_measure(self, side, samples, variants, checked):\n"
        "        return {'samples_s': [1.0] * samples, 'discarded': 0}\n"
        "from pathlib import Path\n"
        "from harness.perf import sides\n"
        f"sides.Side('candidate', Path({str(candidate)!r}))\n"
        "w = Worker()\n"
        "replies = {s: w.op_measure(side=s, samples=2, variants=[0], checked=[]) for s in ('base', 'candidate')}\n"
        "print(json.dumps(replies))\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                         env=os.environ | {"PYTHONPATH": str(JUDGE_ROOT)})  # fmt: skip
    assert run.returncode == 0, run.stderr
    replies = json.loads(run.stdout.strip().splitlines()[-1])
    assert replies == {
        side: {"samples_s": [factor] * 2, "discarded": 0} for side, factor in adversarial.RESCALE_FACTORS.items()
    }


def test_the_edit_judge_attack_plants_the_base_it_runs_beside_once_and_puts_it_back(tmp_path):
    """The attack loaded as a measuring process holding both sides loads it (the same argv), so
    the GPU test's file-guard verdict rests on an attack that really edited the base."""
    from harness.perf.session import JUDGE_ROOT
    from tests.perf import adversarial, planted

    base = planted.copy_checkout(JUDGE_ROOT, tmp_path / "base")
    candidate = adversarial.build(JUDGE_ROOT, tmp_path / "cand", "edit-judge")
    kernel = base / planted.TARGETS["dequantize"].kernels[0]
    original = kernel.read_text()
    probe = (
        "import sys; from pathlib import Path; from harness.perf import sides; "
        "roots = dict(a.split('=', 1) for a in sys.argv[3::2]); "
        "[sides.Side(name, Path(root)) for name, root in roots.items()]; "
        f"print('PLANTED SLOWDOWN' in Path({str(kernel)!r}).read_text())"
    )
    argv = ["harness.perf.worker", "--side", f"base={base}", "--side", f"candidate={candidate}"]
    run = subprocess.run([sys.executable, "-c", probe, *argv], cwd=JUDGE_ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True"]  # planted while the process ran
    assert kernel.read_text() == original  # and put back at its exit


# -- fixtures and tools -----------------------------------------------------------------------


def test_planted_kernel_compiles_and_changes_only_where_asked(tmp_path):
    from harness.perf.session import JUDGE_ROOT
    from harness.runtime import jit
    from harness.runtime.dequantize_kernel import KernelVariant
    from harness.runtime.matmul_kernel import MatmulVariant
    from tests.perf import planted

    dq, mm = planted.TARGETS["dequantize"], planted.TARGETS["matmul"]
    # The kernels' includes, beside the copies.
    for header in ("format_4bit.cuh", "matmul_4bit_common.cuh", "matmul_4bit_step128.cuh"):
        (tmp_path / header).write_text((JUDGE_ROOT / "kernels" / header).read_text())
    original = (JUDGE_ROOT / dq.kernels[0]).read_text()
    source = (tmp_path / "k.cu", tmp_path / "k32.cu", *(tmp_path / f"mm{n}.cu" for n in ("8", "8p", "", "90")))
    source[0].write_text(planted.planted_source(original, 0.02))
    source[1].write_text(planted.planted_source(original, 0.10, only_fp32=True))
    for path, kernel in zip(source[2:], mm.kernels, strict=True):
        path.write_text(planted.planted_source((JUDGE_ROOT / kernel).read_text(), 0.05, target=mm))
        assert "PLANTED_ON 1" in path.read_text() and "gridDim.x * gridDim.y * gridDim.z" in path.read_text()
    for path, target in ((source[0], dq), *((path, mm) for path in source[2:])):
        # Every launch reaches the stretch: no way out of the kernel body before it (a cluster's
        # early return once skipped it, and the planted slowdown shrank to nothing there).
        body = path.read_text().split(target.entry)[1].split("PLANTED SLOWDOWN: the last block")[0]
        assert "return" not in body, path.name
    assert "PLANTED_ON 1" in source[0].read_text() and "(DQ_OUT == 2)" in source[1].read_text()
    variants = [(path, KernelVariant("nf4", out, True)) for path in source[:2] for out in ("fp16", "fp32")]
    variants += [
        (source[2], MatmulVariant("bf16", "nf4", False, 8)),
        (source[3], MatmulVariant("bf16", "nf4", True, 8)),
        (source[3], MatmulVariant("bf16", "nf4", True, 8, few_rows=True)),  # the one- and two-row calls' build
        (source[4], MatmulVariant("bf16", "nf4", True, 16)),
        (source[5], MatmulVariant("bf16", "nf4", True, 16)),
    ]
    for path, v in variants:
        arch = "sm_90a" if path == source[5] else "sm_90"  # the Hopper kernel's wgmma
        macros = v.macros("sm_90") if isinstance(v, MatmulVariant) else v.macros()
        spec = jit.CompileSpec(source=path, arch=arch, macros=macros, label=v.name)
        assert jit.compile_kernel(spec, use_cache=False).cubin
    with pytest.raises(ValueError, match="anchor"):
        planted.planted_source(original.replace(dq.start, ""), 0.02)


def test_gate_rates_summary():
    from tests.perf import gate_rates

    def session(status, verdicts, drift="OK"):
        cases = {
            "big-fp16": {"class": "large", "verdict": verdicts[0], "ratio": 1.02, "drift": "OK"},
            "big-fp32-x": {"class": "large", "verdict": verdicts[1], "ratio": 1.0, "drift": "OK"},
            "tiny-fp16": {"class": "small", "verdict": verdicts[2], "ratio": 1.02, "drift": drift},
        }
        return {"status": status, "wall_s": 10.0, "cases": cases}

    rows = gate_rates.summarize(
        "plant:0.02",
        [
            session(1, ["SLOWER", "SLOWER", "SLOWER"]),
            session(1, ["SLOWER", "SLOWER", "SAME"]),
            session(0, ["SAME", "SAME", "SAME"]),
        ],
    )
    assert rows["red"] == 2 and rows["every large SLOWER"] == 2 and rows["every case SLOWER"] == 1
    fp32 = gate_rates.summarize("fp32:0.1", [session(1, ["SAME", "SLOWER", "SAME"])])
    assert fp32["only fp32 SLOWER"] == 1
    # Unchanged code red by the stored baseline alone (a host whose timer reads higher, before the
    # drift check moved by the timer's floor): the table says so, not only "red".
    aa = gate_rates.summarize("aa", [session(1, ["SAME"] * 3, drift="DRIFTED"), session(0, ["SAME"] * 3)])
    assert aa["red"] == 1 and aa["with a case DRIFTED"] == 1 and aa["SLOWER cases (all sessions)"] == 0
    assert rows["with a case DRIFTED"] == 0
    # The counts as rates: unchanged code's false alarms at most, a plant's detections at least.
    assert aa["red rate, 95% bound"] == "≤ 97%" and rows["red rate, 95% bound"] == "≥ 14%"


def test_gate_rates_swap_scenario_measures_the_same_two_trees_with_their_roles_swapped(tmp_path, monkeypatch):
    """``aa``: this checkout is the base, an unchanged copy the candidate; ``swap``: the copy is the
    base, this checkout the candidate; both count as unchanged code."""
    from tests.perf import gate_rates, planted

    copies = []
    monkeypatch.setattr(planted, "copy_checkout", lambda source, dest: copies.append((source, dest)) or dest)
    src = tmp_path / "checkout"
    assert gate_rates.scenario_trees("aa", src, tmp_path) == (src, tmp_path / "aa")
    assert gate_rates.scenario_trees("swap", src, tmp_path) == (tmp_path / "swap", src)
    assert copies == [(src, tmp_path / "aa"), (src, tmp_path / "swap")]
    with pytest.raises(ValueError, match="swap"):
        gate_rates.scenario_trees("bogus:1", src, tmp_path)
    unchanged = gate_rates.summarize("swap", [{"status": 1, "wall_s": 1.0, "cases": {}}])
    assert unchanged["red rate, 95% bound"] == "≤ 100%"
    assert gate_rates.summarize("mm:0.02", [{"status": 1, "wall_s": 1.0, "cases": {}}])["red rate, 95% bound"] == "≥ 5%"


def test_a_count_of_sessions_bounds_the_gates_rate_as_clopper_pearson_does():
    """0 of 6 false alarms bounds the rate under 39%, 10 of 10 detections over 74% (kernels/NOTES.md);
    the bounds hold at their confidence: over many simulated counts of a known rate, the upper bound
    falls under it in at most 5% of them."""
    from harness.perf.stats import rate_bounds

    assert rate_bounds(0, 6)[1] == pytest.approx(1 - 0.05 ** (1 / 6)) and rate_bounds(0, 6)[0] == 0.0
    assert rate_bounds(10, 10)[0] == pytest.approx(0.05 ** (1 / 10)) and rate_bounds(10, 10)[1] == 1.0
    lower, upper = rate_bounds(3, 10)
    assert lower < 0.3 < upper
    rng = random.Random(7)
    missed = sum(rate_bounds(sum(rng.random() < 0.2 for _ in range(12)), 12)[1] < 0.2 for _ in range(2000))
    assert missed <= 0.05 * 2000
    with pytest.raises(ValueError):
        rate_bounds(3, 2)


def test_stop_and_throttle_rules():
    assert not StopRule(min_samples=3).done([1.0, 1.0], 2, 0.0)
    assert StopRule(min_samples=3).done([1.0, 1.0, 1.0], 3, 0.0)
    assert StopRule(budget_s=0.1).done([1.0, 2.0], 2, 0.2)
    assert not StopRule(min_samples=3).done([1.0, 2.0, 3.0], 3, 0.0)  # too noisy, budget left
    assert relative_noise([1.0, 1.0]) == 0.0
    assert ThrottleRule().keep(1800, 1755) and not ThrottleRule().keep(1000, 1755)
    assert ThrottleRule().keep(None, 1755)


def test_nvml_device_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_info.nvml_device(0) == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert gpu_info.nvml_device(1) == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")
    assert gpu_info.nvml_device(0) == "GPU-abc"


@pytest.mark.parametrize(
    ("name", "slug"),
    [("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"), ("NVIDIA A100-SXM4-80GB", "nvidia-a100-sxm4-80gb")],
)
def test_slug(name, slug):
    assert gpu_info.slug(name) == slug


def test_machine_info_without_nvml_says_so(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pynvml(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    gpu_info.gpu_identity.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    try:
        info = gpu_info.machine_info()
    finally:
        gpu_info.gpu_identity.cache_clear()
    assert info["gpu"]["nvml"].startswith("unavailable")
    assert "torch" in info["software"]


def test_host_time_per_call_warms_up_then_times_each_function_between_syncs():
    from harness.perf import gpu_timer

    events = []
    fns = {"a": lambda: events.append("a"), "b": lambda: events.append("b")}
    times = gpu_timer.host_us_per_call(fns, lambda: events.append("sync"), calls=5, warmup=2)
    assert set(times) == {"a", "b"} and all(t > 0 for t in times.values())
    assert events == ["a"] * 2 + ["sync"] + ["a"] * 5 + ["sync"] + ["b"] * 2 + ["sync"] + ["b"] * 5 + ["sync"]


def test_host_time_is_timed_in_batches_shorter_than_the_launch_queue(monkeypatch):
    from harness.perf import gpu_timer

    assert gpu_timer.HOST_BATCH <= 256  # the driver queues about a thousand launches
    monkeypatch.setattr(gpu_timer, "HOST_BATCH", 2)
    events = []
    gpu_timer.host_us_per_call({"a": lambda: events.append("a")}, lambda: events.append("sync"), calls=5, warmup=1)
    assert events == ["a", "sync", "a", "a", "sync", "a", "a", "sync", "a", "sync"]


def test_a_side_is_named_by_a_commit_only_at_the_top_of_its_checkout(tmp_path):
    """A base tree unpacked inside another checkout is not that checkout's commit: the summary names
    its directory alone, as outside git."""
    repo = tmp_path / "repo"
    (repo / "unpacked").mkdir(parents=True)
    (repo / "unpacked" / "noxfile.py").write_text("# the base tree\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    rev = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert sides.describe(repo) == f"{repo.resolve()} @ {rev}"
    (repo / "unpacked" / "noxfile.py").write_text("# changed\n")
    assert sides.describe(repo) == f"{repo.resolve()} @ {rev}+dirty"
    assert sides.describe(repo / "unpacked") == str((repo / "unpacked").resolve())
    assert sides.describe(tmp_path) == str(tmp_path.resolve())


def test_every_case_the_catalog_times_is_of_an_op_the_judge_stages():
    """The stage asks a case's op for its inputs, call, reference and check (``op_checks.CHECKS``):
    a catalog case of an op it does not know would fail only on a GPU, in the middle of a session."""
    kinds = [case.kind for case in catalog.timed_cases()]
    assert set(kinds) == set(op_checks.CHECKS) == {op.name for op in ops.OPS}
    for name, checks in op_checks.CHECKS.items():  # each op's cases are its own, in one run
        assert checks.name == name and all(case.kind == name for case in checks.perf_cases())
    assert kinds == sorted(kinds, key=list(op_checks.CHECKS).index)


@pytest.mark.parametrize("order", [("candidate", "base"), ("base", "candidate")])
def test_a_side_cannot_redirect_another_sides_kernel_sources_or_compile_cache(tmp_path, order):
    """In a measuring process holding both sides, a candidate whose code points the environment at
    other kernel sources and another compile cache (as it loads, and again when it runs) moves
    neither for the base: each side compiles its own kernels/ into a cache of its own."""
    from harness.perf.session import JUDGE_ROOT
    from tests.perf import planted

    roots = {"base": planted.copy_checkout(JUDGE_ROOT, tmp_path / "base")}
    roots["candidate"] = planted.copy_checkout(JUDGE_ROOT, tmp_path / "candidate")
    evil = (
        "import os\nos.environ['NF4_HARNESS_KERNELS_DIR'] = '/evil/kernels'\n"
        "os.environ['NF4_HARNESS_CACHE_DIR'] = '/evil/cache'\n"
    )
    init = roots["candidate"] / "harness" / "__init__.py"
    init.write_text(init.read_text() + "\n" + evil)
    probe = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from harness.perf import worker
        roots = {{name: Path(root) for name, root in {[(n, str(roots[n])) for n in order]!r}}}
        loaded = worker.load_sides(roots)
        os.environ['NF4_HARNESS_KERNELS_DIR'] = '/evil/again'  # the candidate's code at call time
        for name, side in loaded.items():
            with side.active():
                from harness.runtime import jit
                print(name, jit.kernels_dir(), jit.cache_dir())
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NF4_HARNESS_")}
    env |= {"NF4_HARNESS_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(JUDGE_ROOT)}
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    seen = {line.split()[0]: line.split()[1:] for line in run.stdout.splitlines()}
    assert seen["base"] == [str(roots["base"] / "kernels"), str(tmp_path / "cache" / "base")]
    assert seen["candidate"] == ["/evil/kernels", "/evil/cache"]  # the payload took: for its own compiles


def test_a_measuring_process_imports_nothing_from_its_working_directory_or_a_new_judge_file(tmp_path):
    """Its working directory is its own cache, outside every checkout and off its import path: a
    module planted there is not found; it writes no bytecode; the module runs as `-m` runs it."""
    from harness.perf import session

    cache, probe_site = tmp_path / "cache", tmp_path / "site"
    cache.mkdir()
    probe_site.mkdir()
    (cache / "planted.py").write_text("")
    (probe_site / "probe.py").write_text(
        "import json, os, sys\n"
        "try:\n    import planted\n    found = True\nexcept ImportError:\n    found = False\n"
        "print(json.dumps([__name__, sys.argv[1:], os.getcwd(), found, sys.pycache_prefix]))\n"
    )
    argv, cwd, env = session.worker_command({"base": tmp_path / "b", "candidate": tmp_path / "c"}, cache, "probe")
    assert cwd == cache and not cwd.resolve().is_relative_to(session.JUDGE_ROOT)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(session.JUDGE_ROOT)
    env["PYTHONPATH"] += os.pathsep + str(probe_site)
    run = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    name, args, where, found, bytecode = json.loads(run.stdout)
    assert name == "__main__" and args == ["--side", f"base={tmp_path / 'b'}", "--side", f"candidate={tmp_path / 'c'}"]
    assert where == str(cache) and not found and bytecode == str(cache / "bytecode")


def test_bytecode_planted_beside_a_module_is_not_what_a_private_bytecode_directory_loads(tmp_path):
    """A .pyc a side writes beside one of the judge's modules, valid for its source (size and time
    in its header) but holding other code, runs where Python reads bytecode from the checkout, and
    not where it reads it from a directory of its own (the judge's and the measuring processes')."""
    import py_compile

    from harness.perf import session

    package = tmp_path / "tree" / "judged"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    source = package / "verdict.py"
    source.write_text("VERDICT = 'own'\n")
    stat = source.stat()
    decoy = tmp_path / "decoy.py"
    decoy.write_text("VERDICT = 'bad'\n")  # the same size as the source: the header will match it
    # Beside the module, where Python reads it without a prefix (cache_from_source would follow this
    # process's sys.pycache_prefix, which a perf session open in the same test process sets).
    planted_pyc = package / "__pycache__" / f"verdict.{sys.implementation.cache_tag}.pyc"
    planted_pyc.parent.mkdir()
    os.utime(decoy, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    py_compile.compile(str(decoy), cfile=str(planted_pyc), invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
    probe = "from judged import verdict; print(verdict.VERDICT)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"PYTHONPATH": str(tmp_path / "tree")}

    def run(extra: dict) -> str:
        done = subprocess.run([sys.executable, "-c", probe], env=env | extra, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert run({}) == "bad"  # the plant works where bytecode is read from the checkout
    _argv, _cwd, worker_env = session.worker_command({}, tmp_path / "cache")
    assert run({"PYTHONPYCACHEPREFIX": worker_env["PYTHONPYCACHEPREFIX"]}) == "own"


def test_a_measuring_process_loads_no_ops_call_module_of_the_judges():
    """A call module registers its op's torch ops as it loads, and the first ``harness`` to register
    them is the one every side's call through ``torch.ops`` reaches: the judge's modules a measuring
    process loads before the sides (the worker, the stage and each op's checks) import none."""
    probe = (
        "import sys; from harness.perf import stage, worker; from harness.runtime import ops; "
        "print(sorted(op.call_module for op in ops.OPS if op.call_module in sys.modules))"
    )
    from harness.perf.session import JUDGE_ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    run = subprocess.run([sys.executable, "-c", probe], cwd=JUDGE_ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_the_judge_imports_its_late_modules_before_any_side_runs():
    """Every module the judge's perf code, its ops' judge halves and its perf tests import inside a
    function (a first import during a session) is imported at its start
    (``session.JUDGE_LATE_IMPORTS``), but the judge's own package."""
    import ast

    from harness.perf import session

    root = session.JUDGE_ROOT
    late = set()
    judged = [root / "harness" / "perf", root / "harness" / "correctness" / "op_checks", root / "tests" / "perf"]
    for path in [p for folder in judged for p in folder.glob("*.py")]:
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Import):
                    late |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    late.add(node.module.split(".")[0])
    late -= {*sys.stdlib_module_names, "harness", "tests"}
    assert late and late <= {name.split(".")[0] for name in session.JUDGE_LATE_IMPORTS}, late


def test_the_redirect_attack_moves_its_own_sides_kernel_sources_to_a_slowed_copy_and_not_the_bases(tmp_path):
    """The attack loaded as a measuring process loads it (the GPU test's SLOWER verdict rests on a
    payload that really points the candidate's compiles at slowed sources): the candidate's
    dequantization source is the planted one, the base's its own."""
    from harness.perf.session import JUDGE_ROOT
    from tests.perf import adversarial, planted

    roots = {"base": planted.copy_checkout(JUDGE_ROOT, tmp_path / "base")}
    roots["candidate"] = adversarial.build(JUDGE_ROOT, tmp_path / "cand", "redirect")
    probe = textwrap.dedent(f"""
        from pathlib import Path
        from harness.perf import worker
        loaded = worker.load_sides({{n: Path(r) for n, r in {[(n, str(r)) for n, r in roots.items()]!r}}})
        for name, side in loaded.items():
            with side.active():
                from harness.runtime import jit
                print(name, 'PLANTED SLOWDOWN' in (jit.kernels_dir() / 'dequantize_4bit.cu').read_text())
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NF4_HARNESS_")}
    env |= {"NF4_HARNESS_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(JUDGE_ROOT)}
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert sorted(run.stdout.split("\n")[:2]) == ["base False", "candidate True"]


def test_every_case_kind_gives_its_host_calls_through_its_drop_in():
    """The host-time table names no op: each kind's calls go through the entry the side lends."""
    called = []

    class DropIns:
        def dequantize_4bit(self, *args, **kwargs):
            called.append(("dequantize_4bit", "out" in kwargs))

        def matmul_4bit(self, *args, **kwargs):
            called.append(("matmul_4bit", "out" in kwargs))

    t = torch.zeros(4, 2)
    for kind in op_checks.CHECKS:
        lent = stage.Lent(kind, t, SimpleNamespace(shape=(4, 2)), t, t, t, t, t)
        calls = lent.host_calls(DropIns())
        assert {"ours", "ours out=", "bnb full"} == set(calls)
        calls["ours"](), calls["ours out="]()
    assert called == [
        ("dequantize_4bit", False),
        ("dequantize_4bit", True),
        ("matmul_4bit", False),
        ("matmul_4bit", True),
    ]


def test_a_measuring_process_keeps_the_judges_checkout_on_its_path_with_pythonsafepath_set(tmp_path):
    """Where the caller runs Python with PYTHONSAFEPATH, `-c` puts no working directory first:
    nothing else is taken off the path (the judge's checkout stays first)."""
    from harness.perf import session

    argv, cwd, env = session.worker_command({}, tmp_path, "json.tool")
    probe = [argv[0], "-c", session.RUN_MODULE.replace("runpy.run_module", "print(sys.path[0]) or (lambda *a, **k: 0)")]
    run = subprocess.run([*probe, "x"], cwd=cwd, env=env | {"PYTHONSAFEPATH": "1"}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[0] == str(session.JUDGE_ROOT)


def test_an_ab_session_times_its_sides_in_two_shared_processes_that_load_them_in_opposite_orders(tmp_path):
    """``session.arrangements``: shared, an A/B session starts policy.SHARED_PROCESSES processes, the
    first loading the base's modules first, the second the candidate's; a session of one side, or a
    process per side, is one arrangement as before. Each arrangement times every side once."""
    from harness.perf import session

    base, cand = tmp_path / "base", tmp_path / "cand"
    roots = {"base": base, "candidate": cand}
    shared = session.arrangements(roots, policy.Isolation.SHARED)
    assert policy.SHARED_PROCESSES == 2
    assert shared == [[{"base": base, "candidate": cand}], [{"candidate": cand, "base": base}]]
    assert [list(groups[0]) for groups in shared] == [["base", "candidate"], ["candidate", "base"]]
    assert session.arrangements({"candidate": cand}, policy.Isolation.SHARED) == [[{"candidate": cand}]]
    assert session.arrangements(roots, policy.Isolation.PER_SIDE) == [[{"base": base}, {"candidate": cand}]]
    for groups in (*shared, *session.arrangements(roots, policy.Isolation.PER_SIDE)):
        assert sorted(name for group in groups for name in group) == ["base", "candidate"]
    keys = {session.evidence_key(side, i) for side in roots for i in range(policy.SHARED_PROCESSES)}
    assert len(keys) == 2 * policy.SHARED_PROCESSES and session.evidence_key("base", 0) == "base"


def test_rounds_alternate_between_the_arrangements_two_at_a_time_so_each_gets_both_abba_orders():
    from harness.perf import session

    assert [session.round_arrangement(i, 1) for i in range(8)] == [0] * 8
    picks = [session.round_arrangement(i, 2) for i in range(16)]
    assert picks == [0, 0, 1, 1] * 4
    for start in range(0, 16, 4):  # any 4 rounds from an even start: 2 each, both orders (index % 2) each
        for a in (0, 1):
            assert sorted(i % 2 for i in range(start, start + 4) if picks[i] == a) == [0, 1]


@pytest.mark.parametrize("offset", [0.013, -0.013])
def test_a_place_offset_one_process_gives_the_candidate_the_mirrored_process_takes_back(run_seed, offset):
    """The false alarm the mirrored processes remove, with the gate's own statistics: unchanged
    code whose modules land so that, in one process, the side loaded second runs ``offset`` slower
    (up to 1.1% measured on H100s), with 0.1% round noise. One process: SLOWER or FASTER, a false
    alarm. Two mirrored ones, rounds alternating as the session alternates them: no verdict of a
    change; after the rounds an undecided case gets (8 -> 32) it is SAME.

    The offset is 1.3%, not the measured 1.1%: 1.1% sits 2 noise deviations above the 1% threshold,
    so one process reads AMBIGUOUS on 2% of seeds and the test would be a coin toss; at 1.3% every
    one of 20,000 seeds gave the verdicts asserted here."""
    from harness.perf import session

    rng = random.Random(run_seed)
    large = policy.size_class(10**9)

    def rounds(count: int, arrangements: int) -> PairedRatio:
        base, cand = [], []
        for i in range(count):
            second = "candidate" if session.round_arrangement(i, arrangements) == 0 else "base"
            times = {
                s: 20e-6 * (1 + rng.gauss(0, 0.001)) * (1 + offset if s == second else 1) for s in ("base", "candidate")
            }
            base.append(times["base"])
            cand.append(times["candidate"])
        return PairedRatio.from_rounds(base, cand)

    one = gate.judge({"o": (rounds(8, 1), large)})["o"].verdict
    assert one in (gate.Verdict.SLOWER, gate.Verdict.FASTER)
    mirrored = [gate.judge({"o": (rounds(n, 2), large)})["o"].verdict for n in (8, 32)]
    assert gate.Verdict.SLOWER not in mirrored and gate.Verdict.FASTER not in mirrored
    assert mirrored[-1] is gate.Verdict.SAME


class _RecordedProcess:
    """A stand-in measuring process that records what the session asks of it."""

    def __init__(self, group, events, fail_on=None):
        self.name, self.events, self.fail_on = "+".join(group), events, fail_on
        events.append(("start", self.name))

    def call(self, op, **kwargs):
        self.events.append((op, self.name))
        if op == self.fail_on:
            raise RuntimeError(f"{self.name} failed at {op}")
        return {}

    def close(self):
        self.events.append(("close", self.name))


@pytest.mark.parametrize("isolation", list(policy.Isolation))
def test_every_measuring_process_starts_before_any_loads_a_side(tmp_path, isolation):
    """``session.start_arrangements``: a side's code may edit files, so no measuring process may
    import a judge module after it runs: every process starts (importing all its judge code) before
    the first is asked to load its sides, then each loads them; the arrangements map every side."""
    from harness.perf import session

    roots = {"base": tmp_path / "base", "candidate": tmp_path / "cand"}
    events = []
    placed = session.start_arrangements(
        session.arrangements(roots, isolation), lambda group: _RecordedProcess(group, events)
    )
    ops = [op for op, _ in events]
    processes = ops.count("start")
    assert processes == (policy.SHARED_PROCESSES if isolation is policy.Isolation.SHARED else 2)
    assert ops == ["start"] * processes + ["load_sides"] * processes
    assert all(sorted(a) == ["base", "candidate"] for a in placed)
    if isolation is policy.Isolation.SHARED:
        assert [a["base"].name for a in placed] == ["base+candidate", "candidate+base"]


def test_a_process_that_fails_to_load_its_sides_closes_every_started_one(tmp_path):
    from harness.perf import session

    roots = {"base": tmp_path / "base", "candidate": tmp_path / "cand"}
    events = []
    with pytest.raises(RuntimeError, match="candidate\\+base failed at load_sides"):
        session.start_arrangements(
            session.arrangements(roots, policy.Isolation.SHARED),
            lambda group: _RecordedProcess(
                group,
                events,
                fail_on="load_sides" if next(iter(group)) == "candidate" else None,
            ),
        )
    assert sorted(name for op, name in events if op == "close") == ["base+candidate", "candidate+base"]


def test_each_process_gets_a_compile_cache_per_side_seeded_once_and_shared_by_the_sides_second_process(
    tmp_path, monkeypatch
):
    """``PerfSession._process_cache``: a side's first process gets a copy of this machine's cache;
    its second (the mirrored arrangement) a link to that same directory, never a second copy."""
    from harness.perf import session

    seed = tmp_path / "seed"
    (seed / "k").mkdir(parents=True)
    (seed / "k" / "a.cubin").write_bytes(b"x")
    monkeypatch.setenv("NF4_HARNESS_CACHE_DIR", str(seed))
    run = session.PerfSession.__new__(session.PerfSession)
    run._tmp, run._side_caches = str(tmp_path / "run"), {}
    first = run._process_cache({"base": tmp_path, "candidate": tmp_path})
    second = run._process_cache({"candidate": tmp_path, "base": tmp_path})
    assert first != second
    for name in ("base", "candidate"):
        assert not (first / name).is_symlink() and (first / name / "k" / "a.cubin").read_bytes() == b"x"
        assert (second / name).is_symlink() and (second / name).resolve() == (first / name).resolve()
