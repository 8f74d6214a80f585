"""The dequantization call at the tensor level: a quant state read into the kernel's arguments,
the call's checks, and the launch, for every caller (the drop-in ``api.dequantize_4bit``, its
registered op, the fused matmul's weight checks and fallback, the bitsandbytes patch).

Everything is validated before anything is enqueued, so a bad call never reaches the GPU and the
CUDA context stays usable. Differences from bitsandbytes are deliberate and only make it stricter:
bitsandbytes would silently read out of bounds or reinterpret memory for the inputs rejected here
(short absmax, wrong dtypes, tensors on another GPU, a non-contiguous ``out``).

A call becomes a launch recipe (``recipe_of``). It goes to the compiled host path first
(``host_path``), which asks ``compiled_form`` once per call signature and runs the recipe where
every tensor is as the kernel reads it; anything else runs the Python path below. Both reach the
same checks (``check_call``: ``dequantize_kernel``'s rule tables), which name every error. Under
``torch.compile`` the call is one of this op's registered ops (``TORCH_OPS``, registered through
``torch_op`` as this module loads), reached by ``traced_call``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from harness.errors import InputError
from harness.runtime import dequantize_kernel, host_launcher, host_path, operands, recipe, route_counts, torch_op
from harness.runtime.dequantize_kernel import BLOCKSIZES, QUANT_TYPES
from harness.runtime.dtypes import DTYPES, OUT_NAME

# What a call on host tensors is told (the compiled path and the registered op only see CUDA ones).
CUDA_ONLY = (
    "the drop-ins are CUDA-only; for CPU tensors call bitsandbytes' own functions "
    "(bitsandbytes.functional.dequantize_4bit, bitsandbytes.matmul_4bit)"
)


def _fail(msg: str):
    raise InputError(msg)


def check_explicit_args(absmax: Any, out: Any) -> None:
    """bitsandbytes' rule for a call without a quant state: ``absmax`` and ``out`` both given."""
    if absmax is None or out is None:
        _fail("dequantize_4bit requires both absmax and out when quant_state is not provided")
    if not isinstance(out, torch.Tensor):
        _fail(f"out must be a torch.Tensor, got {type(out).__name__}")


