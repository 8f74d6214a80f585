"""A measuring process, driven over a pipe by the judge's ``harness.perf.session``.

Started as ``python -m harness.perf.worker --side NAME=DIR [--side NAME=DIR]`` with the judge's
checkout first on the import path: it loads the judge's timer and the rest of the judge's code,
then, asked (``load_sides``, once every measuring process of the session has started), each side's
own ``harness`` (``sides.Side``), and times a side's drop-in on the inputs the judge lends it
(``harness.perf.stage``), or its ``patch_bitsandbytes`` in the end-to-end step. The judge runs one
such process per side, or one for both (``policy.Isolation``): in a process of its own, nothing a
side's code does to its process (a global, a torch setting, a stream, the allocator) reaches the
other side's timing; the judge, which holds the schedule, the statistics and the verdict, is
always a process apart.

Protocol: one JSON object per line each way. A request is ``{"op": NAME, ...}``; the reply is the
op's result, or ``{"error": TRACEBACK}``. The protocol channel is this process's original
stdout; anything else printed (by the side's code, bitsandbytes, transformers) goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from pathlib import Path


class Worker:
    """The state of a measuring process: the judge's timer, the sides, what each borrowed."""

    def __init__(self, side_roots: dict[str, Path]):
        import torch

        # The judge's code, all of it, loaded before any side's.
        from harness import settings
        from harness.correctness import qlora
        from harness.correctness.bitcompare import poison_
        from harness.perf import gpu_info, gpu_timer, sides, stage

        self.torch, self.qlora, self.poison_, self.gpu_timer, self.stage = torch, qlora, poison_, gpu_timer, stage
        self.device = torch.device("cuda", torch.cuda.current_device())
        clock = gpu_info.sm_clock_reader(gpu_info.nvml_device(self.device.index))
        self.timer = gpu_timer.ColdL2Timer(self.device, clock=clock)
        self.own_flush = self.timer.flush_buffer  # replaced by the judge's while a case is lent
        del settings, sides  # imported now: load_sides runs later, when a side's code may have run
        self._side_roots = side_roots
        self.sides: dict = {}  # op_load_sides
        self.lent: dict[str, object] = {}
        self.e2e = None

    def op_load_sides(self) -> dict:
        """Load the sides. The session asks once every one of its measuring processes has started,
        each with all of its judge code imported: a side's code may edit files, and no process may
        import a judge module after any side's code has run (the edit is caught when the session
        ends; an edited module imported by a later process would not be)."""
        if self.sides:
            raise RuntimeError("the sides are loaded once")
        self.sides = load_sides(self._side_roots)
        return {}

    # -- kernel cases ---------------------------------------------------------------------------
    def _call(self, side: str):
        return self.lent[side].call(self.sides[side])

    def op_kernel_case(self, side: str, lent: str) -> dict:
        """Borrow the judge's case for ``side`` and run it once per variant of the live input, on
        a poisoned output, each output copied to its evidence slot for the judge to check."""
        self.lent[side] = borrowed = self.stage.borrow(lent)
        self.timer.flush_buffer = borrowed.flush
        call = self._call(side)
        with self.sides[side].active():
            for variant in range(self.stage.VARIANTS):
                borrowed.refresh(variant)
                self.poison_(borrowed.out, alternate=variant % 2 == 1)
                borrowed.evidence[variant].copy_(call())
        self.torch.cuda.synchronize(self.device)
        return {}

    def op_measure(self, side: str, samples: int, variants: list[int], checked: list[int]) -> dict:
        """One batch: ``samples`` cold-L2 GPU times of the side's call (seconds). Sample ``i``
        gets variant ``variants[i]`` of the live input; the output of each sample in ``checked``
        goes to the evidence slot of its position there."""
        lent, taken = self.lent[side], 0

        def prepare():
            lent.refresh(variants[taken % len(variants)])

        def collect(result):
            nonlocal taken
            if taken in checked:
                lent.evidence[checked.index(taken)].copy_(result)
            taken += 1

        call = self._call(side)
        with self.sides[side].active():
            m = self.timer.batch(call, samples, hooks=self.gpu_timer.Hooks(prepare, collect))
        self.torch.cuda.synchronize(self.device)
        return {"samples_s": m.samples_s, "discarded": m.discarded}

    def op_host_overhead(self, side: str, calls: int = 500) -> dict:
        """Host time per call, queue never full, of the borrowed case's calls
        (``Lent.host_calls``: the side's drop-in allocating and with out=, bitsandbytes' full path) and of
        two floors every caller pays on this host: allocating the output alone and one bare
        cuda-python launch (the timer's blocking kernel, released)."""
        torch, lent, chosen = self.torch, self.lent[side], self.sides[side]
        out = lent.out
        fns = lent.host_calls(chosen) | {
            "floor: new_empty": lambda: out.new_empty(out.shape),
            "floor: bare launch": self.timer.bare_launch(),
        }
        with chosen.active():
            return self.gpu_timer.host_us_per_call(fns, lambda: torch.cuda.synchronize(self.device), calls)

    def op_release(self) -> dict:
        """Drop every borrowed case (before the judge frees it)."""
        self.lent.clear()
        self.timer.flush_buffer = self.own_flush
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.empty_cache()
        return {}

    # -- end-to-end ------------------------------------------------------------------------------
    def op_e2e_prepare(self, checkpoint: str) -> dict:
        """Load the judge's random-weight checkpoint as the QLoRA model the sides step."""
        self.op_release()
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


def load_sides(side_roots: dict[str, Path]) -> dict:
    """Each side's package (``sides.Side``), its kernel sources and compile cache fixed as it loads
    (``jit.pin_paths``): its own ``kernels/`` and a cache directory of its own under this process's,
    so that no side's code, whatever it does to the environment, redirects another side's compiles
    or hands it compiled kernels."""
    from harness import settings  # the judge's, imported when the process started (``Worker``)
    from harness.perf import sides

    cache = Path(settings.CACHE_DIR.get() or Path.cwd() / "cache")
    loaded = {}
    for name, root in side_roots.items():
        os.environ.pop(settings.KERNELS_DIR.name, None)
        os.environ[settings.CACHE_DIR.name] = str(cache / name)
        side = loaded[name] = sides.Side(name, root)
        with side.active():
            importlib.import_module("harness.runtime.jit").pin_paths()
    os.environ[settings.CACHE_DIR.name] = str(cache)
    return loaded


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
