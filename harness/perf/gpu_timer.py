"""GPU time per launch, measured the way nvbench measures a cold-cache sample.

One sample is a small state machine on the measured stream:

    BLOCK         enqueue a kernel that spins on a host-mapped flag, holding the stream
    PREPARE       enqueue the caller's untimed setup (fresh inputs for this sample), if any
    FLUSH_L2      read a buffer twice the L2's size, so the launch starts cold with a clean L2
    RECORD_START  enqueue the start event
    LAUNCH        enqueue the work (any callable that launches on the current stream)
    RECORD_STOP   enqueue the stop event
    COLLECT       enqueue the caller's untimed use of the work's result (keep it for a check)
    RELEASE       set the flag: everything queued behind the spin runs back to back
    READ          wait for the stop event, read the elapsed time and the SM clock

Because the host enqueues while the stream is held, the host's launch cost never shows up as a gap
inside the timed region. PREPARE is held behind the spin too: work that the timed call starts on
another stream, without waiting for the measured one, runs while the stream is held and so finds
the previous sample's inputs, not this one's; COLLECT runs right behind the stop event, so work not
finished by then is caught unfinished.

The flush reads (a reduction) rather than writes: a written buffer (a memset, as nvbench and Triton
flush) leaves up to the L2's size of dirty lines, whose write-back to DRAM then runs inside the
timed call and competes with its reads. Measured on an H100 (kernels/NOTES.md, "The pair-table
kernel's weights in 16-byte loads"): 1024x8192 dequantization 11.9 µs after a written flush, 9.2
after a read one; the fused matmul on the 70B gate weight at one row 54.3 µs after a read flush,
62.4 after a written one, where the kernel it replaced took 61.8 and 62.1: a written flush hid a
12% gain of a kernel near the memory's pace.

Whether to keep sampling is the ``StopRule``'s call; whether a sample counts is the
``ThrottleRule``'s. Both have their defaults written down below.
"""

from __future__ import annotations

import enum
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from harness.runtime import launcher

BLOCK_TIMEOUT_NS = 2_000_000_000  # a spin that is never released gives up after 2 s
BLOCKER_PARAMS = ("ptr", "ptr", "u64")  # kernels/block_stream.cu: flag, timed_out, timeout_ns


class State(enum.Enum):
    BLOCK = "block"
    PREPARE = "prepare"
    FLUSH_L2 = "flush_l2"
    RECORD_START = "record_start"
    LAUNCH = "launch"
    RECORD_STOP = "record_stop"
    COLLECT = "collect"
    RELEASE = "release"
    READ = "read"


@dataclass(frozen=True)
class StopRule:
    """Sample until the relative noise (stdev / mean of kept samples) is at most ``max_noise``
    with at least ``min_samples`` kept, or until ``budget_s`` of wall time or ``max_samples``."""

    max_noise: float = 0.005
    min_samples: int = 10
    budget_s: float = 0.5
    max_samples: int = 1000

    def done(self, kept: list[float], taken: int, elapsed_s: float) -> bool:
        if taken >= self.max_samples or elapsed_s >= self.budget_s:
            return True
        return len(kept) >= self.min_samples and relative_noise(kept) <= self.max_noise


@dataclass(frozen=True)
class ThrottleRule:
    """Discard a sample when the SM clock read right after it is below ``min_fraction`` of the
    GPU's default (base application) clock: the GPU was throttling, the time says nothing."""

    min_fraction: float = 0.75

    def keep(self, sm_clock_mhz: float | None, default_mhz: float | None) -> bool:
        if not sm_clock_mhz or not default_mhz:
            return True  # no clock to judge by
        return sm_clock_mhz >= self.min_fraction * default_mhz


def relative_noise(samples: list[float]) -> float:
    if len(samples) < 2:
        return math.inf
    mean = statistics.fmean(samples)
    return statistics.stdev(samples) / mean if mean > 0 else math.inf


@dataclass
class Measurement:
    samples_s: list[float]
    discarded: int
    sm_clocks_mhz: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def noise(self) -> float:
        return relative_noise(self.samples_s)

    def summary(self) -> dict:
        return {
            "median_us": self.median_s * 1e6,
            "noise": self.noise,
            "p10_us": float(np.percentile(self.samples_s, 10)) * 1e6,
            "p90_us": float(np.percentile(self.samples_s, 90)) * 1e6,
            "samples": len(self.samples_s),
            "discarded": self.discarded,
            "sm_clock_mhz": statistics.median(self.sm_clocks_mhz) if self.sm_clocks_mhz else None,
        }


def _nothing(*_args) -> None:
    return None


