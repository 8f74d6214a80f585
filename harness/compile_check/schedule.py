"""The static schedule of a compiled kernel: its loops and, on each loop's main path, how many
instructions each global load has to arrive before its value is first read (no GPU needed).

``python -m harness.compile_check.schedule mm4-nf4-bf16-nested-m8-w4-few [--arch sm_90]`` prints
it for one variant (``harness.runtime.ops.compile_specs`` names them). The SASS comes from
``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel, found by cuda-pathfinder) on the cubin NVRTC
builds, so it is the code the GPU runs. A loop's main path is its code from the top to the first
unconditional jump, then from that jump's target to the loop's back edge: the way a step goes when
no branch inside it is taken. A load's lead counts the instructions on that path from the load to
its first reader, past the back edge into the next step where the loop reads it there.

Each instruction also carries the scheduling fields the compiler wrote into its encoding (Volta and
later: the top 23 bits of the 128-bit word, decoded as published by Jia et al., "Dissecting the
NVIDIA Volta GPU Architecture via Microbenchmarking", 2018): the stall count, the scoreboard its
result will release when it lands (a variable-latency instruction's write barrier), the one that
guards its source registers, and the scoreboards it waits for before it issues. A warp that waits on
a scoreboard waits for every outstanding instruction assigned to it, so the printout lists where a
loop's main path waits on its global loads' scoreboards: the points a load-bound step stalls at.
``divergence_guards`` finds the code with which ptxas guards a warp collective it cannot prove
converged.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cuda.pathfinder import find_nvidia_binary_utility

from harness.runtime import jit, ops

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_HIGH_WORD = re.compile(r"^\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")
# The control fields' place in the encoding's high 64-bit word.
_CONTROL_SHIFT = 41
_NO_BARRIER = 7
_LABEL = re.compile(r"^\.(L_x_\d+):")
_TARGET = re.compile(r"`\(\.(L_x_\d+)\)")
_REGISTER = re.compile(r"\bR(\d+)(\.64)?\b")
# A loop shorter than this is a copy or reduction loop of a prologue or epilogue, not a step.
MIN_LOOP_INSTRUCTIONS = 50
# Opcodes whose operands are all read (no destination register first).
_READ_ALL = ("ST", "BRA", "BAR", "RED", "ATOM", "EXIT", "RET")


@dataclass(frozen=True)
class Control:
    """An instruction's scheduling fields. Scoreboards are numbered 0-5; ``None``: sets none."""

    stall: int  # cycles before the warp's next instruction may issue
    yield_: bool
    write_barrier: int | None  # released when a variable-latency result lands
    read_barrier: int | None  # released when the source registers have been read
    waits: frozenset[int]  # scoreboards that must be clear before this instruction issues

    @classmethod
    def from_high_word(cls, word: int) -> Control:
        bits = word >> _CONTROL_SHIFT
        write, read = (bits >> 5) & 7, (bits >> 8) & 7
        return cls(
            stall=bits & 15,
            yield_=bool((bits >> 4) & 1),
            write_barrier=None if write == _NO_BARRIER else write,
            read_barrier=None if read == _NO_BARRIER else read,
            waits=frozenset(b for b in range(6) if (bits >> (11 + b)) & 1),
        )


@dataclass(frozen=True)
class Instruction:
    predicate: str | None
    opcode: str
    operands: tuple[str, ...]
    control: Control | None = None  # from nvdisasm -hex; None where the listing had no encoding

    @property
    def text(self) -> str:
        return " ".join(filter(None, (self.predicate, self.opcode, ", ".join(self.operands))))

    def registers_read(self) -> set[int]:
        sources = self.operands if self.opcode.startswith(_READ_ALL) else self.operands[1:]
        return {r for operand in sources for r in _registers(operand)}

    def global_load(self) -> set[int]:
        """The registers a global load (LDG) writes; empty for any other instruction."""
        if not self.opcode.startswith("LDG.") or not self.operands:
            return set()
        first = int(_REGISTER.match(self.operands[0]).group(1))
        width = 4 if ".128" in self.opcode else 2 if ".64" in self.opcode else 1
        return set(range(first, first + width))


