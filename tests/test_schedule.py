"""The static schedule (``harness.compile_check.schedule``): reading nvdisasm's SASS, finding a
loop's main path and each global load's lead; and, on the NVRTC cubins (no GPU), the pair-table
kernel's design rules: every load of a step issued a step ahead of its first use, and no shuffle
guarded against divergence."""

from __future__ import annotations

import functools

import pytest

from harness.compile_check import schedule
from harness.runtime import matmul_kernel, ops


def _sass(body: list[str]) -> str:
    lines, address = [], 0
    for item in body:
        if item.endswith(":"):
            lines.append(item)
        else:
            lines.append(f"        /*{address:04x}*/                   {item} ;")
            address += 16
    return "\n".join(lines)


FILLER = ["IADD3 R30, R30, 0x1, RZ"] * 60
# One loop: a 16-byte load its next step reads first (PRMT at the top), an 8-byte load this step
# reads (STG of R10.64), a block the main path jumps over (it reads R4 at once), a conditional branch
# that stays on the path.
SASS = _sass(
    [
        "MOV R1, c[0x0][0x28]",
        ".L_x_1:",
        "PRMT R9, R5, 0x1, R4",
        *FILLER[:10],
        "LDG.E.128 R4, desc[UR4][R2.64]",
        "LDG.E.64 R10, desc[UR4][R12.64+0x10]",
        *FILLER[:20],
        "@P0 BRA `(.L_x_1)",
        "STG.E desc[UR4][R10.64], R0",
        *FILLER[:20],
        "BRA `(.L_x_2)",
        "FADD R8, R6, R8",
        ".L_x_2:",
        *FILLER[:5],
        "@!P1 BRA `(.L_x_1)",
        "EXIT",
    ]
)


def test_the_parser_finds_the_loop_its_main_path_and_each_loads_lead():
    sass = schedule.parse(SASS)
    (loop,) = schedule.loops(sass)
    assert (loop.top, loop.back_edge) == (1, len(sass.instructions) - 2)
    path = loop.main_path(sass)
    skipped = next(i for i, ins in enumerate(sass.instructions) if ins.opcode == "FADD")
    assert skipped not in path and path[0] == loop.top and path[-1] == loop.back_edge
    first, second = schedule.leads(sass, loop)
    # The 16-byte load: read at the top of the next step (the skipped FADD reads it sooner, off the path).
    assert first.load.startswith("LDG.E.128 R4") and first.next_step
    assert first.position + first.lead == len(path)
    # The 8-byte load: its register pair is read by the STG in the same step, after the conditional branch.
    assert second.load.startswith("LDG.E.64 R10") and not second.next_step and second.lead == 20 + 1 + 1


def _high_word(stall=1, yield_=True, write=7, read=7, waits=()):
    """An encoding's high 64-bit word with these control fields (the low 41 bits: arbitrary)."""
    bits = stall | yield_ << 4 | write << 5 | read << 8 | sum(1 << (11 + b) for b in waits)
    return (bits << 41) | 0x1E2D3C4B5A


def test_the_control_fields_decode_from_the_high_word():
    control = schedule.Control.from_high_word(_high_word(stall=4, yield_=False, write=5, read=2, waits=(0, 3)))
    assert control == schedule.Control(stall=4, yield_=False, write_barrier=5, read_barrier=2, waits=frozenset({0, 3}))
    # 7 is "no scoreboard"; a word nvdisasm printed for an FFMA with no barriers and a stall of 1.
    assert schedule.Control.from_high_word(0x000FE20000000004) == schedule.Control(1, True, None, None, frozenset())


def _hex_sass(body: list[tuple[str, int]]) -> str:
    """nvdisasm -hex style: each instruction with its low word, its high word on the next line."""
    lines = []
    for n, (text, high) in enumerate(body):
        lines.append(f"        /*{16 * n:04x}*/                   {text} ;   /* 0x000000ff00007981 */")
        lines.append(f"                                                   /* 0x{high:016x} */")
    return "\n".join(lines)


