"""harness.patch_bitsandbytes: patch, undo, double patch, context manager, routing and fallback.

The mechanics run on the CPU (CI); routing to the real kernel is checked on the GPU.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import harness
from harness import api, cases, patch
from harness.bitcompare import assert_bit_exact
from harness.errors import DequantizeInputError


@pytest.fixture
def F(bnb):
    yield bnb
    patch.unpatch_bitsandbytes()  # never leak a patch into other tests


@pytest.fixture
def from_importer(F):
    """A module of a patched package (transformers) that did ``from bitsandbytes.functional
    import dequantize_4bit`` before patching."""
    mod = types.ModuleType("transformers._nf4_harness_test_site")
    mod.dequantize_4bit = F.dequantize_4bit
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def test_patch_replaces_and_undo_restores_the_original_object(F, from_importer):
    original = F.dequantize_4bit
    harness.patch_bitsandbytes()
    assert F.dequantize_4bit is not original
    assert F.dequantize_4bit.__wrapped__ is original
    assert from_importer.dequantize_4bit is F.dequantize_4bit, "from-imports are rebound too"
    harness.unpatch_bitsandbytes()
    assert F.dequantize_4bit is original
    assert from_importer.dequantize_4bit is original


def test_patching_twice_is_harmless_and_one_undo_restores(F):
    original = F.dequantize_4bit
    harness.patch_bitsandbytes()
    wrapper = F.dequantize_4bit
    harness.patch_bitsandbytes()
    assert F.dequantize_4bit is wrapper, "a second patch must not wrap the wrapper"
    harness.unpatch_bitsandbytes()
    assert F.dequantize_4bit is original
    harness.unpatch_bitsandbytes()  # undo without a patch: no-op
    assert F.dequantize_4bit is original


def test_modules_importing_while_patched_are_restored_on_undo(F):
    original = F.dequantize_4bit
    harness.patch_bitsandbytes()
    late = types.ModuleType("peft._nf4_harness_test_late_site")
    late.dequantize_4bit = F.dequantize_4bit
    sys.modules[late.__name__] = late
    try:
        harness.unpatch_bitsandbytes()
        assert late.dequantize_4bit is original
    finally:
        del sys.modules[late.__name__]


def test_a_users_variable_is_never_rebound(F):
    """A reference a user took (to compare patched with original, say) stays bitsandbytes' own."""
    user = types.ModuleType("nf4_harness_user_code")
    user.ref = F.dequantize_4bit
    sys.modules[user.__name__] = user
    try:
        original = F.dequantize_4bit
        harness.patch_bitsandbytes()
        assert F.dequantize_4bit is not original
        assert user.ref is original
        assert all(not m.__name__.startswith("nf4_harness_user") for m, _ in patch._rebound)
        harness.unpatch_bitsandbytes()
        assert user.ref is original and F.dequantize_4bit is original
    finally:
        del sys.modules[user.__name__]


def test_unproven_bitsandbytes_is_refused_with_a_warning(F, monkeypatch):
    import bitsandbytes

    original = F.dequantize_4bit
    monkeypatch.setattr(bitsandbytes, "__version__", "0.51.0")
    with pytest.warns(RuntimeWarning, match=r"nothing patched: bitsandbytes 0\.51\.0 is installed"):
        assert harness.patch_bitsandbytes() is False
    assert F.dequantize_4bit is original and not patch.is_patched()
    changed = patch.unproven_reason("0.50.2", lambda A, quant_state=None, out=None: None)
    assert "takes ('A', 'quant_state', 'out')" in changed
    assert patch.unproven_reason("0.50.2", original) is None


def test_context_manager_patches_for_the_block_only(F):
    original = F.dequantize_4bit
    with harness.bitsandbytes_patched():
        assert patch.is_patched() and F.dequantize_4bit is not original
    assert F.dequantize_4bit is original
    harness.patch_bitsandbytes()
    with harness.bitsandbytes_patched():
        pass
    assert patch.is_patched(), "a patch made before the block outlives it"