def _registers(operand: str) -> set[int]:
    out = set()
    for m in _REGISTER.finditer(operand):
        first = int(m.group(1))
        out |= {first, first + 1} if m.group(2) else {first}
    return out


@dataclass(frozen=True)
class Sass:
    instructions: tuple[Instruction, ...]
    labels: dict[str, int]  # label -> index of the instruction it marks


def parse(text: str) -> Sass:
    """``nvdisasm -c [-hex]`` output: its instructions in order (with their control fields where
    the listing has the encoding: ``-hex`` puts the high word on the line after the instruction)
    and where each label points."""
    instructions, labels = [], {}
    for line in text.splitlines():
        if m := _LABEL.match(line.strip()):
            labels[m.group(1)] = len(instructions)
        elif m := _INSTRUCTION.match(line):
            body = m.group(2)
            predicate = None
            if body.startswith("@"):
                predicate, body = body.split(None, 1)
            opcode, _, rest = body.partition(" ")
            operands = tuple(o.strip() for o in rest.split(",")) if rest.strip() else ()
            instructions.append(Instruction(predicate, opcode, operands))
        elif (m := _HIGH_WORD.match(line)) and instructions and instructions[-1].control is None:
            control = Control.from_high_word(int(m.group(1), 16))
            instructions[-1] = dataclasses.replace(instructions[-1], control=control)
    return Sass(tuple(instructions), labels)


@dataclass(frozen=True)
class Loop:
    top: int  # index of its first instruction
    back_edge: int  # index of the branch back to the top

    def main_path(self, sass: Sass) -> list[int]:
        for i in range(self.top, self.back_edge):
            ins = sass.instructions[i]
            if ins.opcode.startswith("BRA") and ins.predicate is None:
                target = sass.labels[_TARGET.search(ins.text).group(1)]
                if self.top <= target <= self.back_edge:
                    return [*range(self.top, i), *range(target, self.back_edge + 1)]
        return list(range(self.top, self.back_edge + 1))


def loops(sass: Sass) -> list[Loop]:
    """Every backward branch over at least ``MIN_LOOP_INSTRUCTIONS``, in code order."""
    out = []
    for i, ins in enumerate(sass.instructions):
        if ins.opcode.startswith("BRA") and (m := _TARGET.search(ins.text)):
            top = sass.labels[m.group(1)]
            if top <= i - MIN_LOOP_INSTRUCTIONS:
                out.append(Loop(top, i))
    return out


@dataclass(frozen=True)
class Lead:
    load: str  # the load's text
    position: int  # its place on the main path
    lead: int  # instructions on the path from the load to its first reader
    path_length: int
    scoreboard: int | None = None  # the one its result releases (None: no encodings in the listing)
    # instructions to the first wait on its scoreboard, at or before the first reader (None: none
    # there, or no encodings): the warp stalls there until this load and every other on it landed
    waited: int | None = None

    @property
    def next_step(self) -> bool:
        """Whether the first reader comes after the back edge: the load has the rest of this step
        and the start of the next to arrive in."""
        return self.position + self.lead >= self.path_length


def leads(sass: Sass, loop: Loop) -> list[Lead]:
    """Each global load on the loop's main path, with its lead and the first wait on its scoreboard
    (none where nothing reads it)."""
    path = loop.main_path(sass)
    out = []
    for k, i in enumerate(path):
        written = sass.instructions[i].global_load()
        if not written:
            continue
        control = sass.instructions[i].control
        board = control.write_barrier if control else None
        waited = None
        for step in range(1, len(path) + 1):
            ins = sass.instructions[path[(k + step) % len(path)]]
            if waited is None and board is not None and ins.control and board in ins.control.waits:
                waited = step
            if ins.registers_read() & written:
                out.append(Lead(sass.instructions[i].text, k, step, len(path), board, waited))
                break
    return out