def test_a_wait_on_the_loads_scoreboard_before_their_reader_is_where_the_load_is_waited_for():
    """A load on scoreboard 5 whose first reader comes 40 instructions on, behind a branch at 10
    that waits on scoreboard 5: the step stalls at the branch, so the load's deadline is 10."""
    body = [("LDG.E.128 R4, desc[UR4][R2.64]", _high_word(write=5, read=1))]
    body += [("IADD3 R30, R30, 0x1, RZ", _high_word())] * 9
    body += [("@P0 BRA `(.L_x_9)", _high_word(waits=(1, 5)))]
    body += [("IADD3 R30, R30, 0x1, RZ", _high_word())] * 29
    body += [("PRMT R9, R5, 0x1, R4", _high_word())]
    sass = schedule.parse(_hex_sass(body))
    assert sass.instructions[0].control.write_barrier == 5
    loop = schedule.Loop(0, len(sass.instructions) - 1)
    (lead,) = schedule.leads(sass, loop)
    assert (lead.lead, lead.scoreboard, lead.waited) == (40, 5, 10)
    (wait,) = schedule.load_waits(sass, loop)
    assert (wait.position, wait.scoreboards) == (10, frozenset({5}))
    # Without the encodings (plain nvdisasm -c) the same listing has no control fields and no waits.
    plain = schedule.parse(_sass([text for text, _ in body]))
    assert all(ins.control is None for ins in plain.instructions)
    (plain_lead,) = schedule.leads(plain, loop)
    assert plain_lead.scoreboard is None and plain_lead.waited is None and not schedule.load_waits(plain, loop)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_decoded_scoreboards_fit_what_each_instruction_is(arch):
    """A check of the field layout on real code: in the pair-table kernel every global load sets a
    write scoreboard (its result lands after a variable latency) and no fixed-latency arithmetic
    (FFMA, IADD3, LOP3, PRMT, HMMA) sets one; a wrong layout would put random bits in both."""
    sass = _variant_sass("mm4-nf4-bf16-nested-m8-w4-few", arch)
    loads = [ins for ins in sass.instructions if ins.global_load()]
    fixed = [ins for ins in sass.instructions if ins.opcode.split(".")[0] in ("FFMA", "IADD3", "LOP3", "PRMT", "HMMA")]
    assert loads and fixed and all(ins.control is not None for ins in sass.instructions)
    assert all(ins.control.write_barrier is not None for ins in loads)
    assert all(ins.control.write_barrier is None for ins in fixed)


def test_a_register_pair_and_a_predicate_are_read_as_such():
    ins = schedule.parse(_sass(["@!P2 STG.E.64 desc[UR4][R6.64], R8"])).instructions[0]
    assert ins.predicate == "@!P2" and ins.opcode == "STG.E.64"
    assert ins.registers_read() == {6, 7, 8}
    load = schedule.parse(_sass(["@!P4 LDG.E.EF.128 R36, desc[UR22][R16.64]"])).instructions[0]
    assert load.global_load() == {36, 37, 38, 39} and load.registers_read() == {16, 17}
    assert not schedule.parse(_sass(["LDS R52, [R52+UR5]"])).instructions[0].global_load()


# Every build of the pair-table kernel, by its source (its 8-, 16- and 32-token tiles, the few-rows
# build and its columns form).
PAIR_TABLE_VARIANTS = [
    (arch, name)
    for arch in ("sm_80", "sm_90")
    for name, spec in ops.compile_specs(arch)
    if spec.source.name == matmul_kernel.SOURCE_M8_PAIRS
]


@functools.cache
def _variant_sass(name: str, arch: str) -> schedule.Sass:
    """A pair-table build's SASS, disassembled once a test process for the tests that read it."""
    return schedule.variant_sass(name, arch)


def _step_loops(sass):
    """The pair-table kernel's step loops: those that stream weights (evict-first global loads)."""
    return [
        loop for loop in schedule.loops(sass) if any("LDG.E.EF" in lead.load for lead in schedule.leads(sass, loop))
    ]


