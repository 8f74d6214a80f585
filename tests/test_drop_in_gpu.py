"""The drop-in as a user meets it: it leaves the caller's device and context alone, compiles in one
graph, and takes packed data in every storage dtype bitsandbytes takes. GPU only."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

import harness
from harness.correctness import cases
from harness.correctness.bitcompare import assert_bit_exact, poison_
from harness.runtime import dequantize, dequantize_kernel, host_path, launcher
from tests.threads import in_fresh_thread

ROOT = Path(__file__).resolve().parent.parent


def _current_context() -> int:
    from cuda.bindings import driver

    err, ctx = driver.cuCtxGetCurrent()
    assert not err
    return int(ctx)


@pytest.mark.gpu
def test_loading_a_kernel_leaves_the_callers_context_as_it_was(cuda):
    """Loading makes the GPU's primary context current for the load only: the caller's context
    (here none, as in a fresh thread) is given back; PyTorch reads the current device from it."""

    def fresh_thread():
        before = _current_context()
        variant = dequantize_kernel.KernelVariant("nf4", "fp16", False)
        label = f"{variant.name}-probe-{uuid.uuid4().hex}"  # never loaded before: a real load
        launcher.load(label, dequantize_kernel.SOURCE, dequantize_kernel.ENTRY, cuda.index,
                      dequantize_kernel.KERNEL_PARAMS, variant.macros())  # fmt: skip
        return {"before": before, "after": _current_context()}

    seen = in_fresh_thread(fresh_thread)
    assert seen["before"] == 0 and seen["after"] == 0, seen


_OTHER_GPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch, bitsandbytes.functional as F, harness
    from harness.correctness import cases
    route = sys.argv[1]
    torch.cuda.set_device(0)
    A, qs = cases.quantize_weights((1024, 320), "nf4", 64, True, torch.bfloat16, 0, device="cuda:1")
    expected = F.dequantize_4bit(A, qs)
    torch.cuda.set_device(0)
    if route == "patched":
        harness.patch_bitsandbytes()
        got = F.dequantize_4bit(A, qs)
    else:
        got = harness.dequantize_4bit(A, qs)
    device_after = torch.cuda.current_device()
    torch.cuda.synchronize(1)
    same = torch.equal(got.view(torch.int16), expected.view(torch.int16))
    print(f"current={device_after} got_on={got.device} same_bits={same}")
    """
)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("route", ["drop-in", "patched"])
def test_the_first_call_on_another_gpu_keeps_the_current_device(cuda, route):
    """A fresh process (nothing loaded yet), current device 0, tensors on cuda:1: the call must
    leave the current device at 0, as bitsandbytes' own call does."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    done = subprocess.run(
        [sys.executable, "-c", _OTHER_GPU_SCRIPT, route], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "current=0 got_on=cuda:1 same_bits=True", done.stdout


_MATMUL_OTHER_GPU_SCRIPT = textwrap.dedent(
    """
    import copy, sys, torch, bitsandbytes, harness
    from harness.correctness import cases, matmul_reference as mr
    from harness.runtime import patch
    route = sys.argv[1]
    torch.cuda.set_device(0)
    gpu1 = torch.device("cuda:1")
    streams = (torch.cuda.current_stream(0), torch.cuda.current_stream(1))
    B, qs = cases.quantize_weights((320, 1024), "nf4", 64, True, torch.bfloat16, 0, device=gpu1)
    W = bitsandbytes.functional.dequantize_4bit(B, qs)  # our dequantization's bits too
    g = cases.seeded_generator(1, gpu1)
    # 1 row: the 8-token kernel; 40 rows: the wide one (warpgroup mma on Hopper).
    inputs = [torch.randn(m, 1024, generator=g, device=gpu1).to(torch.bfloat16) for m in (1, 40)]
    torch.cuda.set_device(0)
    fused = lambda: patch.routed_calls().get("gemm_4bit fused: ours", 0)
    if route == "patched":
        harness.patch_bitsandbytes(matmul=True)
        before = fused()
        results = [bitsandbytes.matmul_4bit(A, B.t(), qs) for A in inputs]
        assert fused() - before == len(inputs), "matmul mode did not run the fused kernel on cuda:1"
    elif route == "compiled":
        call = torch.compile(lambda a: harness.matmul_4bit(a, B.t(), qs), fullgraph=True)
        results = [call(A) for A in inputs]
    elif route == "graphed":
        results = []
        for A in inputs:
            side = torch.cuda.Stream(device=gpu1)
            side.wait_stream(torch.cuda.current_stream(gpu1))
            with torch.cuda.stream(side):  # warm-up off the capture, as PyTorch's graphs ask
                harness.matmul_4bit(A, B.t(), qs)
            torch.cuda.current_stream(gpu1).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(device=gpu1)):
                out = harness.matmul_4bit(A, B.t(), qs)
            A.copy_(torch.randn(A.shape, generator=g, device=gpu1))  # the replay must read the new rows
            graph.replay()
            results.append(out)
    else:
        results = [harness.matmul_4bit(A, B.t(), qs) for A in inputs]
    device_after = torch.cuda.current_device()
    streams_kept = streams == (torch.cuda.current_stream(0), torch.cuda.current_stream(1))
    torch.cuda.synchronize(1)
    refs = [mr.fused_reference(A, B, qs, W, None, torch.bfloat16) for A in inputs]
    in_bound = all(mr.judge(r, ref).ok for r, ref in zip(results, refs))
    # The same call on GPU 0 (a GPU of the same model runs the same grid: the same bits).
    same_model = torch.cuda.get_device_name(0) == torch.cuda.get_device_name(1)
    with torch.cuda.device(0):
        B0, qs0 = B.to("cuda:0"), copy.deepcopy(qs)
        qs0.to("cuda:0")  # in place
        on_gpu0 = [harness.matmul_4bit(A.to("cuda:0"), B0.t(), qs0) for A in inputs]
    same = all(torch.equal(r.view(torch.int16).cpu(), e.view(torch.int16).cpu()) for r, e in zip(results, on_gpu0))
    print(f"current={device_after} streams_kept={streams_kept} got_on={results[0].device} in_bound={in_bound} "
          f"same_bits_as_gpu0={same or not same_model}")
    """
)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("route", ["drop-in", "patched", "compiled", "graphed"])
def test_the_fused_matmul_on_another_gpu_keeps_the_current_device_and_streams(cuda, route):
    """A fresh process, current device 0, a weight and activations on cuda:1, through the drop-in,
    matmul mode, torch.compile and a CUDA graph captured on cuda:1: results inside the fp64 bound
    (and the bits of the same call on GPU 0 where the GPUs are of one model), the current device
    still 0 and neither GPU's current stream changed."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    done = subprocess.run(
        [sys.executable, "-c", _MATMUL_OTHER_GPU_SCRIPT, route], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    expected = "current=0 streams_kept=True got_on=cuda:1 in_bound=True same_bits_as_gpu0=True"
    assert done.stdout.strip().splitlines()[-1] == expected, done.stdout + done.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
