"""One source for the call's rules: the same battery through every path that validates.

No GPU needed. Both host paths take host tensors here (``operands.DEVICE_TYPE`` set to "cpu", which
the compiled path reads when it is bound), the compiled one with inert driver entry points, and
asked what it would launch (``describe``) instead of launching; the Python path is asked the same
(``dequantize.check_call`` + ``dequantize.launch_of``, the launch ``dequantize_packed`` makes). For
every valid call both must choose the same variant, tiling, grid, block and kernel arguments, slot
for slot; for every bad call the Python path must name the broken rule and the compiled path must
decline. The registered op's fake implementation (what ``torch.compile`` traces) runs the battery on
fake CUDA tensors.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from harness.correctness import call_battery
from harness.errors import InputError
from harness.runtime import (
    dequantize,
    dequantize_kernel,
    dtypes,
    host_launcher,
    matmul,
    matmul_kernel,
    operands,
    torch_op,
)
from harness.runtime.launcher import ArgPacker

VALID = dict(call_battery.valid_calls())
BAD = {name: (call, message) for name, call, message in call_battery.bad_calls()}
MATMUL = dict(call_battery.matmul_calls())


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


def _geometry_only(quant, dtype, nested, tiling, device):
    """The plan resolver with no GPU: the geometry the real one returns, no kernel or context."""
    g = dequantize_kernel.geometry(
        dequantize_kernel.QUANT_TYPES[quant],
        dequantize_kernel.OUT_DTYPES[dtype],
        bool(nested),
        dequantize_kernel.TILINGS[tiling],
    )
    return (0, 0, *host_launcher.plan_geometry(g))


@pytest.fixture(scope="module")
def entry(module):
    # Inert driver entry points: describe() never calls them.
    with on_host():
        return host_launcher.configure(
            module, _geometry_only, launch_kernel=1, ctx_get_current=1, raw_stream=int, devices=0
        )


def _compiled(module, entry, call):
    got = module.describe(entry, *call_battery.positional(call))
    if got is None:
        return None
    (quant, dtype, nested, tiling, device), grid, threads, slots = got
    key = (
        dequantize_kernel.QUANT_TYPES[quant],
        dequantize_kernel.OUT_DTYPES[dtype],
        bool(nested),
        dequantize_kernel.TILINGS[tiling],
        device,
    )
    return key, grid, threads, list(slots)


def _python(call, out):
    with on_host():
        checked = dequantize.check_call(**call_battery.keywords(call))
    (*variant, device), grid, threads, args = dequantize.launch_of(checked, out)
    packer = ArgPacker(dequantize_kernel.KERNEL_PARAMS)
    packer.pack(args)
    host = -1 if device is None else device  # a host tensor's device index, as PyTorch's C++ gives it
    return (*variant, host), grid, threads, packer._buf.tolist()


@pytest.mark.parametrize("name", list(VALID))
def test_both_paths_make_the_same_launch_for_a_valid_call(module, entry, name):
    call = VALID[name]
    compiled = _compiled(module, entry, call)
    assert compiled is not None, "the compiled path declined a valid call"
    # Where each path allocates its own output, the Python path plans into the compiled one's address.
    out = call["out"] if call["out"] is not None else _AtAddress(compiled[3][6])
    assert compiled == _python(call, out)


class _AtAddress:
    """Stands in for an output tensor at a given address (only ``data_ptr`` is read)."""

    def __init__(self, address: int):
        self._address = address

    def data_ptr(self) -> int:
        return self._address


def test_the_battery_covers_both_tilings_and_both_store_paths(module, entry):
    launches = [_compiled(module, entry, call) for call in VALID.values()]
    assert {key[3] for key, *_ in launches} == set(dequantize_kernel.TILINGS)
    assert {slots[10] for *_, slots in launches} == {0, 1}  # the vectorized flag


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_call_is_named_by_the_python_path_and_declined_by_the_compiled_path(module, entry, name):
    call, message = BAD[name]
    with on_host(), pytest.raises(InputError, match=_literal(message)):
        dequantize.check_call(**call_battery.keywords(call))
    assert _compiled(module, entry, call) is None


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_call_fails_tracing_with_the_same_error(name):
    """The registered op's fake implementation, on fake CUDA tensors, raises what eager mode raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        call, message = _on_fake_cuda(mode, BAD[name][0]), BAD[name][1]
        message = message.replace("A must be on a", "A must be on a CUDA")
        with pytest.raises(InputError, match=_literal(message)):
            torch_op._check(**_op_arguments(call))


