"""End to end: a QLoRA training step, a prefill and a LoRA merge give bit-identical results with
``harness.patch_bitsandbytes()`` and without, and the patched run really used our kernel.

A 2-layer model at Llama-3.3-70B's sizes, random weights (no downloads), quantized by
transformers (nf4, double quantization, bf16 compute), a peft LoRA adapter on every projection.
Token counts: 256 (bitsandbytes' per-GPU heuristic picks its fused GEMM or the fallback) and
2048 and 8192 (the forward takes gemm_4bit's dequantize-then-linear path, as real training does).
"""

from __future__ import annotations

import pytest
import torch

import harness
from harness.correctness import qlora
from harness.correctness.bitcompare import assert_bit_exact
from harness.runtime import patch

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


@pytest.fixture(scope="module")
def qlora_model(checkpoint):
    m = qlora.load_qlora(checkpoint)
    yield m
    del m
    torch.cuda.empty_cache()


@pytest.mark.parametrize(("batch", "seq"), [(1, 256), (1, 2048), (4, 2048)], ids=["256", "2048", "8192"])
def test_training_step_is_bit_identical_with_the_patch(bnb, cuda, qlora_model, batch, seq):
    m = qlora.QLoRAModel(qlora_model.model, qlora.random_tokens(qlora_model.model.config.vocab_size, batch, seq))
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
    forward = after.get("gemm_4bit fallback: ours", 0) - before.get("gemm_4bit fallback: ours", 0)
    assert after["fallback"] == before["fallback"], "a QLoRA dequantization fell back to bitsandbytes"
    # The backward dequantizes wherever the input's gradient is needed: every projection but the
    # first layer's q, k and v, whose input (normed frozen embeddings) needs none.
    assert routed - forward == 2 * 7 - 3, "every backward dequantization ran our kernel"
    # Up to 1536 tokens bitsandbytes' per-GPU heuristic picks its fused GEMM or the fallback.
    assert forward == 2 * 7 or (forward == 0 and batch * seq <= 1536), "the forward's dequantizations ran ours"
    assert_bit_exact(p_loss, loss, "loss")
    assert set(p_grads) == set(grads) and len(grads) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    for name in grads:
        assert_bit_exact(p_grads[name], grads[name], name)
    print(f"\nQLoRA step, {batch}x{seq} tokens: {routed} dequantizations ran our kernel; loss {loss.item():.6f}")


def test_prefill_logits_are_bit_identical_with_the_patch(bnb, cuda):
    """Inference prefill of 2048 tokens on a small Llama built from a config: every projection's
    forward is gemm_4bit's dequantize-then-linear path."""
    pytest.importorskip("transformers", reason="the prefill check needs transformers")
    tmp = qlora.temporary_checkpoint(dims=qlora.SMALL_LLAMA, layers=2)
    model = None
    try:
        model = qlora.load_quantized(tmp.name)
        ids = qlora.random_tokens(model.config.vocab_size, 1, 2048, seed=1)
        with torch.no_grad():
            expected = model(input_ids=ids).logits
            assert_bit_exact(model(input_ids=ids).logits, expected, "unpatched prefill repeated")
            before = patch.routed_calls()
            with harness.bitsandbytes_patched():
                got = model(input_ids=ids).logits
            after = patch.routed_calls()
        assert after.get("gemm_4bit fallback: ours", 0) - before.get("gemm_4bit fallback: ours", 0) == 2 * 7
        assert after["fallback"] == before["fallback"]
        assert_bit_exact(got, expected, "prefill logits")
    finally:
        del model
        torch.cuda.empty_cache()
        tmp.cleanup()


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
