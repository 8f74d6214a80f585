"""Bad input raises a clear Python exception before any launch, and the GPU stays usable after.

The first group needs no GPU (CI runs it); the second builds each bad call from a good one on the
GPU, checks that nothing was launched, then runs a good case and checks its bits.
"""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pytest
import torch

import harness
from harness.correctness import cases
from harness.correctness.bitcompare import assert_bit_exact, poison_
from harness.correctness.op_checks import dequantize_battery
from harness.errors import InputError, KernelLaunchError
from harness.runtime import dequantize, host_path, launcher

# --- no GPU needed -----------------------------------------------------------------------------


def _cpu_state(**overrides):
    from types import SimpleNamespace

    state = dict(
        absmax=torch.ones(2),
        shape=torch.Size([128]),
        dtype=torch.float16,
        blocksize=64,
        quant_type="nf4",
        state2=None,
        offset=None,
    )
    state.update(overrides)
    return SimpleNamespace(**state)


def test_absmax_and_out_are_required_without_quant_state():
    A = torch.zeros(64, 1, dtype=torch.uint8)
    with pytest.raises(InputError, match="requires both absmax and out"):
        harness.dequantize_4bit(A, absmax=torch.ones(2))
    with pytest.raises(InputError, match="requires both absmax and out"):
        harness.dequantize_4bit(A, out=torch.empty(128))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"blocksize": 48}, "invalid blocksize 48"),
        ({"blocksize": 8192}, "invalid blocksize 8192"),
        ({"quant_type": "int4"}, "quant_type must be 'nf4' or 'fp4', got 'int4'"),
        ({"dtype": torch.float64}, "only supports 16/32-bit floats"),
        ({"dtype": torch.int8}, "only supports 16/32-bit floats"),
    ],
)
def test_unsupported_configuration_raises_like_bitsandbytes(override, message):
    with pytest.raises(InputError, match=message):
        harness.dequantize_4bit(torch.zeros(64, 1, dtype=torch.uint8), _cpu_state(**override))


@pytest.mark.parametrize(
    ("state", "missing"),
    [
        ("not a state", "'str' object has no attribute 'absmax'"),
        ({"absmax": 1}, "'dict' object has no attribute 'absmax'"),
        (SimpleNamespace(absmax=torch.ones(2), shape=(8, 16)), "has no attribute 'dtype'"),
        (
            SimpleNamespace(**{**vars(_cpu_state()), "nested": True, "state2": SimpleNamespace(absmax=torch.ones(1))}),
            "has no attribute 'code'",
        ),
    ],
    ids=["str", "dict", "partial", "nested-without-code"],
)
def test_an_object_that_is_not_a_quant_state_is_an_input_error(state, missing):
    with pytest.raises(InputError, match=rf"quant_state must be a bitsandbytes QuantState: .*{missing}"):
        harness.dequantize_4bit(torch.zeros(64, 1, dtype=torch.uint8), state)


def test_cpu_tensor_is_rejected_before_cuda_is_touched():
    """A host tensor is told where CPU calls go, by either drop-in, with the one input error type
    (``DequantizeInputError``, its name from before the matmul drop-in, is the same class)."""
    cuda_only = r"must be on a CUDA device, got cpu: the drop-ins are CUDA-only; for CPU tensors call bitsandbytes"
    with pytest.raises(InputError, match=cuda_only):
        harness.dequantize_4bit(torch.zeros(64, 1, dtype=torch.uint8), _cpu_state())
    state = _cpu_state(shape=torch.Size([2, 64]), dtype=torch.bfloat16)
    with pytest.raises(InputError, match=cuda_only):
        harness.matmul_4bit(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(64, 1, dtype=torch.uint8).t(), state)
    assert harness.DequantizeInputError is InputError and issubclass(InputError, ValueError)


def test_input_errors_are_value_errors():
    assert issubclass(InputError, ValueError)


# --- on the GPU --------------------------------------------------------------------------------


@pytest.fixture
def good(cuda, run_seed):
    """A valid nested and a valid plain case, with their expected outputs from the reference."""
    out = {}
    for nested in (False, True):
        case = cases.raw_case((96, 130), "nf4", 64, torch.bfloat16, nested, run_seed, device=cuda, special_scales=False)
        out[nested] = case
    return out


