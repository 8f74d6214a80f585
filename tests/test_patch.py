"""harness.patch_bitsandbytes: patch, undo, double patch, context manager, routing and fallback.

The mechanics run on the CPU (CI); routing to the real kernel is checked on the GPU.
"""

from __future__ import annotations

import collections
import sys
import types

import pytest
import torch

import harness
from harness.correctness import cases
from harness.correctness.bitcompare import assert_bit_exact
from harness.errors import InputError, SettingError
from harness.runtime import api, dequantize, host_path, patch, route_counts


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
        assert all(not m.__name__.startswith("nf4_harness_user") for m, _, _ in patch._rebound)
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
    functional = patch.SEAMS[0]
    changed = patch.unproven_reason("0.50.2", {functional: lambda A, quant_state=None, out=None: None})
    assert "dequantize_4bit takes ('A', 'quant_state', 'out')" in changed
    assert patch.unproven_reason("0.50.2", {functional: original}) is None


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
        raise InputError("not ours")

    monkeypatch.setattr(api, "dequantize_4bit", refuse)
    wrapper = patch._functional_wrapper(lambda *a: received.append(a) or "bnb")
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


def _proven_cuda_ops(name: str = patch.CUDA_OPS, **replace) -> types.ModuleType:
    """A stand-in for bitsandbytes' CUDA backend module (absent without CUDA) whose two seams
    have the proven signatures and record their calls."""
    mod = types.ModuleType(name)
    mod.calls = []

    def _dequantize_4bit_impl(A, absmax, blocksize, quant_type, dtype, out):
        mod.calls.append(("impl", A, absmax, blocksize, quant_type, dtype, out))

    def _dequant_linear_fallback(
        A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None, absmax_offset=None
    ):
        mod.calls.append(("fallback", A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code))
        return "bnb"

    def _gemm_4bit_kernel_impl(
        A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None, absmax_offset=None
    ):
        mod.calls.append(("kernel", A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code))
        return "bnb kernel"

    mod._dequantize_4bit_impl = _dequantize_4bit_impl
    mod._dequant_linear_fallback = _dequant_linear_fallback
    mod._gemm_4bit_kernel_impl = _gemm_4bit_kernel_impl
    for attr, value in replace.items():
        if value is None:
            delattr(mod, attr)
        else:
            setattr(mod, attr, value)
    return mod


@pytest.fixture
def cuda_ops(F, monkeypatch):
    mod = _proven_cuda_ops()
    monkeypatch.setitem(sys.modules, patch.CUDA_OPS, mod)
    return mod


@pytest.mark.parametrize("matmul", [False, True], ids=["default", "matmul"])
def test_every_seam_of_the_mode_is_rebound_and_undo_restores_each(F, cuda_ops, matmul):
    originals = {s: getattr(sys.modules[s.module], s.name) for s in patch.SEAMS}
    patched = {s for s in patch.SEAMS if matmul or not s.matmul_only}
    assert harness.patch_bitsandbytes(matmul=matmul) is True
    for seam, original in originals.items():
        wrapper = getattr(sys.modules[seam.module], seam.name)
        if seam in patched:
            assert wrapper is not original and wrapper.__wrapped__ is original, seam.name
        else:  # the default mode leaves bitsandbytes' fused kernel alone: no output bit changes
            assert wrapper is original, seam.name
    assert {(m.__name__, n) for m, n, _ in patch._rebound} == {(s.module, s.name) for s in patched}
    harness.unpatch_bitsandbytes()
    for seam, original in originals.items():
        assert getattr(sys.modules[seam.module], seam.name) is original, seam.name


def test_switching_modes_replaces_the_patch_and_the_context_restores_the_one_before(F, cuda_ops):
    kernel_seam = next(s for s in patch.SEAMS if s.matmul_only)
    original = getattr(cuda_ops, kernel_seam.name)
    assert harness.patch_bitsandbytes() and getattr(cuda_ops, kernel_seam.name) is original
    with harness.bitsandbytes_patched(matmul=True):
        assert getattr(cuda_ops, kernel_seam.name).__wrapped__ is original
    assert patch.is_patched() and getattr(cuda_ops, kernel_seam.name) is original  # back to the default mode
    harness.unpatch_bitsandbytes()


