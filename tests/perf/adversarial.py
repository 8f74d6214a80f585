"""Candidates that attack the perf gate instead of being faster, built in a temporary copy of a
checkout like the planted slowdowns (``tests/perf/planted.py``). A test fixture, never a switch in
the product. Each must end in a red gate or an unchanged verdict, never a green FASTER:

    memoise       the drop-ins hand back the result they kept for the same input objects,
                  launching nothing (the timer gives every call the same objects)
    side-stream   the drop-ins run on a stream of their own that the measured one never waits
                  for, so the timed region holds no work
    reach-base    the package's ``__init__`` wraps every other copy of the drop-ins it can find
                  in its process with extra GPU work, to slow the base down
    reach-judge   the package's ``__init__`` replaces the verdicts and the exit status of every
                  copy of the gate it can find in its process with FASTER and a pass
    edit-judge    the package's ``__init__`` finds the base's checkout from the command lines
                  of its judge's measuring processes (its own and its siblings'), plants a
                  slowdown in the base's kernel source (which the base compiles on its first
                  call) and puts the file back when it exits
    redirect      the package's ``__init__`` points the process's kernel sources and compile
                  cache at a copy of its kernels with a slowed dequantization kernel, for every
                  side's compiles after it
    rescale       the package's ``__init__`` wraps its measuring process's ``op_measure`` so that
                  the base's samples read 8% longer and its own 3% shorter. Not stopped: a side's
                  code runs where its timing is taken (.github/SECURITY.md, residual risks); the
                  GPU self-test asserts it still succeeds, so the day the gate catches it the
                  test fails and the residual's line changes with it

    python -m tests.perf.adversarial DEST ATTACK
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tests.perf import planted

# Appended to the modules that define the drop-ins; NAME is the drop-in's name there.
_MEMOISE = """

# ADVERSARIAL (tests/perf/adversarial.py): hand back the first result for the same input objects.
def _adversarial_memoise(fn):
    kept = {}

    def memoised(*args, **kwargs):
        key = tuple(map(id, args)) + tuple((k, id(v)) for k, v in sorted(kwargs.items()))
        if key not in kept:
            kept[key] = fn(*args, **kwargs)
        return kept[key]

    return memoised


NAME = _adversarial_memoise(NAME)
"""

_SIDE_STREAM = """

# ADVERSARIAL (tests/perf/adversarial.py): the work on a stream the caller's never waits for.
def _adversarial_side_stream(fn):
    import torch

    streams = {}

    def elsewhere(*args, **kwargs):
        current = torch.cuda.current_stream()
        side = streams.setdefault(current.device, torch.cuda.Stream(current.device))
        side.wait_stream(current)
        with torch.cuda.stream(side):
            return fn(*args, **kwargs)

    return elsewhere


NAME = _adversarial_side_stream(NAME)
"""

# Appended to the package's __init__.
_REACH_BASE = """

# ADVERSARIAL (tests/perf/adversarial.py): slow down every other copy of the drop-ins in reach.
import harness.runtime.api as _own_api  # noqa: E402


def _adversarial_reach_base():
    import gc
    import types

    import torch

    def slowed(fn):
        def slower(*args, **kwargs):
            torch.cuda._sleep(200_000)  # about 100 µs of GPU time, on the caller's stream
            return fn(*args, **kwargs)

        return slower

    for module in [m for m in gc.get_objects() if isinstance(m, types.ModuleType)]:
        if module is _own_api:
            continue
        for entry in ("dequantize_4bit", "matmul_4bit"):
            if getattr(module, "__name__", "").startswith("harness.") and callable(getattr(module, entry, None)):
                setattr(module, entry, slowed(getattr(module, entry)))


_adversarial_reach_base()
"""

_REACH_JUDGE = """

# ADVERSARIAL (tests/perf/adversarial.py): every gate in reach says FASTER and passes.
def _adversarial_reach_judge():
    import gc
    import types

    for module in [m for m in gc.get_objects() if isinstance(m, types.ModuleType)]:
        if getattr(module, "__name__", "") == "harness.perf.gate" and hasattr(module, "Verdict"):
            judge, verdict = module.judge, module.Verdict

            def faster(evidence, judge=judge, verdict=verdict):
                import dataclasses

                return {c: dataclasses.replace(j, verdict=verdict.FASTER) for c, j in judge(evidence).items()}

            module.judge = faster
            module.exit_status = lambda *args, **kwargs: 0


_adversarial_reach_judge()
"""

_EDIT_JUDGE = """

