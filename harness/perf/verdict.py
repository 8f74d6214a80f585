"""Per-GPU-model baselines and the noise-aware regression verdict.

A run and its baseline each give a median, a relative noise (stdev / mean of the kept samples)
and a sample count. Each median gets an interval of ``Z`` standard errors either side
(noise / sqrt(samples), times 1.25 for a median). The verdict:

    SAME       |delta| <= FLOOR: inside the run-to-run variation we measured on unchanged code
    SLOWER     slower by more than FLOOR and the two intervals do not overlap
    FASTER     faster by more than FLOOR and the two intervals do not overlap
    AMBIGUOUS  more than FLOOR apart but the intervals overlap: re-measure before deciding

Two signals are judged: the absolute GPU time against the baseline's, and the in-run ratio to
bitsandbytes' kernel against the baseline's ratio (robust to a faster or slower machine of the
same model). Either one SLOWER fails the gate.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

# Relative change treated as no change. Two runs of unchanged code on the H100 (2026-11-22, 62
# cases each) moved medians by at most 0.8% and 1.3% from the baseline run; 3% is over twice that,
# and a deliberately slower build (+61% to +77%) was SLOWER on all 62 cases.
FLOOR = 0.03
# Interval half-width in units of the relative noise.
Z = 3.0

# CI points this at the base branch's baselines/ so a pull request cannot lower its own bar.
BASELINE_DIR = Path(
    os.environ.get("NF4_HARNESS_BASELINE_DIR", Path(__file__).resolve().parent.parent.parent / "baselines")
)
SAVE_COMMAND = "nox -s perf -- --save-baseline"


class BaselineError(RuntimeError):
    """No usable baseline for this case or this GPU; the message says which command fixes it."""


@dataclass(frozen=True)
class Verdict:
    name: str  # SAME / FASTER / SLOWER / AMBIGUOUS
    delta: float  # (current - baseline) / baseline

    def __str__(self) -> str:
        return self.name


def _half_width(noise: float, samples: int) -> float:
    """Relative half-width of a median's interval: Z standard errors (1.25 x noise / sqrt(n))."""
    if not math.isfinite(noise) or samples < 2:
        return 1.0
    return Z * 1.25 * noise / math.sqrt(samples)


def judge(
    current: float, current_noise: float, current_n: int, baseline: float, baseline_noise: float, baseline_n: int
) -> Verdict:
    """Compare two medians (any unit, smaller is better) given their relative noises and counts."""
    delta = (current - baseline) / baseline
    if abs(delta) <= FLOOR:
        return Verdict("SAME", delta)
    cur_w, base_w = _half_width(current_noise, current_n), _half_width(baseline_noise, baseline_n)
    cur_lo, cur_hi = current * (1 - cur_w), current * (1 + cur_w)
    base_lo, base_hi = baseline * (1 - base_w), baseline * (1 + base_w)
    if cur_lo > base_hi:
        return Verdict("SLOWER", delta)
    if cur_hi < base_lo:
        return Verdict("FASTER", delta)
    return Verdict("AMBIGUOUS", delta)


def worst(*verdicts: Verdict) -> Verdict:
    order = {"SLOWER": 3, "AMBIGUOUS": 2, "FASTER": 1, "SAME": 0}
    return max(verdicts, key=lambda v: order[v.name])


def baseline_path(gpu_slug: str, directory: Path = BASELINE_DIR) -> Path:
    return directory / f"{gpu_slug}.json"


def load_baseline(gpu: dict, directory: Path = BASELINE_DIR) -> dict:
    """The baseline for this GPU model; checks it was recorded on the same model and driver."""
    if gpu.get("nvml") != "ok":
        raise BaselineError(f"no GPU identity (NVML {gpu.get('nvml')}): cannot pick a baseline")
    path = baseline_path(gpu["slug"], directory)
    if not path.exists():
        raise BaselineError(f"no baseline for {gpu['name']} ({path.name}); record one with: {SAVE_COMMAND}")
    data = json.loads(path.read_text())
    recorded = data.get("gpu", {})
    if recorded.get("name") != gpu["name"]:
        raise BaselineError(
            f"{path.name} was recorded on {recorded.get('name')!r}, this is {gpu['name']!r}; "
            f"record one for this GPU with: {SAVE_COMMAND}"
        )
    for key in ("driver", "default_sm_clock_mhz", "max_sm_clock_mhz"):
        if recorded.get(key) != gpu.get(key):
            raise BaselineError(
                f"{path.name} was recorded with {key}={recorded.get(key)}, this GPU has {gpu.get(key)}; "
                f"re-record on this configuration with: {SAVE_COMMAND}"
            )
    return data


def baseline_case(baseline: dict, case_id: str) -> dict:
    try:
        return baseline["cases"][case_id]
    except KeyError:
        raise BaselineError(f"case {case_id} has no baseline; record it with: {SAVE_COMMAND}") from None


def save_baseline(gpu: dict, software: dict, cases: dict, directory: Path = BASELINE_DIR) -> Path:
    """Write (or update, case by case) the baseline file for this GPU model."""
    path = baseline_path(gpu["slug"], directory)
    data = json.loads(path.read_text()) if path.exists() else {"cases": {}}
    data["gpu"] = {k: gpu.get(k) for k in ("name", "driver", "cuda_driver", "default_sm_clock_mhz", "max_sm_clock_mhz")}
    data["software"] = software
    data["cases"].update(cases)
    data["cases"] = dict(sorted(data["cases"].items()))
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    return path
