"""One source for the call's rules: the same battery through every path that validates.

No GPU needed. Both host paths take host tensors here (``operands.DEVICE_TYPE`` set to "cpu", which
the compiled path reads when it is bound), the compiled one with inert driver entry points and
stand-in plans (no kernels), asked what it would launch (``describe``) instead of launching; the
Python path is asked for its plan (``dequantize.python_form``, what ``dequantize_packed`` runs).
For every valid call both must launch the same kernels on the same grids with the same arguments,
slot for slot, whatever calls the compiled entry saw before (it keeps one recipe a call
signature); for every bad call the Python path must name the broken rule and the compiled path
must raise the same error or decline. The registered op's fake implementation (what
``torch.compile`` traces) runs the battery on fake CUDA tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import re
from unittest import mock

import pytest
import torch

from harness.correctness.op_checks import dequantize_battery, matmul_battery
from harness.errors import InputError
from harness.runtime import (
    dequantize,
    dequantize_kernel,
    host_launcher,
    launcher,
    matmul,
    matmul_kernel,
    operands,
)
from harness.runtime import recipe as recipes

VALID = dict(dequantize_battery.valid_calls())
BAD = {name: (call, message) for name, call, message in dequantize_battery.bad_calls()}
MATMUL = dict(matmul_battery.calls())


@contextlib.contextmanager
def on_host():
    """Both host paths taking host tensors for the duration (the compiled one when bound in it)."""
    saved, operands.DEVICE_TYPE = operands.DEVICE_TYPE, "cpu"
    try:
        yield
    finally:
        operands.DEVICE_TYPE = saved


@pytest.fixture(scope="module")
def module():
    """The extension, built once per cache directory (about 20 s on two cores)."""
    return host_launcher.build()


_stand_ins: dict[int, launcher.LoadedKernel] = {}  # by handle


@functools.cache
def _stand_in_kernel(label: str, kinds: tuple[str, ...], shared_bytes: int = 0) -> launcher.LoadedKernel:
    """A kernel as a plan holds it, without a GPU: its label, parameter kinds and a handle of its own."""
    handle = 0x1000 + len(_stand_ins)
    kernel = _stand_ins[handle] = launcher.LoadedKernel(
        label, -1, None, launcher.ArgPacker(kinds), handle, shared_bytes
    )
    return kernel


def _stand_in_plan(quant_type, out_dtype, nested, tiling, _device) -> dequantize_kernel.Plan:
    """``dequantize_kernel.plan_tiled`` on no GPU: the variant's geometry and a stand-in kernel."""
    variant = dequantize_kernel.KernelVariant(quant_type, out_dtype, nested, *tiling)
    kernel = _stand_in_kernel(variant.name, dequantize_kernel.KERNEL_PARAMS)
    return dequantize_kernel.Plan(kernel, dequantize_kernel.geometry(quant_type, out_dtype, nested, tiling))


def _bind(module, op: host_launcher.HostOp, form):
    """A compiled entry for ``op`` on host tensors with inert driver entry points (describe never calls them)."""
    with on_host():
        return host_launcher.configure(
            module, op, form, context_of=lambda device: 0, launch_kernel=1, launch_kernel_ex=1, ctx_get_current=1,
            raw_stream=int,
        )  # fmt: skip


@pytest.fixture(scope="module")
def entry(module):
    return _bind(module, dequantize.HOST, functools.partial(dequantize.compiled_form, plan_of=_stand_in_plan))


def _describe(module, entry, *args):
    """What the compiled entry would launch for a call of host tensors (its form asks the Python
    path's checks, which then take host tensors too)."""
    with on_host():
        return module.describe(entry, *args)


def _resolved(planned, described) -> tuple | None:
    """A Python-path plan (recipe, its arguments) as ``describe`` answers, into the compiled path's
    output and workspace addresses (where each path allocates its own)."""
    r, args = planned[:2]
    out_ptr, workspace_ptr, _ = described
    if isinstance(r.out, int):
        out_ptr = args[r.out].data_ptr()
    filled = recipes.values(r, args, out_ptr, workspace_ptr if r.workspace else 0)
    launches = tuple(
        (
            int(launch.kernel.handle),
            launch.grid,
            launch.threads,
            launch.kernel.shared_bytes,
            launch.cluster_y,
            tuple(recipes.slot_bits(kind, v) for kind, v in zip(launch.kernel.packer.kinds, values, strict=True)),
        )
        for launch, values in zip(r.launches, filled, strict=True)
    )
    return out_ptr, workspace_ptr if r.workspace else 0, launches


def _python(call):
    with on_host():
        return dequantize.python_form(*dequantize_battery.positional(call), plan_of=_stand_in_plan)