def test_the_public_drop_in_compiles_in_one_graph(cuda, bnb, run_seed, nested):
    A, qs = cases.quantize_weights((256, 320), "nf4", 64, nested, torch.bfloat16, run_seed, device=cuda)
    expected = bnb.dequantize_4bit(A, qs)
    torch._dynamo.reset()
    got = torch.compile(lambda a: harness.dequantize_4bit(a, qs), fullgraph=True)(A)
    assert_bit_exact(got, expected, "compiled drop-in")
    out = poison_(torch.empty_like(expected))
    torch.compile(lambda a, o: harness.dequantize_4bit(a, qs, out=o), fullgraph=True)(A, out)
    assert_bit_exact(out, expected, "compiled drop-in, out=")
    if not nested:  # the absmax/out form, without a quant state
        out = poison_(torch.empty_like(expected))
        absmax = qs.absmax
        compiled = torch.compile(
            lambda a, o: harness.dequantize_4bit(a, absmax=absmax, out=o, blocksize=64, quant_type="nf4"),
            fullgraph=True,
        )
        compiled(A, out)
        assert_bit_exact(out, expected, "compiled drop-in, absmax and out")


@pytest.mark.gpu
def test_a_bad_call_fails_compilation_with_the_input_error(cuda, run_seed):
    A, qs = cases.quantize_weights((256, 320), "nf4", 64, False, torch.bfloat16, run_seed, device=cuda)
    qs.absmax = qs.absmax[:-1]
    torch._dynamo.reset()
    # TorchDynamo wraps what the op's fake implementation raised; the message is eager mode's.
    with pytest.raises(Exception, match=r"InputError\('absmax must hold"):
        torch.compile(lambda a: harness.dequantize_4bit(a, qs), fullgraph=True)(A)


STORAGES = [torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.int8]


@pytest.mark.gpu
@pytest.mark.parametrize("storage", STORAGES, ids=str)
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "nested"])
@pytest.mark.parametrize("path", ["compiled", "python"])
def test_packed_data_in_any_quant_storage_dtype(cuda, bnb, run_seed, storage, nested, path):
    """bitsandbytes reads packed data through a raw pointer whatever dtype holds it (FSDP keeps it
    in bf16); the drop-in takes what bitsandbytes takes, bit for bit, on both host paths."""
    g = cases.seeded_generator(run_seed, cuda)
    w = torch.randn(192, 320, generator=g, device=cuda).to(torch.bfloat16)
    A, qs = bnb.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="fp4", quant_storage=storage)
    assert A.dtype == storage
    expected = bnb.dequantize_4bit(A, qs)
    out = poison_(torch.empty_like(expected))
    if path == "python":
        with host_path.python_path_only():
            harness.dequantize_4bit(A, qs, out=out)
            allocated = harness.dequantize_4bit(A, qs)
    else:
        entry = host_path.entry(dequantize.HOST).bound()
        fields, nested_args = dequantize.quant_state_args(qs)
        assert entry, "the GPU sessions run with the compiled host path"
        absmax, blocksize, quant_type, shape, dtype = fields
        n2 = nested_args or dict.fromkeys(("code2", "absmax2", "blocksize2", "offset"))
        taken = entry(A, absmax, n2["code2"], n2["absmax2"], n2["offset"], out, shape, dtype, blocksize,
                      n2["blocksize2"], quant_type)  # fmt: skip
        assert taken is out, "the compiled path declined packed data in another storage dtype"
        allocated = harness.dequantize_4bit(A, qs)
    assert_bit_exact(out, expected, f"{storage} out=")
    assert_bit_exact(allocated, expected, f"{storage}")
