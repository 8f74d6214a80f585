"""The 4-bit matmul with bitsandbytes 0.50.2's semantics (``api.matmul_4bit`` is its drop-in):
``A [..., K] · dequant(B)ᵀ (+ bias)`` for a weight quantized from ``[N, K]`` (or, deprecated there,
``[K, N]``).

Inference calls with few rows (``crossover_m``, measured per GPU and weight size) run the fused kernel
(``matmul_kernel``), which reads the packed weights once and never writes them out; everything
else, and every call that needs gradients, runs our dequantization kernel and ``F.linear``, as
bitsandbytes' own fallback does. A fused call goes to the compiled host path first
(``host_path``'s matmul entry), which takes it where every tensor is as the kernel reads it;
the rest runs the Python path below, with the same decisions (``takes``). A fused result is not
bit-identical to cuBLAS (another summation order); its bound is
``harness.correctness.matmul_reference``'s. Bad input raises ``InputError`` before any
launch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from harness.errors import InputError
from harness.runtime import dequantize, launcher, matmul_kernel, operands
from harness.runtime.dtypes import ACTIVATION_NAME
from harness.runtime.host_path import matmul_entry

# Rows up to which the fused kernel runs, per GPU model and weight size: (weight elements N * K
# from which it holds, rows) by increasing size, the first from 0; above, dequantize + F.linear.
# Each is read off the matmul table of `python -m harness.perf.bnb_paths --only matmul` on that GPU
# (``bnb_paths.crossover_table_of``, printed in every run): per measured weight the largest M at
# which the fused kernel beat dequantize + F.linear at every M up to it, a weight taking the
# smallest of its own and every larger one's. On the H100 and the H200 the 28672x8192, 8192x8192
# and 1024x8192 weights all win up to 128 rows (kernels/NOTES.md, "Splits for the small weights").
CROSSOVER_M = {"NVIDIA H100 80GB HBM3": ((0, 128),), "NVIDIA H200": ((0, 128),)}
# A GPU not measured yet: the smallest token tile's worth, where the fused kernel reads the
# weights once and dequantize + F.linear reads and writes them twice more.
DEFAULT_CROSSOVER_M = ((0, 16),)


def _fail(message: str):
    raise InputError(message)


def check_out_and_bias(A: torch.Tensor, N: int, out: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    """The rules of ``out`` and ``bias``, checked before anything is launched (else the fallback
    fails in F.linear or the copy into ``out``, after its kernels ran). ``out`` holds the result's
    shape, in any dtype and on any device (filled by a copy where the kernel cannot write it);
    ``bias`` is what F.linear adds and bitsandbytes takes: in A's dtype, on A's device, N values
    or one."""
    result = (*A.shape[:-1], N)
    if out is not None and tuple(out.shape) != result:
        _fail(f"Expected out.shape == {result}, got {tuple(out.shape)}")
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        _fail(f"bias must be a torch.Tensor, got {type(bias).__name__}")
    if bias.dim() > 1 or bias.numel() not in (N, 1):
        _fail(f"bias must hold the weight's {N} output features (or one value), got shape {tuple(bias.shape)}")
    if bias.dtype != A.dtype:
        _fail(f"bias must be {A.dtype} like A, got {bias.dtype}")
    if bias.device != A.device:
        _fail(f"bias is on {bias.device}, but A is on {A.device}; all tensors must be on the same device")


def result_features(A: torch.Tensor, shape) -> tuple[int, bool]:
    """(output features, weight quantized as [K, N]) for activations ``A`` and a weight of ``shape``."""
    if len(shape) != 2:
        _fail("matmul_4bit: quant_state.shape must be 2D [N, K]")
    K = A.shape[-1] if A.dim() else _fail("A must have at least one dimension")
    if K == shape[0] and K != shape[1]:  # quantized from [K, N]: bitsandbytes uses it transposed
        return shape[1], True
    if K != shape[1]:
        _fail(f"A has {K} features but the weight takes {shape[1]} (quant_state.shape {tuple(shape)})")
    return shape[0], False


def matmul_parts(A, B, fields: tuple, nested: dict, out=None, bias=None) -> torch.Tensor:
    """``matmul_4bit`` on a quant state read into ``dequantize.quant_state_args``' form: what the
    drop-in and its registered op (``torch_op``) both run."""
    absmax, blocksize, quant_type, shape, _dtype = fields
    N, transposed = result_features(A, shape)
    check_out_and_bias(A, N, out, bias)
    if A.numel() == 0 and not needs_grad(A, bias):
        return out if out is not None else A.new_empty((*A.shape[:-1], N))
    if A.device.type != "cuda":
        _fail(f"A must be on a CUDA device, got {A.device}: {dequantize.CUDA_ONLY}")
    if transposed:
        W = dequantize.dequantize_packed(B, *fields, **nested).to(A.dtype)
        return into(out, torch.nn.functional.linear(A, W.t(), bias))
    if (result := try_fused(A, B, fields, nested, bias, out)) is not None:
        return result
    W = dequantize.dequantize_packed(B, absmax, blocksize, quant_type, shape, A.dtype, **nested)
    return into(out, torch.nn.functional.linear(A, W, bias))


def needs_grad(A: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether autograd records this call (bitsandbytes' test for its training path)."""
    return torch.is_grad_enabled() and (A.requires_grad or (bias is not None and bias.requires_grad))