def test_a_valid_call_traces():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        for call in (VALID["nf4-torch.bfloat16-nested"], VALID["storage-torch.bfloat16"], VALID["offset-number"]):
            torch_op._check(**_op_arguments(_on_fake_cuda(mode, call)))


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
    """The registered op's arguments for a battery call (``torch_op.call``'s packing)."""
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


def test_configure_refuses_a_table_the_compiled_path_cannot_read(module):
    from harness.runtime.operands import BYTES, Count, Operand

    bad = Operand("absmax", "absmax", "float32", Count("no-such-quantity"))
    with pytest.raises(ValueError, match="no-such-quantity"):
        host_launcher.operands.encoded((bad,), host_launcher.ENTRY_ARGS, dequantize_kernel.QUANTITIES)
    only_A = host_launcher.operands.encoded(
        (Operand("A", "A", BYTES, Count("n", "two", at_least=True)),),
        host_launcher.ENTRY_ARGS,
        dequantize_kernel.QUANTITIES,
    )
    with pytest.raises(ValueError, match="cover its scale tensors"):
        module.configure(
            1, 1, int, _geometry_only, host_launcher.subclass_ok, ("nf4",), (torch.float16,), (64,), 1, 1, 0,
            dequantize_kernel.QUANTITIES, only_A, only_A, *only_A, *only_A, "cpu",
        )  # fmt: skip


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

# What the stand-in plan resolver reports of every variant: blocks an SM holds, SMs; and the
# crossover table: the battery's "crossover" call (3 rows, 96x128) fuses from the second entry on,
# its "crossover-smaller-weight" one (64x128) is declined by the first.
BLOCKS_PER_SM, SMS, CROSSOVER = 4, 132, ((0, 2), (96 * 128, 32))


# A stand-in GPU's clusters held at once, by splits (Plan.max_clusters): few of 5 or more splits, so
# the battery's split calls run both ways.
MAX_CLUSTERS = (0, 0, 260, 170, 130, 1, 1, 1, 1)


def _clusters(tokens: int, max_clusters: tuple[int, ...]) -> tuple[int, ...]:
    """The stand-in GPU's clusters at once for a token tile's kernel, as a Hopper plan has them:
    only for the kernels compiled with the cluster epilogue, up to their size."""
    sizes = matmul_kernel.MatmulVariant("bf16", "nf4", True, tokens).cluster_splits("sm_90")
    return max_clusters[: sizes + 1] if sizes and max_clusters else ()


def _stand_in_plan(max_clusters: tuple[int, ...]):
    """``matmul.decide``'s plan resolver on the stand-in GPU: a variant's plan without its kernels."""

    def plan_of(variant: matmul_kernel.MatmulVariant, _device) -> matmul_kernel.Plan:
        clusters = _clusters(variant.tokens, max_clusters)
        return matmul_kernel.Plan(None, None, matmul_kernel.threads(variant.tokens), BLOCKS_PER_SM, SMS, clusters)

    return plan_of


@pytest.fixture(scope="module", params=[(), MAX_CLUSTERS], ids=["no-clusters", "clusters"])
def matmul_entry(module, entry, request):
    """The compiled matmul entry on a stand-in GPU without thread block clusters (splits added by
    the finish kernel) and with them (added inside a cluster where they fit); the stand-in's
    ``max_clusters`` rides along."""

    stand_in = _stand_in_plan(request.param)

    def plan_only(dtype, quant, nested, tokens, device):
        variant = _variant(dtype, quant, nested, tokens)
        p, shared = stand_in(variant, device), variant.dynamic_shared_bytes("sm_90")
        return (0, 0, 0, p.threads, shared, matmul_kernel.FINISH_THREADS, p.blocks_per_sm, p.sms, p.max_clusters)

    compiled = host_launcher.configure_matmul(
        module, entry, plan_only, crossover=lambda device: CROSSOVER, launch_kernel_ex=1
    )
    return compiled, request.param


def _variant(dtype: int, quant: int, nested: int, tokens: int) -> matmul_kernel.MatmulVariant:
    """The variant of the compiled path's plan key (indices into the variants' tables)."""
    mk = matmul_kernel
    return mk.MatmulVariant(mk.DTYPES[dtype], mk.QUANT_TYPES[quant], bool(nested), mk.TOKEN_TILES[tokens])