@dataclass(frozen=True)
class Hooks:
    """The caller's untimed work around each sample: ``prepare()`` behind the stream's hold,
    before the L2 flush; ``collect(result)`` with what the timed call returned, right after the
    stop event."""

    prepare: Callable[[], object] = _nothing
    collect: Callable[[object], object] = _nothing


class ColdL2Timer:
    """Measures any launch callable; one instance per device, reused across cases."""

    def __init__(
        self,
        device: torch.device,
        stop: StopRule = StopRule(),
        throttle: ThrottleRule = ThrottleRule(),
        clock: Callable[[], tuple[float | None, float | None]] | None = None,
    ):
        self.device = device
        self.stop = stop
        self.throttle = throttle
        self.clock = clock or (lambda: (None, None))  # (current SM MHz, default SM MHz)
        props = torch.cuda.get_device_properties(device)
        # Twice the L2's size, and never under 32 MiB, so the flush evicts everything.
        self.flush_buffer = torch.empty(max(2 * props.L2_cache_size, 32 << 20), dtype=torch.uint8, device=device)
        self.flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.timed_out = torch.zeros(1, dtype=torch.int32, device=device)
        self.start = torch.cuda.Event(enable_timing=True)
        self.stop_event = torch.cuda.Event(enable_timing=True)
        self.flush_sink = torch.empty((), dtype=torch.float32, device=device)
        self.blocker = launcher.load("block-stream", "block_stream.cu", "block_stream", device.index, BLOCKER_PARAMS)
        self.state = State.READ
        # The reduction's kernel loads now: a lazy module load while the stream is held would
        # stall the enqueue past the spin's timeout.
        self.flush_l2()
        torch.cuda.synchronize(device)

    def flush_l2(self) -> None:
        """Reads every byte of ``flush_buffer`` (a sum into a preallocated scalar; the buffer's
        values do not matter), evicting the L2 without dirtying it."""
        torch.sum(self.flush_buffer.view(torch.float32), 0, out=self.flush_sink)

    def _block(self, stream: torch.cuda.Stream) -> None:
        self.flag.zero_()
        launcher.launch(
            self.blocker,
            1,
            32,
            stream.cuda_stream,
            (self.flag.data_ptr(), self.timed_out.data_ptr(), BLOCK_TIMEOUT_NS),
        )

    def _steps(
        self, stream: torch.cuda.Stream, fn: Callable[[], object], hooks: Hooks
    ) -> tuple[tuple[State, Callable[[], object]], ...]:
        """The sample's states in order, each with the action it performs."""
        result = None

        def launch():
            nonlocal result
            result = fn()

        return (
            (State.BLOCK, lambda: self._block(stream)),
            (State.PREPARE, hooks.prepare),
            (State.FLUSH_L2, self.flush_l2),
            (State.RECORD_START, lambda: self.start.record(stream)),
            (State.LAUNCH, launch),
            (State.RECORD_STOP, lambda: self.stop_event.record(stream)),
            (State.COLLECT, lambda: hooks.collect(result)),
            (State.RELEASE, lambda: self.flag.fill_(1)),
            (State.READ, lambda: self.stop_event.synchronize()),
        )

    def sample(self, fn: Callable[[], object], hooks: Hooks | None = None) -> tuple[float, float | None]:
        """One cold-L2, gap-free sample of ``fn``: (GPU seconds, SM clock in MHz or None).

        A failure names the state it happened in; the stream is released before it propagates,
        so a failed launch never leaves the blocking kernel spinning."""
        stream = torch.cuda.current_stream(self.device)
        for state, action in self._steps(stream, fn, hooks or Hooks()):
            self.state = state
            try:
                action()
            except Exception as exc:
                self.flag.fill_(1)
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(f"(raised in the GPU timer's {state.name} state)")
                raise
        if int(self.timed_out.item()):
            self.timed_out.zero_()
            raise RuntimeError("the blocking kernel timed out: the timed work took too long to enqueue")
        elapsed_s = self.start.elapsed_time(self.stop_event) / 1e3
        current, _ = self.clock()
        return elapsed_s, current

    def _released_args(self) -> tuple[int, int, int]:
        """The blocking kernel's arguments with its flag already set: it exits at once."""
        self.flag.fill_(1)
        return (self.flag.data_ptr(), self.timed_out.data_ptr(), 0)

    def bare_launch(self) -> Callable[[], None]:
        """One launch of the blocking kernel, released (it exits at once): the host floor every
        cuda-python launch pays, for host-time comparisons."""
        stream, args = torch.cuda.current_stream(self.device).cuda_stream, self._released_args()
        return lambda: launcher.launch(self.blocker, 1, 32, stream, args)

    def driver_launch(self) -> Callable[[], None]:
        """The same launch as ``bare_launch`` as one cuLaunchKernel call with every argument built
        beforehand (in a buffer of its own): what the driver binding alone costs, below the
        launcher's own packing."""
        from cuda.bindings import driver

        stream = driver.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        packer = launcher.ArgPacker(BLOCKER_PARAMS)
        packer.pack(self._released_args())
        handle = self.blocker.handle
        return lambda: driver.cuLaunchKernel(handle, 1, 1, 1, 32, 1, 1, 0, stream, packer.params, 0)

    def batch(self, fn: Callable[[], object], samples: int, warmup: int = 1, hooks: Hooks | None = None) -> Measurement:
        """Exactly ``samples`` kept samples (throttled ones retaken, at most 3x as many taken):
        one batch of an A/B round, where the round count, not the batch, adapts to the noise."""
        self._warm_up(fn, warmup)
        return self._collect(fn, lambda kept, taken, _: len(kept) < samples and taken < 3 * samples, hooks)

    def measure(self, fn: Callable[[], object], warmup: int = 3) -> Measurement:
        """Warm up (compilation, caches of the host side), then sample under the rules."""
        return self.measure_with(fn, self.stop, warmup)

    def measure_with(self, fn: Callable[[], object], stop: StopRule, warmup: int = 3) -> Measurement:
        self._warm_up(fn, warmup)
        return self._collect(fn, lambda kept, taken, elapsed: not stop.done(kept, taken, elapsed))

    def _warm_up(self, fn: Callable[[], object], calls: int) -> None:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(self.device)

    def _collect(
        self, fn: Callable[[], object], more: Callable[[list[float], int, float], bool], hooks: Hooks | None = None
    ) -> Measurement:
        """Sample while ``more(kept, taken, elapsed_s)``; the throttle rule decides what is kept."""
        kept, clocks, discarded, taken = [], [], 0, 0
        t0 = time.perf_counter()
        _, default = self.clock()
        while more(kept, taken, time.perf_counter() - t0):
            elapsed, sm = self.sample(fn, hooks)
            taken += 1
            if self.throttle.keep(sm, default):
                kept.append(elapsed)
                if sm:
                    clocks.append(sm)
            else:
                discarded += 1
        if not kept:
            raise RuntimeError(f"every one of {taken} samples was discarded as throttled")
        return Measurement(kept, discarded, clocks)