# ADVERSARIAL (tests/perf/adversarial.py): plant a slowdown in the base's kernel source, put it back at exit.
def _adversarial_edit_judge():
    import atexit
    import pathlib
    import sys

    sys.path.insert(0, PLANTED_DIR)
    import planted

    def parent(proc):  # the 4th field of /proc/PID/stat, after the command name in parentheses
        return proc.joinpath("stat").read_bytes().rsplit(b")", 1)[1].split()[1]

    bases = set()
    for proc in pathlib.Path("/proc").iterdir():
        try:  # only this judge's measuring processes: this one and its siblings
            if not proc.name.isdigit() or parent(proc) != parent(pathlib.Path("/proc/self")):
                continue
            argv = proc.joinpath("cmdline").read_bytes().split(b"\\0")
        except OSError:
            continue
        if b"harness.perf.worker" in argv:
            sides = [argv[i + 1].decode() for i, a in enumerate(argv[:-1]) if a == b"--side"]
            bases.update(side[5:] for side in sides if side.startswith("base="))
    for base in bases:
        source = pathlib.Path(base) / "kernels" / "dequantize_4bit.cu"
        original = source.read_text()
        if "PLANTED_STRETCH" in original:  # a sibling measuring process planted it first
            continue
        source.write_text(planted.planted_source(original, 0.5))
        atexit.register(source.write_text, original)


_adversarial_edit_judge()
"""

_REDIRECT = """

# ADVERSARIAL (tests/perf/adversarial.py): every later compile in this process from slowed sources.
def _adversarial_redirect():
    import os
    import pathlib
    import shutil
    import sys
    import tempfile

    sys.path.insert(0, PLANTED_DIR)
    import planted

    slowed = pathlib.Path(tempfile.mkdtemp(prefix="nf4-redirect-")) / "kernels"
    shutil.copytree(pathlib.Path(__file__).resolve().parent.parent / "kernels", slowed)
    source = slowed / "dequantize_4bit.cu"
    source.write_text(planted.planted_source(source.read_text(), 0.5))
    os.environ["NF4_HARNESS_KERNELS_DIR"] = str(slowed)
    os.environ["NF4_HARNESS_CACHE_DIR"] = str(slowed.parent / "cache")


_adversarial_redirect()
"""

RESCALE_FACTORS = {"base": 1.08, "candidate": 0.97}  # what the rescale attack multiplies each side's samples by
_RESCALE = """

# ADVERSARIAL (tests/perf/adversarial.py): the measuring process's samples rescaled, the base's up, its own down.
def _adversarial_rescale():
    import sys

    for module in list(sys.modules.values()):
        worker = getattr(module, "Worker", None)
        if isinstance(worker, type) and hasattr(worker, "op_measure") and not hasattr(worker, "_adversarial"):

            def rescaled(self, side, *args, _measure=worker.op_measure, **kwargs):
                reply = _measure(self, side, *args, **kwargs)
                factor = FACTORS.get(side, 1.0)
                return reply | {"samples_s": [s * factor for s in reply["samples_s"]]}

            worker.op_measure, worker._adversarial = rescaled, True


_adversarial_rescale()
"""

ATTACKS = ("memoise", "side-stream", "reach-base", "reach-judge", "edit-judge", "redirect", "rescale")
_DROP_INS = ((Path("harness/runtime/api.py"), "dequantize_4bit"), (Path("harness/runtime/api.py"), "matmul_4bit"))


def build(source_root: Path, dest: Path, attack: str) -> Path:
    """Copy the checkout at ``source_root`` to ``dest`` with ``attack`` (one of ``ATTACKS``) in it."""
    root = planted.copy_checkout(source_root, dest)
    if attack in ("memoise", "side-stream"):
        wrapper = _MEMOISE if attack == "memoise" else _SIDE_STREAM
        for path, name in _DROP_INS:
            (root / path).write_text((root / path).read_text() + wrapper.replace("NAME", name))
        return root
    init = root / "harness" / "__init__.py"
    if attack == "reach-base":
        init.write_text(init.read_text() + _REACH_BASE)
    elif attack == "reach-judge":
        init.write_text(init.read_text() + _REACH_JUDGE)
    elif attack == "rescale":
        init.write_text(init.read_text() + _RESCALE.replace("FACTORS", repr(RESCALE_FACTORS)))
    elif attack in ("edit-judge", "redirect"):
        payload = _EDIT_JUDGE if attack == "edit-judge" else _REDIRECT
        init.write_text(init.read_text() + payload.replace("PLANTED_DIR", repr(str(Path(planted.__file__).parent))))
    else:
        raise ValueError(f"no such attack {attack!r}: one of {ATTACKS}")
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.perf.adversarial", description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument("attack", choices=ATTACKS)
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[2])
    args = parser.parse_args(argv)
    print(build(args.source, args.dest, args.attack))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
