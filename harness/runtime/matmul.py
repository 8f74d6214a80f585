"""The 4-bit matmul with bitsandbytes 0.50.2's semantics (``api.matmul_4bit`` is its drop-in):
``A [..., K] · dequant(B)ᵀ (+ bias)`` for a weight quantized from ``[N, K]`` (or, deprecated there,
``[K, N]``).

Inference calls with few rows (``crossover_m``, measured per GPU and weight size) run the fused kernel
(``matmul_kernel``), which reads the packed weights once and never writes them out; everything
else, and every call that needs gradients, runs our dequantization kernel and ``F.linear``, as
bitsandbytes' own fallback does. A fused call is decided (``decide``) and turned into a launch
recipe (``recipe_of``); the compiled host path (``host_path``) asks ``compiled_form`` for it once
per call signature and runs it where every tensor is as the kernel reads it; the rest runs the
Python path below, with the same decision. A fused result is not
bit-identical to cuBLAS (another summation order); its bound is
``harness.correctness.matmul_reference``'s. Bad input raises ``InputError`` before any
launch. Under ``torch.compile`` the call is this op's registered op (``TORCH_OPS``, registered
through ``torch_op`` as this module loads), reached by ``traced_call``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from harness.errors import InputError
from harness.runtime import dequantize, host_launcher, host_path, launcher, matmul_kernel, operands, recipe, torch_op
from harness.runtime.dtypes import ACTIVATION_NAME

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
    """The rules of ``out`` and ``bias`` (``matmul_kernel.OPERANDS``), checked before anything is
    launched (else the fallback fails in F.linear or the copy into ``out``, after its kernels ran)."""
    if out is None and bias is None:  # most calls: nothing to check on the per-call path
        return
    out_rule, bias_rule = matmul_kernel.OPERANDS
    if out is not None:
        operands.check(out_rule, out, A.device, {}, A.dtype, (*tuple(A.shape)[:-1], N))
    if bias is not None:
        operands.check(bias_rule, bias, A.device, {"N": N, "one": 1}, A.dtype)


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
    drop-in and its registered op (``TORCH_OPS``) both run."""
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
    """This GPU's crossover by weight size (``CROSSOVER_M``), read once."""
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
    absmax, blocksize, quant_type, shape, _dtype = fields
    code2, absmax2, blocksize2, offset = (nested.get(k) for k in ("code2", "absmax2", "blocksize2", "offset"))
    args = (A, B, absmax, code2, absmax2, offset, bias, out, shape, blocksize, blocksize2, quant_type, max_rows)
    if (fn := _ENTRY.fn) is None:
        fn = _ENTRY.bound()
    if fn and (result := fn(*args)) is not None:
        if result.__class__ is tuple:  # (launch index, CUresult)
            _ENTRY.refused(result, args)
        return result
    return _run(python_form(*args), out)


class Decision(NamedTuple):
    """How the Python path computes a fused call (``decide``)."""

    weight: dequantize.Call  # the weight, checked by the dequantization call's rules
    plan: matmul_kernel.Plan  # its variant's plan on A's GPU
    grid: matmul_kernel.Grid  # the grid the plan's rules pick for the call


def decide(A, B, fields: tuple, nested: dict, bias, max_rows: int | None, plan_of) -> Decision | None:
    """The Python path's decision for a call, before it allocates or launches anything: None where
    the fused kernel does not take it (``takes``); else its ``Decision``, the plan from
    ``plan_of(variant, device index)``. A weight that breaks the dequantization call's rules raises
    InputError. The compiled path's form runs this (``compiled_form``)."""
    if not takes(A, B, fields, bias, max_rows):
        return None
    call = dequantize.check_call(B, *fields[:4], A.dtype, **nested)
    (N, K), M = call.shape, A.numel() // call.shape[1]
    variant = _variant(A, call.quant_type, call.nested, M, N * K)
    p = matmul_kernel.pick_plan(variant, A.device.index, M, N, K, plan_of)
    return Decision(call, p, p.grid(M, N, K, variant.tokens))


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