def transposed_like_bitsandbytes(A: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' back-compat shim: A passed as [1, bytes] gets its output transposed."""
    return result.t() if A.shape[0] == 1 else result


def quant_state_args(quant_state: Any) -> tuple[tuple, dict]:
    """A QuantState's fields as ``dequantize_packed``'s arguments: (absmax, blocksize, quant_type,
    shape, dtype) and the nested keywords (empty where the scales are plain)."""
    try:  # read every field first, so only a quant state's own gap is reported as one
        absmax, shape, dtype = quant_state.absmax, quant_state.shape, quant_state.dtype
        blocksize, quant_type = quant_state.blocksize, quant_state.quant_type
        state2 = getattr(quant_state, "state2", None)
        nested = bool(getattr(quant_state, "nested", state2 is not None))  # what bitsandbytes branches on
        if nested and state2 is not None:
            code2, absmax2, blocksize2 = state2.code, state2.absmax, getattr(state2, "blocksize", None)
    except AttributeError as e:
        _fail(f"quant_state must be a bitsandbytes QuantState: {e}")
    if not nested:
        return (absmax, blocksize, quant_type, shape, dtype), {}
    if state2 is None:
        _fail("quant_state.nested is set but quant_state.state2 is None")
    if getattr(state2, "dtype", torch.float32) != torch.float32:
        _fail(f"nested statistics must decode to float32 (state2.dtype), got {state2.dtype}")
    offset = getattr(quant_state, "offset", None)
    if offset is None:
        _fail("nested quant_state has no offset")
    nested_args = {"code2": code2, "absmax2": absmax2, "blocksize2": blocksize2, "offset": offset}
    return (absmax, blocksize, quant_type, shape, dtype), nested_args


class Call(NamedTuple):
    """A call that obeys every rule, with what its launch needs read from it once."""

    quant_type: str
    out_name: str
    nested: bool
    device: torch.device
    shape: torch.Size
    dtype: torch.dtype
    n: int
    blocksize: int
    blocksize2: int
    scales: tuple  # the first six KernelArgs but for the packed pointer: tensors and the offset value
    A: torch.Tensor


def check_call(
    A: Any,
    absmax: Any,
    blocksize: Any,
    quant_type: Any,
    shape: Any,
    dtype: Any,
    out: Any = None,
    *,
    code2: Any = None,
    absmax2: Any = None,
    blocksize2: Any = None,
    offset: Any = None,
) -> Call:
    """The Python path's checks, in bitsandbytes' order and with its messages where it has them:
    the configuration, then every operand against ``dequantize_kernel``'s rule tables (the compiled
    path's form runs them too). Reads metadata only, but for a nested offset given as a host tensor
    (its value is read) or in another float dtype (converted to fp32 on its device)."""
    if type(blocksize) is not int or blocksize not in BLOCKSIZES:  # 64.0 == 64, but not a block size
        _fail(f"invalid blocksize {blocksize}")
    if quant_type not in QUANT_TYPES:
        _fail(f"quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    out_name = OUT_NAME.get(dtype)
    if out_name is None:
        _fail(f"Blockwise 4bit dequantization only supports 16/32-bit floats, but got {dtype}")
    if not isinstance(A, torch.Tensor):
        _fail(f"A must be a torch.Tensor, got {type(A).__name__}")
    if A.device.type != operands.DEVICE_TYPE:
        hint = f": {CUDA_ONLY}" if operands.DEVICE_TYPE == "cuda" else ""
        _fail(f"A must be on a {operands.DEVICE_TYPE.upper()} device, got {A.device}{hint}")
    try:
        shape = shape if type(shape) is torch.Size else torch.Size(shape)
    except (TypeError, ValueError) as e:
        _fail(f"shape must be a sequence of ints: {e}")
    if any(d < 0 for d in shape):
        _fail(f"shape must not have negative sizes, got {tuple(shape)}")
    n = math.prod(shape)
    device = A.device

    nested = code2 is not None
    if nested:
        if not isinstance(blocksize2, int) or blocksize2 <= 0 or blocksize2 & (blocksize2 - 1):
            _fail(f"quant_state.state2.blocksize must be a positive power of two, got {blocksize2!r}")
        table = dequantize_kernel.NESTED_OPERANDS
    else:
        blocksize2, table = 1, dequantize_kernel.PLAIN_OPERANDS
    values = {"A": A, "absmax": absmax, "code2": code2, "absmax2": absmax2, "out": out}
    quantities = dequantize_kernel.quantities(n, blocksize, blocksize2)
    for operand in table:
        operands.check(operand, values[operand.arg], device, quantities, dtype, shape)
    offset_value = 0.0
    if nested:
        offset, offset_value = _offset_form(offset, device)
        if offset is not None:
            operands.check(dequantize_kernel.OFFSET, offset, device, quantities)
    if out is not None:
        operands.check(dequantize_kernel.OUTPUT, out, device, quantities, dtype, shape)
    scales = (absmax, code2, absmax2, offset, offset_value)
    return Call(quant_type, out_name, nested, device, shape, dtype, n, blocksize, blocksize2, scales, A)


def _offset_form(offset: Any, device: torch.device) -> tuple[torch.Tensor | None, float]:
    """The nested offset as (device tensor the kernel reads, or None; value): a host tensor or a
    number becomes a value, another float dtype is converted; the offset rule checks the tensor."""
    if isinstance(offset, torch.Tensor):
        if offset.numel() != 1:
            _fail(f"quant_state.offset must hold one value, got {offset.numel()}")
        if offset.device.type == "cpu" and device.type != "cpu":
            return None, float(offset.item())
        if offset.device == device and offset.dtype != torch.float32 and offset.is_floating_point():
            offset = offset.float()  # exact for fp16/bf16; torch rounds wider types to fp32 too
        return offset, 0.0
    if isinstance(offset, (int, float)):
        return None, float(offset)
    _fail(f"nested quant_state needs a numeric offset, got {type(offset).__name__}")


# The compiled entry's arguments, in order (``recipe.Ref`` indices name them).
ENTRY_ARGS = (
    "A", "absmax", "code2", "absmax2", "offset", "out", "shape", "dtype", "blocksize", "blocksize2", "quant_type",
)  # fmt: skip
_OFFSET, _OUT = ENTRY_ARGS.index("offset"), ENTRY_ARGS.index("out")


def scale_refs(call: Call, first: int) -> tuple:
    """The kernels' six weight arguments (packed data, absmax, code2, absmax2, offset pointer, offset
    value) as references to an entry's arguments, the packed data at ``first`` and the scales after
    it in ``ENTRY_ARGS``' order; the offset is read from its tensor or passed as the number it is."""
    offset_ptr, offset_value = 0, 0.0
    if call.nested and call.scales[3] is not None:
        offset_ptr = recipe.ptr(first + 4)
    elif call.nested:
        offset_value = recipe.number(first + 4)
    return (*(recipe.ptr(first + i) for i in range(4)), offset_ptr, offset_value)


def recipe_of(call: Call, out: torch.Tensor | None, plan_of=dequantize_kernel.plan_tiled) -> recipe.Recipe:
    """The launch of a checked call into ``out`` (None: allocated), its arguments named as the entry
    names them (``ENTRY_ARGS``); ``plan_of`` is ``plan_tiled``'s signature (tests: stand-in plans)."""
    quant_type, out_name, nested, device, shape, dtype, n, blocksize, blocksize2, *_ = call
    given = out is not None
    into = _OUT if given else (tuple(shape), dtype)
    if not n:
        return recipe.Recipe(call.A.get_device(), into, 0, 0, ())
    p = plan_of(quant_type, out_name, nested, dequantize_kernel.tiling_for(n), device.index)
    # An allocated output has the allocation's alignment (recipe.ALLOC_ALIGN, which OUT_ALIGN divides).
    grid, vectorized = p.geometry.grid_and_path(call.A.data_ptr(), out.data_ptr() if given else 0, n)
    args = dequantize_kernel.KernelArgs(
        *scale_refs(call, 0), recipe.OUT, n, blocksize.bit_length() - 1, blocksize2.bit_length() - 1, vectorized
    )
    launch = recipe.Launch(p.kernel, (grid, 1, 1), p.geometry.threads, tuple(args))
    return recipe.Recipe(call.A.get_device(), into, 0, 0, (launch,))


def python_form(*args, plan_of=dequantize_kernel.plan_tiled) -> tuple[recipe.Recipe, tuple, Call]:
    """The Python path's plan of a call given as the entry's ``args`` (``ENTRY_ARGS``): its recipe,
    the arguments that recipe runs with (the offset as the kernel reads it: its tensor, converted
    where it had to be, or its value) and the checked call. A bad call raises InputError."""
    A, absmax, code2, absmax2, offset, out, shape, dtype, blocksize, blocksize2, quant_type = args
    call = check_call(
        A, absmax, blocksize, quant_type, shape, dtype, out, code2=code2, absmax2=absmax2, blocksize2=blocksize2,
        offset=offset,
    )  # fmt: skip
    converted = call.scales[3] if call.scales[3] is not None else call.scales[4]
    return recipe_of(call, out, plan_of), (A, absmax, code2, absmax2, converted, *args[_OFFSET + 1 :]), call


def compiled_form(*args, plan_of=dequantize_kernel.plan_tiled) -> recipe.Recipe | None:
    """The compiled path's recipe of a call (``host_launcher.HostOp``): the Python path's, None
    where the offset needs a conversion the kernel does not make (a host tensor, another dtype)."""
    r, _, call = python_form(*args, plan_of=plan_of)
    return r if reads_offset_as_given(call, args[_OFFSET]) else None


def reads_offset_as_given(call: Call, offset) -> bool:
    """Whether the kernel reads a checked call's ``offset`` argument as it is: its tensor, or a
    Python number passed as the kernel's fp32 argument (not a host tensor's value, nor a conversion)."""
    return not call.nested or call.scales[3] is offset or offset.__class__ in (int, float)


HOST = host_launcher.HostOp("dequantize", ENTRY_ARGS, compiled_form)
_ENTRY = host_path.entry(HOST)


def dequantize_packed(
    A: torch.Tensor,
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    shape,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    *,
    code2: torch.Tensor | None = None,
    absmax2: torch.Tensor | None = None,
    blocksize2: int | None = None,
    offset: Any = None,
) -> torch.Tensor:
    """The tensor-level entry every caller shares: ``A`` packed bytes (in any dtype), ``absmax``
    the fp32 block scales or, with ``code2`` given, their 8-bit codes decoded in the same launch
    as ``code2[absmax] * absmax2[block // blocksize2] + offset``. Returns ``out`` (allocated when
    None) shaped ``shape``; never transposes."""
    args = (A, absmax, code2, absmax2, offset, out, shape, dtype, blocksize, blocksize2, quant_type)
    if (fn := _ENTRY.fn) is None:
        fn = _ENTRY.bound()
    if fn and (result := fn(*args)) is not None:
        if result.__class__ is tuple:  # (launch index, CUresult)
            _ENTRY.refused(result, args)
        return result
    return recipe.run(*python_form(*args)[:2])


# --- Under torch.compile: the registered ops (``torch_op``) and the traced drop-in's calls ---------


# A quant state's fields as the registered ops take them after their tensors, in
# ``registered_state_args``' order: stated once for every op's schema.
STATE_SCHEMA = (
    "Tensor absmax, SymInt blocksize, str quant_type, SymInt[] shape, ScalarType dtype, "
    "Tensor? code2, Tensor? absmax2, SymInt blocksize2, Tensor? offset, float offset_value"
)


def _run_registered(
    A, absmax, blocksize, quant_type, shape, dtype, code2, absmax2, blocksize2, offset, offset_value, out=None
):
    nested = nested_keywords(code2, absmax2, blocksize2, offset, offset_value)
    result = dequantize_packed(A, absmax, blocksize, quant_type, shape, dtype, out, **nested)
    route_counts.count("compiled op", True)
    return result


def _run_registered_out(*args) -> None:
    _run_registered(*args)


def _dequantize_fake(A, *state):
    check_traced(A, *state)
    shape, dtype = state[3:5]
    return A.new_empty(shape, dtype=dtype)


def check_traced(
    A, absmax, blocksize, quant_type, shape, dtype, code2, absmax2, blocksize2, offset, offset_value, out=None
) -> None:
    """A registered op's arguments checked while the graph is traced, with eager mode's InputError."""
    if offset is not None and offset.device.type == "cpu":
        offset = offset_value  # a host offset is read with .item() at run time; a fake has no value
    nested = nested_keywords(code2, absmax2, blocksize2, offset, offset_value)
    check_call(A, absmax, blocksize, quant_type, shape, dtype, out, **nested)


TORCH_OPS = (
    torch_op.TorchOp("dequantize_4bit", _run_registered, _dequantize_fake, f"(Tensor A, {STATE_SCHEMA}) -> Tensor"),
    torch_op.TorchOp(
        "dequantize_4bit_out",
        _run_registered_out,
        check_traced,
        f"(Tensor A, {STATE_SCHEMA}, Tensor(a!) out) -> ()",
        mutates_args=("out",),
    ),
)
torch_op.register(TORCH_OPS)


def nested_keywords(code2, absmax2, blocksize2, offset, offset_value) -> dict:
    """The registered ops' nested arguments as ``dequantize_packed``'s keywords (none when plain)."""
    if code2 is None:
        return {}
    return {
        "code2": code2,
        "absmax2": absmax2,
        "blocksize2": blocksize2,
        "offset": offset if offset is not None else offset_value,
    }


def registered_state_args(quant_state, dtype) -> tuple:
    """A quant state's fields as the registered ops' arguments after ``A`` (the nested ones included)."""
    offset, offset_value, code2, absmax2, blocksize2 = None, 0.0, None, None, 0
    if quant_state.nested:
        state2 = quant_state.state2
        code2, absmax2, blocksize2 = state2.code, state2.absmax, state2.blocksize
        if isinstance(quant_state.offset, torch.Tensor):
            offset = quant_state.offset
        else:
            offset_value = float(quant_state.offset)
    shape = list(quant_state.shape)
    return (
        quant_state.absmax,
        quant_state.blocksize,
        quant_state.quant_type,
        shape,
        dtype,
        code2,
        absmax2,
        blocksize2,
        offset,
        offset_value,
    )


def traced_takes(A, quant_state) -> bool:
    """Whether the patched bitsandbytes function, being traced, sends a call to our op: judged on
    its configuration (the same tables as eager mode); everything else about the call is checked
    by the op's fake implementation. Anything else stays with bitsandbytes' own traced ops."""
    if not (isinstance(A, torch.Tensor) and A.is_cuda and A.dim() > 0):
        return False
    if quant_state.dtype not in DTYPES.values() or quant_state.blocksize not in BLOCKSIZES:
        return False
    if quant_state.quant_type not in QUANT_TYPES:
        return False
    if quant_state.nested:
        state2 = quant_state.state2
        return state2 is not None and state2.dtype == torch.float32 and quant_state.offset is not None
    return True


def traced_call(A, quant_state, absmax=None, out=None, blocksize=None, quant_type="fp4"):
    """The traced equivalent of ``api.dequantize_4bit``, same arguments."""
    if quant_state is None:
        check_explicit_args(absmax, out)
        blocksize = 64 if blocksize is None else blocksize
        args = (A, absmax, blocksize, quant_type, list(out.shape), out.dtype, None, None, 0, None, 0.0)
        torch_op.registered("dequantize_4bit_out")(*args, out)
        return transposed_like_bitsandbytes(A, out)
    args = (A, *registered_state_args(quant_state, quant_state.dtype))
    if out is None:
        result = torch_op.registered("dequantize_4bit")(*args)
    else:
        torch_op.registered("dequantize_4bit_out")(*args, out)
        result = out
    return transposed_like_bitsandbytes(A, result)