@functools.cache
def crossover_table(device_index: int) -> tuple[tuple[int, int], ...]:
    """This GPU's crossover by weight size (``CROSSOVER_M``): what the compiled path reads once."""
    return CROSSOVER_M.get(torch.cuda.get_device_name(device_index), DEFAULT_CROSSOVER_M)


def rows_within(table: tuple[tuple[int, int], ...], elements: int) -> int:
    """The rows of ``table``'s last entry whose weight size is at most ``elements``."""
    rows = 0
    for size, most in table:
        if size > elements:
            break
        rows = most
    return rows


def crossover_m(device_index: int, elements: int) -> int:
    """The most rows the fused kernel takes on this GPU for a weight of ``elements`` (N * K) elements."""
    return rows_within(crossover_table(device_index), elements)


# max_rows for a call the fused kernel takes at any number of rows.
_ANY_ROWS = 1 << 62


def try_fused(A, B, fields: tuple, nested: dict, bias=None, out=None, any_rows=False) -> torch.Tensor | None:
    """The fused kernel's result for an [N, K] weight where it takes the call (no gradients
    needed, at most the GPU's ``crossover_m`` rows unless ``any_rows``), else None: the caller
    has a fallback (ours, or the bitsandbytes patch's). The compiled host path takes the call
    where its tensors are as the kernel reads them; the rest comes here, with the same decisions."""
    max_rows = _ANY_ROWS if any_rows else None  # None: the GPU's crossover
    if (host := matmul_entry(crossover_table)) is not None:
        absmax, blocksize, quant_type, shape, _dtype = fields
        code2, absmax2 = nested.get("code2"), nested.get("absmax2")
        result = host(
            A, B, absmax, code2, absmax2, nested.get("offset"), bias, out, shape, blocksize, nested.get("blocksize2"),
            quant_type, max_rows,
        )  # fmt: skip
        if result is not None:
            if result.__class__ is tuple:  # (kernel, CUresult): the driver refused a launch
                variant = _variant(A, quant_type, code2 is not None, A.numel() // shape[1])
                p = matmul_kernel.plan(variant, A.device.index)
                raise launcher.launch_error((p.main, p.finish)[result[0]].label, result[1])
            return result
    decided = decide(A, B, fields, nested, bias, max_rows, matmul_kernel.plan)
    return None if decided is None else _launch(A, *decided, bias, out)


class Decision(NamedTuple):
    """How the Python path computes a fused call (``decide``)."""

    weight: dequantize.Call  # the weight, checked by the dequantization call's rules
    plan: matmul_kernel.Plan  # its variant's plan on A's GPU
    grid: matmul_kernel.Grid  # the grid the plan's rules pick for the call


def decide(A, B, fields: tuple, nested: dict, bias, max_rows: int | None, plan_of) -> Decision | None:
    """The Python path's decision for a call, before it allocates or launches anything: None where
    the fused kernel does not take it (``takes``); else its ``Decision``, the plan from
    ``plan_of(variant, device index)``. A weight that breaks the dequantization call's rules raises
    InputError. The compiled path decides the same (tests/test_call_rules.py)."""
    if not takes(A, B, fields, bias, max_rows):
        return None
    call = dequantize.check_call(B, *fields[:4], A.dtype, **nested)
    (N, K), M = call.shape, A.numel() // call.shape[1]
    p = plan_of(_variant(A, call.quant_type, call.nested, M), A.device.index)
    return Decision(call, p, p.grid(M, N, K, matmul_kernel.token_tile(M)))


def takes(A, B, fields: tuple, bias=None, max_rows: int | None = None) -> bool:
    """Whether the fused kernel computes this call of at most ``max_rows`` rows (None: the GPU's
    ``crossover_m``), the weight's own rules aside (a weight that breaks them raises
    InputError at the launch); the rest is the fallback's, not an error."""
    blocksize, shape = fields[1], fields[3]
    if len(shape) != 2 or not A.dim() or A.shape[-1] != shape[1] or A.numel() == 0 or needs_grad(A, bias):
        return False
    N, K = shape[0], shape[1]
    if A.device.type != operands.DEVICE_TYPE:
        return False
    if A.numel() // K > (max_rows or crossover_m(A.device.index, N * K)):
        return False
    return (
        A.dtype in ACTIVATION_NAME
        and matmul_kernel.takes_shape(K, blocksize)
        and _aligned(A)
        and isinstance(B, torch.Tensor)
        and B.device == A.device  # the weight's own rules are checked by the dequantization call's
        and B.data_ptr() % matmul_kernel.ALIGN == 0
        and (
            bias is None or (bias.dtype == A.dtype and bias.device == A.device and bias.numel() == N and _aligned(bias))
        )
    )


def fused_matmul(A, B, quant_state, bias=None, out=None) -> torch.Tensor:
    """The fused kernel's result at any number of rows, never the fallback's: what benchmarks
    and the oracle time and check. Raises ``InputError`` where the kernel does not
    take the call (gradients needed, K not a multiple of 32, a misaligned or non-CUDA tensor)."""
    fields, nested = dequantize.quant_state_args(quant_state)
    result = try_fused(A, B, fields, nested, bias, out, any_rows=True)
    if result is None:
        _fail("the fused kernel does not take this call (see matmul.takes)")
    return result


def into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """``result``, copied into ``out`` when one is given."""
    if out is None:
        return result
    out.copy_(result)
    return out


def _aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % matmul_kernel.ALIGN == 0


def writes_directly(out, A: torch.Tensor, N: int) -> bool:
    """Whether the kernel writes ``out`` itself (the result's shape, dtype and device, dense); any
    other ``out`` is filled by a copy of the result."""
    return (
        out is not None
        and out.shape == (*A.shape[:-1], N)
        and out.dtype == A.dtype
        and out.device == A.device
        and out.is_contiguous()
    )


def _variant(A: torch.Tensor, quant_type: str, nested: bool, M: int) -> matmul_kernel.MatmulVariant:
    return matmul_kernel.MatmulVariant(ACTIVATION_NAME[A.dtype], quant_type, nested, matmul_kernel.token_tile(M))


def fused_matmul_on_grid(A, B, quant_state, grid: matmul_kernel.Grid) -> torch.Tensor:
    """``fused_matmul`` through the Python path on ``grid`` instead of the one the rules pick
    (``harness.perf.grid_sweep`` times every grid the kernel runs). Raises ValueError for a grid
    the kernel cannot run on this call and GPU (``matmul_kernel.Plan.runs``)."""
    fields, nested = dequantize.quant_state_args(quant_state)
    decided = decide(A, B, fields, nested, None, _ANY_ROWS, matmul_kernel.plan)
    if decided is None:
        _fail("the fused kernel does not take this call (see matmul.takes)")
    call, p = decided.weight, decided.plan
    (N, K), M = call.shape, A.numel() // call.shape[1]
    if not p.runs(grid, M, N, K, matmul_kernel.token_tile(M)):
        raise ValueError(f"the kernel does not run {grid} for M={M}, N={N}, K={K} on this GPU")
    return _launch(A, call, p, grid, None, None)


def _launch(A, call: dequantize.Call, p: matmul_kernel.Plan, grid: matmul_kernel.Grid, bias, out) -> torch.Tensor:
    (N, K), device = call.shape, A.device.index
    M = A.numel() // K
    direct = writes_directly(out, A, N)
    target = out if direct else A.new_empty((*A.shape[:-1], N))
    workspace = A.new_empty(grid.workspace_elements(M, N), dtype=torch.float32)
    main_args, finish_args = launch_of(A, call, bias, target, grid, workspace.data_ptr())
    launcher.on_gpu(device, lambda stream: matmul_kernel.launch(p, grid, stream, main_args, finish_args, M, N))
    return target if direct or out is None else into(out, target)


def launch_of(
    A, call: dequantize.Call, bias, target, grid: matmul_kernel.Grid, workspace_ptr: int
) -> tuple[tuple, tuple]:
    """The Python path's kernel arguments for a checked weight (``call``): the main kernel's and
    the finish's (``matmul_kernel.launch_args``)."""
    N, K = call.shape
    absmax, code2, absmax2, offset, offset_value = call.scales
    scales = (*(t.data_ptr() if t is not None else 0 for t in (call.A, absmax, code2, absmax2, offset)), offset_value)
    return matmul_kernel.launch_args(
        grid, A.data_ptr(), scales, workspace_ptr, bias.data_ptr() if bias is not None else 0, target.data_ptr(),
        A.numel() // K, N, K, call.blocksize, call.blocksize2,
    )  # fmt: skip