def _expect_rejected(call, match, monkeypatch, cuda, good, bnb):
    launches = []
    real_launch = launcher.launch
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: launches.append(a))
    with pytest.raises(InputError, match=match):
        call()
    assert launches == [], "a rejected call must not launch anything"
    monkeypatch.setattr(launcher, "launch", real_launch)
    # The context still works: a good case right after is bit-exact.
    case = good[True]
    got = poison_(torch.empty(case.shape, dtype=case.dtype, device=cuda))
    harness.dequantize_4bit(case.A, case.quant_state(), out=got)
    assert_bit_exact(got, bnb.dequantize_4bit(case.A, case.quant_state()))


BAD = {name: (call, message) for name, call, message in dequantize_battery.bad_calls()}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_raises_before_launch_and_gpu_stays_usable(cuda, bnb, good, monkeypatch, name):
    """The battery of tests/test_call_rules.py on GPU tensors: the compiled path declines or raises
    the Python path's error (it launches nothing), the Python path names the rule before its launch."""
    call, message = next((c, m) for n, c, m in dequantize_battery.bad_calls(cuda) if n == name)
    entry = host_path.entry(dequantize.HOST).bound()
    assert entry, "the GPU sessions run with the compiled host path"
    try:
        assert entry(*dequantize_battery.positional(call)) is None, "the compiled path took a bad call"
    except InputError as e:
        assert re.search(re.escape(message), str(e)), str(e)
    kwargs = dequantize_battery.keywords(call)
    _expect_rejected(lambda: dequantize.dequantize_packed(**kwargs), re.escape(message), monkeypatch, cuda, good, bnb)


def _quant_state_faults(good, cuda):
    """What only a QuantState can get wrong, through the public drop-in."""
    nested = good[True]
    nqs = nested.quant_state()

    def with_state(state, **changes):
        s = copy.copy(state)
        for k, v in changes.items():
            setattr(s, k, v)
        return s

    state2 = copy.copy(nqs.state2)
    state2.dtype = torch.float16
    yield "state2-fp16", lambda: harness.dequantize_4bit(nested.A, with_state(nqs, state2=state2)), "float32"
    yield "no-offset", lambda: harness.dequantize_4bit(nested.A, with_state(nqs, offset=None)), "no offset"
    yield "no-state2", lambda: harness.dequantize_4bit(nested.A, with_state(nqs, state2=None)), "state2 is None"


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["state2-fp16", "no-offset", "no-state2"])
def test_a_broken_quant_state_raises_before_launch(cuda, bnb, good, monkeypatch, which):
    call, match = next((c, m) for n, c, m in _quant_state_faults(good, cuda) if n == which)
    _expect_rejected(call, match, monkeypatch, cuda, good, bnb)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_tensors_on_different_gpus_are_rejected(cuda, bnb, good, monkeypatch):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    case = good[False]
    qs = case.quant_state()
    qs.absmax = qs.absmax.to("cuda:1")
    _expect_rejected(lambda: harness.dequantize_4bit(case.A, qs), "same device", monkeypatch, cuda, good, bnb)


@pytest.mark.gpu
def test_failed_launch_names_the_cuda_error_and_context_survives(cuda, bnb, good):
    from harness.runtime.dequantize_kernel import KernelArgs, plan

    loaded = plan("nf4", "fp16", False, 1, cuda.index).kernel
    nothing = KernelArgs(*(0,) * 5, 0.0, *(0,) * 5)  # n = 0: the kernel would write nothing
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(KernelLaunchError) as info:
        # 4096 threads per block exceeds every GPU's limit: the driver refuses the launch.
        launcher.launch(loaded, 1, 4096, stream, nothing)
    assert info.value.cuda_error.startswith("CUDA_ERROR_")
    assert info.value.cuda_error in str(info.value)
    torch.cuda.synchronize()
    case = good[True]
    got = poison_(torch.empty(case.shape, dtype=case.dtype, device=cuda))
    harness.dequantize_4bit(case.A, case.quant_state(), out=got)
    assert_bit_exact(got, bnb.dequantize_4bit(case.A, case.quant_state()))
