"""The fused matmul kernels' data movement, lane by lane, in Python: which bytes each lane of a warp
loads, how it turns them into mma fragments, and where the accumulators land, transcribed from
kernels/matmul_4bit.cu (``WIDE``, token tiles of 16 or more), kernels/matmul_4bit_m8.cu (``M8``,
its prmt table lookups included), kernels/matmul_4bit_m8_pairs.cu (``M8P_64`` and ``M8P_32``:
chunks of 64 or 32 k, the pair table's lookups included; ``_A``: the 16-token tile's activation
rows on 128-byte lines; ``emulate_pair_columns``: its columns
build, MM_COLUMNS) and kernels/matmul_4bit_sm90.cu (WIDE's lanes, its pair table from 64 tokens:
``SM90_PAIRS``); the mma itself is assembled from its
fragments by the layout the PTX ISA states for mma.m16n8k16 (.row.col, 16-bit inputs, fp32
accumulators).

It proves the kernels' index arithmetic (the k permutation shared by both operands, the nibble
order, the table lookups, the activation tile's staging and padded slots, the fragment slots,
the epilogue) without a GPU; it cannot prove the compiled code.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.runtime import jit
from harness.runtime.matmul_kernel import COLUMNS_ROWS, STEP_K_M8, STEP_K_WIDE


def a_fragment_position(lane: int, reg: int, half: int) -> tuple[int, int]:
    """(row, col) of operand A (16 x 16) held by ``lane`` in register ``reg``, half ``half``."""
    g, t = lane // 4, lane % 4
    row = g + 8 * (reg % 2)
    col = 2 * t + half + 8 * (reg // 2)
    return row, col


def b_fragment_position(lane: int, reg: int, half: int) -> tuple[int, int]:
    """(k, n) of operand B (16 x 8) held by ``lane`` in register ``reg``, half ``half``."""
    g, t = lane // 4, lane % 4
    return 2 * t + half + 8 * reg, g


def c_fragment_position(lane: int, index: int) -> tuple[int, int]:
    """(row, col) of the accumulator (16 x 8) held by ``lane`` at ``index`` (0-3)."""
    g, t = lane // 4, lane % 4
    return g + 8 * (index // 2), 2 * t + index % 2


def decode_pair(pair: int, scale: float, code: list[float]) -> tuple[float, float, float, float]:
    """The kernel's decode_frag for one feature: values at k+0, k+1 (byte 2j) and k+2, k+3 (byte 2j+1)."""
    return (
        code[(pair >> 4) & 0xF] * scale,
        code[pair & 0xF] * scale,
        code[(pair >> 12) & 0xF] * scale,
        code[(pair >> 8) & 0xF] * scale,
    )


def byte_perm(a: int, b: int, selector: int) -> int:
    """prmt.b32 as PTX states it: byte i of the result is byte (nibble i of the selector) & 7 of
    the 8 bytes {b, a} (a's bytes first), or, where the nibble's top bit is set, that byte's sign
    bit replicated."""
    source = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    out = []
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = source[nibble & 7]
        out.append((0xFF if byte & 0x80 else 0) if nibble & 8 else byte)
    return int.from_bytes(bytes(out), "little")


def _m8_constants() -> dict[str, int]:
    """The byte-permute selectors and masks of kernels/matmul_4bit_m8.cu, read from its source, so
    this transcription runs the kernel's own constants: a changed constant there changes here."""
    text = (jit.kernels_dir() / "matmul_4bit_m8.cu").read_text()
    patterns = {
        "table": r"tb\.lo\[i\] = prmt\(p, q, (0x[0-9a-f]+)\);\s+tb\.hi\[i\] = prmt\(p, q, (0x[0-9a-f]+)\);",
        "pair": r"w01 = prmt\(lo, hi, (0x[0-9a-f]+)\);\s+w23 = prmt\(lo, hi, (0x[0-9a-f]+)\);",
        "low3": r"low3 = x & (0x[0-9a-f]+)u;",
        "pick": r"pick = lop3_and_or\(shr_mul\(x, 1\), (0x[0-9a-f]+)u, (0x[0-9a-f]+)u\);",
    }
    found = {}
    for name, pattern in patterns.items():
        match = re.search(pattern, text)
        assert match, f"kernels/matmul_4bit_m8.cu no longer has its {name} constants where this reads them"
        found |= {f"{name}{i}": int(v, 16) for i, v in enumerate(match.groups())}
    return found


M8_CONSTANTS = _m8_constants()


def _source_expression(file: str, pattern: str, names: str) -> Callable[..., int]:
    """An integer expression of a kernel source (C and Python agree on the precedence of the
    operators these use: * + << >> & ^ |), as a function of ``names``: this transcription runs the
    kernel's own index arithmetic. C's unsigned literals (8u), scope operator (S::run) and a
    parenthesised ternary (a ? b : c) are read as Python's."""
    match = re.search(pattern, (jit.kernels_dir() / file).read_text())
    assert match, f"kernels/{file} no longer has the expression this reads ({pattern})"
    expression = re.sub(r"\b(0x[0-9a-fA-F]+|\d+)u\b", r"\1", match.group(1))
    expression = expression.replace("ln.", "").replace("::", ".").replace("/", "//")  # C's / on ints is Python's //
    expression = re.sub(r"\(([^()?]+) \? ([^():]+) : ([^()]+)\)", r"(\2 if \1 else \3)", expression)
    return eval(f"lambda {names}: {expression}")  # the repository's own source


