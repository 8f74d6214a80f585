"""A perf session: the base and the candidate measured side by side on one GPU, in one job.

This process is the judge: the base revision's code, holding the schedule, the case list, the
statistics, the verdicts and every file the session writes. The sides are measured in processes
of their own (``harness.perf.worker``, one per side or one for both: ``policy.Isolation``) that
import each side's checkout (``harness.perf.sides``), so each is timed through its own API,
launcher and kernel; nothing of the candidate is imported here. The judge builds each case's
inputs once, lends the same buffers to both sides (``harness.perf.stage``) and checks the
outputs they return. Per case, rounds of ABBA batches (base, candidate, candidate, base; the next
round BAAB) put clock and thermal drift on both sides alike; each round's ratio of medians is one
paired observation (``stats``).

Without a base the session measures the candidate alone: the drift guard against the stored
baseline still runs, and ``--save-baseline`` records from it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness import settings
from harness.correctness.op_checks.unit import PerfCase
from harness.perf import baseline, gate, gpu_info, gpu_timer, policy, sides, stage, tree_guard
from harness.perf.catalog import E2E_STEP
from harness.perf.stats import PairedRatio
from harness.runtime import jit

JUDGE_ROOT = Path(__file__).resolve().parent.parent.parent
REFERENCES = ("bnb_kernel", "bnb_full", "same_size_copy")
# Host time per call is measured on each case kind's first case of at most this many weight
# elements: a call of a few µs of GPU time (the catalog's 1024x8192 weights and smaller).
HOST_CASE_ELEMENTS = 1 << 23


# Runs a module as `python -m` does, without the working directory on the import path (what
# Python 3.11's -P does, on 3.10 too): `-c` puts it first as "" (nothing where PYTHONSAFEPATH is set).
RUN_MODULE = (
    "import runpy, sys; sys.path[:1] = [p for p in sys.path[:1] if p]; "
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
)


def worker_command(
    side_roots: dict[str, Path], cache: Path, module: str = "harness.perf.worker"
) -> tuple[list[str], Path, dict[str, str]]:
    """(argv, working directory, environment) of a measuring process for ``side_roots``: the judge's
    checkout first on its import path (PYTHONPATH), the working directory not on it
    (``RUN_MODULE``) and outside every checkout (its own cache directory), so no file a side adds
    anywhere is imported in its place; its kernels and compile cache each side's own
    (``worker.load_sides``); bytecode only in a directory of its own, never a checkout's."""
    env = {k: v for k, v in os.environ.items() if k != settings.KERNELS_DIR.name}
    env[settings.CACHE_DIR.name] = str(cache)  # compiled kernels and host launcher: this process's alone
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(JUDGE_ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPYCACHEPREFIX"] = str(cache / "bytecode")  # none read from, or written into, a checkout
    sides_args = [a for name, root in side_roots.items() for a in ("--side", f"{name}={root}")]
    return [sys.executable, "-c", RUN_MODULE, module, *sides_args], cache, env


# What the judge imports late (inside functions), imported before any side's code runs: a module
# first imported later could come from a package a side's process added to the judge's checkout,
# the first entry of the judge's import path (tests/test_perf_logic.py holds this list to the
# judge's late imports).
JUDGE_LATE_IMPORTS = (
    "bitsandbytes", "cuda.bindings.driver", "matplotlib.pyplot", "pynvml", "tabulate", "torch", "transformers",
)  # fmt: skip


def import_late_modules() -> None:
    """Import ``JUDGE_LATE_IMPORTS`` that are installed (matplotlib without a display)."""
    import importlib

    os.environ.setdefault("MPLBACKEND", "Agg")
    for name in JUDGE_LATE_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def arrangements(roots: dict[str, Path], isolation: policy.Isolation) -> list[list[dict[str, Path]]]:
    """The measuring processes of a session, as arrangements: each a list of processes (the sides
    each loads, in the order their modules load) that together time every side once. Per side: one
    arrangement of a process per side. Shared: one process for all, and in an A/B session
    ``policy.SHARED_PROCESSES`` of them, each loading the sides in the order the one before it
    loads them rotated by one (two sides: the base first, then the candidate first)."""
    if isolation is policy.Isolation.PER_SIDE:
        return [[{name: root} for name, root in roots.items()]]
    names = list(roots)
    count = policy.SHARED_PROCESSES if len(names) > 1 else 1
    return [[{n: roots[n] for n in names[i % len(names) :] + names[: i % len(names)]}] for i in range(count)]


def start_arrangements(
    planned: list[list[dict[str, Path]]], start: Callable[[dict[str, Path]], Worker]
) -> list[dict[str, Worker]]:
    """Start the measuring processes of ``planned`` (``arrangements``), and only once every one has
    started, each having imported all of its judge code, have each load its sides (``load_sides``,
    in the order started): no process imports a judge module after a side's code has run. Each
    arrangement as a map from side to the process that times it. On a failure every started process
    is closed."""
    started: list[Worker] = []
    try:
        placed = []
        for groups in planned:
            arrangement: dict[str, Worker] = {}
            for group in groups:
                started.append(worker := start(group))
                arrangement |= dict.fromkeys(group, worker)
            placed.append(arrangement)
        for worker in started:
            worker.call("load_sides")
        return placed
    except BaseException:
        for worker in started:
            worker.close()
        raise


def distinct(workers: Iterable[Worker]) -> list[Worker]:
    """Each process once (a shared process times several sides), in first-seen order."""
    return list({id(w): w for w in workers}.values())


def round_arrangement(index: int, count: int) -> int:
    """The arrangement that times round ``index`` of a case among ``count``: two rounds each in turn,
    so each gets both of the ABBA orders (``PerfSession._order``) alike."""
    return (index // 2) % count


def evidence_key(side: str, arrangement: int) -> str:
    """The name a side's evidence buffer is lent under in an arrangement (each process its own)."""
    return side if arrangement == 0 else f"{side}@{arrangement}"


class WorkerError(RuntimeError):
    """A measuring process failed; the message carries its traceback."""


class Worker:
    """The judge's end of a measuring process (one side's, or both sides')."""

    def __init__(self, side_roots: dict[str, Path], cache: Path):
        argv, cwd, env = worker_command(side_roots, cache)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=cwd, env=env)
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerError(f"the measuring process exited (status {self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError(f"the measuring process failed:\n{reply['error']}")
        return reply

    def call(self, op: str, **kwargs) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


@dataclass
class KernelResult:
    case: PerfCase
    base_rounds_s: list[float] = field(default_factory=list)  # per-round median, base side
    cand_rounds_s: list[float] = field(default_factory=list)  # per-round median, candidate side
    cand_samples_s: list[float] = field(default_factory=list)  # every kept candidate sample
    # Every side's prepared outputs were what the case demands (the base's bits; a matmul: inside
    # the fp64 bound); None where there is nothing to compare with (a dequantization measured alone).
    prepared_agree: bool | None = None
    # Timed batches the judge rejected, each with why: a checked output not what its sample's
    # inputs demand, or a sample faster than the memory roofline allows (work that escaped timing).
    rejected_batches: list[str] = field(default_factory=list)
    references_s: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0  # host wall time spent on this case (inputs, rounds, references)

    @property
    def outputs_agree(self) -> bool | None:
        return False if self.rejected_batches else self.prepared_agree

    @property
    def paired(self) -> PairedRatio | None:
        return PairedRatio.from_rounds(self.base_rounds_s, self.cand_rounds_s) if self.base_rounds_s else None

    @property
    def candidate_us(self) -> float:
        return statistics.median(self.cand_rounds_s) * 1e6

    @property
    def base_us(self) -> float | None:
        return statistics.median(self.base_rounds_s) * 1e6 if self.base_rounds_s else None


@dataclass
class E2EResult:
    case: str
    base_rounds_s: list[float] = field(default_factory=list)
    cand_rounds_s: list[float] = field(default_factory=list)
    cand_samples_s: list[float] = field(default_factory=list)

    @property
    def paired(self) -> PairedRatio | None:
        return PairedRatio.from_rounds(self.base_rounds_s, self.cand_rounds_s) if self.base_rounds_s else None


class PerfSession:
    """Owns the sides' measuring processes, the lent inputs and every result of one session."""

    def __init__(
        self,
        candidate_root: Path,
        base_root: Path | None = None,
        schedule: policy.Schedule = policy.SCHEDULE,
        seed: int = 0,
        references: bool = True,
        isolation: policy.Isolation = policy.ISOLATION,
        output_dirs: tuple[Path, ...] = (),
    ):
        self.schedule, self.seed, self.references, self.isolation = schedule, seed, references, isolation
        self.candidate_root, self.base_root = Path(candidate_root).resolve(), base_root and Path(base_root).resolve()
        self.gpu = gpu_info.gpu_identity(gpu_info.nvml_device(0))
        self.kernel: dict[str, KernelResult] = {}
        self.e2e: dict[str, E2EResult] = {}
        self.host_overhead_us: dict[str, dict[str, float]] = {}  # by case kind: its first small case's
        self.judgements: dict[str, gate.Judgement] = {}
        self.started = time.perf_counter()
        self._tmp = tempfile.mkdtemp(prefix="nf4-harness-perf-")
        self._rng = random.Random(seed)  # batch plans: which variant each sample gets, what is checked
        self._stage = None
        self.device = torch.device("cuda", torch.cuda.current_device())
        clock = gpu_info.sm_clock_reader(gpu_info.nvml_device(self.device.index))
        self.timer = gpu_timer.ColdL2Timer(self.device, clock=clock)  # the references' and the copy's
        self.copy_gbps, _ = gpu_timer.copy_bandwidth(self.timer)
        # Compared with the stored baseline's: what this host's timer adds to every launch.
        self.timer_floor_us = gpu_timer.empty_interval_us(self.timer)
        # The judge's files before any of the candidate's code runs (checked again by ``close``); from
        # here the judge imports nothing for the first time, and no bytecode from its checkout.
        import_late_modules()
        self._pycache_prefix, sys.pycache_prefix = sys.pycache_prefix, str(Path(self._tmp) / "judge-bytecode")
        self._guarded = [JUDGE_ROOT] + ([self.base_root] if self.base_root else [])
        self._unguarded = tuple(Path(p) for p in output_dirs)
        self._fingerprint = tree_guard.fingerprint(self._guarded, self._unguarded)
        self.judge_changed: list[str] = []
        # The base first: in a dequantization case its prepared outputs are the bits to match.
        roots = ({"base": self.base_root} if self.base_root else {}) | {"candidate": self.candidate_root}
        # Each arrangement maps every side to the process that times it, in the order its modules load.
        self.arrangements: list[dict[str, Worker]] = []
        self._side_caches: dict[str, Path] = {}  # side -> its compile cache, made for its first process
        try:
            self.arrangements = start_arrangements(
                arrangements(roots, isolation), lambda group: Worker(group, self._process_cache(group))
            )
        except BaseException:
            self.close()
            raise
        self.workers = self.arrangements[0]  # where the host overheads and the end-to-end step are timed

    @property
    def processes(self) -> list[Worker]:
        return distinct(w for a in self.arrangements for w in a.values())

    def _process_cache(self, group: dict[str, Path]) -> Path:
        """The measuring process's own compile cache, with a directory for each of its sides
        (``worker.load_sides``), each seeded from this machine's before any side's process starts:
        nothing one process or side writes into its cache reaches another's. A side in a second
        shared process (``policy.SHARED_PROCESSES``) shares its first process's directory: the
        same side's kernels, compiled once."""
        cache, seed = Path(self._tmp) / f"{'-'.join(group)}-cache", jit.cache_dir()
        for name in group:
            if name in self._side_caches:
                cache.mkdir(parents=True, exist_ok=True)
                (cache / name).symlink_to(self._side_caches[name], target_is_directory=True)
                continue
            if seed.is_dir():
                shutil.copytree(seed, cache / name, symlinks=True)
            else:
                (cache / name).mkdir(parents=True)
            self._side_caches[name] = cache / name
        return cache

    @property
    def ab(self) -> bool:
        return self.base_root is not None

    def _arrangement(self, index: int) -> tuple[int, dict[str, Worker]]:
        """(its position, the arrangement) that times round ``index`` (``round_arrangement``)."""
        i = round_arrangement(index, len(self.arrangements))
        return i, self.arrangements[i]

    def _order(self, index: int) -> tuple[str, ...]:
        if not self.ab:
            return ("candidate",)
        a, b = "base", "candidate"
        return (a, b, b, a) if index % 2 == 0 else (b, a, a, b)

    # -- kernel cases ---------------------------------------------------------------------------
    def _prepare(self, case: PerfCase) -> bool:
        """Build the case, lend it to every side, and say whether each side's prepared outputs
        are what the case demands."""
        self._stage = stage.Stage(case.spec(self.seed), self.device, self.timer.flush_buffer)
        agree = True
        for i, arrangement in enumerate(self.arrangements):
            for name, worker in arrangement.items():  # in this arrangement's load order
                worker.call("kernel_case", side=name, lent=self._stage.lend(evidence_key(name, i)))
                agree = self._stage.check_prepared(evidence_key(name, i)) and agree
        return agree

    def _rounds(self, result: KernelResult, count: int) -> None:
        fastest_s = result.case.bytes_moved() / (policy.ROOFLINE_MARGIN * self.copy_gbps * 1e9)
        start = len(result.cand_rounds_s)
        for index in range(start, start + count):
            batch: dict[str, list[float]] = {"base": [], "candidate": []}
            at, arrangement = self._arrangement(index)
            for side in self._order(index):
                plan = stage.BatchPlan.draw(self._rng, self.schedule.samples)
                reply = arrangement[side].call(
                    "measure", side=side, samples=self.schedule.samples, variants=plan.variants, checked=plan.checked
                )
                batch[side] += reply["samples_s"]
                if not self._stage.check_batch(evidence_key(side, at), plan):
                    result.rejected_batches.append(f"round {index}, {side}: output")
                if min(reply["samples_s"]) < fastest_s:
                    result.rejected_batches.append(f"round {index}, {side}: faster than the roofline")
            result.cand_rounds_s.append(statistics.median(batch["candidate"]))
            result.cand_samples_s += batch["candidate"]
            if self.ab:
                result.base_rounds_s.append(statistics.median(batch["base"]))

    def measure_kernel(self, case: PerfCase) -> KernelResult:
        """Measure one case on both sides (and the reference implementations in this process)."""
        t0 = time.perf_counter()
        result = KernelResult(case)
        agree = self._prepare(case)
        try:
            if self.ab or self._stage.own_reference:  # judged against a reference of its own even alone
                result.prepared_agree = agree
            if case.kind not in self.host_overhead_us and case.numel <= HOST_CASE_ELEMENTS:
                overhead = self.workers["candidate"].call("host_overhead", side="candidate")
                self.host_overhead_us[case.kind] = overhead
            self._rounds(result, self.schedule.rounds)
            if self.references:
                calls = self._stage.reference_calls(list(REFERENCES), case.bytes_moved())
                stop = gpu_timer.StopRule(budget_s=0.2)
                result.references_s = {name: self.timer.measure_with(fn, stop).median_s for name, fn in calls.items()}
        finally:
            self._release()
        result.wall_s = time.perf_counter() - t0
        self.kernel[case.id] = result
        return result

    def _release(self) -> None:
        """The sides drop the lent buffers before the judge frees them."""
        for worker in self.processes:
            worker.call("release")
        self._stage = None
        torch.cuda.synchronize(self.device)
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()

    # -- end-to-end -------------------------------------------------------------------------------
    @property
    def _e2e_processes(self) -> list[Worker]:
        """The first arrangement's processes: the report-only step is not timed in the others."""
        return distinct(self.workers.values())

    def measure_e2e(self) -> E2EResult:
        """The QLoRA step on both sides, ABBA rounds of wall-timed steps. Report-only."""
        from harness.correctness import qlora

        checkpoint = str(Path(self._tmp) / "llama-checkpoint")
        result = E2EResult(E2E_STEP)
        try:
            qlora.save_random_llama(checkpoint)
            for worker in self._e2e_processes:
                worker.call("e2e_prepare", checkpoint=checkpoint)
            for index in range(self.schedule.e2e_rounds):
                batch: dict[str, list[float]] = {"base": [], "candidate": []}
                for side in self._order(index):
                    steps = self.workers[side].call("e2e_measure", side=side, steps=self.schedule.e2e_steps)
                    batch[side] += steps["samples_s"]
                result.cand_rounds_s.append(statistics.median(batch["candidate"]))
                result.cand_samples_s += batch["candidate"]
                if self.ab:
                    result.base_rounds_s.append(statistics.median(batch["base"]))
        finally:
            for worker in self._e2e_processes:
                worker.call("e2e_release")
            shutil.rmtree(checkpoint, ignore_errors=True)
        self.e2e[result.case] = result
        return result

    # -- verdicts ---------------------------------------------------------------------------------
    def _evidence(self) -> dict:
        return {cid: (r.paired, policy.size_class(r.case.numel)) for cid, r in self.kernel.items()}

    def settle(self) -> dict[str, gate.Judgement]:
        """Judge every kernel case; re-measure the AMBIGUOUS and NOT_SLOWER ones with more rounds
        until each is decided or has ``Schedule.max_rounds``; judge again. A/B sessions only."""
        if not self.ab or not self.kernel:
            return {}
        while True:
            self.judgements = gate.judge(self._evidence())
            extra = {c: n for c, j in self.judgements.items() if (n := gate.rounds_to_add(j, self.schedule))}
            if not extra:
                return self.judgements
            for cid, count in extra.items():
                result = self.kernel[cid]
                t0 = time.perf_counter()
                self._prepare(result.case)
                self._rounds(result, count)
                self._release()
                result.wall_s += time.perf_counter() - t0

    def medians_us(self) -> dict[str, float]:
        return {cid: r.candidate_us for cid, r in self.kernel.items()}

    def record(self) -> dict:
        """This session's contribution to a stored baseline."""
        numels = {cid: r.case.numel for cid, r in self.kernel.items()}
        return baseline.session_record(
            self.gpu, gpu_info.software_versions(), self.medians_us(), numels, self.timer_floor_us
        )

    def describe_sides(self) -> list[str]:
        lines = [f"candidate: {sides.describe(self.candidate_root)}"]
        if self.ab:
            lines.insert(0, f"base (judge): {sides.describe(self.base_root)}")
        return lines

    def close(self) -> None:
        for worker in self.processes:
            worker.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
        after = tree_guard.fingerprint(self._guarded, self._unguarded)
        self.judge_changed = tree_guard.changed(self._fingerprint, after)
        sys.pycache_prefix = self._pycache_prefix