@pytest.mark.parametrize("order", ["battery", "reversed"])
def test_both_paths_make_the_same_launch_for_every_valid_call_whatever_came_before(module, order):
    """One entry for the whole battery, so each call meets the recipes every call before it left:
    a signature that missed something the decision reads would launch another call's plan."""
    entry = _bind(module, dequantize.HOST, functools.partial(dequantize.compiled_form, plan_of=_stand_in_plan))
    names = list(VALID) if order == "battery" else list(reversed(VALID))
    for name in names + names:  # the second round from the kept recipes only
        call = VALID[name]
        compiled = _describe(module, entry, *dequantize_battery.positional(call))
        assert compiled is not None, f"{name}: the compiled path declined a valid call"
        assert compiled == _resolved(_python(call), compiled), name
    assert module.signatures(entry) == len({_signature(VALID[n]) for n in names})


def _signature(call: dict) -> tuple:
    """What the compiled path keys a call by (host_launcher.cpp's signature), in Python."""

    def part(v):
        if isinstance(v, torch.Tensor):
            p = v.data_ptr()
            align = 8 if p == 0 else min((p & -p).bit_length() - 1, 8)
            return ("tensor", v.dtype, tuple(v.shape), align)
        return ("float",) if isinstance(v, float) else (type(v).__name__, repr(v))

    return tuple(part(v) for v in dequantize_battery.positional(call))


