"""The perf summary: one row per case, printed, written as Markdown (and to the GitHub job
summary when ``GITHUB_STEP_SUMMARY`` is set), and one plot of % of copy bandwidth per case."""

from __future__ import annotations

import os
from pathlib import Path

from tabulate import tabulate

HEADERS = [
    "case",
    "µs",
    "noise %",
    "GB/s",
    "% copy",
    "% same-size copy",
    "µs/call",
    "x bnb kernel",
    "x bnb full",
    "x bnb full/call",
    "x triton",
    "x torchao",
    "baseline µs",
    "Δ %",
    "verdict",
]


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def rows(results: list[dict]) -> list[list[str]]:
    out = []
    for r in results:
        out.append(
            [
                r["case"],
                _fmt(r["median_us"], ".1f"),
                _fmt(r["noise"] * 100, ".2f"),
                _fmt(r["gbps"], ".0f"),
                _fmt(r["pct_copy"], ".1f"),
                _fmt(r.get("pct_same_size_copy"), ".1f"),
                _fmt(r["per_call_us"], ".1f"),
                _fmt(r["x_bnb_kernel"], ".2f"),
                _fmt(r["x_bnb_full"], ".2f"),
                _fmt(r["x_bnb_full_per_call"], ".2f"),
                _fmt(r.get("x_triton"), ".2f"),
                _fmt(r.get("x_torchao"), ".2f"),
                _fmt(r.get("baseline_us"), ".1f"),
                _fmt(None if r.get("delta") is None else r["delta"] * 100, "+.1f"),
                r.get("verdict", "—"),
            ]
        )
    return out


E2E_HEADERS = ["end-to-end case", "patched ms", "unpatched ms", "speed-up", "noise %", "baseline ms", "Δ %", "verdict"]


def e2e_rows(e2e: list[dict]) -> list[list[str]]:
    return [
        [
            r["case"],
            _fmt(r["ours_ms"], ".2f"),
            _fmt(r["bnb_ms"], ".2f"),
            _fmt(r["speedup"], ".3f"),
            _fmt(r["noise"] * 100, ".2f"),
            _fmt(r.get("baseline_ms"), ".2f"),
            _fmt(None if r.get("delta") is None else r["delta"] * 100, "+.1f"),
            r.get("verdict", "—"),
        ]
        for r in e2e
    ]


def render(results: list[dict], header_lines: list[str], fmt: str, e2e: list[dict] = ()) -> str:
    sep = "\n\n" if fmt == "github" else "\n"
    parts = [*header_lines]
    if results:
        parts.append(tabulate(rows(results), headers=HEADERS, tablefmt=fmt, disable_numparse=True))
    if e2e:
        parts.append(tabulate(e2e_rows(e2e), headers=E2E_HEADERS, tablefmt=fmt, disable_numparse=True))
    return sep.join(parts) + "\n"


def write_outputs(results: list[dict], header_lines: list[str], out_dir: Path, e2e: list[dict] = ()) -> dict[str, Path]:
    """Markdown summary, plot, and the job summary when running under GitHub Actions."""
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = render(results, header_lines, "github", e2e)
    md_path = out_dir / "perf-summary.md"
    md_path.write_text(markdown)
    if step_summary := os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(step_summary, "a") as fh:
            fh.write(markdown)
    return {"markdown": md_path, "plot": plot(results, out_dir / "perf-copy-bandwidth.png") if results else None}


def plot(results: list[dict], path: Path) -> Path:
    """% of the same-run copy bandwidth per case: ours next to bitsandbytes' kernel and full path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["case"] for r in results]
    series = {
        "nf4-harness": [r["pct_copy"] for r in results],
        "bitsandbytes kernel": [r["bnb_kernel_pct_copy"] for r in results],
        "bitsandbytes dequantize_4bit": [r["bnb_full_pct_copy"] for r in results],
    }
    fig, ax = plt.subplots(figsize=(max(8, 0.32 * len(names) + 3), 5.5))
    width = 0.27
    for i, (label, values) in enumerate(series.items()):
        ax.bar([x + (i - 1) * width for x in range(len(names))], values, width, label=label)
    ax.axhline(100, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(names)), names, rotation=75, ha="right", fontsize=7)
    ax.set_ylabel("% of same-run device-to-device copy bandwidth")
    ax.set_title("4-bit dequantization, GPU time per launch (cold L2)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