def test_in_matmul_mode_gemm_4bit_runs_the_fused_kernel_where_it_takes_the_call(F, cuda_ops, monkeypatch):
    from harness.runtime import matmul

    seen = []
    monkeypatch.setattr(matmul, "try_fused", lambda *a: seen.append(a) or "fused" if a[0] == "small" else None)
    with harness.bitsandbytes_patched(matmul=True):
        args = (None, "B", (6, 4), "absmax2", 64, "nf4", "bias", "codes", "code", "offset")
        A_small, A_big = _Rows("small"), _Rows("big")
        assert cuda_ops._gemm_4bit_kernel_impl(A_small, *args[1:]) == "fused"
        assert cuda_ops._gemm_4bit_kernel_impl(A_big, *args[1:]) == "bnb kernel"  # not ours: bitsandbytes' kernel
    fields, nested = seen[0][2], seen[0][3]
    assert fields == ("codes", 64, "nf4", (6, 4), "dtype") and nested["blocksize2"] == 256
    assert nested["code2"] == "code" and nested["absmax2"] == "absmax2" and nested["offset"] == "offset"


class _Rows(str):
    """An activation stand-in: a name the test routes on, and a dtype."""

    dtype = "dtype"


@pytest.mark.parametrize(
    ("replace", "reason"),
    [
        ({"_dequantize_4bit_impl": None}, r"ops\._dequantize_4bit_impl is missing"),
        (
            {"_dequant_linear_fallback": lambda A, B, shapeB, absmax, blocksize, quant_type, bias=None: None},
            r"ops\._dequant_linear_fallback takes \('A', 'B', 'shapeB', 'absmax', 'blocksize', 'quant_type', 'bias'\)",
        ),
    ],
    ids=["missing", "changed"],
)
def test_a_missing_or_changed_seam_refuses_the_whole_patch(F, monkeypatch, replace, reason):
    monkeypatch.setitem(sys.modules, patch.CUDA_OPS, _proven_cuda_ops(**replace))
    original = F.dequantize_4bit
    with pytest.warns(RuntimeWarning, match=r"nothing patched: bitsandbytes\.backends\.cuda\." + reason):
        assert harness.patch_bitsandbytes() is False
    assert F.dequantize_4bit is original and not patch.is_patched() and not patch._rebound


def test_without_cudas_backend_only_the_functional_seam_is_patched(F, monkeypatch):
    monkeypatch.delitem(sys.modules, patch.CUDA_OPS, raising=False)
    assert harness.patch_bitsandbytes() is True
    assert {n for _, n, _ in patch._rebound} == {"dequantize_4bit"}


def test_gemm_fallback_decodes_nested_scales_in_our_one_launch(monkeypatch):
    """bitsandbytes' fallback runs three kernels before F.linear; ours gets every nested piece
    (8-bit codes, code book, second-level absmax and block size, offset) in one call."""
    seen = []
    weight = torch.randn(6, 4)
    monkeypatch.setattr(dequantize, "dequantize_packed", lambda *a, **k: seen.append((a, k)) or weight)
    wrapper = patch._gemm_fallback_wrapper(lambda *a: pytest.fail("bitsandbytes' fallback was called"))
    x, bias = torch.randn(3, 4), torch.randn(6)
    B, codes, absmax2, code, offset = (torch.zeros(12, 1, dtype=torch.uint8), "codes", "absmax2", "code", "offset")
    got = wrapper(x, B, (6, 4), absmax2, 64, "nf4", bias, absmax_8bit=codes, absmax_code=code, absmax_offset=offset)
    assert_bit_exact(got, torch.nn.functional.linear(x, weight, bias))
    ((args, kwargs),) = seen
    assert args == (B, codes, 64, "nf4", (6, 4), x.dtype)
    assert kwargs == {"code2": code, "absmax2": absmax2, "blocksize2": 256, "offset": offset}
    seen.clear()
    wrapper(x, B, (6, 4), "absmax", 64, "fp4")
    assert seen == [((B, "absmax", 64, "fp4", (6, 4), x.dtype), {})]