def _python_matmul(call: dict, compiled, max_clusters: tuple[int, ...]):
    """The Python path's decision and launches for a matmul call on a GPU holding ``max_clusters``
    clusters (``matmul.decide``, ``matmul.launch_of``), into the compiled path's output and workspace
    addresses; None where it does not fuse the call, or where it would raise or copy the result
    into ``out`` (the compiled path declines those, leaving them to it)."""
    A, bias, out = call["A"], call["bias"], call["out"]
    fields = (call["absmax"], call["blocksize"], call["quant_type"], call["shape"], A.dtype)
    max_rows = call["max_rows"] or matmul.rows_within(CROSSOVER, call["shape"][0] * call["shape"][1])
    nested = {k: call[k] for k in ("code2", "absmax2", "blocksize2", "offset")} if call["code2"] is not None else {}
    with on_host():
        try:
            decided = matmul.decide(A, call["W"], fields, nested, bias, max_rows, _stand_in_plan(max_clusters))
        except InputError:
            return None
    if decided is None:
        return None
    checked, plan, grid = decided.weight, decided.plan, decided.grid
    N, K = call["shape"]
    if out is not None and not matmul.writes_directly(out, A, N):
        return None
    M, main_slots = A.numel() // K, compiled[4] if compiled else (0,) * 16
    target = out if out is not None else _AtAddress(main_slots[9])
    main_args, finish_args = matmul.launch_of(A, checked, bias, target, grid, main_slots[7])
    packed = []
    for kinds, args in ((matmul_kernel.MAIN_PARAMS, main_args), (matmul_kernel.FINISH_PARAMS, finish_args)):
        packer = ArgPacker(kinds)
        packer.pack(args)
        packed.append(tuple(packer._buf.tolist()))
    tokens = matmul_kernel.token_tile(M)
    key = (
        matmul_kernel.DTYPES.index(dtypes.ACTIVATION_NAME[A.dtype]),
        matmul_kernel.QUANT_TYPES.index(checked.quant_type),
        int(checked.nested),
        matmul_kernel.TOKEN_TILES.index(tokens),
        -1,  # a host tensor's device index, as PyTorch's C++ gives it
    )
    shared = _variant(*key[:4]).dynamic_shared_bytes("sm_90")
    finish_blocks = grid.finish_blocks(M, N) if grid.finished else 0
    cluster = matmul_kernel.cluster_of(grid)
    return (
        key,
        grid.blocks,
        plan.threads,
        shared,
        packed[0],
        cluster,
        finish_blocks,
        matmul_kernel.FINISH_THREADS,
        packed[1],
    )


@pytest.mark.parametrize("name", list(MATMUL))
def test_both_paths_fuse_the_same_matmul_calls_with_the_same_launches(module, matmul_entry, name):
    call, (entry, max_clusters) = MATMUL[name], matmul_entry
    compiled = module.describe_matmul(entry, *call_battery.matmul_positional(call))
    assert compiled == _python_matmul(call, compiled, max_clusters)


def test_the_matmul_battery_covers_every_token_tile_split_and_unsplit_k_and_both_decisions(module, matmul_entry):
    describe, (entry, max_clusters) = module.describe_matmul, matmul_entry
    launches = {name: describe(entry, *call_battery.matmul_positional(c)) for name, c in MATMUL.items()}
    taken = [launch for launch in launches.values() if launch is not None]
    assert {key[3] for key, *_ in taken} == set(range(len(matmul_kernel.TOKEN_TILES)))
    assert any(shared > 0 for _key, _grid, _threads, shared, *_ in taken), "no kernel with dynamic shared memory"
    assert {grid[1] > 1 for _key, grid, *_ in taken} == {True, False}
    # A split call runs its splits as clusters (no finish) or the finish adds them: on a GPU with
    # clusters the battery has both, without only the finish.
    split = {
        (cluster > 1, finish > 0) for _key, grid, _threads, _shared, _slots, cluster, finish, *_ in taken if grid[1] > 1
    }
    assert split == ({(True, False), (False, True)} if max_clusters else {(False, True)})
    assert {key[:3] for key, *_ in taken} >= {(d, q, n) for d in (0, 1) for q in (0, 1) for n in (0, 1)}
    declined = {name for name, launch in launches.items() if launch is None}
    expected = {"over-max-rows", "crossover-smaller-weight", "A-requires-grad", "weight-codes-short", "out-dtype"}
    assert expected <= declined
    assert "at-max-rows" not in declined and "crossover" not in declined


def test_configure_matmul_refuses_what_is_not_a_dequantize_entry(module, entry):
    with pytest.raises(TypeError, match="entry point from configure"):
        module.configure_matmul(print, int, int, int, (torch.float16,), (8,), 32, 16, 1)
    with pytest.raises(TypeError, match="output dtypes"):
        module.configure_matmul(entry, int, int, int, (torch.int8,), (8,), 32, 16, 1)
    with pytest.raises(ValueError, match="increasing"):
        module.configure_matmul(entry, int, int, int, (torch.float16,), (16, 8), 32, 16, 1)
