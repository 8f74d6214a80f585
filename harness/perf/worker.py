"""The measuring process of a perf session, driven over a pipe by ``harness.perf.session``.

Started as ``python -m harness.perf.worker --side NAME=DIR ...`` with the judge's checkout first
on the import path. It loads the judge's timer and input factory, then every side's own
``harness`` (``sides.Side``), and measures each side's drop-in ``dequantize_4bit`` (and, for the
end-to-end case, each side's ``patch_bitsandbytes``) on inputs the judge built once for all
sides. A separate process keeps the driver alive, and able to report, if a side's kernel faults.

Protocol: one JSON object per line each way. A request is ``{"op": NAME, ...}``; the reply is the
op's result, or ``{"error": TRACEBACK}``. The protocol channel is this process's original
stdout; anything else printed (by the side's code, bitsandbytes, transformers) goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path


class Worker:
    """The state of the measuring process: the judge's tools, the sides, the current inputs."""

    def __init__(self, side_roots: dict[str, Path]):
        import torch

        # The judge's code, loaded before any side's.
        from harness.correctness import cases, matmul_reference, qlora
        from harness.correctness.bitcompare import poison_
        from harness.perf import gpu_info, gpu_timer, sides
        from harness.runtime import launcher

        self.torch, self.cases, self.qlora, self.launcher, self.poison_ = torch, cases, qlora, launcher, poison_
        self.matmul_reference = matmul_reference
        self.device = torch.device("cuda", torch.cuda.current_device())
        clock = gpu_info.sm_clock_reader(gpu_info.nvml_device(self.device.index))
        self.timer = gpu_timer.ColdL2Timer(self.device, clock=clock)
        self.gpu_timer = gpu_timer
        self.sides = {name: sides.Side(name, root) for name, root in side_roots.items()}
        self.case: dict | None = None
        self.e2e = None

    # -- kernel cases ---------------------------------------------------------------------------
    def op_kernel_case(self, spec: dict) -> dict:
        """Build a case's inputs once for every side (bitsandbytes quantizes fresh random weights
        from the seed; a matmul case adds seeded activations), run each side once on a poisoned
        output and say whether every output is what the case demands: the first side's bits
        exactly (dequantization), or inside the fp64 reference's bound (matmul, whose summation
        order a kernel may change)."""
        self.op_release()
        torch = self.torch
        dtype = self.cases.dtype_of(spec["dtype"])
        A, qs = self.cases.quantize_weights(
            spec["shape"], spec["quant"], spec["blocksize"], spec["nested"], dtype, spec["seed"], device=self.device
        )
        self.case = {"A": A, "qs": qs, "spec": spec}
        if spec.get("kind") == "matmul":
            g = self.cases.seeded_generator(spec["seed"] + 1, self.device)
            self.case["x"] = torch.randn(spec["tokens"], qs.shape[1], generator=g, device=self.device).to(dtype)
            return self._check_matmul_outputs()
        first, agree = None, True
        for side in self.sides.values():
            out = self.poison_(torch.empty(qs.shape, dtype=dtype, device=self.device), alternate=first is not None)
            with side.active():
                side.dequantize_4bit(A, qs, out=out)
            torch.cuda.synchronize(self.device)
            bits = out.view(-1).view(torch.uint8)
            if first is None:
                first = bits
            else:
                agree = agree and torch.equal(first, bits)
            del out
        return {"numel": qs.shape.numel(), "outputs_agree": agree}

    def _check_matmul_outputs(self) -> dict:
        import bitsandbytes.functional as F

        matmul_reference = self.matmul_reference
        torch, A, qs, x = self.torch, self.case["A"], self.case["qs"], self.case["x"]
        ref = matmul_reference.reference(x, F.dequantize_4bit(A, qs), None, x.dtype)
        agree = True
        for index, side in enumerate(self.sides.values()):
            out = torch.empty(x.shape[0], qs.shape[0], dtype=x.dtype, device=self.device)
            self.poison_(out, alternate=index > 0)
            with side.active():
                side.matmul_4bit(x, A.t(), qs, out=out)
            torch.cuda.synchronize(self.device)
            agree = agree and matmul_reference.judge(out, ref).ok
            del out
        return {"numel": qs.shape.numel(), "outputs_agree": agree}

    def _call(self, side) -> Callable[[], object]:
        """The timed call of the prepared case on one side: its drop-in, as a user calls it."""
        A, qs = self.case["A"], self.case["qs"]
        if self.case["spec"].get("kind") == "matmul":
            matmul, x, B = side.matmul_4bit, self.case["x"], A.t()
            return lambda: matmul(x, B, qs)
        dequantize = side.dequantize_4bit
        return lambda: dequantize(A, qs)

    def op_measure(self, side: str, samples: int) -> dict:
        """One batch: ``samples`` cold-L2 GPU times of one side's call (seconds)."""
        chosen = self.sides[side]
        call = self._call(chosen)
        with chosen.active():
            m = self.timer.batch(call, samples)
        return {"samples_s": m.samples_s, "discarded": m.discarded}

    def op_references(self, names: list[str]) -> dict:
        """GPU time of other implementations on the prepared case (for the report only):
        bitsandbytes' kernel alone (fp32 scales), its full dequantize_4bit (for a matmul case: its
        own matmul_4bit, and no kernel alone), a device copy moving the same bytes."""
        import bitsandbytes
        import bitsandbytes.functional as F

        torch = self.torch
        A, qs, spec = self.case["A"], self.case["qs"], self.case["spec"]
        dtype = qs.dtype
        calls = {}
        if spec.get("kind") == "matmul":
            x, B = self.case["x"], A.t()
            names = [n for n in names if n != "bnb_kernel"]
            if "bnb_full" in names:
                calls["bnb_full"] = lambda: bitsandbytes.matmul_4bit(x, B, qs)
                names.remove("bnb_full")
        if "bnb_kernel" in names:
            absmax = F.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset if spec["nested"] else qs.absmax
            out = torch.empty(qs.shape, dtype=dtype, device=self.device)
            calls["bnb_kernel"] = lambda: torch.ops.bitsandbytes.dequantize_4bit.out(
                A, absmax, qs.blocksize, qs.quant_type, qs.shape, dtype, out=out
            )
        if "bnb_full" in names:
            calls["bnb_full"] = lambda: F.dequantize_4bit(A, qs)
        if "same_size_copy" in names:
            src = torch.empty(int(spec["bytes"]) // 2, dtype=torch.uint8, device=self.device)
            dst = torch.empty_like(src)
            calls["same_size_copy"] = lambda: dst.copy_(src)
        stop = self.gpu_timer.StopRule(budget_s=0.2)
        return {name: self.timer.measure_with(fn, stop).median_s for name, fn in calls.items()}

    def op_copy_bandwidth(self) -> dict:
        """Device-to-device copy of 1 GiB, same method, counting bytes read and written."""
        m = self.gpu_timer.copy_bandwidth(self.timer)
        return {"gbps": 2 * (1 << 30) / m.median_s / 1e9, "noise": m.noise}

    def op_host_overhead(self, side: str, calls: int = 500) -> dict:
        """Host time per call, queue never full: one side's call (allocating and with out=),
        bitsandbytes' full path, and two floors every caller pays on this host: allocating the
        output alone and one bare cuda-python launch (the timer's blocking kernel, released)."""
        import bitsandbytes.functional as F

        torch = self.torch
        A, qs = self.case["A"], self.case["qs"]
        out_buf = torch.empty(qs.shape, dtype=qs.dtype, device=self.device)
        dequantize = self.sides[side].dequantize_4bit
        fns = {
            "ours": lambda: dequantize(A, qs),
            "ours out=": lambda: dequantize(A, qs, out=out_buf),
            "bnb full": lambda: F.dequantize_4bit(A, qs),
            "floor: new_empty": lambda: A.new_empty(qs.shape, dtype=qs.dtype),
            "floor: bare launch": self.timer.bare_launch(),
        }
        with self.sides[side].active():
            return self.gpu_timer.host_us_per_call(fns, lambda: torch.cuda.synchronize(self.device), calls)

    def op_release(self) -> dict:
        self.case = None
        self.torch.cuda.empty_cache()
        return {}

    # -- end-to-end ------------------------------------------------------------------------------
    def op_e2e_prepare(self, checkpoint: str) -> dict:
        """Write a random-weight checkpoint and load it as the QLoRA model every side steps."""
        self.op_release()
        self.qlora.save_random_llama(checkpoint)
        self.e2e = self.qlora.load_qlora(checkpoint)
        for side in self.sides:
            self.op_e2e_measure(side, 2)  # warm-up: compilation, allocator, cuBLAS handles
        return {}

    def op_e2e_measure(self, side: str, steps: int) -> dict:
        """Wall time per QLoRA training step with one side's patch applied (synchronised)."""
        import gc

        model, ids, chosen = self.e2e.model, self.e2e.input_ids, self.sides[side]

        def step():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()

        gc.collect()
        with chosen.active():
            chosen.patch_bitsandbytes()
            gc.disable()  # a collection inside a step showed up as a 4x outlier
            try:
                return {"samples_s": self.qlora.wall_times(step, steps)}
            finally:
                gc.enable()
                chosen.unpatch_bitsandbytes()

    def op_e2e_release(self) -> dict:
        self.e2e = None
        self.torch.cuda.empty_cache()
        return {}


def serve(worker: Worker, requests, replies) -> None:
    for line in requests:
        request = json.loads(line)
        op = request.pop("op")
        if op == "quit":
            break
        try:
            reply = getattr(worker, f"op_{op}")(**request)
        except Exception:
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.perf.worker")
    parser.add_argument("--side", action="append", required=True, metavar="NAME=DIR", help="a side to measure")
    args = parser.parse_args(argv)
    side_roots = {name: Path(root) for name, root in (s.split("=", 1) for s in args.side)}
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the protocol
    try:
        worker = Worker(side_roots)
    except Exception:
        replies.write(json.dumps({"error": traceback.format_exc()}) + "\n")
        replies.flush()
        return 1
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    serve(worker, sys.stdin, replies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
