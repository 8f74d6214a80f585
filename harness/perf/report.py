"""The perf summary: printed, written as Markdown (and to the GitHub job summary when
``GITHUB_STEP_SUMMARY`` is set), plus one plot of % of copy bandwidth per case.

Both tables are driven by one column table (``COLUMNS``): each row is a dict of values, each
column names its key, header and format, and a column with no value in any row is left out (a
session without a base has no ratio columns, one without a stored baseline no drift columns).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from harness.correctness import op_checks
from harness.perf import gate, policy
from harness.perf.baseline import DriftRow


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: str = ""  # format spec for numbers; strings are shown as they are


COLUMNS = (
    Column("case", "case"),
    Column("class", "class"),
    Column("base_us", "base µs", ".2f"),
    Column("cand_us", "cand µs", ".2f"),
    Column("ratio", "cand/base", ".4f"),
    Column("interval", f"{policy.CASE_CONFIDENCE:.0%} interval"),
    Column("threshold_pct", "threshold %", ".1f"),
    Column("p_adjusted", "p (Holm)", ".1e"),
    Column("rounds", "rounds", "d"),
    Column("verdict", "verdict"),
    Column("outputs_agree", "outputs agree"),
    Column("pct_copy", "% copy", ".1f"),
    Column("pct_same_size_copy", "% same-size copy", ".1f"),
    Column("x_bnb_kernel", "x bnb kernel", ".2f"),
    Column("x_bnb_full", "x bnb full", ".2f"),
    Column("baseline_us", "baseline µs", ".3g"),
    Column("drift_pct", "drift %", "+.1f"),
    Column("tolerance_pct", "tolerance %", ".1f"),
    Column("drift", "drift"),
)


def _cell(value, fmt: str) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float) and not math.isfinite(value):
        return "—"
    return format(value, fmt) if fmt and not isinstance(value, str) else str(value)


def table(rows: list[Mapping], fmt: str, columns: tuple[Column, ...] = COLUMNS) -> str:
    shown = [c for c in columns if any(r.get(c.key) is not None for r in rows)]
    body = [[_cell(r.get(c.key), c.fmt) for c in shown] for r in rows]
    return tabulate(body, headers=[c.header for c in shown], tablefmt=fmt, disable_numparse=True)


def _drift_values(drift: DriftRow | None) -> dict:
    if drift is None:
        return {}
    return {
        "baseline_us": drift.baseline_us,
        "drift_pct": None if drift.change is None else 100 * drift.change,
        "tolerance_pct": None if drift.tolerance is None else 100 * drift.tolerance,
        "drift": drift.status,
    }


def kernel_rows(session, drift: Mapping[str, DriftRow]) -> list[dict]:
    """One row per kernel case of a ``harness.perf.session.PerfSession``."""
    rows = []
    for cid, r in session.kernel.items():
        us = r.candidate_us
        refs = r.references_s
        row = {
            "case": cid,
            "kind": r.case.kind,
            "class": policy.size_class(r.case.numel).name,
            "base_us": r.base_us,
            "cand_us": us,
            "outputs_agree": r.outputs_agree,
            "pct_copy": 100 * r.case.bytes_moved() / (us * 1e-6) / 1e9 / session.copy_gbps,
            "pct_same_size_copy": 100 * refs["same_size_copy"] / (us * 1e-6) if "same_size_copy" in refs else None,
            "x_bnb_kernel": refs["bnb_kernel"] / (us * 1e-6) if "bnb_kernel" in refs else None,
            "x_bnb_full": refs["bnb_full"] / (us * 1e-6) if "bnb_full" in refs else None,
            **_drift_values(drift.get(cid)),
        }
        if (j := session.judgements.get(cid)) is not None:
            low, high = j.interval
            row |= {
                "ratio": j.ratio,
                "interval": f"[{low:.4f}, {high:.4f}]",
                "threshold_pct": 100 * j.size_class.threshold,
                "p_adjusted": j.p_adjusted,
                "rounds": j.paired.rounds,
                "verdict": str(j.verdict),
            }
        rows.append(row)
    return rows


def e2e_rows(session) -> list[dict]:
    rows = []
    for name, r in session.e2e.items():
        row = {"case": name, "cand_ms": 1e3 * statistics.median(r.cand_rounds_s)}
        if (p := r.paired) is not None:
            low, high = p.interval(policy.CASE_CONFIDENCE)
            row |= {
                "base_ms": 1e3 * statistics.median(r.base_rounds_s),
                "ratio": p.ratio,
                "interval": f"[{low:.3f}, {high:.3f}]",
                "rounds": p.rounds,
                "verdict": "report-only",
            }
        rows.append(row)
    return rows


E2E_COLUMNS = (
    Column("case", "end-to-end case"),
    Column("base_ms", "base ms", ".2f"),
    Column("cand_ms", "cand ms", ".2f"),
    Column("ratio", "cand/base", ".3f"),
    Column("interval", f"{policy.CASE_CONFIDENCE:.0%} interval"),
    Column("rounds", "rounds", "d"),
    Column("verdict", "verdict"),
)


def header_lines(session, drift_line: str, status: int) -> list[str]:
    gpu = session.gpu
    lines = [
        f"GPU: {gpu.get('name')} (driver {gpu.get('driver')}, SM clock default {gpu.get('default_sm_clock_mhz')} MHz)",
        *session.describe_sides(),
        f"copy bandwidth this run: {session.copy_gbps:.0f} GB/s (read + write); "
        f"NVML theoretical: {gpu.get('theoretical_gbps') or 0:.0f} GB/s",
    ]
    for kind, host_us in session.host_overhead_us.items():
        lines.append(
            f"host time per call, {kind} (candidate; validation + launch, no GPU wait): "
            + ", ".join(f"{k} {v:.1f} µs" for k, v in host_us.items())
        )
    if session.judgements:
        classes = ", ".join(f"{c.name} {100 * c.threshold:.1f}%" for c in policy.SIZE_CLASSES)
        lines.append(
            f"A/B: {session.schedule.rounds}+ ABBA rounds of {session.schedule.samples} launches per side per batch; "
            f"thresholds {classes}; family-wise alpha {policy.FAMILY_ALPHA} (Holm)"
        )
        lines.append("verdicts: " + ", ".join(f"{k} {v}" for k, v in gate.counts(session.judgements).items()))
    differing = [r for r in session.kernel.values() if r.outputs_agree is False]
    if differing:
        where = (f"{r.case.id} ({'; '.join(r.rejected_batches[:2]) or 'before timing'})" for r in differing[:5])
        lines.append(f"rejected on {len(differing)} case(s): {', '.join(where)}")
    if session.judge_changed:
        lines.append(f"judge's files changed during the session: {', '.join(session.judge_changed[:5])}")
    lines.append(drift_line)
    lines.append(f"session wall time: {time.perf_counter() - session.started:.0f} s")
    lines.append(STATUS_LINES[status])
    return lines


STATUS_LINES = {
    gate.EXIT_OK: "gate: PASS (every gated case SAME, NOT_SLOWER or FASTER, no drift past the stored baseline)",
    gate.EXIT_REGRESSION: "gate: FAIL, regression (a case SLOWER than the base, or drifted past the stored baseline)",
    gate.EXIT_ERROR: "gate: FAIL, some cases could not be measured (see the failures above)",
    gate.EXIT_OUTPUT_DIFFERS: (
        "gate: FAIL, an output is not what the case demands (column `outputs agree`: the base's bits, or for a "
        "matmul the fp64 reference's bound), or a timed call beat the memory roofline: its timing measures "
        "another computation"
    ),
    gate.EXIT_JUDGE_CHANGED: (
        "gate: FAIL, the judge's or the base's files changed while the candidate's code ran (listed above): "
        "nothing this session measured can be trusted"
    ),
    gate.EXIT_UNDECIDED: (
        "gate: FAIL, undecided (no regression found, but a case is still AMBIGUOUS after every re-measurement: "
        "re-run the job, or look at that case's rounds in benchmark.json)"
    ),
}


def render(session, drift: Mapping[str, DriftRow], drift_line: str, status: int, fmt: str) -> str:
    sep = "\n\n" if fmt == "github" else "\n"
    parts = header_lines(session, drift_line, status)
    if session.kernel:
        parts.append(table(kernel_rows(session, drift), fmt))
    if session.e2e:
        parts.append(table(e2e_rows(session), fmt, E2E_COLUMNS))
    return sep.join(parts) + "\n"


def verdicts(session, drift: Mapping[str, DriftRow], status: int) -> dict:
    """The machine-readable outcome: exit status and one entry per case."""
    rows = {r["case"]: r for r in kernel_rows(session, drift) + e2e_rows(session)}
    keys = (
        "class",
        "base_us",
        "cand_us",
        "ratio",
        "interval",
        "p_adjusted",
        "rounds",
        "verdict",
        "outputs_agree",
        "drift",
    )
    return {"status": status, "cases": {c: {k: r.get(k) for k in keys} for c, r in rows.items()}}


def write_outputs(session, drift, drift_line: str, status: int, out_dir: Path) -> dict[str, Path | None]:
    """Markdown summary, plot, and the job summary when running under GitHub Actions."""
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = render(session, drift, drift_line, status, "github")
    md_path = out_dir / "perf-summary.md"
    md_path.write_text(markdown)
    if step_summary := os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(step_summary, "a") as fh:
            fh.write(markdown)
    rows = kernel_rows(session, drift)
    return {"markdown": md_path, "plot": plot(rows, out_dir / "perf-copy-bandwidth.png") if rows else None}


def plot_panels(rows: list[dict]) -> list[tuple[str, list[str], dict[str, list[float]]]]:
    """The plot's panels, one an op in the rows' order: (title, case ids, series), each series a
    % of the same-run copy bandwidth per case (the fewest bytes the call moves over its time: its
    roofline's share), the candidate's and bitsandbytes' where every case has it."""
    panels = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        panel = [r for r in rows if r["kind"] == kind]
        series = {"nf4-harness (candidate)": [r["pct_copy"] for r in panel]}
        for key, label in (("x_bnb_kernel", "bitsandbytes kernel"), ("x_bnb_full", "bitsandbytes (full call)")):
            if all(r.get(key) for r in panel):
                series[label] = [r["pct_copy"] / r[key] for r in panel]
        title = f"{op_checks.CHECKS[kind].title}, GPU time per launch (cold L2)"
        panels.append((title, [r["case"] for r in panel], series))
    return panels


def plot(rows: list[dict], path: Path) -> Path:
    """``plot_panels`` drawn one above the other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = plot_panels(rows)
    widest = max(len(names) for _, names, _ in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 0.32 * widest + 3), 5.5 * len(panels)), squeeze=False)
    for ax, (title, names, series) in zip(axes[:, 0], panels, strict=True):
        width = 0.8 / len(series)
        for i, (label, values) in enumerate(series.items()):
            ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(names))], values, width, label=label)
        ax.axhline(100, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(names)), names, rotation=75, ha="right", fontsize=7)
        ax.set_ylabel("% of same-run device-to-device copy bandwidth")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