def test_callers_that_look_up_the_attribute_are_routed(F, monkeypatch):
    """bitsandbytes' own dequantize_nf4 calls the module-level name: it must reach ours."""
    seen = []
    sentinel = torch.zeros(1)
    monkeypatch.setattr(api, "dequantize_4bit", lambda *a: seen.append(a) or sentinel)
    harness.patch_bitsandbytes()
    A = torch.zeros(4, 1, dtype=torch.uint8)
    assert F.dequantize_nf4(A, absmax=torch.ones(1), out=torch.empty(8), blocksize=64) is sentinel
    assert seen and seen[0][5] == "nf4"


def test_what_ours_refuses_falls_back_to_bitsandbytes_bit_exact(F, run_seed):
    """CPU tensors: ours refuses before launching, bitsandbytes' CPU backend answers."""
    for nested in (False, True):
        A, qs = cases.quantize_weights((64, 96), "nf4", 64, nested, torch.bfloat16, run_seed, device="cpu")
        expected = F.dequantize_4bit(A, qs)
        before = patch.routed_calls()
        with harness.bitsandbytes_patched():
            got = F.dequantize_4bit(A, qs)
        after = patch.routed_calls()
        assert after["fallback"] == before["fallback"] + 1 and after["ours"] == before["ours"]
        assert_bit_exact(got, expected)


def test_fallback_passes_every_argument_through(monkeypatch):
    received = []

    def refuse(*a):
        raise DequantizeInputError("not ours")

    monkeypatch.setattr(api, "dequantize_4bit", refuse)
    wrapper = patch._make_wrapper(lambda *a: received.append(a) or "bnb")
    args = ("A", "qs", "absmax", "out", 128, "nf4")
    assert wrapper(*args) == "bnb"
    assert received == [args]


def test_under_torch_compile_the_original_op_is_traced(F, run_seed):
    """TorchDynamo can't trace raw-pointer launches; the patch hands compiled code to
    bitsandbytes' traceable op, in one graph (fullgraph=True fails on any graph break)."""
    A, qs = cases.quantize_weights((32, 64), "nf4", 64, False, torch.float16, run_seed, device="cpu")
    expected = F.dequantize_4bit(A, qs)
    torch._dynamo.reset()
    with harness.bitsandbytes_patched():
        compiled = torch.compile(lambda a: F.dequantize_4bit(a, qs) * 1, backend="eager", fullgraph=True)
        got = compiled(A)
    assert_bit_exact(got, expected)


# --- on the GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_patched_calls_run_our_kernel_bit_exact(F, cuda, run_seed, quant_type, nested):
    A, qs = cases.quantize_weights((384, 512), quant_type, 64, nested, torch.bfloat16, run_seed, device=cuda)
    expected = F.dequantize_4bit(A, qs)
    before = patch.routed_calls()
    with harness.bitsandbytes_patched():
        got = F.dequantize_4bit(A, qs)
    assert patch.routed_calls()["ours"] == before["ours"] + 1
    assert_bit_exact(got, expected)


@pytest.mark.gpu
def test_qlora_backward_through_matmul_4bit_is_bit_identical(F, cuda, run_seed):
    import bitsandbytes as bnb

    B, qs = cases.quantize_weights((768, 512), "nf4", 64, True, torch.bfloat16, run_seed, device=cuda)
    g = cases.seeded_generator(run_seed, cuda)
    x = torch.randn(16, 512, generator=g, device=cuda, dtype=torch.bfloat16)

    def grad():
        a = x.clone().requires_grad_()
        bnb.matmul_4bit(a, B.t(), qs).square().sum().backward()
        return a.grad

    expected = grad()
    before = patch.routed_calls()["ours"]
    with harness.bitsandbytes_patched():
        got = grad()
    assert patch.routed_calls()["ours"] == before + 1, "the backward's dequantize must run our kernel"
    assert_bit_exact(got, expected)


@pytest.mark.gpu
def test_compiled_module_on_gpu_gives_the_same_bits(F, cuda, run_seed):
    A, qs = cases.quantize_weights((256, 256), "nf4", 64, True, torch.float16, run_seed, device=cuda)
    expected = F.dequantize_4bit(A, qs)
    torch._dynamo.reset()
    with harness.bitsandbytes_patched():
        got = torch.compile(lambda a: F.dequantize_4bit(a, qs), fullgraph=True)(A)
    assert_bit_exact(got, expected)
