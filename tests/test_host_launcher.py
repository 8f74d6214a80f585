"""The compiled host path (harness/runtime/host_launcher.cpp).

Without a GPU: it builds against this PyTorch, reads Tensor subclasses only where Python would
read the same, keeps one recipe a call signature, and the binding modes behave as documented
(tests/test_call_rules.py holds its launches to the Python path's for both ops). On a GPU: it
takes every valid call, bit-identical to the Python path, never launches what the Python path
converts or rejects, works from a fresh thread, and names the CUDA error of a refused launch; the
fused matmul's entry likewise.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil

import pytest
import torch

import harness
from harness import settings
from harness.correctness import cases
from harness.correctness.bitcompare import assert_bit_exact, poison_
from harness.errors import HostLauncherUnavailable, InputError, KernelLaunchError, SettingError
from harness.runtime import (
    dequantize,
    dequantize_kernel,
    dtypes,
    host_launcher,
    host_path,
    jit,
    matmul,
    matmul_kernel,
    recipe,
)
from harness.runtime.dequantize_kernel import OUT_DTYPES, QUANT_TYPES
from tests.threads import in_fresh_thread


@pytest.fixture(scope="module")
def module():
    """The extension, built once per cache directory (about 20 s on two cores)."""
    return host_launcher.build()


def test_a_subclass_is_read_directly_only_where_python_would_read_the_same():
    class Plain(torch.Tensor):
        pass

    class OwnFunction(torch.Tensor):  # like bitsandbytes' Params4bit
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    class OwnDispatch(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert host_launcher.subclass_ok(torch.nn.Parameter)
    assert host_launcher.subclass_ok(Plain)
    assert not host_launcher.subclass_ok(OwnFunction)
    assert not host_launcher.subclass_ok(OwnDispatch)


def test_binding_modes(monkeypatch):
    def broken_build():
        raise RuntimeError("Error building extension 'nf4_harness_host'\nc++: not found")

    monkeypatch.setattr(host_launcher, "build", broken_build)
    monkeypatch.setenv(settings.HOST_LAUNCHER.name, "auto")
    with pytest.warns(RuntimeWarning, match="compiled host launcher is unavailable .*Error building extension"):
        assert host_launcher.bind(dequantize.HOST) is None
    monkeypatch.setenv(settings.HOST_LAUNCHER.name, "compiled")
    with pytest.raises(HostLauncherUnavailable, match="NF4_HARNESS_HOST_LAUNCHER=compiled requires it"):
        host_launcher.bind(dequantize.HOST)
    monkeypatch.setenv(settings.HOST_LAUNCHER.name, "python")
    assert host_launcher.bind(dequantize.HOST) is None  # and no build was tried: it would have warned or raised
    monkeypatch.setenv(settings.HOST_LAUNCHER.name, "fast")
    with pytest.raises(SettingError, match="must be one of"):
        host_launcher.bind(dequantize.HOST)


def test_ninja_of_an_unactivated_virtualenv_is_found_for_the_build_only(monkeypatch):
    import ninja  # a dependency of the harness

    monkeypatch.setattr(host_launcher.shutil, "which", lambda name: None)
    before = os.environ.get("PATH", "")
    with host_launcher._ninja_on_path():
        assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR
    assert os.environ.get("PATH", "") == before


def test_build_dir_names_torch_python_and_source():
    name = host_launcher.build_dir().name
    assert torch.__version__ in name
    assert host_launcher.MODULE_NAME in name


def test_a_signature_is_asked_of_the_op_once_and_each_call_fills_its_own_addresses(module, monkeypatch):
    """The form runs once per signature; a call of the same signature gets its own pointers and
    numbers; another alignment class, dtype, size, value or gradient flag is another signature."""
    asked = []
    kernel = launcher_kernel("copy", ("ptr", "ptr", "f32", "i64"))

    def form(x, y, scale, n):
        asked.append((x.dtype, tuple(x.shape), x.data_ptr() % 256 == 0, n))
        args = (recipe.ptr(0), recipe.ptr(1), recipe.number(2), x.numel() * n)
        return recipe.Recipe(-1, 1, 0, 0, (recipe.Launch(kernel, (1, 1, 1), 32, args),))

    monkeypatch.setattr("harness.runtime.operands.DEVICE_TYPE", "cpu")
    op = host_launcher.HostOp("copy", ("x", "y", "scale", "n"), form)
    entry = host_launcher.configure(
        module, op, context_of=lambda d: 0, launch_kernel=1, launch_kernel_ex=1, ctx_get_current=1, raw_stream=int
    )
    x, y, x2, y2 = (_at_256_bytes(64) for _ in range(4))
    first = module.describe(entry, x, y, 0.5, 3)
    second = module.describe(entry, x2, y2, 2.0, 3)
    assert len(asked) == 1 and module.signatures(entry) == 1
    (_, _, (launch,)), (_, _, (again,)) = first, second
    assert launch[5] == (x.data_ptr(), y.data_ptr(), recipe.slot_bits("f32", 0.5), 192)
    assert again[5][:3] == (x2.data_ptr(), y2.data_ptr(), recipe.slot_bits("f32", 2.0))
    others = [(x[1:], y[1:], 0.5, 3), (x.double(), y, 0.5, 3), (x[:32], y, 0.5, 3), (x, y, 0.5, 4)]
    for args in others:
        module.describe(entry, *args)
    with torch.enable_grad():
        module.describe(entry, x.requires_grad_(), y, 0.5, 3)
    assert module.signatures(entry) == 2 + len(others) and len(asked) == 2 + len(others)
    # Past the table's first size (64 slots at half load) every signature is still found, not asked again.
    many = [_at_256_bytes(100 + i) for i in range(100)]
    for t in many + many:
        module.describe(entry, t, t, 0.5, 3)
    assert module.signatures(entry) == 2 + len(others) + len(many) and len(asked) == 2 + len(others) + len(many)
    # What no signature holds never reaches the form: the Python path takes it.
    assert module.describe(entry, x.detach()[::2], y, 0.5, 3) is None  # not contiguous
    assert module.describe(entry, x.detach(), y, 1e39, 3) is None  # past fp32: struct.pack refuses it


def _at_256_bytes(n: int) -> torch.Tensor:
    """n fp32 zeros at an address aligned to 256 bytes (the signature's largest alignment class)."""
    buffer = torch.zeros(n + 64)
    skip = (-buffer.data_ptr() % 256) // 4
    return buffer[skip : skip + n]


def test_the_shared_host_machinery_names_no_op():
    """The compiled path is one interpreter for every op, and the torch op registration one
    registrar: an op's name, its modules or its arguments written into them would make the next op
    edit them (README, "Adding an op")."""
    from harness.runtime import ops

    words = {op.name for op in ops.OPS} | {"dequantiz", "quant", "absmax", "blocksize", "token"}
    for name in ("host_launcher.cpp", "host_launcher.py", "host_path.py", "recipe.py", "torch_op.py"):
        text = (host_launcher.SOURCE.parent / name).read_text().lower()
        assert not [w for w in words if w in text], name


def launcher_kernel(label, kinds):
    """A stand-in of a loaded kernel (no GPU): a label, parameter kinds and a handle."""
    from harness.runtime import launcher

    return launcher.LoadedKernel(label, -1, None, launcher.ArgPacker(kinds), 0x51, 0)


def _refuse_to_build(**_kwargs):
    raise AssertionError("built again")


def test_a_finished_build_is_imported_from_a_copied_cache_and_a_checkout_elsewhere(module, tmp_path, monkeypatch):
    """Each perf measuring process gets a copy of the cache, and a candidate is a checkout at
    another path: neither may pay for the build again (cpp_extension's ninja file names the
    source's path, so going through it would)."""
    from torch.utils import cpp_extension

    built = host_launcher.build_dir()
    copied = tmp_path / "cache" / built.relative_to(jit.cache_dir())
    shutil.copytree(built, copied)
    elsewhere = tmp_path / "checkout" / host_launcher.SOURCE.name
    elsewhere.parent.mkdir()
    shutil.copy(host_launcher.SOURCE, elsewhere)
    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path / "cache"))
    monkeypatch.setattr(host_launcher, "SOURCE", elsewhere)
    monkeypatch.setattr(cpp_extension, "load", _refuse_to_build)
    again = host_launcher.build()
    assert again.__file__ == str(copied / f"{host_launcher.MODULE_NAME}.so")
    assert again is not module and sorted(dir(again)) == sorted(dir(module))


