"""A perf session: the base and the candidate measured side by side on one GPU, in one job.

Both sides run in one measuring process (``harness.perf.worker``) that imports each side's
checkout (``harness.perf.sides``), so each is timed through its own API, launcher and kernel, on
the same inputs in the same CUDA context; the judge (this code, the timer, the case list, the
thresholds) is the base revision's. Per case, rounds of ABBA batches (base, candidate,
candidate, base; the next round BAAB) put clock and thermal drift on both sides alike; each
round's ratio of medians is one paired observation (``stats``).

Without a base the session measures the candidate alone: the drift guard against the stored
baseline still runs, and ``--save-baseline`` records from it.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import settings
from harness.perf import baseline, gate, gpu_info, policy, sides
from harness.perf.catalog import E2E_STEP, KernelCase
from harness.perf.stats import PairedRatio

JUDGE_ROOT = Path(__file__).resolve().parent.parent.parent
REFERENCES = ("bnb_kernel", "bnb_full", "same_size_copy")


class WorkerError(RuntimeError):
    """A measuring process failed; the message carries its traceback."""


class Worker:
    """The driver's end of the measuring process."""

    def __init__(self, side_roots: dict[str, Path]):
        env = {k: v for k, v in os.environ.items() if k != settings.KERNELS_DIR.name}  # each side its own kernels/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(JUDGE_ROOT), env.get("PYTHONPATH")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        sides_args = [a for name, root in side_roots.items() for a in ("--side", f"{name}={root}")]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "harness.perf.worker", *sides_args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=JUDGE_ROOT,  # `-m` puts the working directory first on the path: the judge's harness
            env=env,
        )
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
    case: KernelCase
    base_rounds_s: list[float] = field(default_factory=list)  # per-round median, base side
    cand_rounds_s: list[float] = field(default_factory=list)  # per-round median, candidate side
    cand_samples_s: list[float] = field(default_factory=list)  # every kept candidate sample
    # Every side's output was what the case demands (the same bits; a matmul: inside the bound).
    outputs_agree: bool | None = None
    references_s: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0  # host wall time spent on this case (inputs, rounds, references)

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
    """Owns the measuring process and every result of one session."""

    def __init__(
        self,
        candidate_root: Path,
        base_root: Path | None = None,
        schedule: policy.Schedule = policy.SCHEDULE,
        seed: int = 0,
        references: bool = True,
    ):
        self.schedule, self.seed, self.references = schedule, seed, references
        self.candidate_root, self.base_root = Path(candidate_root).resolve(), base_root and Path(base_root).resolve()
        self.gpu = gpu_info.gpu_identity(gpu_info.nvml_device(0))
        self.kernel: dict[str, KernelResult] = {}
        self.e2e: dict[str, E2EResult] = {}
        self.host_overhead_us: dict[str, float] = {}
        self.judgements: dict[str, gate.Judgement] = {}
        self.started = time.perf_counter()
        self._tmp = tempfile.mkdtemp(prefix="nf4-harness-perf-")
        roots = {"candidate": self.candidate_root} | ({"base": self.base_root} if self.base_root else {})
        self.worker = Worker(roots)
        self.copy_gbps = self.worker.call("copy_bandwidth")["gbps"]

    @property
    def ab(self) -> bool:
        return self.base_root is not None

    def _order(self, index: int) -> tuple[str, ...]:
        if not self.ab:
            return ("candidate",)
        a, b = "base", "candidate"
        return (a, b, b, a) if index % 2 == 0 else (b, a, a, b)

    # -- kernel cases ---------------------------------------------------------------------------
    def _prepare(self, case: KernelCase) -> bool:
        return self.worker.call("kernel_case", spec=case.spec(self.seed))["outputs_agree"]

    def _rounds(self, result: KernelResult, count: int) -> None:
        start = len(result.cand_rounds_s)
        for index in range(start, start + count):
            batch: dict[str, list[float]] = {"base": [], "candidate": []}
            for side in self._order(index):
                batch[side] += self.worker.call("measure", side=side, samples=self.schedule.samples)["samples_s"]
            result.cand_rounds_s.append(statistics.median(batch["candidate"]))
            result.cand_samples_s += batch["candidate"]
            if self.ab:
                result.base_rounds_s.append(statistics.median(batch["base"]))

    def measure_kernel(self, case: KernelCase) -> KernelResult:
        """Measure one case on both sides (and the reference implementations on the candidate)."""
        t0 = time.perf_counter()
        agree = self._prepare(case)
        result = KernelResult(case)
        if self.ab or case.kind == "matmul":  # a matmul is judged against its bound even alone
            result.outputs_agree = agree
        if not self.host_overhead_us and case.numel < 8_000_000:
            self.host_overhead_us = self.worker.call("host_overhead", side="candidate")
        self._rounds(result, self.schedule.rounds)
        if self.references:
            result.references_s = self.worker.call("references", names=list(REFERENCES))
        self._release()
        result.wall_s = time.perf_counter() - t0
        self.kernel[case.id] = result
        return result

    def _release(self) -> None:
        self.worker.call("release")

    # -- end-to-end -------------------------------------------------------------------------------
    def measure_e2e(self) -> E2EResult:
        """The QLoRA step on both sides, ABBA rounds of wall-timed steps. Report-only."""
        checkpoint = str(Path(self._tmp) / "llama-checkpoint")
        result = E2EResult(E2E_STEP)
        try:
            self.worker.call("e2e_prepare", checkpoint=checkpoint)
            for index in range(self.schedule.e2e_rounds):
                batch: dict[str, list[float]] = {"base": [], "candidate": []}
                for side in self._order(index):
                    steps = self.worker.call("e2e_measure", side=side, steps=self.schedule.e2e_steps)
                    batch[side] += steps["samples_s"]
                result.cand_rounds_s.append(statistics.median(batch["candidate"]))
                result.cand_samples_s += batch["candidate"]
                if self.ab:
                    result.base_rounds_s.append(statistics.median(batch["base"]))
        finally:
            self.worker.call("e2e_release")
            shutil.rmtree(checkpoint, ignore_errors=True)
        self.e2e[result.case] = result
        return result

    # -- verdicts ---------------------------------------------------------------------------------
    def _evidence(self) -> dict:
        return {cid: (r.paired, r.case.size_class) for cid, r in self.kernel.items()}

    def settle(self) -> dict[str, gate.Judgement]:
        """Judge every kernel case; re-measure the AMBIGUOUS ones with more rounds until each is
        decided or has ``Schedule.max_rounds``; judge again. A/B sessions only."""
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
        return baseline.session_record(self.gpu, gpu_info.software_versions(), self.medians_us(), numels)

    def describe_sides(self) -> list[str]:
        lines = [f"candidate: {sides.describe(self.candidate_root)}"]
        if self.ab:
            lines.insert(0, f"base (judge): {sides.describe(self.base_root)}")
        return lines

    def close(self) -> None:
        self.worker.close()
        shutil.rmtree(self._tmp, ignore_errors=True)
