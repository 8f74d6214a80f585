"""The dequantization's battery of calls, for every path that validates one: valid calls in every
form the kernel takes, and bad calls, each with the rule it breaks.

The same battery runs through the Python path (``dequantize.check_call``), the compiled host path
(``host_launcher.cpp``, bound to host tensors and stand-in plans on a CPU machine), the registered op's fake
implementation (``torch.compile``'s view) and, on a GPU, the public drop-in. A call is a dict of
``dequantize.dequantize_packed``'s arguments.

Part of the op's judge half, apart from ``dequantize.py`` there: a battery imports the op's call
module, which registers the op's torch ops as it loads, and the checks module is loaded into every
measuring process, where the first ``harness`` to register them is the one both sides' calls would
reach (tests/test_perf_logic.py holds the measuring process's judge modules off the call modules).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from harness.runtime import dequantize, dequantize_kernel


def positional(call: dict) -> list:
    """A call as the compiled entry point takes it (``dequantize.ENTRY_ARGS``)."""
    return [call.get(name) for name in dequantize.ENTRY_ARGS]


def keywords(call: dict) -> dict:
    """A call as ``dequantize.check_call`` and ``dequantize.dequantize_packed`` take it."""
    call = dict(call)
    nested = {k: call.pop(k) for k in ("code2", "absmax2", "blocksize2", "offset")}
    if nested["code2"] is None:
        nested = {}
    return call | nested


def make_call(
    shape=(96, 130),
    quant_type="nf4",
    dtype=torch.bfloat16,
    blocksize=64,
    nested=True,
    device="cpu",
    storage=torch.uint8,
    offset="tensor",
    blocksize2=256,
) -> dict:
    """A valid call on ``device`` (contents arbitrary: only the checks and the launch geometry are
    under test). ``storage`` is the dtype that holds the packed bytes; ``offset`` "tensor" or "number"."""
    n = int(torch.Size(shape).numel())
    packed_bytes = (n + 1) // 2
    itemsize = torch.empty((), dtype=storage).element_size()
    A = torch.zeros(-(-packed_bytes // itemsize), 1, dtype=storage, device=device)
    nblocks = -(-n // blocksize)
    call = dict(
        A=A,
        absmax=torch.ones(nblocks, device=device),
        out=None,
        shape=torch.Size(shape),
        dtype=dtype,
        blocksize=blocksize,
        quant_type=quant_type,
        code2=None,
        absmax2=None,
        blocksize2=None,
        offset=None,
    )
    if nested:
        call |= dict(
            absmax=torch.zeros(nblocks, dtype=torch.uint8, device=device),
            code2=torch.linspace(-1, 1, 256, device=device),
            absmax2=torch.ones(-(-nblocks // blocksize2), device=device),
            blocksize2=blocksize2,
            offset=torch.tensor(0.25, device=device) if offset == "tensor" else 0.25,
        )
    return call


def misaligned(shape, dtype, device, by: int = 1) -> torch.Tensor:
    """A contiguous tensor of ``shape`` ``by`` elements past an allocation's start (which is aligned)."""
    n = int(torch.Size(shape).numel())
    return torch.empty(n + by + 8, dtype=dtype, device=device)[by : by + n].view(shape)


def valid_calls(device="cpu") -> Iterator[tuple[str, dict]]:
    """Every form the kernel takes: each quant type, output dtype and scale kind, offsets as
    tensors and numbers, packed bytes in other storage dtypes and misaligned, outputs allocated,
    given and misaligned, both tilings, odd sizes."""
    small, large = (96, 130), (dequantize_kernel.LARGE_MIN_ELEMENTS,)
    for quant, dtype, nested in itertools.product(
        dequantize_kernel.QUANT_TYPES, (torch.float16, torch.bfloat16, torch.float32), (False, True)
    ):
        name = f"{quant}-{dtype}-{'nested' if nested else 'plain'}"
        yield name, make_call(small, quant, dtype, nested=nested, device=device)
        call = make_call(small, quant, dtype, nested=nested, device=device)
        yield f"{name}-out", call | {"out": torch.empty(small, dtype=dtype, device=device)}
        yield f"{name}-out-misaligned", call | {"out": misaligned(small, dtype, device)}
    for blocksize in dequantize_kernel.BLOCKSIZES:
        yield f"blocksize-{blocksize}", make_call((3, 1001), blocksize=blocksize, device=device)
    yield "odd-n", make_call((7, 9), nested=False, device=device)
    yield "one-element", make_call((1,), device=device)
    yield "offset-number", make_call(device=device, offset="number")
    yield "blocksize2-1", make_call(device=device, blocksize2=1)
    for storage in (torch.bfloat16, torch.float16, torch.float32, torch.int8):
        yield f"storage-{storage}", make_call((96, 130), device=device, storage=storage)
    call = make_call(device=device)
    yield "A-misaligned", call | {"A": misaligned(call["A"].shape, torch.uint8, device)}
    yield "large-tiling", make_call(large, dtype=torch.float16, nested=False, device=device)
    yield "large-tiling-nested", make_call(large, dtype=torch.float16, device=device)
    yield "below-large-tiling", make_call((large[0] - 2,), dtype=torch.float16, nested=False, device=device)