def test_a_broken_library_is_built_again(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setenv(settings.CACHE_DIR.name, str(tmp_path))
    directory = host_launcher.build_dir()
    directory.mkdir(parents=True)
    (directory / f"{host_launcher.MODULE_NAME}.so").write_bytes(b"\x7fELF cut short by a killed link")
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: ("built", kwargs["build_directory"]))
    assert host_launcher.build() == ("built", str(directory))


# --- on the GPU --------------------------------------------------------------------------------


@pytest.fixture
def entry(cuda):
    bound = host_path.entry(dequantize.HOST).bound()
    if not bound:
        pytest.skip(
            "the compiled host launcher is not available here (see the warning); "
            f"{settings.HOST_LAUNCHER.name}=compiled says why"
        )
    return bound


def _args(case, out=None, offset="tensor"):
    """``entry``'s arguments for a RawCase, the nested offset as a device tensor or a float."""
    nested = case.code2 is not None
    value = None
    if nested:
        value = case.offset if offset == "tensor" else float(case.offset)
    return [
        case.A,
        case.absmax,
        case.code2,
        case.absmax2,
        value,
        out,
        torch.Size(case.shape),
        case.dtype,
        case.blocksize,
        case.blocksize2 if nested else None,
        case.quant_type,
    ]


def _python_path(args):
    A, absmax, code2, absmax2, offset, _out, shape, dtype, blocksize, blocksize2, quant_type = args
    expected = poison_(torch.empty(shape, dtype=dtype, device=A.device), alternate=True)
    with host_path.python_path_only():
        dequantize.dequantize_packed(
            A, absmax, blocksize, quant_type, shape, dtype, expected,
            code2=code2, absmax2=absmax2, blocksize2=blocksize2, offset=offset,
        )  # fmt: skip
    return expected