_M8P = "matmul_4bit_m8_pairs.cu"
_M8P_SOURCE = (jit.kernels_dir() / _M8P).read_text()


def _m8p_define(name: str) -> int:
    match = re.search(rf"^#define {name} (\d+)", _M8P_SOURCE, re.MULTILINE)
    assert match, f"kernels/{_M8P} no longer defines {name} where this reads it"
    return int(match.group(1))


# kernels/matmul_4bit_common.cuh's addressing of the tables of code pairs (pair_addresses' byte masks,
# pair_offset's selector for byte b) and kernels/matmul_4bit_m8_pairs.cu's table: its size, the
# lane's offset and the entry each stored word holds, read from the sources.
_COMMON = "matmul_4bit_common.cuh"
PAIR_ROWS, PAIR_ROW_WORDS = _m8p_define("PAIR_ROWS"), _m8p_define("PAIR_ROW_WORDS")
_PAIR_MASKS = re.search(
    r"return \{x & (0x[0-9a-f]+)u, lop3_and_or\(x, (0x[0-9a-f]+)u, lane_bytes\)\};",
    (jit.kernels_dir() / _COMMON).read_text(),
)
assert _PAIR_MASKS, f"kernels/{_COMMON} no longer has pair_addresses' masks where this reads them"
LOW7_MASK, TOP_MASK = (int(v, 16) for v in _PAIR_MASKS.groups())
PAIR_SELECTOR = _source_expression(_COMMON, r"constexpr u32 sel = ([^;]+);", "kByte")
LANE_BYTES = _source_expression(_M8P, r"const u32 lane_bytes = \(threadIdx\.x & 31\) \* ([^;]+);", "")()
_PAIR_ENTRY = _source_expression(_M8P, r"int pair_entry\(int row, int quarter\) \{ return ([^;]+); \}", "row, quarter")
# stage_pair_table: thread x's quarter and first row, the two low nibbles it loads once, the high
# nibble of iteration m, and the slot iteration (m, s) stores.
_BUILD_QUARTER = _source_expression(_M8P, r"const int x = threadIdx\.x, quarter = ([^,]+), row0 = [^;]+;", "x")
_BUILD_ROW0 = _source_expression(_M8P, r"const int x = threadIdx\.x, quarter = [^,]+, row0 = ([^;]+);", "x")
_BUILD_LOWS = [
    _source_expression(_M8P, rf"const float low\[2\] = \{{{head}code_of\(([^;]*?)\)[,}}]", "row0, quarter, pair_entry")
    for head in ("", r"code_of\([^;]*?\), ")
]
_BUILD_HIGH = _source_expression(_M8P, r"const float high = code_of\(([^;]+)\);", "m, row0, quarter, pair_entry")
_BUILD_SLOT = _source_expression(_M8P, r"reinterpret_cast<uint4\*>\(table\)\[([^\]]+)\] = make_uint4", "x, m, s")