def test_gemm_fallback_hands_what_ours_refuses_to_bitsandbytes_unchanged(monkeypatch):
    received = []

    def refuse(*a, **k):
        raise InputError("not ours")

    monkeypatch.setattr(dequantize, "dequantize_packed", refuse)
    wrapper = patch._gemm_fallback_wrapper(lambda *a: received.append(a) or "bnb")
    args = (torch.zeros(2, 4), "B", (6, 4), "absmax", 64, "nf4", "bias", "codes", "code", "offset")
    assert wrapper(*args) == "bnb"
    assert received == [args]


def test_the_op_kernel_seam_passes_packed_storage_through_and_defers_odd_calls(monkeypatch):
    seen = []
    monkeypatch.setattr(dequantize, "dequantize_packed", lambda *a, **k: seen.append(a))
    received = []
    wrapper = patch._op_impl_wrapper(lambda *a: received.append(a))
    packed = torch.zeros(8, 1, dtype=torch.bfloat16)  # FSDP-style quant_storage: ours reads its bytes
    out = torch.empty(4, 8, dtype=torch.float16)
    assert wrapper(packed, "absmax", 64, "nf4", torch.float16, out) is None
    assert seen == [(packed, "absmax", 64, "nf4", out.shape, torch.float16, out)]
    assert not received
    wrapper(packed, "absmax", 64, "nf4", torch.float32, out)  # out's dtype disagrees: bitsandbytes decides
    assert len(seen) == 1 and received == [(packed, "absmax", 64, "nf4", torch.float32, out)]


def test_a_misconfigured_setting_is_raised_not_hidden_behind_the_fallback(F, monkeypatch):
    """An unknown NF4_HARNESS_HOST_LAUNCHER must stop the patched call: were it a ValueError, the
    wrapper would take it for input ours refuses and send every call to bitsandbytes quietly."""
    from harness import settings

    monkeypatch.setenv(settings.HOST_LAUNCHER.name, "fast")
    monkeypatch.setattr(host_path.entry(dequantize.HOST), "fn", None)  # bound afresh, as at a process' first call
    A, qs = cases.quantize_weights((64, 96), "nf4", 64, False, torch.bfloat16, 0, device="cpu")
    with harness.bitsandbytes_patched(), pytest.raises(SettingError, match="must be one of"):
        F.dequantize_4bit(A, qs)


def test_routed_calls_counts_per_seam_and_in_total(monkeypatch):
    monkeypatch.setattr(route_counts, "counts", collections.Counter())
    route_counts.count("gemm_4bit fallback", True)
    route_counts.count("functional", False)
    route_counts.count("functional", True)
    assert patch.routed_calls() == {
        "ours": 2,
        "fallback": 1,
        "functional: fallback": 1,
        "functional: ours": 1,
        "gemm_4bit fallback: ours": 1,
    }