def test_the_battery_covers_both_tilings_both_store_paths_and_both_offset_forms(module, entry):
    launches = [_describe(module, entry, *dequantize_battery.positional(call))[2] for call in VALID.values()]
    taken = [launch for launches_of_call in launches for launch in launches_of_call]
    labels = {_stand_ins[launch[0]].label for launch in taken}
    assert all(any(label.endswith(f"-t{t}-u{u}") for label in labels) for t, u in dequantize_kernel.TILINGS)
    assert {launch[5][10] for launch in taken} == {0, 1}  # the vectorized flag
    assert {launch[5][4] == 0 for launch in taken if "nested" in _stand_ins[launch[0]].label} == {True, False}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_call_is_named_by_the_python_path_and_never_launched_by_the_compiled_path(module, entry, name):
    call, message = BAD[name]
    with on_host(), pytest.raises(InputError, match=_literal(message)):
        dequantize.check_call(**dequantize_battery.keywords(call))
    # The compiled path asks the same checks (and raises what they raise) or declines before them.
    try:
        got = _describe(module, entry, *dequantize_battery.positional(call))
    except InputError as e:
        assert re.search(_literal(message), str(e)), str(e)
    else:
        assert got is None


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_call_fails_tracing_with_the_same_error(name):
    """The registered op's fake implementation, on fake CUDA tensors, raises what eager mode raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        call, message = _on_fake_cuda(mode, BAD[name][0]), BAD[name][1]
        message = message.replace("A must be on a", "A must be on a CUDA")
        with pytest.raises(InputError, match=_literal(message)):
            dequantize.check_traced(**_op_arguments(call))


def test_a_valid_call_traces():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        for call in (VALID["nf4-torch.bfloat16-nested"], VALID["storage-torch.bfloat16"], VALID["offset-number"]):
            dequantize.check_traced(**_op_arguments(_on_fake_cuda(mode, call)))


def _on_fake_cuda(mode, call):
    """The call with every host tensor as a fake CUDA tensor of the same shape, strides and dtype
    (meta tensors stay where they are: they are the battery's 'elsewhere')."""

    def fake(t):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return t
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cuda")

    faked = {k: fake(v) for k, v in call.items()}
    if isinstance(call["A"], torch.Tensor) and call["A"].device.type == "meta":
        faked["A"] = call["A"].to("cpu")  # the battery's A elsewhere: for a CUDA call that is the host
    return faked


def _op_arguments(call: dict) -> dict:
    """The registered op's arguments for a battery call (``dequantize.traced_call``'s packing)."""
    offset = call["offset"]
    return dict(
        A=call["A"],
        absmax=call["absmax"],
        blocksize=call["blocksize"],
        quant_type=call["quant_type"],
        shape=call["shape"],
        dtype=call["dtype"],
        out=call["out"],
        code2=call["code2"],
        absmax2=call["absmax2"],
        blocksize2=call["blocksize2"],
        offset=offset if isinstance(offset, torch.Tensor) else None,
        offset_value=offset if not isinstance(offset, torch.Tensor) else 0.0,
    )


def _literal(message: str) -> str:
    return re.escape(message)


def test_an_empty_call_launches_nothing_and_allocates_its_output(module, entry):
    call = dequantize_battery.make_call((0, 8), nested=False) | {"absmax": torch.ones(0)}
    _out_ptr, workspace_ptr, launches = _describe(module, entry, *dequantize_battery.positional(call))
    assert launches == () and workspace_ptr == 0
    r, _args, _ = _python(call)
    assert r.launches == () and r.out == ((0, 8), torch.bfloat16)


def test_configure_refuses_what_it_cannot_interpret(module):
    with pytest.raises(ValueError, match="power of two"):
        module.configure(1, 1, 1, int, int, print, 11, "cpu", 256, 24)
    with pytest.raises(ValueError, match="past 32"):
        module.configure(1, 1, 1, int, int, print, 33, "cpu", 256, 16)
    with pytest.raises(TypeError, match="callable"):
        module.configure(1, 1, 1, int, int, 3, 11, "cpu", 256, 16)
    with pytest.raises(ValueError, match="backend"):
        module.configure(1, 1, 1, int, int, print, 11, "xpu", 256, 16)


def test_a_malformed_recipe_is_an_error_not_a_launch(module):
    """A form answering slots the interpreter cannot fill safely raises (never reads past the arguments)."""
    A = torch.zeros(4)
    kernel = _stand_in_kernel("bad", ("ptr",))
    for bad in (recipes.ptr(5), recipes.Ref("number", 0)):
        r = recipes.Recipe(-1, ((4,), torch.float32), 0, 0, (recipes.Launch(kernel, (1, 1, 1), 32, (bad,)),))
        entry = _bind(module, host_launcher.HostOp("bad", ("A",), lambda A, r=r: r), None)
        with pytest.raises(ValueError, match="malformed recipe"):
            _describe(module, entry, A)


def test_the_public_drop_in_traces_in_one_graph_to_the_ops_checks():
    """torch.compile(fullgraph=True) of a function calling harness.dequantize_4bit: TorchDynamo
    must trace through it (a graph break would raise Unsupported) into the registered op, whose
    fake implementation then rejects host tensors with eager mode's message."""
    import harness

    A = torch.zeros(48, 1, dtype=torch.uint8)
    fields = dict(absmax=torch.ones(2), shape=torch.Size([8, 12]), dtype=torch.bfloat16, blocksize=64)
    state = type("State", (), fields | dict(quant_type="nf4", nested=False, state2=None, offset=None))()
    torch._dynamo.reset()
    with pytest.raises(
        Exception, match=r"InputError\(.A must be on a CUDA device, got cpu: the drop-ins are CUDA-only"
    ) as info:
        torch.compile(lambda a: harness.dequantize_4bit(a, state), backend="eager", fullgraph=True)(A)
    assert not isinstance(info.value, torch._dynamo.exc.Unsupported)


# ---- The fused matmul: the compiled path takes exactly the calls the Python path fuses ----

# What the stand-in plans report of every variant: blocks an SM holds, SMs; and the crossover table:
# the battery's "crossover" call (3 rows, 96x128) fuses from the second entry on, its
# "crossover-smaller-weight" one (64x128) is declined by the first.
BLOCKS_PER_SM, SMS, CROSSOVER = 4, 132, ((0, 2), (96 * 128, 32))


# A stand-in GPU's clusters held at once, by splits (Plan.max_clusters): few of 5 or more splits, so
# the battery's split calls run both ways.
MAX_CLUSTERS = (0, 0, 260, 170, 130, 1, 1, 1, 1)


def _clusters(variant: matmul_kernel.MatmulVariant, max_clusters: tuple[int, ...]) -> tuple[int, ...]:
    """The stand-in GPU's clusters at once for a variant's kernel, as a Hopper plan has them: only
    for the kernels compiled with the cluster epilogue, up to their size."""
    sizes = variant.cluster_splits("sm_90")
    return max_clusters[: sizes + 1] if sizes and max_clusters else ()


def _stand_in_matmul_plan(max_clusters: tuple[int, ...]):
    """``matmul_kernel.plan`` on a stand-in Hopper GPU: a variant's plan with stand-in kernels."""

    def plan_of(variant: matmul_kernel.MatmulVariant, _device) -> matmul_kernel.Plan:
        clusters = _clusters(variant, max_clusters)
        shared = variant.dynamic_shared_bytes("sm_90")
        main = _stand_in_kernel(variant.name, matmul_kernel.MAIN_PARAMS, shared)
        finish = _stand_in_kernel(f"{variant.name}-finish", matmul_kernel.FINISH_PARAMS)
        block, rule = matmul_kernel.threads(variant.tokens, variant.warps), variant.grid_rule("sm_90")
        alternative = variant.alternative("sm_90")
        return matmul_kernel.Plan(main, finish, block, BLOCKS_PER_SM, SMS, clusters, rule, variant.warps, alternative)

    return plan_of


@pytest.fixture(autouse=True, scope="module")
def _stand_in_crossover():
    """The stand-in GPU's crossover, where a call names no most rows (``max_rows`` None)."""
    with mock.patch.object(matmul, "crossover_table", lambda device: CROSSOVER):
        yield


@pytest.fixture(scope="module", params=[(), MAX_CLUSTERS], ids=["no-clusters", "clusters"])
def matmul_entry(module, request):
    """The compiled matmul entry on a stand-in GPU without thread block clusters (splits added by
    the finish kernel) and with them (added inside a cluster where they fit); the stand-in's
    ``max_clusters`` rides along."""
    plan_of = _stand_in_matmul_plan(request.param)
    return _bind(module, matmul.HOST, functools.partial(matmul.compiled_form, plan_of=plan_of)), request.param


def _python_matmul(call: dict, described, max_clusters: tuple[int, ...]):
    """The Python path's launches for a matmul call (``matmul.python_form``) as ``describe``
    answers; None where it does not fuse the call, would raise, or copies the result into ``out``
    or converts the offset (the compiled path declines those, leaving them to it)."""
    args = matmul_battery.positional(call)
    with on_host():
        try:
            planned = matmul.python_form(*args, plan_of=_stand_in_matmul_plan(max_clusters))
        except InputError:
            return None
    if planned is None or (call["out"] is not None and planned[1][7] is not call["out"]):
        return None
    return _resolved(planned, described or (0, 0, ()))


@pytest.mark.parametrize("name", list(MATMUL))
def test_both_paths_fuse_the_same_matmul_calls_with_the_same_launches(module, matmul_entry, name):
    call, (entry, max_clusters) = MATMUL[name], matmul_entry
    try:
        compiled = _describe(module, entry, *matmul_battery.positional(call))
    except InputError:
        compiled = None  # the Python path raises it too (its decision runs the same weight checks)
    assert compiled == _python_matmul(call, compiled, max_clusters)


def test_the_matmul_battery_covers_every_token_tile_split_and_unsplit_k_and_both_decisions(module, matmul_entry):
    (entry, max_clusters) = matmul_entry
    launches = {}
    for name, c in MATMUL.items():
        try:
            launches[name] = _describe(module, entry, *matmul_battery.positional(c))
        except InputError:
            launches[name] = None
    taken = [described[2] for described in launches.values() if described is not None]
    variants = [_stand_ins[launch[0][0]].label for launch in taken]
    assert {int(v.split("-m")[1].split("-")[0]) for v in variants} == set(matmul_kernel.TOKEN_TILES)
    assert any(launch[0][3] > 0 for launch in taken), "no kernel with dynamic shared memory"
    assert {launch[0][1][1] > 1 for launch in taken} == {True, False}
    # A split call runs its splits as clusters (no finish) or the finish adds them: on a GPU with
    # clusters the battery has both, without only the finish.
    split = {(launch[0][4] > 1, len(launch) > 1) for launch in taken if launch[0][1][1] > 1}
    assert split == ({(True, False), (False, True)} if max_clusters else {(False, True)})
    kinds = {tuple(v.split("-")[1:4]) for v in variants}
    assert kinds >= {(q, d, n) for q in ("nf4", "fp4") for d in ("fp16", "bf16") for n in ("plain", "nested")}
    declined = {name for name, described in launches.items() if described is None}
    expected = {"over-max-rows", "crossover-smaller-weight", "A-requires-grad", "weight-codes-short", "out-dtype"}
    assert expected <= declined
    assert "at-max-rows" not in declined and "crossover" not in declined


# ---- The entry itself: what it hands the driver ----


class _LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute as the compiled path lays it out (an id padded to 8 bytes, a 64-byte value)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
        ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint),
    ]  # fmt: skip


_LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, *(ctypes.c_uint,) * 7, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
)
_LAUNCH_EX = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
)
_CTX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
CONTEXT, STREAM = 0xC0DE, 0x5EED


class _Driver:
    """Driver entry points that record what they are handed instead of launching (ctypes callbacks
    at the addresses the compiled path calls); ``fail_at`` makes that launch return CUresult 700."""

    def __init__(self, current=CONTEXT, fail_at=None):
        self.launches, self.current, self.fail_at = [], current, fail_at
        self._keep = (_LAUNCH(self._launch), _LAUNCH_EX(self._launch_ex), _CTX(self._ctx))

    def addresses(self) -> dict:
        launch, launch_ex, ctx = (ctypes.cast(f, ctypes.c_void_p).value for f in self._keep)
        return {"launch_kernel": launch, "launch_kernel_ex": launch_ex, "ctx_get_current": ctx}

    def _slots(self, function, params):
        pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        count = len(_stand_ins[function].packer.kinds)
        return tuple(ctypes.cast(pointers[i], ctypes.POINTER(ctypes.c_uint64))[0] for i in range(count))

    def _record(self, function, grid, block, shared, stream, cluster, params) -> int:
        self.launches.append((function, grid, block, shared, stream, cluster, self._slots(function, params)))
        return 700 if len(self.launches) - 1 == self.fail_at else 0

    def _launch(self, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        return self._record(f, (gx, gy, gz), (bx, by, bz), shared, stream, None, params)

    def _launch_ex(self, config, f, params, extra):
        # Recorded, not asserted here: an exception inside a ctypes callback is printed and dropped.
        c = config.contents
        attributes = tuple((a.id, *a.value[:3]) for a in c.attrs[: c.num_attrs])
        return self._record(f, tuple(c.grid), tuple(c.block), c.shared, c.stream, attributes, params)

    def _ctx(self, out):
        out[0] = self.current
        return 0


def _driven(module, op, form, driver: _Driver):
    with on_host():
        return host_launcher.configure(
            module, op, form, context_of=lambda device: CONTEXT, raw_stream=lambda device: STREAM,
            **driver.addresses(),
        )  # fmt: skip


ENTRY_CASES = [("dequantize", name) for name in VALID] + [("matmul", name) for name in MATMUL]


@pytest.mark.parametrize(("op", "name"), ENTRY_CASES, ids=[f"{op}-{name}" for op, name in ENTRY_CASES])
def test_the_entry_hands_the_driver_what_describe_answers(module, op, name):
    """The launch itself (not ``describe``): each kernel, grid, block, dynamic shared memory,
    cluster (through cuLaunchKernelEx's config) and argument slot, on PyTorch's current stream;
    the output and workspace addresses are the call's own, a given output is returned as it is."""
    if op == "dequantize":
        host, call = dequantize.HOST, VALID[name]
        form = functools.partial(dequantize.compiled_form, plan_of=_stand_in_plan)
        args = dequantize_battery.positional(call)
    else:
        host, call = matmul.HOST, MATMUL[name]
        form = functools.partial(matmul.compiled_form, plan_of=_stand_in_matmul_plan(MAX_CLUSTERS))
        args = matmul_battery.positional(call)
    try:
        described = _describe(module, _bind(module, host, form), *args)
    except InputError:
        return  # the Python path raises it too (the tests above)
    driver = _Driver()
    with on_host():
        result = _driven(module, host, form, driver)(*args)
    if described is None:
        assert result is None and driver.launches == []
        return
    out_ptr, workspace_ptr, launches = described
    assert isinstance(result, torch.Tensor) and len(driver.launches) == len(launches)
    if call["out"] is not None:
        assert result is call["out"]
    workspaces = set()
    for got, (function, grid, threads, shared, cluster, slots) in zip(driver.launches, launches, strict=True):
        # cuLaunchKernel without clusters; cuLaunchKernelEx with one attribute, the cluster's dimension (id 4).
        clusters = None if cluster == 1 else ((4, 1, cluster, 1),)
        assert got[:6] == (function, grid, (threads, 1, 1), shared, STREAM, clusters)
        for mine, theirs in zip(got[6], slots, strict=True):
            if theirs == out_ptr:
                assert mine == result.data_ptr()
            elif workspace_ptr and theirs == workspace_ptr:
                workspaces.add(mine)
            else:
                assert mine == theirs
    assert len(workspaces) == (1 if workspace_ptr else 0) and 0 not in workspaces  # one workspace, both kernels


def test_the_entry_declines_on_another_context_and_names_a_refused_launch(module):
    form = functools.partial(matmul.compiled_form, plan_of=_stand_in_matmul_plan(()))
    call = matmul_battery.make_call((3,), N=200, K=4096, max_rows=1 << 62)
    args = matmul_battery.positional(call)
    _, _, launches = _describe(module, _bind(module, matmul.HOST, form), *args)
    assert len(launches) == 2, "the case must launch the main kernel and the finish (K split)"
    elsewhere, refusing = _Driver(current=CONTEXT + 1), _Driver(fail_at=1)
    with on_host():
        assert _driven(module, matmul.HOST, form, elsewhere)(*args) is None and elsewhere.launches == []
        assert _driven(module, matmul.HOST, form, refusing)(*args) == (1, 700) and len(refusing.launches) == 2