def _variant(
    A: torch.Tensor, quant_type: str, nested: bool, M: int, elements: int, warps: int = 0, tokens: int = 0
) -> matmul_kernel.MatmulVariant:
    return matmul_kernel.variant_for(ACTIVATION_NAME[A.dtype], quant_type, nested, M, elements, warps, tokens)


def fused_matmul_on_grid(A, B, quant_state, grid: matmul_kernel.Grid, warps: int = 0, tokens: int = 0) -> torch.Tensor:
    """``fused_matmul`` through the Python path on ``grid`` of the build with ``warps`` a block (0:
    the token tile's WARPS) and ``tokens`` a tile (0: the rules' tile; else one of the call's
    ``matmul_kernel.tile_choices``) instead of what the rules pick (``harness.perf.grid_sweep`` times
    every grid of every build and tile). Raises ValueError for a tile, build or grid the kernel
    cannot run on this call and GPU (``MatmulVariant.builds_on``, ``matmul_kernel.Plan.runs``)."""
    fields, nested = dequantize.quant_state_args(quant_state)
    decided = decide(A, B, fields, nested, None, _ANY_ROWS, matmul_kernel.plan)
    if decided is None:
        _fail("the fused kernel does not take this call (see matmul.takes)")
    call = decided.weight
    (N, K), M = call.shape, A.numel() // call.shape[1]
    variant = _variant(A, call.quant_type, call.nested, M, N * K, warps, tokens)
    if not variant.builds_on(launcher.device_arch(A.device.index)):
        raise ValueError(f"{variant.name} is not built for this GPU")
    p = matmul_kernel.plan_for_rows(variant, A.device.index, M)
    if not p.runs(grid, M, N, K, variant.tokens):
        raise ValueError(f"the kernel does not run {grid} for M={M}, N={N}, K={K} on this GPU")
    return _run(_planned(A, decided._replace(plan=p, grid=grid), None, None), None)


def _run(planned: tuple | None, out) -> torch.Tensor | None:
    """The Python path's launch of ``python_form``'s plan (None: not fused); a result the kernel
    could not write into ``out`` itself is copied there."""
    if planned is None:
        return None
    target = recipe.run(*planned[:2])
    return target if out is None or target is out else into(out, target)


def _planned(A, decided: Decision, bias, out) -> tuple[recipe.Recipe, tuple, Decision]:
    """``python_form``'s answer for a decided call."""
    call = decided.weight
    direct = writes_directly(out, A, call.shape[0])
    # The entry's arguments as the recipe names them, the offset as the kernel reads it.
    converted = call.scales[3] if call.scales[3] is not None else call.scales[4]
    args = (A, call.A, *call.scales[:3], converted, bias, out if direct else None)
    return recipe_of(A, decided, bias, direct), args, decided


# The compiled entry's arguments, in order (``recipe.Ref`` indices name them).
ENTRY_ARGS = (
    "A", "W", "absmax", "code2", "absmax2", "offset", "bias", "out", "shape", "blocksize", "blocksize2", "quant_type",
    "max_rows",
)  # fmt: skip


def recipe_of(A, decided: Decision, bias, direct: bool) -> recipe.Recipe:
    """The launches of a decided call (``decide``): the main kernel, and the finish where it adds
    the splits, into ``out`` (the entry's argument) where ``direct`` else an allocated output."""
    call, p, grid = decided
    (N, K), M = call.shape, A.numel() // call.shape[1]
    elements = grid.workspace_elements(M, N)
    main_args, finish_args = matmul_kernel.launch_args(
        grid, recipe.ptr(0), dequantize.scale_refs(call, 1), recipe.WORKSPACE if elements else 0,
        recipe.ptr(ENTRY_ARGS.index("bias")), recipe.OUT, M, N, K, call.blocksize, call.blocksize2,
    )  # fmt: skip
    launches = [recipe.Launch(p.main, grid.blocks, p.threads, main_args, matmul_kernel.cluster_of(grid))]
    if grid.finished:
        launches.append(
            recipe.Launch(p.finish, (grid.finish_blocks(M, N), 1, 1), matmul_kernel.FINISH_THREADS, finish_args)
        )
    out = ENTRY_ARGS.index("out") if direct else ((*A.shape[:-1], N), A.dtype)
    return recipe.Recipe(A.get_device(), out, 0, elements, tuple(launches))