@pytest.mark.parametrize(("arch", "name"), PAIR_TABLE_VARIANTS)
def test_the_pair_table_kernel_issues_every_load_of_a_step_a_step_ahead(arch, name):
    """kernels/matmul_4bit_m8_pairs.cu refills a step's registers with the next step's weights and
    scale codes as it goes, so that every load has a step of decoding to arrive in: in each of its
    step loops (those that load weights), no global load may be first read in its own step. A
    version of the columns path that held every word's table addresses first broke this (the
    compiler copied the loaded registers at the step's end; kernels/NOTES.md, "Chunks as mma
    columns"), and no GPU was needed to see it."""
    sass = _variant_sass(name, arch)
    step_loops = _step_loops(sass)
    assert len(step_loops) == 3, "one step loop for each of the kernel's chunk widths (16-, 8- and 4-byte loads)"
    for loop in step_loops:
        same_step = [lead for lead in schedule.leads(sass, loop) if not lead.next_step]
        assert not same_step, (loop, same_step)


@pytest.mark.parametrize(("arch", "name"), [(a, n) for a, n in PAIR_TABLE_VARIANTS if "-few" not in n])
def test_the_pair_table_kernel_waits_for_its_loads_where_it_reads_them(arch, name):
    """Every global load of a step loop shares one scoreboard, so the step's first wait on it is a
    wait for all of them: the loads' real deadline. The activation staging copies with predicated
    instructions (kernels/matmul_4bit_common.cuh, cp_async16_rows) because a branch around a copy
    put that wait at the branch, 6-15 instructions into the step, before anything of it had run.
    So each step loop's first wait on its loads must be at an instruction that reads a loaded
    register, or after the step's activation copies have all been issued. (Not the few-rows build nor
    its columns form, which keep the branch so that their warps with no row skip their copies.)"""
    sass = _variant_sass(name, arch)
    step_loops = _step_loops(sass)
    assert step_loops
    for loop in step_loops:
        path = loop.main_path(sass)
        loaded = set().union(*(sass.instructions[i].global_load() for i in path))
        copies = [k for k, i in enumerate(path) if sass.instructions[i].opcode.startswith("LDGSTS")]
        first = schedule.load_waits(sass, loop)[0]
        reads = bool(sass.instructions[path[first.position]].registers_read() & loaded)
        assert reads or first.position > max(copies), (loop, first, copies)


def test_a_collective_guarded_against_divergence_is_found():
    guarded = _sass(
        [
            "UMOV UR10, 0xffffffff",
            "BRA.DIV UR10, `(.L_x_2)",
            "SHFL.BFLY PT, R16, R16, 0x2, 0x1f",
            ".L_x_2:",
            "WARPSYNC.COLLECTIVE R56, `(.L_x_3)",
            "SHFL.BFLY PT, R16, R16, 0x2, 0x1f",
            "ENDCOLLECTIVE",
            ".L_x_3:",
            "SHFL.IDX PT, R168, R162, R140, 0x1f",
            "EXIT",
        ]
    )
    assert schedule.divergence_guards(schedule.parse(guarded)) == [1, 3, 5]
    assert not schedule.divergence_guards(schedule.parse(SASS))


@pytest.mark.parametrize(("arch", "name"), PAIR_TABLE_VARIANTS)
def test_the_pair_table_kernels_shuffles_run_unguarded(arch, name):
    """The pair-table kernel's shuffles (its scales to the feature pair's lanes, the traded halves of
    16-byte runs) run with the warp converged, so no build may guard one against divergence: in a
    build with two feature tiles a warp the compiler made trade_halves' selects branches around
    the shuffles, and that build ran at half speed on an H200 (kernels/NOTES.md)."""
    sass = _variant_sass(name, arch)
    guards = schedule.divergence_guards(sass)
    assert not guards, [sass.instructions[k].text for k in guards[:4]]


def test_the_command_names_the_variants_when_asked_for_one_it_does_not_have(capsys):
    with pytest.raises(SystemExit) as exit_:
        schedule.main(["mm4-no-such-variant", "--arch", "sm_90"])
    assert exit_.value.code == 2
    assert "no variant 'mm4-no-such-variant' for sm_90" in capsys.readouterr().err