def _misaligned(shape, dtype, device):
    """A contiguous tensor of ``shape`` one element past a 16-byte boundary: the scalar path."""
    n = int(torch.Size(shape).numel())
    return torch.empty(n + 8, dtype=dtype, device=device)[1 : n + 1].view(shape)


SCALES = ("plain", "nested-tensor-offset", "nested-float-offset")
OUTS = ("allocated", "out", "out-misaligned")
SHAPES = {"small": (96, 130), "large-tiling": (4096, 4096)}  # 4096 x 4096 = LARGE_MIN_ELEMENTS


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("quant_type", "out_dtype", "scales", "outs", "size"),
    list(itertools.product(QUANT_TYPES, OUT_DTYPES, SCALES, OUTS, SHAPES)),
    ids=lambda v: str(v),
)
def test_takes_every_valid_call_bit_identical_to_the_python_path(
    entry, cuda, run_seed, quant_type, out_dtype, scales, outs, size
):
    dtype = dtypes.DTYPES[out_dtype]
    case = cases.raw_case(SHAPES[size], quant_type, 64, dtype, scales != "plain", run_seed, device=cuda)
    out = None
    if outs == "out":
        out = poison_(torch.empty(case.shape, dtype=dtype, device=cuda))
    elif outs == "out-misaligned":
        out = poison_(_misaligned(case.shape, dtype, cuda))
    args = _args(case, out, offset="float" if scales == "nested-float-offset" else "tensor")
    got = entry(*args)
    assert isinstance(got, torch.Tensor), f"the compiled path declined a valid call: {got!r}"
    if out is not None:
        assert got is out
    assert got.shape == torch.Size(case.shape) and got.dtype == dtype and got.device == case.A.device
    assert_bit_exact(got, _python_path(args), f"{quant_type} {out_dtype} {scales} {outs} {size}")