def bad_calls(device="cpu") -> Iterator[tuple[str, dict, str]]:
    """(name, call, what the error message says) for each rule a call can break."""
    plain, nested = make_call(nested=False, device=device), make_call(device=device)
    shape, dtype = plain["shape"], plain["dtype"]
    A = plain["A"]

    def changed(base, **what):
        return base | what

    yield "blocksize-48", changed(plain, blocksize=48), "invalid blocksize 48"
    yield "blocksize-8192", changed(plain, blocksize=8192), "invalid blocksize 8192"
    yield "blocksize-float", changed(plain, blocksize=64.0), "invalid blocksize 64.0"
    yield "quant-int4", changed(plain, quant_type="int4"), "quant_type must be 'nf4' or 'fp4'"
    yield "dtype-float64", changed(plain, dtype=torch.float64), "only supports 16/32-bit floats"
    yield "dtype-int8", changed(plain, dtype=torch.int8), "only supports 16/32-bit floats"
    yield "A-not-a-tensor", changed(plain, A=A.tolist()), "A must be a torch.Tensor"
    yield "A-0-dim", changed(plain, A=A[0, 0]), "A must have at least 1 dimension"
    strided = torch.zeros(A.shape[0], 2, dtype=torch.uint8, device=device)[:, :1]
    yield "A-not-contiguous", changed(plain, A=strided), "A must be contiguous"
    yield "A-short", changed(plain, A=A[:-1]), "bytes but shape"
    yield "A-short-in-bf16-storage", changed(plain, A=A.view(-1)[:-2].view(torch.bfloat16)), "bytes but shape"
    yield "shape-not-a-sequence", changed(plain, shape=12480), "shape must be a sequence of ints"
    yield "shape-of-floats", changed(plain, shape=(96.0, 130.0)), "shape must be a sequence of ints"
    yield "shape-negative", changed(plain, shape=(-96, -130)), "negative sizes"
    yield "absmax-short", changed(plain, absmax=plain["absmax"][:-1]), "absmax must hold"
    yield "absmax-fp16", changed(plain, absmax=plain["absmax"].half()), "absmax must be torch.float32"
    yield "absmax-not-contiguous", changed(plain, absmax=plain["absmax"].repeat(2)[::2]), "absmax must be contiguous"
    yield "nested-codes-fp32", changed(nested, absmax=nested["absmax"].float()), "must be torch.uint8"
    yield "nested-codes-short", changed(nested, absmax=nested["absmax"][:-1]), "(nested codes) must hold"
    yield "code2-short", changed(nested, code2=nested["code2"][:255]), "state2.code must hold 256"
    yield "code2-fp16", changed(nested, code2=nested["code2"].half()), "state2.code must be torch.float32"
    yield "absmax2-short", changed(nested, absmax2=nested["absmax2"][:0]), "state2.absmax must hold"
    yield "blocksize2-100", changed(nested, blocksize2=100), "power of two"
    yield "blocksize2-0", changed(nested, blocksize2=0), "power of two"
    yield "offset-vector", changed(nested, offset=torch.ones(2, device=device)), "one value"
    yield "offset-string", changed(nested, offset="0.5"), "numeric offset"
    yield "offset-int-tensor", changed(nested, offset=torch.ones(1, dtype=torch.int32, device=device)), "float32"
    out = torch.empty(shape, dtype=dtype, device=device)
    yield "out-not-a-tensor", changed(plain, out=out.tolist()), "out must be a torch.Tensor"
    yield "out-shape", changed(plain, out=out.view(-1)), "out.shape"
    yield "out-dtype", changed(plain, out=out.float()), "out.dtype"
    yield "out-not-contiguous", changed(plain, out=out.t().contiguous().t()), "out must be contiguous"
    # Another device: the host for a GPU call, PyTorch's meta device for a host call.
    elsewhere = "meta" if torch.device(device).type == "cpu" else "cpu"
    yield "A-elsewhere", changed(plain, A=A.to(elsewhere)), "A must be on a"
    yield "absmax-elsewhere", changed(plain, absmax=plain["absmax"].to(elsewhere)), "all tensors must be on the same"
    yield "code2-elsewhere", changed(nested, code2=nested["code2"].to(elsewhere)), "all tensors must be on the same"
    yield "out-elsewhere", changed(plain, out=out.to(elsewhere)), "all tensors must be on the same"