@dataclass(frozen=True)
class Wait:
    position: int  # on the main path
    text: str
    scoreboards: frozenset[int]  # of those the loop's global loads set


def load_waits(sass: Sass, loop: Loop) -> list[Wait]:
    """Where the loop's main path waits on a scoreboard that one of its global loads sets: each
    such wait is for every load outstanding on that scoreboard, not only the one it reads."""
    path = loop.main_path(sass)
    boards = {
        sass.instructions[i].control.write_barrier
        for i in path
        if sass.instructions[i].global_load() and sass.instructions[i].control
    } - {None}
    out = []
    for k, i in enumerate(path):
        ins = sass.instructions[i]
        if ins.control and ins.control.waits & boards:
            out.append(Wait(k, ins.text, ins.control.waits & boards))
    return out


# What ptxas emits around a warp collective (a shuffle, a vote) it cannot prove the warp reaches
# converged: a branch taken when the warp has diverged (BRA.DIV) to a copy run under
# WARPSYNC.COLLECTIVE ... ENDCOLLECTIVE. The fused kernels' collectives all run converged; guarded,
# they ran a build of the pair-table kernel at half speed on an H200 (the compiler had made a
# select around its shuffles a branch: kernels/NOTES.md, "Two feature tiles a warp at 16 tokens").
DIVERGENCE_GUARDS = ("BRA.DIV", "WARPSYNC", "ENDCOLLECTIVE")


def divergence_guards(sass: Sass) -> list[int]:
    """Indices of the instructions with which the code guards a collective against divergence."""
    return [k for k, ins in enumerate(sass.instructions) if ins.opcode.startswith(DIVERGENCE_GUARDS)]


def nvdisasm() -> str:
    path = find_nvidia_binary_utility("nvdisasm")
    if path is None:
        raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (the compile dependency group)")
    return path


def disassemble(cubin: bytes) -> Sass:
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "kernel.cubin"
        file.write_bytes(cubin)
        text = subprocess.run([nvdisasm(), "-c", "-hex", str(file)], capture_output=True, text=True, check=True).stdout
    return parse(text)


def variant_sass(name: str, arch: str) -> Sass:
    """The SASS of a variant (``ops.compile_specs`` name) for ``arch``, through the compile cache."""
    specs = dict(ops.compile_specs(arch))
    if name not in specs:
        raise KeyError(f"no variant {name!r} for {arch}; variants: {', '.join(sorted(specs))}")
    return disassemble(jit.compile_kernel(specs[name]).cubin)


def describe(sass: Sass) -> str:
    lines = []
    for n, loop in enumerate(loops(sass)):
        path = loop.main_path(sass)
        lines.append(f"loop {n}: instructions {loop.top}..{loop.back_edge}, main path {len(path)}")
        for lead in leads(sass, loop):
            where = "next step" if lead.next_step else "same step"
            board = "" if lead.scoreboard is None else f"  sb {lead.scoreboard}"
            waited = "" if lead.waited is None else f", waited for after {lead.waited}"
            lines.append(f"  {lead.position:5d}  {lead.load:60.60s}  lead {lead.lead:4d} ({where}){board}{waited}")
        for wait in load_waits(sass, loop):
            boards = ",".join(map(str, sorted(wait.scoreboards)))
            lines.append(f"  {wait.position:5d}  {wait.text:60.60s}  waits for the loads on sb {boards}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.compile_check.schedule", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("variant", help="a variant's name, e.g. mm4-nf4-bf16-nested-m8-w4-few")
    parser.add_argument("--arch", default="sm_90")
    args = parser.parse_args(argv)
    try:
        sass = variant_sass(args.variant, args.arch)
    except KeyError as e:
        parser.error(e.args[0])
    print(describe(sass))
    return 0


if __name__ == "__main__":
    sys.exit(main())
