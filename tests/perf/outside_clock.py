"""A clock outside the measuring process (GPU only): can the judge time a call another process runs?

The judge's stream, held by the timer's blocking kernel, flushes the L2, writes a ``%globaltimer``
stamp (``kernels/probes/globaltimer_stamp.cu``) and records an interprocess event; the measuring
process, told over a pipe, makes its stream wait on that event, enqueues the call and records a
second interprocess event; the judge's stream waits on that one and writes the second stamp; then
the judge releases its hold. The difference of the stamps is a time the measuring process can
neither write nor reorder (the perf gate reads CUDA events in the measuring process today). Each
call is also timed by the measuring process's own timer (the gate's), and an empty call (nothing
between the events) gives each clock's floor. Calls as ``tests.perf.process_offset``'s: a
one-element ``add_``, a 1024x8192 dequantization and a one-row fused matmul on that weight.

    python -m tests.perf.outside_clock [--samples 100] [--cold-stamp]

``--cold-stamp`` launches the stamp kernel for the first time while the stream is held, as a first
attempt did: a module's first launch there stalls its enqueue (lazy loading) past the hold.
Run it under MPS (``nvidia-cuda-mps-control -d``) to see both processes in one GPU context.
Prints one table last; kernels/NOTES.md, "A clock outside the measuring process", has the figures.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.multiprocessing as mp

from harness.perf import gpu_timer
from harness.runtime import launcher

from .process_offset import calls, make_inputs

CALLS = ("empty", "tiny", "deq", "mm")
ANSWER_S = 2.5  # the measuring process's answer must come inside the hold (BLOCK_TIMEOUT_NS)


def measuring_process(conn, inputs, handles, n: int) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    start, end = (torch.cuda.Event.from_ipc_handle(device, h) for h in handles)
    fns = calls(inputs, device) | {"empty": lambda: None}
    timer, stream = gpu_timer.ColdL2Timer(device), torch.cuda.current_stream(device)
    conn.send("ready")
    while (request := conn.recv()) is not None:
        kind, name = request
        if kind == "own":  # the process's own clock, as the gate reads it
            for _ in range(3):
                timer.sample(fns[name])
            conn.send([timer.sample(fns[name])[0] * 1e9 for _ in range(n)])
            continue
        stream.wait_event(start)
        fns[name]()
        end.record(stream)
        conn.send("queued")


def answer(conn, timeout_s: float):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"the measuring process did not answer in {timeout_s} s")
    return conn.recv()


def quartiles(xs: list[float]) -> list[float]:
    return statistics.quantiles(xs, n=4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.perf.outside_clock", description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--cold-stamp", action="store_true", help="first stamp launch while the stream is held")
    args = parser.parse_args(argv)
    device = torch.device("cuda", 0)
    inputs = make_inputs()
    timer, stream = gpu_timer.ColdL2Timer(device), torch.cuda.current_stream(device)
    stamp = launcher.load("globaltimer-stamp", "probes/globaltimer_stamp.cu", "stamp_globaltimer", 0, ("ptr",))
    stamps = torch.zeros(2, dtype=torch.int64, device=device)
    if not args.cold_stamp:  # its module loads now, not behind the hold
        launcher.launch(stamp, 1, 1, stream.cuda_stream, (stamps.data_ptr(),))
    start, end = torch.cuda.Event(interprocess=True), torch.cuda.Event(interprocess=True)
    start.record(stream)
    end.record(stream)
    torch.cuda.synchronize(device)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    handles = (start.ipc_handle(), end.ipc_handle())
    proc = ctx.Process(target=measuring_process, args=(theirs, inputs, handles, args.samples), daemon=True)
    proc.start()
    if answer(mine, 120) != "ready":
        raise RuntimeError("the measuring process did not start")

    def outside(name: str) -> float:
        timer._block(stream)
        try:
            timer.flush_l2()
            launcher.launch(stamp, 1, 1, stream.cuda_stream, (stamps.data_ptr(),))
            start.record(stream)
            mine.send(("outside", name))
            if answer(mine, ANSWER_S) != "queued":
                raise RuntimeError("the measuring process did not queue its call")
            stream.wait_event(end)
            launcher.launch(stamp, 1, 1, stream.cuda_stream, (stamps.data_ptr() + 8,))
        finally:
            timer.flag.fill_(1)
        torch.cuda.synchronize(device)
        if int(timer.timed_out.item()):
            timer.timed_out.zero_()
            raise RuntimeError("the blocking kernel timed out: the sample's enqueue outlasted the hold")
        first, second = stamps.tolist()
        return float(second - first)

    rows = []
    try:
        for name in CALLS:
            for _ in range(3):
                outside(name)
            clock = [outside(name) for _ in range(args.samples)]
            mine.send(("own", name))
            rows.append((name, quartiles(clock), quartiles(answer(mine, 120))))
    finally:
        mine.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    floor_out, floor_own = rows[0][1][1], rows[0][2][1]
    print(f"{'call':6} {'outside clock ns: q1 / median / q3':>36} {'own clock ns: q1 / median / q3':>32}"
          f" {'outside - empty':>16} {'own - empty':>12}")  # fmt: skip
    for name, (a1, am, a3), (o1, om, o3) in rows:
        print(f"{name:6} {a1:11.0f} {am:11.0f} {a3:11.0f} {o1:10.0f} {om:10.0f} {o3:10.0f}"
              f" {am - floor_out:16.0f} {om - floor_own:12.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