def python_form(*args, plan_of=matmul_kernel.plan) -> tuple[recipe.Recipe, tuple, Decision] | None:
    """The Python path's plan of a fused call given as the entry's ``args`` (``ENTRY_ARGS``): its
    recipe, the arguments that recipe runs with and the decision; None where the fused kernel does
    not take the call (``decide``, whose weight checks raise InputError)."""
    A, W, absmax, code2, absmax2, offset, bias, out, shape, blocksize, blocksize2, quant_type, max_rows = args
    nested = {} if code2 is None else {"code2": code2, "absmax2": absmax2, "blocksize2": blocksize2, "offset": offset}
    decided = decide(A, W, (absmax, blocksize, quant_type, shape, A.dtype), nested, bias, max_rows, plan_of)
    return None if decided is None else _planned(A, decided, bias, out)


def compiled_form(*args, plan_of=matmul_kernel.plan) -> recipe.Recipe | None:
    """The compiled path's recipe of a call (``host_launcher.HostOp``): the Python path's, None where
    it does not fuse the call, copies the result into ``out`` or converts the offset."""
    if not isinstance(args[0], torch.Tensor):
        return None
    planned = python_form(*args, plan_of=plan_of)
    if planned is None:
        return None
    r, run_args, decided = planned
    out = args[ENTRY_ARGS.index("out")]
    if (out is not None and run_args[ENTRY_ARGS.index("out")] is not out) or not dequantize.reads_offset_as_given(
        decided.weight, args[ENTRY_ARGS.index("offset")]
    ):
        return None
    return r


HOST = host_launcher.HostOp("matmul", ENTRY_ARGS, compiled_form)
_ENTRY = host_path.entry(HOST)


# --- Under torch.compile: the registered op (``torch_op``) and the traced drop-in's call ---------


def _registered_matmul(A, B, *state_and_bias):
    *state, bias = state_and_bias
    absmax, blocksize, quant_type, shape, dtype, *nested = state
    fields = (absmax, blocksize, quant_type, shape, dtype)
    return matmul_parts(A, B, fields, dequantize.nested_keywords(*nested), None, bias)


def _registered_matmul_fake(A, B, *state_and_bias):
    absmax, blocksize, quant_type, shape, dtype, *nested, _bias = state_and_bias
    features, transposed = result_features(A, shape)
    weight_dtype = dtype if transposed else A.dtype  # what eager mode decodes the weight into
    dequantize.check_traced(B, absmax, blocksize, quant_type, shape, weight_dtype, *nested)
    return A.new_empty((*A.shape[:-1], features))


TORCH_OPS = (
    torch_op.TorchOp(
        "matmul_4bit",
        _registered_matmul,
        _registered_matmul_fake,
        f"(Tensor A, Tensor B, {dequantize.STATE_SCHEMA}, Tensor? bias) -> Tensor",
    ),
)
torch_op.register(TORCH_OPS)


def traced_call(A, B, quant_state, bias):
    """The traced equivalent of ``api.matmul_4bit`` without ``out``: with gradients, the
    dequantization op and an F.linear autograd differentiates; without, one matmul op."""
    if needs_grad(A, bias):
        _features, transposed = result_features(A, quant_state.shape)
        # As eager mode: a [K, N] weight in the quant state's dtype, cast after; else in A's.
        state_args = dequantize.registered_state_args(quant_state, quant_state.dtype if transposed else A.dtype)
        W = torch_op.registered("dequantize_4bit")(B, *state_args)
        return torch.nn.functional.linear(A, W.to(A.dtype).t() if transposed else W, bias)
    state_args = dequantize.registered_state_args(quant_state, quant_state.dtype)
    return torch_op.registered("matmul_4bit")(A, B, *state_args, bias)
