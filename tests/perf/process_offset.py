"""Whether a measuring process's own launches time differently from another's (GPU only).

A process per side shifts A/A sessions by 0.1-0.3 µs a call (kernels/NOTES.md, "The per-side
offset, located"). This separates where: two timers in one process (two flush buffers), then
pairs and groups of processes started one after another and fed the same inputs over CUDA IPC,
taking turns as the judge's sides do (ABBA). Each times a near-empty launch (a one-element
``add_``), a 1024x8192 dequantization and a one-row fused matmul on that weight (nf4 nested
bf16), with the judge's timer, its L2 flushed by reading (as the timer does) and by writing.

    python -m tests.perf.process_offset [--pairs 4] [--groups 4] [--rounds 16] [--samples 50]

Prints one table last: each setup's medians in ns and each process's difference from the first.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.multiprocessing as mp

from harness.perf import gpu_timer

CALLS = ("tiny", "deq", "mm")
SHAPE = (1024, 8192)


class WriteFlushTimer(gpu_timer.ColdL2Timer):
    """The judge's timer with the L2 flushed as it was before it read its buffer: by writing it
    (dirty lines, written back during the timed call)."""

    def flush_l2(self):
        self.flush_buffer.fill_(1)


TIMERS = {"write": WriteFlushTimer, "read": gpu_timer.ColdL2Timer}


def make_inputs():
    from harness.correctness import cases

    B, qs = cases.quantize_weights(SHAPE, "nf4", 64, True, torch.bfloat16, 0)
    return B, qs, torch.randn(1, SHAPE[1], device="cuda", dtype=torch.bfloat16)


def calls(inputs, device: torch.device) -> dict:
    import harness

    B, qs, A = inputs
    tiny = torch.zeros(1, device=device)
    fns = {
        "tiny": lambda: tiny.add_(1),
        "deq": lambda: harness.dequantize_4bit(B, qs),
        "mm": lambda: harness.matmul_4bit(A, B.t(), qs),
    }
    for fn in fns.values():  # compiled and loaded here: a first call under the timer outlasts its hold
        fn()
    torch.cuda.synchronize(device)
    return fns


def samples(timer: gpu_timer.ColdL2Timer, fn, n: int) -> list[float]:
    for _ in range(3):  # compilation and first-use costs, outside the samples
        timer.sample(fn)
    return [timer.sample(fn)[0] for _ in range(n)]


def worker(conn, inputs, n: int) -> None:
    device = torch.device("cuda", 0)
    timers = {mode: cls(device) for mode, cls in TIMERS.items()}
    fns = calls(inputs, device)
    conn.send("ready")
    while (request := conn.recv()) is not None:
        name, mode = request
        conn.send(samples(timers[mode], fns[name], n))


def median_ns(xs: list[float]) -> float:
    return statistics.median(xs) * 1e9


def one_process(inputs, rounds: int, n: int) -> list[tuple]:
    device = torch.device("cuda", 0)
    fns, rows = calls(inputs, device), []
    for mode, cls in TIMERS.items():
        timers = (cls(device), cls(device))
        for name in CALLS:
            taken = ([], [])
            for r in range(rounds):
                for i in (0, 1) if r % 2 == 0 else (1, 0):
                    taken[i].extend(samples(timers[i], fns[name], n))
            rows.append(("one process, two timers", mode, name, [median_ns(t) for t in taken]))
    return rows


def processes(inputs, count: int, label: str, modes, rounds: int, n: int) -> list[tuple]:
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for _ in range(count):  # one after another, as the judge starts its sides
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(theirs, inputs, n))
        proc.start()
        if mine.recv() != "ready":
            raise RuntimeError("a measuring process did not start")
        conns.append(mine)
        procs.append(proc)
    rows = []
    try:
        for mode in modes:
            for name in CALLS:
                taken = [[] for _ in range(count)]
                for r in range(rounds):
                    for i in range(count) if r % 2 == 0 else reversed(range(count)):
                        conns[i].send((name, mode))
                        taken[i].extend(conns[i].recv())
                rows.append((label, mode, name, [median_ns(t) for t in taken]))
    finally:
        for conn in conns:
            conn.send(None)
        for proc in procs:
            proc.join()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.perf.process_offset", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--groups", type=int, default=4, help="groups of four processes at once")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--samples", type=int, default=50, help="samples a turn")
    args = parser.parse_args(argv)
    inputs = make_inputs()
    rows = one_process(inputs, args.rounds, args.samples)
    for k in range(args.pairs):
        rows += processes(inputs, 2, f"process pair {k}", TIMERS, args.rounds, args.samples)
    for k in range(args.groups):
        rows += processes(inputs, 4, f"four processes, group {k}", ("write",), args.rounds, args.samples)
    print(f"{'setup':28s} {'flush':5s} {'call':4s}  medians ns (in start order) | each minus the first")
    for label, mode, name, medians in rows:
        first = medians[0]
        print(
            f"{label:28s} {mode:5s} {name:4s}  "
            + " ".join(f"{m:6.0f}" for m in medians)
            + "  |"
            + " ".join(f"{m - first:+5.0f}" for m in medians[1:])
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
