"""End to end: a QLoRA training step and a LoRA merge give bit-identical results with
``harness.patch_bitsandbytes()`` and without, and the patched run really used our kernel.

A 2-layer model at Llama-3.3-70B's sizes, random weights (no downloads), quantized by
transformers (nf4, double quantization, bf16 compute), a peft LoRA adapter on every projection.
"""

from __future__ import annotations

import pytest
import torch

import harness
from harness import patch, qlora
from harness.bitcompare import assert_bit_exact

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoint():
    pytest.importorskip("transformers", reason="the end-to-end check needs transformers")
    pytest.importorskip("peft", reason="the end-to-end check needs peft")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible")
    tmp = qlora.temporary_checkpoint()
    yield tmp.name
    tmp.cleanup()


def _same_bytes(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    if got.is_floating_point():
        assert_bit_exact(got, expected, name)
        return
    assert got.dtype == expected.dtype and got.shape == expected.shape, name
    diff = (got.reshape(-1).view(torch.uint8) != expected.reshape(-1).view(torch.uint8)).sum().item()
    assert diff == 0, f"{name}: {diff} bytes differ"


def test_training_step_is_bit_identical_with_the_patch(bnb, cuda, checkpoint):
    m = qlora.load_qlora(checkpoint)
    loss, grads = qlora.train_step(m)
    again_loss, again_grads = qlora.train_step(m)
    # Without a deterministic reference the comparison below could not fail for the right reason.
    assert_bit_exact(again_loss, loss, "unpatched step repeated")
    for name in grads:
        assert_bit_exact(again_grads[name], grads[name], f"unpatched step repeated: {name}")

    before = patch.routed_calls()
    with harness.bitsandbytes_patched():
        p_loss, p_grads = qlora.train_step(m)
    after = patch.routed_calls()
    routed = after["ours"] - before["ours"]
    assert routed > 0, "the patched backward never reached our kernel"
    assert after["fallback"] == before["fallback"], "a QLoRA dequantization fell back to bitsandbytes"
    assert_bit_exact(p_loss, loss, "loss")
    assert set(p_grads) == set(grads) and len(grads) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    for name in grads:
        assert_bit_exact(p_grads[name], grads[name], name)
    print(f"\nQLoRA step: {routed} dequantizations ran our kernel; loss {loss.item():.6f}, bit-identical")


def test_merge_and_unload_is_bit_identical_with_the_patch(bnb, cuda, checkpoint):
    expected = {
        k: v.cpu() for k, v in qlora.state_tensors(qlora.load_qlora(checkpoint).model.merge_and_unload()).items()
    }
    torch.cuda.empty_cache()
    m = qlora.load_qlora(checkpoint)
    before = patch.routed_calls()["ours"]
    with harness.bitsandbytes_patched():
        merged = m.model.merge_and_unload()
    assert patch.routed_calls()["ours"] - before >= 2 * 7, "every projection's merge dequantizes"
    got = qlora.state_tensors(merged)
    assert set(got) == set(expected)
    for name, tensor in got.items():
        _same_bytes(name, tensor.cpu(), expected[name])