def empty_interval_us(timer: ColdL2Timer) -> float:
    """The timer's reading, in µs, for a launch of nothing: its two events back to back behind the
    hold and the flush. Every sample carries it, and it belongs to the host: on two hosts of one H100
    model it read 1.25 and 2.94 µs, and every timed call there differed by about as much
    (kernels/NOTES.md, "The drift guard across hosts")."""
    return timer.measure(lambda: None).median_s * 1e6


def copy_bandwidth(timer: ColdL2Timer, nbytes: int = 1 << 30) -> tuple[float, Measurement]:
    """Device-to-device copy of ``nbytes`` by the timer's method: the memory roofline a kernel's
    bytes are divided by, in GB/s counting bytes read and written, and the measurement it is from."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=timer.device).fill_(7)
    dst = torch.empty_like(src)
    measured = timer.measure(lambda: dst.copy_(src))
    return 2 * nbytes / measured.median_s / 1e9, measured


# Calls timed between two synchronisations when measuring host time: far fewer than the driver's
# launch queue holds (about a thousand launches), so however long each kernel runs on the GPU the
# host never waits for a free slot, and what is timed is the host's own work.
HOST_BATCH = 64


def host_us_per_call(
    fns: dict[str, Callable[[], object]], sync: Callable[[], object], calls: int = 500, warmup: int = 20
) -> dict[str, float]:
    """Host microseconds per call of each function: ``calls`` calls after ``warmup``, timed in
    batches of ``HOST_BATCH`` with ``sync`` (the device's synchronize) between batches, untimed,
    so the host's work is timed and never a full launch queue (a call whose host path is faster
    than its kernel would otherwise be timed at the kernel's speed)."""
    result = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        elapsed, done = 0.0, 0
        while done < calls:
            batch = min(HOST_BATCH, calls - done)
            sync()
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            elapsed += time.perf_counter() - t0
            done += batch
        sync()
        result[name] = elapsed / calls * 1e6
    return result


def per_call_seconds(fn: Callable[[], object], device: torch.device, calls: int = 200) -> float:
    """Time per call as a caller sees it: back-to-back calls, host work included, no blocking."""
    for _ in range(5):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.current_stream(device)
    torch.cuda.synchronize(device)
    start.record(stream)
    for _ in range(calls):
        fn()
    stop.record(stream)
    stop.synchronize()
    return start.elapsed_time(stop) / 1e3 / calls