def pair_table() -> list[int]:
    """stage_pair_table as the threads of a block run it: the entry (packed byte) each 4-byte word
    of the table holds, from each store's two nibbles. Every slot is stored once."""
    slots: list[int | None] = [None] * (PAIR_ROWS * PAIR_ROW_WORDS // 4)
    for x in range(len(slots) // 16):
        quarter, row0 = _BUILD_QUARTER(x), _BUILD_ROW0(x)
        lows = [low(row0, quarter, _PAIR_ENTRY) for low in _BUILD_LOWS]
        for m in range(8):
            high = _BUILD_HIGH(m, row0, quarter, _PAIR_ENTRY)
            for s in range(2):
                slot = _BUILD_SLOT(x, m, s)
                assert slots[slot] is None, f"slot {slot} stored twice"
                slots[slot] = high << 4 | lows[s]
    assert None not in slots, "a slot of the table never stored"
    return [entry for entry in slots for _ in range(4)]


def pair_table_as_defined() -> list[int]:
    """The table as pair_entry defines it: slot i (4 words) holds entry pair_entry(i / 16, i % 16)."""
    quarters = PAIR_ROW_WORDS // 4
    return [_PAIR_ENTRY(i // quarters, i % quarters) for i in range(PAIR_ROWS * quarters) for _ in range(4)]


PAIR_TABLE = pair_table()


def pair_address(word: int, byte: int, lane: int, lane_bytes: int | None = None) -> int:
    """The byte address (from the table's start) pair_offset<byte> gives ``lane``, whose offset in
    every byte is ``lane_bytes`` (the pair-table kernel's, lane * LANE_BYTES, unless given)."""
    low7, top = word & LOW7_MASK, (word & TOP_MASK) | (lane * LANE_BYTES if lane_bytes is None else lane_bytes)
    return byte_perm(low7, top, PAIR_SELECTOR(byte))


def decode_pairs(word: int, scale: float, code: list[float], lane: int = 0) -> list[float]:
    """Eight weights of one 32-bit word of packed codes in k order, through the pair table: byte
    b's entry gives (code of its high nibble, code of its low nibble)."""
    values = []
    for byte in range(4):
        address = pair_address(word, byte, lane)
        assert address % 4 == 0 and address // 4 < len(PAIR_TABLE)
        entry = PAIR_TABLE[address // 4]
        values += [code[entry >> 4] * scale, code[entry & 0xF] * scale]
    return values


# The activation tile: chunk c (8 k) of token row r sits at this slot, for writes and reads alike,
# and a tile of t tokens takes this many slots; each kernel has its own.
def _act_slot(file: str) -> Callable[[int, int, int], int]:
    return _source_expression(
        file, r"int act_slot\(int row, int c, int row_chunks\) \{\s+return ([^;]+);", "row, c, row_chunks"
    )


def _tile_slots(file: str) -> Callable[[int, int], int]:
    """Slots of one stage; the pair-table kernel's tile rows (ACT_TILE_ROWS) are read into it as written."""
    slots = _source_expression(
        file,
        r"#define ACT_TILE_SLOTS (\(.+\))  //",
        "MM_TOKENS, ACT_ROW_CHUNKS, MM_COLUMNS=0, ALIGNED_ROWS=0, MM_FEW_ROWS=0, ACT_TILE_ROWS=None",
    )
    if "#define ACT_TILE_ROWS" not in (jit.kernels_dir() / file).read_text():
        return slots
    rows = _tile_rows(file)

    def of(MM_TOKENS, ACT_ROW_CHUNKS, MM_COLUMNS=0, ALIGNED_ROWS=0, MM_FEW_ROWS=0):  # the macros' names
        tile_rows = rows(MM_TOKENS, MM_COLUMNS, MM_FEW_ROWS)
        return slots(MM_TOKENS, ACT_ROW_CHUNKS, MM_COLUMNS, ALIGNED_ROWS, MM_FEW_ROWS, tile_rows)

    return of


def _tile_rows(file: str) -> Callable[[int, int, int], int]:
    """Token rows a stage of the activation tile holds (the pair-table kernel's ACT_TILE_ROWS)."""
    return _source_expression(file, r"#define ACT_TILE_ROWS (\(.+\))\n", "MM_TOKENS, MM_COLUMNS, MM_FEW_ROWS")


# The chunk each lane reads for its mma j, as each kernel writes it.
_WIDE_CHUNK = _source_expression("matmul_4bit.cu", r"tile\[act_slot\(8 \* i \+ g, ([^,]+), ACT_ROW_CHUNKS\)\]", "t, q")
_M8_CHUNK = _source_expression(
    "matmul_4bit_m8.cu", r"tile\[act_slot\(8 \* i \+ ln\.g, ([^,]+), ACT_ROW_CHUNKS\)\]", "t, h, v"
)


def make_table(entries: list[int]) -> tuple[list[int], list[int]]:
    """The kernel's make_table on 16 16-bit patterns: (low-byte registers, high-byte registers)."""
    lo, hi = [], []
    for i in range(4):
        p = entries[4 * i] | entries[4 * i + 1] << 16
        q = entries[4 * i + 2] | entries[4 * i + 3] << 16
        lo.append(byte_perm(p, q, M8_CONSTANTS["table0"]))
        hi.append(byte_perm(p, q, M8_CONSTANTS["table1"]))
    return lo, hi


def lookup4(table, low3: int, pick: int) -> tuple[int, int]:
    lo_t, hi_t = table
    lo = byte_perm(byte_perm(lo_t[0], lo_t[1], low3), byte_perm(lo_t[2], lo_t[3], low3), pick)
    hi = byte_perm(byte_perm(hi_t[0], hi_t[1], low3), byte_perm(hi_t[2], hi_t[3], low3), pick)
    return byte_perm(lo, hi, M8_CONSTANTS["pair0"]), byte_perm(lo, hi, M8_CONSTANTS["pair1"])


def decode8(table, x: int) -> list[int]:
    """The kernel's decode8: four registers of two 16-bit table entries each."""
    low3 = x & M8_CONSTANTS["low30"]
    pick = ((x >> 1) & M8_CONSTANTS["pick0"]) | M8_CONSTANTS["pick1"]
    return [*lookup4(table, low3 & 0xFFFF, pick & 0xFFFF), *lookup4(table, low3 >> 16, pick >> 16)]


# The table's entries are the codes' own indices here, so a lookup says which code a weight got;
# the kernel's entries are the decoded weights' bit patterns, which the GPU tests check.
INDEX_TABLE = make_table(list(range(16)))


def decode_word(word: int, scale: float, code: list[float]) -> list[float]:
    """Eight weights of one 32-bit word of packed codes in register order: (k, k+1) per register."""
    values = []
    for reg in decode8(INDEX_TABLE, word):
        values += [code[reg & 0xFFFF] * scale, code[reg >> 16] * scale]
    return values


@dataclass(frozen=True)
class Layout:
    """What differs between the two kernels: k a warp covers per step, mmas per step, the first k
    of lane t's 16-byte load for mma j (``load_k``), which 32-bit word of that load holds mma j's
    codes (``word``), how a word of codes decodes, and which chunk of the activation tile lane t
    reads for mma j (``chunk``), where a chunk sits in the tile (``slot``) and the tile's size
    (``tile_slots``)."""

    step_k: int
    mmas: int
    load_k: Callable[[int, int, int], int]  # (step, j, t) -> first k of the lane's 16-byte load
    word: Callable[[int], int]  # j -> word of that load holding mma j's codes
    decode: Callable[[int, float, list[float]], list[float]]  # word -> its 8 weights, k order
    chunk: Callable[[int, int], int]  # (j, t) -> chunk of the tile's row
    slot: Callable[[int, int, int], int]  # (row, chunk, chunks a row) -> slot of the tile
    tile_slots: Callable[[int, int], int]  # (tokens, chunks a row) -> slots a tile takes


def _decode_word_wide(word: int, scale: float, code: list[float]) -> list[float]:
    return [*decode_pair(word & 0xFFFF, scale, code), *decode_pair(word >> 16, scale, code)]


# kernels/matmul_4bit.cu: 128 k a step, lane t's 32 k at 32t, mma j from bytes 2j, 2j+1.
WIDE = Layout(
    STEP_K_WIDE,
    8,
    lambda step, j, t: step * STEP_K_WIDE + 32 * t,
    lambda j: j // 2,
    _decode_word_wide,
    lambda j, t: _WIDE_CHUNK(t, j // 2),
    _act_slot("matmul_4bit.cu"),
    _tile_slots("matmul_4bit.cu"),
)
# kernels/matmul_4bit_m8.cu: 256 k a step, lane t's 64 k at 64t in two 32-k halves, mma j from
# word (j % 8) // 2 of half j // 8, decoded by the register-table lookups.
M8 = Layout(
    STEP_K_M8,
    16,
    lambda step, j, t: step * STEP_K_M8 + 64 * t + 32 * (j // 8),
    lambda j: (j % 8) // 2,
    decode_word,
    lambda j, t: _M8_CHUNK(t, j // 8, (j % 8) // 2),
    _act_slot("matmul_4bit_m8.cu"),
    _tile_slots("matmul_4bit_m8.cu"),
)


# --- kernels/matmul_4bit_m8_pairs.cu: the pair table, chunks of 64 or 32 k ---------------------------
def _m8p_act_slot(chunk_k: int, aligned: bool) -> Callable[[int, int, int], int]:
    """act_slot<chunk_k> of kernels/matmul_4bit_m8_pairs.cu, as (row, piece, pieces a row): the
    16-token tile's (ALIGNED_ROWS) where ``aligned``, else the 8-token tile's."""
    head = r"int act_slot\(int row, int piece\) \{\s+if constexpr \(kCols\) return [^;]+;\s+"
    aligned_line = r"if constexpr \(ALIGNED_ROWS\) return "
    line = aligned_line + (r"([^;]+);" if aligned else r"[^;]+;\s+return ([^;]+);")
    slot = _source_expression(_M8P, head + line, "row, piece, ACT_ROW_CHUNKS, kChunk")
    return lambda row, piece, row_chunks: slot(row, piece, row_chunks, chunk_k)


# The row the kernel reads is ln.act_row + 8 * i: g, clamped to the tile's rows inside M, which moves
# only lanes whose token lies past M (never stored); this emulation reads row g for every lane.
_M8P_PIECE = _source_expression(
    _M8P, r"tile\[act_slot<kChunk>\(ln\.act_row \+ 8 \* i, ([^\]]+)\)\]", "c, kChunk, t, S, v"
)


class _Shape:
    """Shape<kChunk> of kernels/matmul_4bit_m8_pairs.cu as its piece expression reads it (``S::run``)."""

    def __init__(self, chunk_k: int):
        self.run = chunk_k // 4


def m8_pairs_layout(chunk_k: int, aligned: bool = False) -> Layout:
    """kernels/matmul_4bit_m8_pairs.cu with chunks of ``chunk_k`` k (64, or 32 where K or the block size
    asks): 256 k a step, lane t's run of chunk_k / 4 k at t * chunk_k / 4 of each chunk, mma
    j % (chunk_k / 16) of chunk j // (chunk_k / 16) from bytes 2j, 2j + 1 of the run, decoded
    through the pair table; its activation tile the 16-token tile's (ALIGNED_ROWS) where ``aligned``."""
    per_chunk = chunk_k // 16
    return Layout(
        STEP_K_M8,
        STEP_K_M8 // 16,
        lambda step, j, t: step * STEP_K_M8 + (j // per_chunk) * chunk_k + t * chunk_k // 4,
        lambda j: (j % per_chunk) // 2,
        decode_pairs,
        lambda j, t: _M8P_PIECE(j // per_chunk, chunk_k, t, _Shape(chunk_k), (j % per_chunk) // 2),
        _m8p_act_slot(chunk_k, aligned),
        functools.partial(_tile_slots(_M8P), ALIGNED_ROWS=int(aligned)),
    )


M8P_64, M8P_32 = m8_pairs_layout(64), m8_pairs_layout(32)
M8P_64_A, M8P_32_A = m8_pairs_layout(64, aligned=True), m8_pairs_layout(32, aligned=True)

# The 16-byte loads (K % 128 == 0): lane t's run position in both chunks of a pair once lanes t and
# t ^ 2 traded halves, and which lanes keep their first run (trade_halves' `low`), from the source.
WIDE_POS = _source_expression(_M8P, r"int wide_pos\(int t\) \{ return ([^;]+); \}", "t")
_KEEPS_FIRST = _source_expression(_M8P, r"const bool low = ([^;]+);", "t")


def wide_pairs_layout(aligned: bool = False) -> Layout:
    """kernels/matmul_4bit_m8_pairs.cu with 16-byte weight loads: chunks of 64 k, lane t's run of
    16 k at run position WIDE_POS(t) of each chunk (where trade_halves left it: ``traded_runs``);
    its activation tile the 16-token tile's (ALIGNED_ROWS) where ``aligned``."""
    return Layout(
        STEP_K_M8,
        STEP_K_M8 // 16,
        lambda step, j, t: step * STEP_K_M8 + (j // 4) * 64 + WIDE_POS(t) * 16,
        lambda j: (j % 4) // 2,
        decode_pairs,
        lambda j, t: _M8P_PIECE(j // 4, 64, WIDE_POS(t), _Shape(64), (j % 4) // 2),
        _m8p_act_slot(64, aligned),
        functools.partial(_tile_slots(_M8P), ALIGNED_ROWS=int(aligned)),
    )


M8P_W, M8P_W_A = wide_pairs_layout(), wide_pairs_layout(aligned=True)


def traded_runs(pair: bytes) -> list[tuple[bytes, bytes]]:
    """What the quad's 4 lanes hold of one row's 64 bytes (two chunks of 64 k) after trade_halves:
    lane t loaded bytes 16t .. 16t + 15 (its first run the low 8, its second the high 8); a lane
    that keeps its first sends its second to lane t ^ 2, the others send their first and keep their
    second. (first, second) per lane, in lane order."""
    loaded = [(pair[16 * t : 16 * t + 8], pair[16 * t + 8 : 16 * t + 16]) for t in range(4)]
    keeps_first = [_KEEPS_FIRST(WIDE_POS(t)) for t in range(4)]  # the kernel's ln.t is the position
    sent = [second if keeps_first[t] else first for t, (first, second) in enumerate(loaded)]
    return [
        (first, sent[t ^ 2]) if keeps_first[t] else (sent[t ^ 2], second) for t, (first, second) in enumerate(loaded)
    ]


def a_operand(packed: bytes, scales, code, N: int, K: int, n0: int, step: int, j: int, layout: Layout) -> torch.Tensor:
    """Operand A (16 features x 16 k) of mma j of a step for the warp owning features n0 ..
    n0 + 15, assembled from what each lane loads (its 16-byte load, the word holding mma j's codes)
    and decodes; zeros past K and past N."""
    a = torch.zeros(16, 16, dtype=torch.float64)
    v, sub = layout.word(j), j % 2  # the word's first or last 4 k
    for lane in range(32):
        g, t = lane // 4, lane % 4
        k = layout.load_k(step, j, t)
        regs = [[0.0, 0.0] for _ in range(4)]
        if k < K:
            decoded = {}
            for which, n in (("lo", n0 + g), ("hi", n0 + g + 8)):
                if n < N:
                    row = packed[(n * K + k) // 2 : (n * K + k) // 2 + 16]  # the 16-byte load
                    word = int.from_bytes(row[4 * v : 4 * v + 4], "little")
                    decoded[which] = layout.decode(word, float(scales[n, k // 32]), code)
                else:
                    decoded[which] = [0.0] * 8
            lo, hi = decoded["lo"][4 * sub : 4 * sub + 4], decoded["hi"][4 * sub : 4 * sub + 4]
            regs = [[lo[0], lo[1]], [hi[0], hi[1]], [lo[2], lo[3]], [hi[2], hi[3]]]
        for reg in range(4):
            for half in range(2):
                r, c = a_fragment_position(lane, reg, half)
                a[r, c] = regs[reg][half]
    return a


def stage_tile(act: torch.Tensor, step: int, K: int, layout: Layout) -> dict[int, torch.Tensor]:
    """stage_activations for one step, every token in one tile: slot -> the chunk's 8 elements;
    zeros past K, NaN in the rows past M (never staged: whatever they hold must not reach a stored
    output). Each slot is written once."""
    M, row_chunks = act.shape[0], layout.step_k // 8
    tile = {}
    for r in range(-(-M // 8) * 8):
        for c in range(row_chunks):
            k = step * layout.step_k + 8 * c
            slot = layout.slot(r, c, row_chunks)
            # written once, and inside a tile of r + 1 tokens (the kernel's tiles are that size)
            assert slot not in tile and 0 <= slot < layout.tile_slots(r + 1, row_chunks)
            if r >= M:
                tile[slot] = torch.full((8,), float("nan"), dtype=torch.float64)
            else:
                tile[slot] = act[r, k : k + 8] if k < K else torch.zeros(8, dtype=torch.float64)
    return tile


def bank_groups_of_quarter_warps(slots: list[int]) -> list[set[int]]:
    """The 16-byte bank groups (8 in a 128-byte row of banks) each quarter warp's 16-byte accesses
    hit, for 32 lanes' slots."""
    return [{slot % 8 for slot in slots[q : q + 8]} for q in range(0, 32, 8)]


def emulate(
    A: torch.Tensor, packed: bytes, scales: torch.Tensor, code: list[float], N: int, K: int, layout: Layout
) -> torch.Tensor:
    """out [M, N] in float64 as one warp per 16 features computes it, K split in ``layout``'s
    steps. ``scales`` holds one scale per (feature, 32-k group); decoded values are not rounded
    here (the kernel rounds each to A's dtype; the arithmetic is not what this checks)."""
    M = A.shape[0]
    act = A.double()
    out = torch.zeros(M, N, dtype=torch.float64)
    tiles = [stage_tile(act, step, K, layout) for step in range(-(-K // layout.step_k))]
    for n0 in range(0, N, 16):
        for step, tile in enumerate(tiles):
            for m0 in range(0, M, 8):
                acc = torch.zeros(16, 8, dtype=torch.float64)
                for j in range(layout.mmas):
                    sub = j % 2  # the word's first or last 4 k
                    a = a_operand(packed, scales, code, N, K, n0, step, j, layout)
                    b = torch.zeros(16, 8, dtype=torch.float64)
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        # Activations: token g's chunk of the staged tile, halves .x .y (sub = 0) or .z .w.
                        elems = tile[layout.slot(m0 + g, layout.chunk(j, t), layout.step_k // 8)]
                        regs_b = [[elems[4 * sub], elems[4 * sub + 1]], [elems[4 * sub + 2], elems[4 * sub + 3]]]
                        for reg in range(2):
                            for half in range(2):
                                kk, nn = b_fragment_position(lane, reg, half)
                                b[kk, nn] = regs_b[reg][half]
                    acc += a @ b
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for index in range(4):
                        r, c = c_fragment_position(lane, index)
                        assert (r, c) == (g + 8 * (index >= 2), 2 * t + (index & 1))  # the kernel's epilogue
                        n, m = n0 + r, m0 + c
                        if m < M and n < N:
                            out[m, n] += acc[r, c]
    return out


# --- kernels/matmul_4bit_sm90.cu: the same lanes and decode as WIDE, operand B staged for wgmma ----
_SM90 = (jit.kernels_dir() / "matmul_4bit_sm90.cu").read_text()


def _sm90_define(name: str) -> str:
    match = re.search(rf"^#define {name} (.+?)(?:\s+//.*)?$", _SM90, re.MULTILINE)
    assert match, f"kernels/matmul_4bit_sm90.cu no longer defines {name} where this reads it"
    return match.group(1)


def sm90_layout(tokens: int, warps: int) -> dict[str, int]:
    """The kernel's tile macros for a token tile and warp count, evaluated from its own source."""
    names = {"MM_TOKENS": tokens, "MM_WARPS": warps, "STEP_K": STEP_K_WIDE}
    for name in ("CORE_LBO", "CORE_SBO", "SLICE_BYTES", "THREADS", "CHUNKS", "ROW_STRIDE"):
        names[name] = eval(_sm90_define(name).replace("/", "//"), {}, dict(names))  # the kernel's own macros
    return names


# store_chunks: where word q of chunk i of thread (x, r) goes, from the kernel's own expressions.
_STORE_BASE = _source_expression(
    "matmul_4bit_sm90.cu", r"unsigned char\* base = stage \+ ([^;]+);", "x, r, SLICE_BYTES, CORE_SBO"
)
_STORE_ROW = _source_expression(
    "matmul_4bit_sm90.cu", r"unsigned char\* row = base \+ ([^;]+);", "i, ROW_STRIDE, CORE_SBO"
)
_STORE_WORD = _source_expression(
    "matmul_4bit_sm90.cu", r"\*reinterpret_cast<u32\*>\(row \+ (.+?)\) = w\[q\];", "q, SLICE_BYTES, CORE_LBO"
)


def sm90_stores(tid: int, i: int, lay: dict[str, int]) -> bool:
    """Whether thread ``tid`` stores its chunk i: store_chunks skips a chunk past the tile's rows
    (its last, where the block's threads do not divide the tile's chunks: 12 warps at 128 tokens)."""
    return (tid >> 4) + lay["ROW_STRIDE"] * i < lay["MM_TOKENS"]


def sm90_store_address(tid: int, i: int, q: int, lay: dict[str, int]) -> int:
    """The stage byte store_chunks writes word q of thread ``tid``'s chunk i to."""
    base = _STORE_BASE(tid & 15, tid >> 4, lay["SLICE_BYTES"], lay["CORE_SBO"])
    row = base + _STORE_ROW(i, lay["ROW_STRIDE"], lay["CORE_SBO"])
    return row + _STORE_WORD(q, lay["SLICE_BYTES"], lay["CORE_LBO"])


def sm90_stage(act: torch.Tensor, step: int, K: int, lay: dict[str, int]) -> dict[int, float]:
    """store_chunks for one step: stage byte address (of each element) -> value; load_chunks'
    zeros past K and past M. Every element is written once."""
    M, stage = act.shape[0], {}
    for tid in range(lay["THREADS"]):
        x = tid & 15
        for i in (i for i in range(lay["CHUNKS"]) if sm90_stores(tid, i, lay)):
            r, k = (tid >> 4) + lay["ROW_STRIDE"] * i, step * STEP_K_WIDE + 8 * x
            for q in range(4):
                address = sm90_store_address(tid, i, q, lay)
                for e in range(2):
                    assert address + 2 * e not in stage, (tid, i, q)
                    inside = r < M and k < K
                    stage[address + 2 * e] = float(act[r, k + 2 * q + e]) if inside else 0.0
    return stage


def sm90_b_operand(stage: dict[int, float], j: int, lay: dict[str, int]) -> torch.Tensor:
    """Operand B (16 k x tokens) of slice j's wgmma as the tensor cores read it: K-major, no
    swizzle (PTX ISA, canonical layout ((8, m), (8, 2)) : ((16 B, SBO), (2 B, LBO))), from the
    slice's start."""
    b = torch.zeros(16, lay["MM_TOKENS"], dtype=torch.float64)
    for kk in range(16):
        for n in range(lay["MM_TOKENS"]):
            address = j * lay["SLICE_BYTES"] + (n // 8) * lay["CORE_SBO"] + (kk // 8) * lay["CORE_LBO"]
            b[kk, n] = stage[address + (n % 8) * 16 + (kk % 8) * 2]
    return b


# From WIDE_PAIRS_TOKENS tokens up the kernel decodes through a table of fp32 code pairs (stage_wide_pairs):
# its size, the entry each 16-byte store holds (two copies), and a thread's copy offset.
WIDE_PAIRS_TOKENS = int(re.search(r"^#define WIDE_PAIRS \(MM_TOKENS >= (\d+)\)", _SM90, re.MULTILINE).group(1))
WIDE_PAIR_TABLE_BYTES = eval(_sm90_define("WIDE_PAIR_TABLE_BYTES"))
_WIDE_ROW = _source_expression("matmul_4bit_sm90.cu", r"const int row = ([^,]+), half = [^;]+;", "i")
_WIDE_HALF = _source_expression("matmul_4bit_sm90.cu", r"const int row = [^,]+, half = ([^;]+);", "i")
_WIDE_ENTRY = _source_expression("matmul_4bit_sm90.cu", r"const int e = ([^;]+);", "row, half")
_WIDE_LANE_BYTES = _source_expression("matmul_4bit_sm90.cu", r"const u32 lane8 = ([^;]+);", "threadIdx")


class _Thread:
    def __init__(self, tid: int):
        self.x = tid


def wide_lane_bytes(tid: int) -> int:
    return _WIDE_LANE_BYTES(_Thread(tid))


def wide_pair_table() -> list[int]:
    """stage_wide_pairs: the entry (packed byte) each 8-byte slot of the table holds."""
    slots = []
    for i in range(WIDE_PAIR_TABLE_BYTES // 16):
        slots += [_WIDE_ENTRY(_WIDE_ROW(i), _WIDE_HALF(i))] * 2
    return slots


WIDE_PAIR_TABLE = wide_pair_table()


def _decode_word_wide_pairs(word: int, scale: float, code: list[float], tid: int = 0) -> list[float]:
    """decode_frag_pairs for one feature's word: byte b's slot gives (code of its high nibble, code
    of its low nibble), each times the scale, in k order."""
    values = []
    for byte in range(4):
        address = pair_address(word, byte, 0, wide_lane_bytes(tid))
        assert address % 8 == 0 and address // 8 < len(WIDE_PAIR_TABLE)
        entry = WIDE_PAIR_TABLE[address // 8]
        values += [code[entry >> 4] * scale, code[entry & 0xF] * scale]
    return values


SM90_PAIRS = dataclasses.replace(WIDE, decode=_decode_word_wide_pairs)


def emulate_sm90(
    A: torch.Tensor, packed: bytes, scales: torch.Tensor, code: list[float], N: int, K: int, tokens: int, warps: int
) -> torch.Tensor:
    """out [M, N] in float64 as kernels/matmul_4bit_sm90.cu computes it: each warpgroup's four warps
    hold operand A as WIDE's lanes decode it (rows 16w .. 16w + 15 of the 64), operand B read from
    the staged tile, one wgmma a slice; the accumulators land as mma.sync's, per warp."""
    lay = sm90_layout(tokens, warps)
    layout = SM90_PAIRS if tokens >= WIDE_PAIRS_TOKENS else WIDE
    M, act = A.shape[0], A.double()
    out = torch.zeros(M, N, dtype=torch.float64)
    for m0 in range(0, M, tokens):
        tile_act = act[m0 : m0 + tokens]
        stages = [sm90_stage(tile_act, step, K, lay) for step in range(-(-K // STEP_K_WIDE))]
        for n0 in range(0, N, 64):
            acc = torch.zeros(64, tokens, dtype=torch.float64)
            for step, stage in enumerate(stages):
                for j in range(8):
                    a = torch.zeros(64, 16, dtype=torch.float64)
                    for w in range(4):
                        a[16 * w : 16 * w + 16] = a_operand(packed, scales, code, N, K, n0 + 16 * w, step, j, layout)
                    acc += a @ sm90_b_operand(stage, j, lay)
            for w, lane in itertools.product(range(4), range(32)):
                for i in range(tokens // 8):
                    for index in range(4):
                        r, c = c_fragment_position(lane, index)
                        n, m = n0 + 16 * w + r, m0 + 8 * i + c
                        if m < M and n < N:
                            out[m, n] = acc[16 * w + r, 8 * i + c]
    return out


# --- the columns build (MM_COLUMNS): a pair of chunks as an mma's columns (compute_pair_columns) --
# The tile's slots in that build, the lane's first piece (or none), its piece for word j of chunk pair
# c, and the lanes columns_to_tokens gathers tokens 2t and 2t + 1 from, all read from the source.
COLS_SLOT = _source_expression(_M8P, r"if constexpr \(kCols\) return ([^;]+);", "row, piece, ACT_ROW_CHUNKS")
_COLS_LIVE_TEXT = re.search(r"ln\.act_row = (.+?) \? act_slot<64, true>", _M8P_SOURCE)
assert _COLS_LIVE_TEXT, f"kernels/{_M8P} no longer says which lanes of the columns build read where this reads it"
_COLS_LIVE = eval("lambda g, t, rows: " + _COLS_LIVE_TEXT.group(1).replace("&&", " and "))  # the source's own test
_COLS_ROW = _source_expression(_M8P, r"\? act_slot<64, true>\((.+?), [^)]+\) : -1;", "g")
_COLS_PIECE0 = _source_expression(_M8P, r"\? act_slot<64, true>\([^,]+, (.+?)\) : -1;", "t")
_COLS_OFFSET = _source_expression(_M8P, r"tile\[ln\.act_row \+ ([^\]]+)\]", "c, j")
_COLS_GATHER = [
    _source_expression(_M8P, rf"const float lo{i} = __shfl_sync\(0xffffffffu, acc\[0\]\[0\], quad \| ([^;]+)\);", "t")
    for i in range(2)
]


def columns_first_slot(lane: int, rows: int) -> int | None:
    """The slot of the lane's first piece in the columns build, or None where it reads nothing."""
    g, t = lane // 4, lane % 4
    if not _COLS_LIVE(g, t, rows):
        return None
    return COLS_SLOT(_COLS_ROW(g), _COLS_PIECE0(t), STEP_K_M8 // 8)


def emulate_pair_columns(
    A: torch.Tensor, packed: bytes, chunk_scales: torch.Tensor, code: list[float], N: int, K: int
) -> torch.Tensor:
    """out [M, N] (M <= 4) in float64 as compute_pair_columns and columns_to_tokens compute it: each
    lane's 16-byte load as loaded (32 k of chunk c + t // 2), column 2m + s of each mma fed by the lanes
    of chunk c + s with row m's activations (the staged tile, the kernel's slots), zeros from the
    others; each column's sum times its chunk's scale (``chunk_scales`` [N, K / 64]); then the epilogue's
    gather and store."""
    M = A.shape[0]
    assert M <= 4 and K % 128 == 0
    act = A.double()
    row_chunks = STEP_K_M8 // 8
    # The columns build (MM_FEW_ROWS = COLUMNS_ROWS) holds the tile's rows its lanes read, its slots in one stage.
    tile_rows = _tile_rows(_M8P)(8, 1, COLUMNS_ROWS)
    tile_slots = _tile_slots(_M8P)(8, row_chunks, 1, MM_FEW_ROWS=COLUMNS_ROWS)
    out = torch.zeros(M, N, dtype=torch.float64)
    for n0 in range(0, N, 16):
        acc = torch.zeros(32, 2, dtype=torch.float64)  # lane -> (feature g, g + 8) of token t
        for step in range(-(-K // STEP_K_M8)):
            tile = {}
            for r in range(tile_rows):  # stage_activations: rows past M not staged (NaN), zeros past K
                for p in range(row_chunks):
                    k = step * STEP_K_M8 + 8 * p
                    slot = COLS_SLOT(r, p, row_chunks)
                    assert slot not in tile and 0 <= slot < tile_slots
                    zeros, nan = (
                        torch.zeros(8, dtype=torch.float64),
                        torch.full((8,), float("nan"), dtype=torch.float64),
                    )
                    tile[slot] = nan if r >= M else (act[r, k : k + 8] if k < K else zeros)
            for c in range(0, STEP_K_M8 // 64, 2):
                k_pair = step * STEP_K_M8 + 64 * c
                if k_pair >= K:
                    break
                part = torch.zeros(16, 8, dtype=torch.float64)
                for j, h in itertools.product(range(4), range(2)):
                    a = torch.zeros(16, 16, dtype=torch.float64)
                    b = torch.zeros(16, 8, dtype=torch.float64)
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        k = k_pair + 32 * t  # the lane's 16-byte load
                        vals = {}
                        for which, n in (("lo", n0 + g), ("hi", n0 + g + 8)):
                            if n < N:
                                run = packed[(n * K + k) // 2 : (n * K + k) // 2 + 16]
                                vals[which] = decode_pairs(int.from_bytes(run[4 * j : 4 * j + 4], "little"), 1.0, code)
                            else:
                                vals[which] = [0.0] * 8
                        lo, hi = vals["lo"][4 * h : 4 * h + 4], vals["hi"][4 * h : 4 * h + 4]
                        regs = [[lo[0], lo[1]], [hi[0], hi[1]], [lo[2], lo[3]], [hi[2], hi[3]]]
                        for reg, half in itertools.product(range(4), range(2)):
                            a[a_fragment_position(lane, reg, half)] = regs[reg][half]
                        first = columns_first_slot(lane, M)
                        none = torch.zeros(8, dtype=torch.float64)
                        elems = none if first is None else tile[first + _COLS_OFFSET(c, j)]
                        regs_b = [[elems[4 * h], elems[4 * h + 1]], [elems[4 * h + 2], elems[4 * h + 3]]]
                        for reg, half in itertools.product(range(2), range(2)):
                            b[b_fragment_position(lane, reg, half)] = regs_b[reg][half]
                    part += a @ b
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for f, n in ((0, n0 + g), (1, n0 + g + 8)):
                        if n < N:
                            for s_ in range(2):  # column 2t + s: chunk c + s of token t
                                acc[lane, f] += chunk_scales[n, k_pair // 64 + s_] * part[g + 8 * f, 2 * t + s_]
        for lane in range(32):  # columns_to_tokens, then the epilogue (token 2t + (index & 1))
            g, t = lane // 4, lane % 4
            for i, src in enumerate(_COLS_GATHER):
                m = 2 * t + i
                for f, n in ((0, n0 + g), (1, n0 + g + 8)):
                    if m < M and n < N:
                        out[m, n] = acc[4 * g + src(t), f]
    return out
