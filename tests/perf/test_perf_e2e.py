"""End-to-end QLoRA training step (2-layer Llama-3.3-70B-sized model, nf4 nested, LoRA on every
projection) with each side's ``patch_bitsandbytes()``, ABBA rounds of wall-timed steps.

Report-only: a step is ~25 ms of eager PyTorch whose host-side noise (6-29% measured) swamps a
kernel change of a few percent of it, so the row shows the ratio and its interval and never
decides the gate; the kernel cases do. Bit-identity of the step is the correctness suite's job
(tests/test_e2e_qlora_gpu.py).
"""

from __future__ import annotations

import pytest

from .conftest import Replay, replay_into

pytestmark = pytest.mark.gpu


@pytest.mark.benchmark(timer=Replay.clock, disable_gc=True, warmup=False)
def test_qlora_training_step(benchmark, perf_session):
    pytest.importorskip("transformers", reason="the end-to-end case needs transformers")
    pytest.importorskip("peft", reason="the end-to-end case needs peft")
    result = perf_session.measure_e2e()
    benchmark.extra_info.update({"candidate_rounds_s": result.cand_rounds_s, "base_rounds_s": result.base_rounds_s})
    replay_into(benchmark, result.cand_samples_s)