def test_our_registered_op_has_a_fake_implementation_for_tracing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        A = torch.empty(48, 1, dtype=torch.uint8, device="cuda")
        got = torch.ops.nf4_harness.dequantize_4bit(
            A, torch.empty(2, device="cuda"), 64, "nf4", [8, 12], torch.bfloat16, None, None, 0, None, 0.0
        )
    assert got.shape == (8, 12) and got.dtype == torch.bfloat16 and got.device.type == "cuda"
    assert not dequantize.traced_takes(torch.zeros(4, 1, dtype=torch.uint8), None), "CPU tensors stay with bitsandbytes"


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
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_compiled_graph_runs_our_registered_op_bit_exact(F, cuda, run_seed, nested):
    """Under torch.compile the patched call becomes one nf4_harness::dequantize_4bit node."""
    A, qs = cases.quantize_weights((256, 256), "nf4", 64, nested, torch.float16, run_seed, device=cuda)
    expected = F.dequantize_4bit(A, qs)
    out = torch.full_like(expected, float("nan"))
    torch._dynamo.reset()
    before = patch.routed_calls().get("compiled op: ours", 0)
    with harness.bitsandbytes_patched():
        got = torch.compile(lambda a: F.dequantize_4bit(a, qs), fullgraph=True)(A)
        torch.compile(lambda a, o: F.dequantize_4bit(a, qs, out=o), fullgraph=True)(A, out)
    assert patch.routed_calls()["compiled op: ours"] == before + 2
    assert_bit_exact(got, expected)
    assert_bit_exact(out, expected, "out=")


@pytest.mark.gpu
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_gemm_4bit_fallback_for_large_m_runs_our_kernel_bit_identical(F, cuda, run_seed, nested, grad):
    """M > 1536: bitsandbytes' gemm_4bit dequantizes and calls F.linear (prefill, training forward)."""
    import bitsandbytes as bnb

    B, qs = cases.quantize_weights((768, 512), "nf4", 64, nested, torch.bfloat16, run_seed, device=cuda)
    g = cases.seeded_generator(run_seed, cuda)
    x = torch.randn(2048, 512, generator=g, device=cuda, dtype=torch.bfloat16, requires_grad=grad)

    def forward():
        with torch.set_grad_enabled(grad):
            return bnb.matmul_4bit(x, B.t(), qs)

    expected = forward()
    before = patch.routed_calls()
    with harness.bitsandbytes_patched():
        got = forward()
    after = patch.routed_calls()
    assert after.get("gemm_4bit fallback: ours", 0) == before.get("gemm_4bit fallback: ours", 0) + 1
    assert after["fallback"] == before["fallback"]
    assert_bit_exact(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16], ids=["uint8", "bf16-storage"])
def test_the_bitsandbytes_op_and_its_out_overload_run_our_kernel(F, cuda, run_seed, storage):
    g = cases.seeded_generator(run_seed, cuda)
    w = torch.randn(384, 256, generator=g, device=cuda, dtype=torch.float16)
    A, qs = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False, quant_storage=storage)
    op = torch.ops.bitsandbytes.dequantize_4bit
    args = (A, qs.absmax, qs.blocksize, qs.quant_type, qs.shape, qs.dtype)
    expected = op.default(*args)
    out = torch.full_like(expected, float("nan"))
    before = patch.routed_calls().get("dequantize_4bit op: ours", 0)
    with harness.bitsandbytes_patched():
        got = op.default(*args)
        op.out(*args, out=out)
        compiled = torch.compile(lambda a: op.default(a, *args[1:]) * 1, fullgraph=True)(A)
    assert patch.routed_calls()["dequantize_4bit op: ours"] == before + 3
    assert_bit_exact(got, expected)
    assert_bit_exact(out, expected, "out overload")
    assert_bit_exact(compiled, expected, "compiled graph holding bitsandbytes' op")


def test_a_second_copy_of_the_op_module_keeps_the_first_registration(monkeypatch):
    """The perf gate's A/B process loads two copies of harness; the second must not re-register."""
    import importlib.util

    from harness.runtime import torch_op

    # A second copy of the registrar, loaded from its file under another name (as another
    # checkout's would be), registering this copy's ops as its op modules do when they load.
    spec = importlib.util.spec_from_file_location("second_copy_torch_op", torch_op.__file__)
    second = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, second)  # dataclasses look their module up there
    spec.loader.exec_module(second)
    first = torch.ops.nf4_harness.dequantize_4bit.default
    second.register([second.TorchOp(t.name, t.fn, t.fake, t.schema, t.mutates_args) for t in dequantize.TORCH_OPS])
    assert torch.ops.nf4_harness.dequantize_4bit.default is first
