"""The perf gate's logic on recorded and synthetic data: verdicts, baselines, naming, summary."""

from __future__ import annotations

import json

import pytest

from harness.perf import gpu_info, report, verdict
from harness.perf.gpu_timer import StopRule, ThrottleRule, relative_noise

GPU = {
    "nvml": "ok",
    "name": "NVIDIA H100 80GB HBM3",
    "slug": "nvidia-h100-80gb-hbm3",
    "driver": "580.159.04",
    "default_sm_clock_mhz": 1755,
    "max_sm_clock_mhz": 1980,
}


def test_identical_data_is_same():
    assert verdict.judge(100.0, 0.004, 500, 100.0, 0.004, 500).name == "SAME"


def test_ten_percent_slower_with_small_spread_is_slower():
    v = verdict.judge(110.0, 0.004, 500, 100.0, 0.004, 500)
    assert v.name == "SLOWER" and v.delta == pytest.approx(0.10)


def test_ten_percent_faster_is_faster():
    assert verdict.judge(90.0, 0.004, 500, 100.0, 0.004, 500).name == "FASTER"


def test_more_samples_narrow_the_interval():
    assert verdict.judge(108.0, 0.06, 10, 100.0, 0.06, 10).name == "AMBIGUOUS"
    assert verdict.judge(108.0, 0.06, 1000, 100.0, 0.06, 1000).name == "SLOWER"


def test_overlapping_noisy_data_is_ambiguous():
    assert verdict.judge(108.0, 0.06, 10, 100.0, 0.06, 10).name == "AMBIGUOUS"


def test_within_the_floor_is_same_however_noisy():
    assert verdict.judge(100.0 * (1 + verdict.FLOOR * 0.9), 0.5, 10, 100.0, 0.5, 10).name == "SAME"


def test_worst_of_two_signals_decides():
    same, slower = verdict.judge(100, 0.001, 50, 100, 0.001, 50), verdict.judge(120, 0.001, 50, 100, 0.001, 50)
    assert verdict.worst(same, slower).name == "SLOWER"


def test_missing_case_is_an_error_naming_the_fix():
    with pytest.raises(verdict.BaselineError, match="nox -s perf -- --save-baseline"):
        verdict.baseline_case({"cases": {}}, "llama-3.3-70b.q_proj-nf4-fp16-bs64-nested")


def test_baseline_roundtrip_and_checks(tmp_path):
    path = verdict.save_baseline(GPU, {"torch": "2.11"}, {"a": {"median_us": 1.0}}, tmp_path)
    assert path.name == "nvidia-h100-80gb-hbm3.json"
    verdict.save_baseline(GPU, {"torch": "2.11"}, {"b": {"median_us": 2.0}}, tmp_path)  # updates, keeps a
    data = verdict.load_baseline(GPU, tmp_path)
    assert set(data["cases"]) == {"a", "b"}
    with pytest.raises(verdict.BaselineError, match="driver"):
        verdict.load_baseline({**GPU, "driver": "999.0"}, tmp_path)
    with pytest.raises(verdict.BaselineError, match="no baseline for"):
        verdict.load_baseline({**GPU, "name": "NVIDIA A100-SXM4-80GB", "slug": "nvidia-a100-sxm4-80gb"}, tmp_path)
    other = json.loads(path.read_text())
    other["gpu"]["name"] = "NVIDIA H200"
    path.write_text(json.dumps(other))
    with pytest.raises(verdict.BaselineError, match="recorded on"):
        verdict.load_baseline(GPU, tmp_path)
    with pytest.raises(verdict.BaselineError, match="NVML"):
        verdict.load_baseline({"nvml": "unavailable: no driver"}, tmp_path)


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


def test_stop_and_throttle_rules():
    assert not StopRule(min_samples=3).done([1.0, 1.0], 2, 0.0)
    assert StopRule(min_samples=3).done([1.0, 1.0, 1.0], 3, 0.0)
    assert StopRule(budget_s=0.1).done([1.0, 2.0], 2, 0.2)
    assert not StopRule(min_samples=3).done([1.0, 2.0, 3.0], 3, 0.0)  # too noisy, budget left
    assert relative_noise([1.0, 1.0]) == 0.0
    assert ThrottleRule().keep(1800, 1755) and not ThrottleRule().keep(1000, 1755)
    assert ThrottleRule().keep(None, 1755)


def _row(case, pct, verdict_name="SAME"):
    return {
        "case": case, "median_us": 100.0, "noise": 0.004, "gbps": 2900.0, "pct_copy": pct, "per_call_us": 104.0,
        "x_bnb_kernel": 1.3, "x_bnb_full": 1.4, "x_bnb_full_per_call": 1.5, "baseline_us": 99.0, "delta": 0.01,
        "verdict": verdict_name, "bnb_kernel_pct_copy": 70.0, "bnb_full_pct_copy": 60.0,
    }  # fmt: skip


def test_summary_markdown_plot_and_job_summary(tmp_path, monkeypatch):
    step = tmp_path / "step.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step))
    results = [_row("llama.q", 95.0), _row("qwen.k", 80.0, "SLOWER")]
    out = report.write_outputs(results, ["GPU: test"], tmp_path / "out")
    md = out["markdown"].read_text()
    assert "| llama.q" in md and "SLOWER" in md and "x bnb kernel" in md
    assert step.read_text() == md
    assert out["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "qwen.k" in report.render(results, [], "simple")