@pytest.mark.gpu
def test_declines_what_the_python_path_converts_or_rejects(entry, cuda, run_seed):
    case = cases.raw_case((96, 130), "nf4", 64, torch.float16, True, run_seed, device=cuda)

    class OwnFunction(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    def changed(**what):
        args = _args(case)
        names = ("A", "absmax", "code2", "absmax2", "offset", "out", "shape", "dtype", "blocksize", "blocksize2")
        for name, value in what.items():
            args[names.index(name)] = value
        return args

    converted = {  # valid: the Python path converts these, then launches
        "offset on the host": changed(offset=case.offset.cpu()),
        "offset as fp16": changed(offset=case.offset.half()),
        "A a subclass with its own __torch_function__": changed(A=case.A.as_subclass(OwnFunction)),
    }
    for name, args in converted.items():
        assert entry(*args) is None, name
        A, absmax, code2, absmax2, offset, _out, shape, dtype, blocksize, blocksize2, quant_type = args
        got = dequantize.dequantize_packed(
            A,
            absmax,
            blocksize,
            quant_type,
            shape,
            dtype,
            code2=code2,
            absmax2=absmax2,
            blocksize2=blocksize2,
            offset=offset,
        )
        assert_bit_exact(got, _python_path(args), name)
    rejected = {
        "absmax codes short": changed(absmax=case.absmax[:-1]),
        "code2 as fp16": changed(code2=case.code2.half()),
        "blocksize2 not a power of two": changed(blocksize2=100),
        "A too short": changed(A=case.A[:-1]),
        "out not contiguous": changed(out=torch.empty(130, 96, dtype=torch.float16, device=cuda).t()),
        "out of another dtype": changed(out=torch.empty(case.shape, dtype=torch.float32, device=cuda)),
    }
    for name, args in rejected.items():  # the compiled path declines them, or raises the Python path's error
        try:
            assert entry(*args) is None, name
        except InputError:
            pass


@pytest.mark.gpu
def test_a_fresh_thread_gets_the_same_bits_and_then_the_compiled_path(entry, cuda, run_seed):
    case = cases.raw_case((96, 130), "fp4", 64, torch.bfloat16, True, run_seed, device=cuda)
    expected = _python_path(_args(case))

    def step():
        return {"first": harness.dequantize_4bit(case.A, case.quant_state()), "second": entry(*_args(case))}

    seen = in_fresh_thread(step)
    assert_bit_exact(seen["first"], expected, "first call in a fresh thread")
    assert isinstance(seen["second"], torch.Tensor), "the compiled path still declines after the thread's first call"
    assert_bit_exact(seen["second"], expected, "compiled path in a fresh thread")


@pytest.mark.gpu
def test_a_refused_launch_names_the_cuda_error_and_the_context_survives(
    entry, module, cuda, bnb, run_seed, monkeypatch
):
    refusing = host_launcher.configure(module, dequantize.HOST, _oversized(dequantize.compiled_form))
    case = cases.raw_case((96, 130), "nf4", 64, torch.float16, False, run_seed, device=cuda)
    monkeypatch.setattr(host_path.entry(dequantize.HOST), "fn", refusing)
    with pytest.raises(KernelLaunchError, match="CUDA_ERROR_INVALID_VALUE") as info:
        harness.dequantize_4bit(case.A, case.quant_state())
    assert info.value.kernel == dequantize_kernel.plan("nf4", "fp16", False, 96 * 130, cuda.index).kernel.label
    monkeypatch.undo()
    torch.cuda.synchronize()
    got = poison_(torch.empty(case.shape, dtype=case.dtype, device=cuda))
    harness.dequantize_4bit(case.A, case.quant_state(), out=got)
    assert_bit_exact(got, bnb.dequantize_4bit(case.A, case.quant_state()))


def _oversized(form):
    """``form`` with more threads a block than any GPU has: the driver refuses its launches."""

    def oversized(*args):
        r = form(*args)
        return dataclasses.replace(r, launches=tuple(dataclasses.replace(k, threads=4096) for k in r.launches))

    return oversized


# --- the fused matmul's entry, on the GPU ------------------------------------------------------


def _matmul_case(quant_type, dtype, nested, rows, bias, seed, device, N=200, K=4096):
    B, qs = cases.quantize_weights((N, K), quant_type, 64, nested, dtype, seed, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    A = torch.randn(rows, K, generator=g, device=device, dtype=dtype)
    b = torch.randn(N, generator=g, device=device, dtype=dtype) if bias else None
    return A, B.t(), qs, b


def _matmul_args(A, B, qs, bias, out):
    fields, nested = dequantize.quant_state_args(qs)
    absmax, blocksize, quant_type, shape, _dtype = fields
    return (
        A, B, absmax, nested.get("code2"), nested.get("absmax2"), nested.get("offset"), bias, out, shape, blocksize,
        nested.get("blocksize2"), quant_type, 1 << 62,
    )  # fmt: skip


def _matmul_python_path(A, B, qs, bias):
    expected = poison_(torch.empty(A.shape[0], qs.shape[0], dtype=A.dtype, device=A.device), alternate=True)
    with host_path.python_path_only():
        matmul.fused_matmul(A, B, qs, bias, out=expected)
    return expected


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("quant_type", "dtype_name", "nested", "rows", "bias"),
    [("nf4", "bf16", True, m, False) for m in (1, 8, 9, 33, 64)]
    + [(*v[:3], 5, v[3]) for v in itertools.product(QUANT_TYPES, ("fp16", "bf16"), (False, True), (False, True))],
    ids=lambda v: str(v),
)
def test_the_matmul_entry_takes_every_fused_call_bit_identical_to_the_python_path(
    entry, cuda, run_seed, quant_type, dtype_name, nested, rows, bias
):
    A, B, qs, b = _matmul_case(quant_type, dtypes.DTYPES[dtype_name], nested, rows, bias, run_seed, cuda)
    mm = host_path.entry(matmul.HOST).bound()
    expected = _matmul_python_path(A, B, qs, b)
    out = poison_(torch.empty_like(expected))
    assert mm(*_matmul_args(A, B, qs, b, out)) is out, "the compiled path declined a call the kernel takes"
    assert_bit_exact(out, expected, "into out")
    allocated = mm(*_matmul_args(A, B, qs, b, None))
    assert isinstance(allocated, torch.Tensor) and allocated.shape == expected.shape
    assert_bit_exact(allocated, expected, "allocated")


@pytest.mark.gpu
def test_the_public_fused_calls_run_through_the_matmul_entry(entry, cuda, run_seed, monkeypatch):
    """harness.matmul_4bit and the benchmarks' fused_matmul reach the compiled entry: the Python
    path's launch is never called for a call the entry takes."""
    A, B, qs, _ = _matmul_case("nf4", torch.bfloat16, True, 4, False, run_seed, cuda)
    expected = _matmul_python_path(A, B, qs, None)

    def python_launch(*args, **kwargs):
        raise AssertionError("the Python path launched a call the compiled entry takes")

    monkeypatch.setattr(recipe, "run", python_launch)
    assert_bit_exact(matmul.fused_matmul(A, B, qs), expected, "fused_matmul")
    assert_bit_exact(harness.matmul_4bit(A, B, qs), expected, "matmul_4bit")


@pytest.mark.gpu
def test_the_matmul_entry_works_from_a_fresh_thread(entry, cuda, run_seed):
    A, B, qs, b = _matmul_case("fp4", torch.float16, False, 3, True, run_seed, cuda)
    expected = _matmul_python_path(A, B, qs, b)
    seen = in_fresh_thread(lambda: [matmul.fused_matmul(A, B, qs, b) for _ in range(2)])
    for i, got in enumerate(seen):
        assert_bit_exact(got, expected, f"call {i} in a fresh thread")


@pytest.mark.gpu
def test_a_refused_matmul_launch_names_the_cuda_error_and_the_context_survives(
    entry, module, cuda, run_seed, monkeypatch
):
    A, B, qs, _ = _matmul_case("nf4", torch.bfloat16, True, 1, False, run_seed, cuda)
    refusing = host_launcher.configure(module, matmul.HOST, _oversized(matmul.compiled_form))
    monkeypatch.setattr(host_path.entry(matmul.HOST), "fn", refusing)
    with pytest.raises(KernelLaunchError, match="CUDA_ERROR_INVALID_VALUE") as info:
        matmul.fused_matmul(A, B, qs)
    variant = matmul_kernel.variant_for("bf16", "nf4", True, 1, qs.shape[0] * qs.shape[1])
    assert info.value.kernel == matmul_kernel.pick_plan(variant, cuda.index, 1, *qs.shape).main.label
    monkeypatch.undo()
    torch.cuda.synchronize()
    assert_bit_exact(matmul.fused_matmul(A, B, qs), _matmul_python_path(A, B, qs, None))
