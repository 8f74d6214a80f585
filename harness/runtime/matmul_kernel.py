"""The fused 4-bit matmul kernels, everything about them in one place: their variants (up to 16
tokens a tile ``kernels/matmul_4bit_m8_pairs.cu`` for nested scales, ``kernels/matmul_4bit_m8.cu``
for plain ones; more ``kernels/matmul_4bit.cu``, or on Hopper ``kernels/matmul_4bit_sm90.cu``; one
parameter list),
the shapes they take, the launch plan (token tile, split of K) and the launch on a raw stream: the
main kernel, writing the output itself when K is not split or its splits run as one thread block
cluster (sm_90 on), else its partial sums into a workspace that ``matmul_4bit_finish`` adds in split
order.

Importable without PyTorch (the compile check lists the variants).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass

from harness.runtime import jit, launcher
from harness.runtime.operands import ANY, LIKE_A, Count, Operand

# Up to 16 tokens each decoded weight feeds one or two mmas, so the decode is the work. With nested
# scales, a shared-memory table of code pairs, the scale applied to fp32 sums (SOURCE_M8_PAIRS: 2.7
# instead of 4.6 instructions a weight); with plain ones that arithmetic measured 5-14% less accurate
# than bitsandbytes' (its low-precision absmax makes many of bitsandbytes' roundings exact), so they
# keep per-block register tables of the dequantized weights (SOURCE_M8). With more tokens, the
# shared-memory code table, whose few registers keep more warps in flight. kernels/NOTES.md.
SOURCE_M8, SOURCE_M8_PAIRS, SOURCE_WIDE = "matmul_4bit_m8.cu", "matmul_4bit_m8_pairs.cu", "matmul_4bit.cu"
SOURCE_SM90 = "matmul_4bit_sm90.cu"  # the wide tiles on Hopper (WGMMA_TARGETS, below)
# The token tiles SOURCE_M8 runs (plain scales) and SOURCE_M8_PAIRS runs (nested; the wider ones, and
# every wider one of plain scales, run SOURCE_WIDE). At 16 tokens the pair-table kernel took the gate
# weight 28672x8192 from the wide kernel's 96 to 82 µs and 8192x8192 from 36 to 30 (H100). Its 32-token
# tile (2 blocks an SM) was slower than the wide kernel's on an H100 in its first form; the kernel
# of today, side by side on an H200 with the wgmma kernel's 32-token tile at 24 and 32 rows, took
# 0.80-0.94x its time on five weights of 44-235 M elements (gate 28672x8192 at 32 rows 109.7 ->
# 98.9 µs; kernels/NOTES.md, "The pair-table kernel's 32-token tile at two blocks an SM").
DECODE_TILES = (8, 16)
PAIR_TILES = (8, 16, 32)
# At 17-32 rows a weight with nested scales of at most this many elements (N * K) runs as two of the
# pair-table kernel's 16-token tiles, each decoding the weights again, instead of one 32-token tile:
# there a launch is mostly its fixed cost, which the 16-token tile's grids keep lower. Against the
# wide kernel's 32-token tile, side by side on an H200 (GPU-474ea7c0, 17 and 32 rows, each tile's rule
# grid): the six nested weights of up to 11.0 M elements took 0.66-0.98x the wide tile's time (qwen2.5-7b k
# 512x3584 11.6 -> 8.1 µs); 12.8-22 M elements 0.91-1.10x; 25-42 M 1.02-1.19x. On an H100 the five
# k weights and phi-3-mini o took 0.72-0.90x at 32 rows. Plain scales keep the wide tile (their
# register-table kernel lost 6% on phi-3-mini o 3072x3072; kernels/NOTES.md, "17-32 rows of a small
# weight as two 16-token tiles"). Against the pair-table kernel's own 32-token tile, which nested
# weights above the line now run, on an H200's sweep of 27 weights at 32 rows (each tile's fastest
# grid): two 16-token tiles took 0.81-0.96x its time on the weights of up to 8 Mi elements (the k
# weights), 1.02-1.07x at 9-12 Mi, 0.92-1.04x at 16-21 Mi and 0.98-1.44x above; the line at 8 Mi
# puts the rules' picks at 1.018x the fastest grid of either tile on replay, at 12 Mi 1.024x
# (kernels/NOTES.md, "The pair-table kernel's 32-token tile at two blocks an SM").
TWO_TILE_ELEMENTS = 8 << 20
# The register-table kernel's (SOURCE_M8: GRID_RULES) grid follows its busiest SM (grid_for) where
# an SM holds at least this many of its blocks (16 warps), which keep the SM's integer pipe busy;
# with fewer it follows its waves (WAVE_STEPS), as the pair-table kernel's always does (at this
# many, with a pair of splits where that runs as few steps on the busiest SM: grid_for). The
# pair-table kernel at 16 tokens holds 3: on a sweep of 30 weights at 16 rows
# (H100) the busiest-SM rule picked grids 1.106x the fastest in geometric mean (worst 1.31), the wide
# tiles' one-wave rule 1.039x but the gate weight 28672x8192 at 1.12x (one wave and an eighth: 104 µs
# in a perf run against 82 as a cluster pair), the waves rule 1.031x. The register-table kernel at
# 16 tokens (plain scales) holds 4, and under the waves rule took that weight from 89 to 101 µs
# (kernels/NOTES.md).
BUSIEST_SM_BLOCKS = 4
# Waves rule: a grid of n splits costs its waves (blocks over what the GPU holds at once) times a
# split's steps plus WAVE_STEPS (a wave's ramp and first loads), plus FINISH_STEPS where the finish
# kernel adds the splits; fit to that sweep (0, 1, 2 and 4 wave steps: 1.066, 1.051, 1.036, 1.031x).
WAVE_STEPS, FINISH_STEPS = 4, 2
# Which rule a decode kernel's grid follows, by source (every other source: WAVES; the wide tiles
# have their own). The pair-table kernel with 16-byte weight loads is no longer bound by its integer
# pipe: over 60 cases at 1 and 8 rows (30 weights, 5 models) of an H100 grid sweep the busiest-SM
# rule picked grids 1.101x the fastest (geometric mean; worst 1.40), the waves rule with the pair
# 1.045x (1.25); on the two earlier sweeps of that kernel with 8-byte loads, 1.067 -> 1.031 (H100)
# and 1.077 -> 1.043 (H200) (kernels/NOTES.md, "The grid rules after the 16-byte loads").
# The wide tiles' waves rule (WAVES_WIDE) differs from the decode kernels' in its steps (STEP_K_WIDE),
# its splits' floor (MIN_SPLIT_STEPS_WIDE), its prices (WAVES_PRICES) and its partial sums
# (PARTIAL_FLOOR_BYTES): the rule names the kernel family, since a token count alone does not (32
# tokens: the pair-table kernel's tile for nested scales, the wide kernels' for plain ones).
BUSIEST_SM, WAVES, WAVES_WIDE = "busiest-sm", "waves", "waves-wide"
GRID_RULES = {SOURCE_M8: BUSIEST_SM, SOURCE_WIDE: WAVES_WIDE, SOURCE_SM90: WAVES_WIDE}


def grid_rule_of(source: str) -> str:
    """The rule a kernel source's grids follow (``GRID_RULES``)."""
    return GRID_RULES.get(source, WAVES)


# On Hopper the wider tiles run the same decode with the warpgroup mma (wgmma), which reads the
# activations from shared memory itself: built for the arch-specific target that has it. Same
# steps, warps and grid rules as SOURCE_WIDE (SOURCE_SM90); its 128-token tile also builds with WIDE_WARPS.
WGMMA_TARGETS = {"sm_90": "sm_90a"}  # GPU arch -> the compile target of SOURCE_SM90
ENTRY, FINISH = "matmul_4bit_kernel", "matmul_4bit_finish"
QUANT_TYPES = ("nf4", "fp4")
DTYPES = ("fp16", "bf16")  # activations, decoded weights and output
TOKEN_TILES = (8, 16, 32, 64, 128)  # tokens one warp multiplies each decoded weight with
# Warps per block (16 output features each) by token tile. The warps of a block share one staged
# activation tile: at 64 tokens, 8 warps halve its share per weight (H100, 28672x8192: 242 -> 192 µs),
# while the smaller tiles and weights lose more to the fewer, larger blocks (kernels/NOTES.md).
WARPS = {8: 4, 16: 4, 32: 4, 64: 8, 128: 8}
# The wgmma kernel also builds its 128-token tile with 12 warps. Its step took 1.24x an 8-warp
# block's for 1.5x the features (H100, the down weights of a 30-weight sweep at 128 rows; one block
# an SM either way), so per weight it is faster, but its wider blocks divide a weight among the SMs
# more coarsely (28672x8192: 150 groups on 132 SMs against 224, 21504x5376: 112 against 168). A call
# takes the build whose grid costs less (``pick_plan``: the waves rule's cost times the step's
# time, plus FINISH_STEPS_PER_MB): replayed on an H100 sweep of both builds' grids (30 weights), the
# rules' pick 1.010x the fastest of either in geometric mean; side by side on one H100, 0.94x the
# 8-warp build's time (kernels/NOTES.md, "Twelve warps at 128 tokens").
WIDE_WARPS = {128: 12}  # token tile -> warps of the wgmma kernel's second build (on WGMMA_TARGETS)
STEP_TIME = {(128, 12): 1.24}  # (token tile, warps) -> a block's step time against the tile's WARPS build
# Between builds the finish's read of the partial sums counts too (the waves rule's flat FINISH_STEPS
# does not grow with them): a MB at the copy rate (3 TB/s, H100) is 0.33 µs, a fifth of an 8-warp
# step at 128 tokens (1.74 µs). Without it the gate weight 28672x8192 took the 12-warp build in 4
# splits (59 MB of sums): 220 µs against 217 for the 8-warp build unsplit.
FINISH_STEPS_PER_MB = 0.2


@dataclass(frozen=True)
class WavesPrice:
    """What the waves rule charges a token tile's grid beyond its waves of steps: a flat cost for
    the finish kernel, a cost a MB of partial sums it reads, and how much longer a block's step runs
    for each further block of the tile on its SM in a wave."""

    finish_steps: float = FINISH_STEPS
    finish_steps_per_mb: float = 0.0
    shared_sm_step: float = 0.0


# By rule and token tile (every other: WavesPrice()). At 16 tokens the finish priced from that tile's
# sweeps at 16 rows (8192x8192: 2 finished splits against 2 clustered, a split's step from 2 against
# 3 finished): 6.2 steps on an H100, 6.7 on an H200. At 2 the rule gave that weight 3 finished
# splits: side by side 8.6% slower than the clustered pair (H200; 7.5% on an H100) and, with the
# finish, two levels of time that made an unchanged perf gate go red (kernels/NOTES.md, "The
# 16-token tile's finish priced at what it was measured to cost"). The 64-token tile holds 2 blocks
# an SM: a wave over more blocks than SMs puts two on an SM, each step then 1.8x as long, and its
# finish reads up to 8 MB of partial sums; priced so, the recorded 64-row sweeps' picks went from
# 1.020x the fastest grid to 1.006x (H100) and 1.026x to 1.013x (H200); the seven weights whose grid
# moved took 0.934x (H100) and 0.936x (H200) their old time side by side (kernels/NOTES.md, "The
# 64-token tile's waves priced with a shared SM and the partial sums' bytes"). The 8-token and
# 128-token tiles keep their fit. The wide 32-token tile (5 blocks an SM; plain scales' since the
# pair-table kernel's own took the nested calls) took the 64-token tile's price
# (its 32-row sweep, H200: 1.019x the fastest of its grids), which gave 8192x8192 at 32 rows 4
# splits of 16 steps for 5 of 13, a 0.4% gain on the sweep's coarse timing but 1.5% slower side by
# side in two perf gates (red) and 3.9% in interleaved timing; a cheaper shared block and a dearer
# MB of sums pick 5 there, keep the gate weight's 4 and leave the sweep's replay as it was (1.0254
# against 1.0257 over its 32-row cases; 1.0255 against 1.0261 on the sweep re-recorded with its
# confirmation stage; kernels/NOTES.md, "The 32-token tile's price: a tie the sweep could not see").
# The pair-table kernel's 32-token tile keeps the flat price: on an H200's sweep of its grids at 32
# rows (27 weights) the 16-token tile's finish price put the rules' picks at 1.030x the fastest grid
# of either tile (the tile line at 8 Mi elements; worst 1.179: qwen3-32b o 5120x8192 in 2 clustered
# splits where 3 finished ran 15% faster), the flat one at 1.018x (kernels/NOTES.md, "The pair-table
# kernel's 32-token tile at two blocks an SM").
WAVES_PRICES = {
    (WAVES, 16): WavesPrice(finish_steps=6),
    (WAVES_WIDE, 32): WavesPrice(0, 0.5, 0.6),
    (WAVES_WIDE, 64): WavesPrice(0, FINISH_STEPS_PER_MB, 0.8),
}


def partial_sums_mb(elements: int) -> float:
    """MB of that many fp32 partial sums (what ``WavesPrice`` and ``Plan.cost`` price a MB)."""
    return 4 * elements / 1e6


def waves_price(tokens: int, rule: str) -> WavesPrice:
    """What the waves rule charges this token tile's grids under ``rule`` (``WAVES_PRICES``)."""
    return WAVES_PRICES.get((rule, tokens), WavesPrice())


# How each kernel forms a weight's share of a sum (harness/correctness/matmul_reference.py holds each
# one's oracle), by source: "dequantized" multiplies the dequantization kernel's bits; "scaled-sums"
# rounds the code to A's dtype and applies the block's scale to fp32 sums of the chunks of k.
ARITHMETIC = {SOURCE_M8_PAIRS: "scaled-sums"}  # every other source: "dequantized"
STEP_K_M8, STEP_K_WIDE = 256, 128  # k one warp covers per step: 64 a lane, or 32
WIDE_DYNAMIC_TILE = 128  # the wide tile whose activation stages the launch passes as dynamic shared memory
PAIR_TABLE_BYTES = 256 * 32 * 4  # SOURCE_M8_PAIRS' table: 256 pairs of codes, 32 copies of each
WIDE_PAIRS_TILE = 64  # SOURCE_SM90 looks codes up in pairs from this tile up: 256 fp32 pairs, 16 copies
WIDE_PAIR_TABLE_BYTES = 256 * 16 * 8
K_MULTIPLE = 32  # a lane's 32 k are all inside K or all outside: no per-element tail
ALIGN = 16  # bytes: weights, activations and bias are read 16 bytes at a time
# The call's operands beside A and the weight (whose rules are the dequantization call's), as data
# for ``operands.check``, in the order they are checked: the output, which a copy fills where the
# kernel cannot write it (any dtype, device or layout), and the bias, which F.linear adds
# (bitsandbytes takes one of N values or a single one, in A's dtype, any layout).
OPERANDS = (
    Operand("out", "out", ANY, None, dense=False, same_device=False),
    Operand(
        "bias", "bias", LIKE_A, Count("N", or_one=True), max_dims=1, dense=False,
        holds="the weight's {need} output features (or one value)",
    ),
)  # fmt: skip

# A, W, absmax, code2, absmax2, offset pointer, offset value, partial, bias, out, M, N, K,
# log2 block size, log2 second-level block size, steps per split.
MAIN_PARAMS = ("ptr",) * 6 + ("f32", "ptr", "ptr", "ptr", "i64", "i32", "i32", "i32", "i32", "i32")
FINISH_PARAMS = ("ptr", "ptr", "ptr", "i64", "i32", "i32")  # partial, bias, out, M, N, splits
FINISH_THREADS = 256
# Calls of at most this many rows of a weight with nested scales run the pair-table kernel's few-rows
# build (MM_FEW_ROWS): only the lanes of those rows read activations. On an H200, where the L1 unit
# paces the one-row call, that made the large weights 4-5% faster at one row; at 8 rows, every lane
# live, 0-2.4% slower, and at 4 rows it gained on two weights and lost on a third (H200 and H100,
# kernels/NOTES.md): the build is kept to the rows where its reads fit one wavefront.
FEW_ROWS = 2
# The few-rows build's columns form (MM_COLUMNS: a chunk pair as an mma's token columns, no trade of
# halves between lanes): fewer of the L1 unit's shuffles and lookups for the same loads. It pays where
# the L1 unit paces the one-row call, a GPU whose DRAM brings each SM many bytes a cycle, and costs
# where the loads do: an H200 (18.4 bytes an SM cycle) faster, an H100 SXM (12.8) 7-8% slower
# (kernels/NOTES.md, "Chunks as mma columns", "The columns build per GPU"). Taken from this rate up,
# and built for the arch both were measured on only (WGMMA_TARGETS'). An mma's 8 token columns hold
# two chunks of 4 rows, so the form takes the nested calls of up to COLUMNS_ROWS rows: on an H200
# 0.91-0.98x the 8-token build's time at 3-4 rows (kernels/NOTES.md, "The columns form at 3-4 rows").
COLUMNS_BYTES_PER_SM_CYCLE = 16.0
COLUMNS_ROWS = 4


def columns_pay(dram_bytes_per_s: float, sms: int, sm_clock_hz: float) -> bool:
    """Whether a GPU of this DRAM bandwidth, SM count and SM clock runs the columns form."""
    return dram_bytes_per_s / (sms * sm_clock_hz) >= COLUMNS_BYTES_PER_SM_CYCLE


@dataclass(frozen=True)
class MatmulVariant:
    dtype: str
    quant_type: str
    nested: bool
    tokens: int
    few_rows: bool = False  # the few-rows build (FEW_ROWS) of the one-tile pair-table kernel
    warps: int = 0  # warps a block: the tile's WARPS (0), or WIDE_WARPS' where the tile has them
    columns: bool = False  # the few-rows build's columns form (COLUMNS_BYTES_PER_SM_CYCLE), COLUMNS_ROWS rows

    def __post_init__(self):
        if self.dtype not in DTYPES or self.quant_type not in QUANT_TYPES or self.tokens not in TOKEN_TILES:
            raise ValueError(f"no such matmul variant: {self}")
        if self.few_rows and not (self.nested and self.tokens == DECODE_TILES[0]):
            raise ValueError(f"the few-rows build is the nested {DECODE_TILES[0]}-token kernel's only: {self}")
        if self.columns and not self.few_rows:
            raise ValueError(f"the columns form is the few-rows build's only: {self}")
        if not self.warps:
            object.__setattr__(self, "warps", block_warps(self.tokens))  # frozen: set once, here
        if self.warps not in (WARPS[self.tokens], WIDE_WARPS.get(self.tokens)):
            raise ValueError(f"no {self.warps}-warp build of the {self.tokens}-token tile: {self}")

    @property
    def rows_read(self) -> int:
        """The most rows of a call of the few-rows build or its columns form (0: neither)."""
        return 0 if not self.few_rows else COLUMNS_ROWS if self.columns else FEW_ROWS

    def columns_form(self) -> MatmulVariant | None:
        """The build this one's calls of at most COLUMNS_ROWS rows run on a GPU of ``columns_on``:
        the columns form, for the nested one-tile builds of the tile's WARPS; else None."""
        tile = DECODE_TILES[0]
        if self.columns or not (self.nested and self.tokens == tile and self.warps == WARPS[tile]):
            return None
        return MatmulVariant(self.dtype, self.quant_type, True, tile, True, columns=True)

    @property
    def name(self) -> str:
        scales, few = "nested" if self.nested else "plain", "-few" if self.few_rows else ""
        cols = "-cols" if self.columns else ""
        return f"mm4-{self.quant_type}-{self.dtype}-{scales}-m{self.tokens}-w{self.warps}{few}{cols}"

    def builds_on(self, arch: str) -> bool:
        """Whether this variant is built for a GPU of ``arch``: the WIDE_WARPS builds only where the
        wgmma kernel runs them (on sm_80 its 12 warps would spill), the columns form only there too."""
        if self.columns:
            return arch in WGMMA_TARGETS
        return self.warps == WARPS[self.tokens] or arch in WGMMA_TARGETS

    def alternative(self, arch: str) -> MatmulVariant | None:
        """The other build of this call on a GPU of ``arch`` its plan may give way to (``pick_plan``):
        the WIDE_WARPS build of the tile's WARPS one where it is built; else None."""
        other = WIDE_WARPS.get(self.tokens)
        if other is None or self.warps == other:
            return None
        built = dataclasses.replace(self, warps=other)
        return built if built.builds_on(arch) else None

    def build(self, arch: str) -> tuple[str, str]:
        """(kernel source, compile target) of this variant on a GPU of ``arch`` (``sm_XY``)."""
        if self.tokens in (PAIR_TILES if self.nested else DECODE_TILES):
            return (SOURCE_M8_PAIRS if self.nested else SOURCE_M8), arch
        if arch in WGMMA_TARGETS:
            return SOURCE_SM90, WGMMA_TARGETS[arch]
        return SOURCE_WIDE, arch

    def grid_rule(self, arch: str) -> str:
        """The rule (``GRID_RULES``) this variant's grid follows on a GPU of ``arch``."""
        return grid_rule_of(self.build(arch)[0])

    def cluster_splits(self, arch: str) -> int:
        """The most splits of K one thread block cluster adds in this variant's kernel on a GPU of
        ``arch`` (0: the splits are the finish kernel's)."""
        if int(arch[3:]) < CLUSTER_ARCH:
            return 0
        return CLUSTER_SPLITS.get((self.build(arch)[0], self.tokens), 0)

    def deep(self, arch: str) -> bool:
        """Whether this build is the wgmma kernel's deep one (``MM_DEEP``: three activation stages, so a
        step never drains the tensor cores, and 4 slices a commit): the nested 8-warp 128-token
        build, 4.4-4.7% faster on a 70B gate weight; the plain and 12-warp builds were not helped
        (kernels/NOTES.md, "Three stages for the 128-token tile")."""
        return (
            self.build(arch)[0] == SOURCE_SM90
            and (self.tokens, self.warps) == (WIDE_DYNAMIC_TILE, WARPS[WIDE_DYNAMIC_TILE])
            and self.nested
        )

    def dynamic_shared_bytes(self, arch: str) -> int:
        """Bytes of dynamic shared memory every launch of this variant's main kernel on ``arch`` passes
        (0: its shared memory is all static)."""
        source = self.build(arch)[0]
        # Past the 48 KB a kernel may declare. The pair table, then two stages of the activation
        # tile with its padding (8 slots a row: kernels/matmul_4bit_m8_pairs.cu).
        if source == SOURCE_M8_PAIRS and self.tokens != DECODE_TILES[0]:
            return PAIR_TABLE_BYTES + 2 * self.tokens * (STEP_K_M8 // 8 + 8) * 16
        # The wgmma kernel's table of code pairs from 64 tokens (kernels/matmul_4bit_sm90.cu), then the
        # wide kernels' stages at 128 tokens (two; three in the deep build): 16 bytes a token and 8 k,
        # 16 bytes of padding a k16 slice in the wgmma kernel's.
        pairs = WIDE_PAIR_TABLE_BYTES if source == SOURCE_SM90 and self.tokens >= WIDE_PAIRS_TILE else 0
        if self.tokens == WIDE_DYNAMIC_TILE:
            slice_padding = 16 * (STEP_K_WIDE // 16) if source == SOURCE_SM90 else 0
            stages = 3 if self.deep(arch) else 2
            return pairs + stages * (self.tokens * STEP_K_WIDE * 2 + slice_padding)
        return pairs

    def macros(self, arch: str) -> tuple[tuple[str, str], ...]:
        """The compile macros of this variant's kernel on a GPU of ``arch``."""
        base = (
            ("MM_DTYPE", str(DTYPES.index(self.dtype))),
            ("MM_QUANT", str(QUANT_TYPES.index(self.quant_type))),
            ("MM_NESTED", "1" if self.nested else "0"),
            ("MM_TOKENS", str(self.tokens)),
            ("MM_WARPS", str(self.warps)),
            ("MM_CLUSTER_SPLITS", str(self.cluster_splits(arch))),
        )
        # Set only where they apply, so the other builds' specs stay as they were.
        few = (("MM_FEW_ROWS", str(self.rows_read)),) if self.few_rows else ()
        cols = (("MM_COLUMNS", "1"),) if self.columns else ()
        return base + few + cols + ((("MM_DEEP", "1"),) if self.deep(arch) else ())


def all_variants(arch: str | None = None) -> list[MatmulVariant]:
    """Every build a call can launch; with ``arch``, those built for a GPU of it (``builds_on``)."""
    every = [MatmulVariant(*v) for v in itertools.product(DTYPES, QUANT_TYPES, (False, True), TOKEN_TILES)]
    few = [
        MatmulVariant(d, q, True, DECODE_TILES[0], True, columns=columns)
        for d, q, columns in itertools.product(DTYPES, QUANT_TYPES, (False, True))
    ]
    wide = [
        MatmulVariant(d, q, nested, tokens, warps=warps)
        for (tokens, warps), d, q, nested in itertools.product(WIDE_WARPS.items(), DTYPES, QUANT_TYPES, (False, True))
    ]
    return [v for v in every + few + wide if arch is None or v.builds_on(arch)]


def variant_for(
    dtype: str, quant_type: str, nested: bool, m: int, elements: int, warps: int = 0, tokens: int = 0
) -> MatmulVariant:
    """The variant that multiplies ``m`` rows of a weight of ``elements`` (N * K): its token tile
    (``tile_for``; ``tokens``, one of the call's ``tile_choices``, instead where given: the grid
    sweep times each), and for at most ``FEW_ROWS`` rows of a weight with nested scales the few-rows
    build (on a GPU that runs the columns form, ``plan_for_rows`` gives the calls of up to
    ``COLUMNS_ROWS`` rows that form's plan); ``warps`` a block (0: the tile's WARPS; a call may take its
    alternative: ``pick_plan``). Raises ValueError for a tile the call cannot run."""
    if tokens and tokens not in tile_choices(m, nested):
        raise ValueError(f"a call of {m} rows does not run the {tokens}-token tile")
    tile = tokens or tile_for(m, nested, elements)
    return MatmulVariant(dtype, quant_type, nested, tile, nested and m <= FEW_ROWS, warps)


def spec_for(variant: MatmulVariant, arch: str) -> jit.CompileSpec:
    """The compile spec of ``variant`` for a GPU of ``arch``."""
    source, target = variant.build(arch)
    return launcher.source_spec(source, target, variant.macros(arch), variant.name)


def step_k(rule: str) -> int:
    """k one warp covers per step in a kernel whose grids follow ``rule`` (``grid_rule_of``)."""
    if rule not in (BUSIEST_SM, WAVES, WAVES_WIDE):  # a token count passed for a rule, say
        raise ValueError(f"no grid rule {rule!r}")
    return STEP_K_WIDE if rule == WAVES_WIDE else STEP_K_M8


def steps_of(K: int, rule: str) -> int:
    """Steps of ``step_k(rule)`` k a grid covers for K."""
    return -(-K // step_k(rule))


def block_warps(tokens: int, warps: int = 0) -> int:
    """Warps a block of the kernel for this token tile runs: ``warps``, 0 for the tile's WARPS."""
    return warps or WARPS[tokens]


def threads(tokens: int, warps: int = 0) -> int:
    """Threads a block of the kernel for this token tile runs."""
    return block_warps(tokens, warps) * 32


def features_per_block(tokens: int, warps: int = 0) -> int:
    """Output features a block of the kernel for this token tile computes (16 a warp)."""
    return block_warps(tokens, warps) * 16


def token_tile(m: int) -> int:
    """The smallest token tile holding ``m`` tokens (the largest for more: the grid covers the rest)."""
    return next((t for t in TOKEN_TILES if m <= t), TOKEN_TILES[-1])


def tile_choices(m: int, nested: bool) -> tuple[int, ...]:
    """The token tiles a call of ``m`` rows may run, whatever the weight's size (``tile_for`` picks by
    it): for 17-32 rows of a weight with nested scales two of the pair-table kernel's 16-token
    tiles or the smallest tile holding them (its 32-token tile); else only that one (``token_tile``)."""
    largest = DECODE_TILES[-1]
    if nested and largest < m <= 2 * largest:
        return largest, token_tile(m)
    return (token_tile(m),)


def tile_for(m: int, nested: bool, elements: int) -> int:
    """The token tile a call of ``m`` rows of a weight of ``elements`` (N * K) runs: of its
    ``tile_choices``, the first for a weight of at most ``TWO_TILE_ELEMENTS``, else the last."""
    choices = tile_choices(m, nested)
    return choices[0] if elements <= TWO_TILE_ELEMENTS else choices[-1]


def tile_arithmetic(tokens: int, nested: bool) -> str:
    """``ARITHMETIC`` of the kernel of this token tile for weights with nested scales or not (the
    same on every GPU arch: only the wide tiles' source depends on it)."""
    source = MatmulVariant(DTYPES[0], QUANT_TYPES[0], nested, tokens).build("sm_80")[0]
    return ARITHMETIC.get(source, "dequantized")


def arithmetic(m: int, nested: bool, elements: int) -> str:
    """``tile_arithmetic`` of the tile that multiplies ``m`` tokens of a weight of ``elements``."""
    return tile_arithmetic(tile_for(m, nested, elements), nested)


def takes_shape(K: int, blocksize: int) -> bool:
    """Shapes the kernel computes: K a multiple of 32 (every model's is), blocks of 32 or more."""
    return K > 0 and K % K_MULTIPLE == 0 and blocksize >= K_MULTIPLE


@dataclass(frozen=True)
class Grid:
    blocks: tuple[int, int, int]  # feature groups, splits of K, token tiles
    steps_per_split: int
    clustered: bool = False  # the splits of a feature group and token tile run as one cluster

    @property
    def splits(self) -> int:
        return self.blocks[1]

    @property
    def finished(self) -> bool:
        """Whether the finish kernel adds the splits (split, and not added inside a cluster)."""
        return self.splits > 1 and not self.clustered

    def workspace_elements(self, M: int, N: int) -> int:
        """fp32 partial sums the launch needs: one [M, N] slice per split the finish adds, else none."""
        return self.splits * M * N if self.finished else 0

    def finish_blocks(self, M: int, N: int) -> int:
        """Blocks of ``FINISH_THREADS`` the finish runs (one thread an output, grid-strided past 65535)."""
        return max(1, min(-(-(M * N) // FINISH_THREADS), 65535))


# Partial sums of all splits together at most this share of the packed weights' bytes: a split's
# slice is written and read back once, so more splits only pay while the weights dominate. A quarter
# left the 1024x8192 weight 2 splits at 128 rows (16 blocks on 132 SMs): 46 µs; with as many bytes
# as the weights, 8 splits take 20.5 (H100, kernels/NOTES.md, "Splits for the small weights").
PARTIAL_SHARE = 1.0
# The 128-token tile holds one block an SM (64 accumulators a thread), so the wide tiles' one-wave
# rule left the weights of a few more feature groups than SMs in two waves, the second mostly empty
# (gemma-3-27b's 21504x5376 at 128 rows unsplit 152 µs, in 3 splits 120), and the small weights short
# of splits by the cap above (1024x8192: 8 splits on 64 SMs, 22.8 µs; 16 splits 18.2). It follows
# the waves rule, with partial sums of up to PARTIAL_FLOOR_BYTES whatever the weight (they stay in
# L2): over 60 weights at 96 and 128 rows of an H200 sweep, 1.011x the fastest grid (geometric mean;
# the one-wave rule 1.074x, the waves rule without the floor 1.057x; kernels/NOTES.md). The 64-token
# tile (2 blocks an SM) follows it too: under the one-wave rule a gate weight of a few more feature
# groups than a wave holds took 2 clustered splits where 3 of the waves rule ran 9-11% faster
# (gemma-3-27b 21504x5376 at 64 rows 78.3 -> 69.4 µs, H100; kernels/NOTES.md, "The 64-token tile
# on the waves rule"). So does the 32-token tile (5 blocks an SM): the one-wave rule ran the large
# gate weights unsplit (28672x8192 at 32 rows 121.7 µs where 5 finished splits took 110.1, H200);
# on the waves rule (its price: WAVES_PRICES), replayed on a sweep of every grid of 30 weights at 32
# rows (H200), 1.039x the fastest grid -> 1.019x; side by side the gate weight 0.91x (kernels/NOTES.md,
# "The grid sweep at 32 rows").
WAVES_WIDE_TILES = (32, 64, 128)
PARTIAL_FLOOR_BYTES = 8 << 20
# The finish adds a value's splits one after another: more than this many and its latency shows.
MAX_SPLITS = 16
# Where the GPU has thread block clusters (sm_90 on), a grid's splits of K may run as one cluster
# per feature group and token tile, which adds them itself (kernels/matmul_4bit_common.cuh): no
# finish launch (about 4 µs a call on an H100) and no workspace. Only where the clusters fit in as
# many waves as the blocks would: the GPU holds fewer clusters at once than blocks / splits (the
# 8192x8192 weight at one row: 124 clusters of 4 against 128, so 4 ran as a second wave, 30.5 -> 33.4
# µs), kernels/NOTES.md.
CLUSTER_ARCH = 90  # the first GPU arch with thread block clusters
# The kernels compiled with the cluster epilogue, by (source, token tile): the most splits a cluster
# adds. The decode kernels (DECODE_TILES, PAIR_TILES) up to MAX_SPLITS (past PORTABLE_CLUSTER_BLOCKS the kernel
# needs the driver's leave, `launcher.allow_nonportable_clusters`); the Hopper kernel at 64 tokens in
# pairs (the only size measured there). Compiled into the wide 16- and 32-token kernels the epilogue
# made their main loops up to 6% slower; into the 64-token one, no slower (kernels/NOTES.md).
CLUSTER_SPLITS = {
    **{(SOURCE_M8, t): 16 for t in DECODE_TILES},
    **{(SOURCE_M8_PAIRS, t): 16 for t in PAIR_TILES},
    (SOURCE_SM90, 64): 2,
}
PORTABLE_CLUSTER_BLOCKS = 8  # the most blocks a cluster has on every GPU with clusters
# Clusters of more than 2 splits pay in grids of at most a block an SM; and of at most this many
# blocks an SM with splits of at most this many steps. First fit to grids against the finish at one
# and 8 rows (kernels/NOTES.md): up to a block an SM 0.71-0.98x its time; with splits of 7-8 steps
# 0.97-1.035x (5 of 6 slower); in grids of 3-14 blocks an SM with splits of 7 or more steps (weights
# of 8192 and 28672 features) 1.00-1.26x. Then to a grid sweep of the shapes catalog on an H100
# (``harness.perf.grid_sweep``): up to 6 blocks an SM, any number of clusters (up to 2 and 64 before),
# took its 8-token picks from 1.049x the fastest grid (geometric mean, 28 cases) to 1.018x and on 32
# cases of four other models' weights from 1.056x to 1.031x, none slower (kernels/NOTES.md).
LARGE_CLUSTER_BLOCKS_PER_SM = 6
LARGE_CLUSTER_STEPS = 5
# Under the waves rule (the pair-table kernel's) clusters of any size pay where the grid runs in one
# wave, however many steps a split runs (unless the clustered pair runs no more steps on the busiest
# SM), and past the splits' cap clustered splits (no partial sums) may run down to a single step
# while the grid holds at most CLUSTER_PAST_CAP_BLOCKS_PER_SM blocks an SM. Replayed on the recorded
# sweeps of 30 weights at 1, 8 and 16 rows, the rule's picks went from 1.035x the fastest grid to
# 1.012x on the H200's (geometric mean of 90 cases; held-out models' weights 1.037 -> 1.011) and from
# 1.043x to 1.015x on the H100's (held-out 1.046 -> 1.016); of the 27 picks that changed on each,
# none slower by more than 2.3%: the small weights' fastest grids are 10-16 clustered splits of 1-2
# steps (qwen2.5-7b's k 512x3584: 14 of one step, 14-17% faster than 4 of 4), the mid weights' 4-8
# clustered splits of 7-14 (kernels/NOTES.md, "The waves rule's clusters refit on the recorded sweeps").
WAVES_CLUSTER_STEPS = 1
CLUSTER_PAST_CAP_BLOCKS_PER_SM = 2
# A split runs at least this many steps: its first loads (a memory latency before any decode)
# are paid once per split. Splits of 2 steps left the 1024x8192 weight 14.8 µs at one row, of 4
# 13.4 (same notes). The 8-token kernel's splits of 3 steps, added in clusters, were the fastest
# grid of four small weights in the same sweep (gemma-3-27b k_proj at one row 12.5 -> 10.7 µs).
MIN_SPLIT_STEPS = 4
MIN_SPLIT_STEPS_M8 = 3
# A step of the 128-token tile multiplies each weight with 4x the 32-token tile's tokens, so a
# split's first loads weigh less there: its splits run down to 2 steps. Replayed on the recorded
# sweeps' 128-row cases, the rules went from 1.010x the fastest grid to 1.003x (H100, both builds;
# worst 1.14 -> 1.07) and to 1.005x (H200, 8 warps; worst 1.14 -> 1.09): only three small weights'
# picks changed (k 512-1024 features: 1-13% faster on the H100, +2.4% to -12% on the H200;
# kernels/NOTES.md, "Splits of 2 steps at 128 tokens"). The 64-token tile's run down to 3 (same
# notes as WAVES_WIDE_TILES: 2 made two small k weights' picks 4-7% slower on both GPUs' sweeps).
# The 32-token tile's down to 2 as well: on its 32-row sweep 1.019x the fastest grid, 1.023 at 3
# and 4 steps (worst 1.11 against 1.13; only small weights' picks differ).
MIN_SPLIT_STEPS_WIDE = {32: 2, 64: 3, 128: 2}
# Splits start at the fewest that give the GPU this share of the blocks it can hold at once.
FILL = 0.9
# Two splits added in a cluster replace a finished grid whose busiest SM runs as many steps, where a
# split of the two runs at most this many: the finish launch (about 4 µs on an H100) then costs more
# than running half the blocks an SM. Measured at one row (8 alike): 8192x8192 31.0 -> 28.8 µs (16 steps
# a split), 4096x4096 15.6 -> 13.5 (8), 8192x5120 22.6 -> 20.9 (10); but 4096x14336 28.2 -> 29.7 (28)
# and 8192x28672 79.7 -> 80.4 (56) (kernels/NOTES.md).
CLUSTER_PAIR_STEPS = 16


def min_split_steps(tokens: int, rule: str) -> int:
    """The fewest steps a split of K runs (the last may run fewer) with this token tile under ``rule``."""
    return MIN_SPLIT_STEPS_WIDE.get(tokens, MIN_SPLIT_STEPS) if rule == WAVES_WIDE else MIN_SPLIT_STEPS_M8


def busiest_sm_steps(blocks: int, steps_per_split: int, sms: int) -> int:
    """Steps the busiest SM runs when ``blocks`` blocks of ``steps_per_split`` steps share ``sms`` SMs."""
    return -(-blocks // sms) * steps_per_split


# Every fused call asks for its grid: a pure function of a few ints, searched once per shape.
@functools.lru_cache(maxsize=4096)
def grid_for(
    M: int,
    N: int,
    K: int,
    tokens: int,
    blocks_per_sm: int,
    sms: int,
    max_clusters: tuple[int, ...] = (),
    *,
    rule: str,
    warps: int = 0,
) -> Grid:
    """How K is split, as far as the partial sums stay within ``PARTIAL_SHARE`` of the weights'
    bytes, a split runs at least ``min_split_steps`` (the last may run fewer) and there are at
    most ``MAX_SPLITS``; and whether the splits run as clusters (``clusters_fit``, with
    ``max_clusters[s]`` clusters of s splits the GPU holds at once, empty where it has none).

    The decode kernels (``DECODE_TILES``, ``PAIR_TILES``) whose ``rule`` is ``BUSIEST_SM``, at ``BUSIEST_SM_BLOCKS``
    blocks an SM, keep every SM's integer pipe busy, so a launch lasts as long as its busiest SM: K
    is split from the fewest parts that fill ``FILL`` of the blocks the GPU holds at once
    (``blocks_per_sm`` on each of ``sms`` SMs) up to twice that, choosing the split whose busiest SM
    runs the fewest steps (the fewest splits on a tie). 448 feature groups on 132 SMs, unsplit,
    leave some SMs 4 blocks and others 3; split in two, 7 half-blocks against 6.8. Where that split
    has more than 2 parts, two splits added in a cluster take its place (before its own cluster,
    where it would have one) if their busiest SM runs no more steps and a split at most
    ``CLUSTER_PAIR_STEPS``.

    With fewer blocks an SM, or by their rule (``WAVES``), they take the split of the waves rule
    (``waves_grid``) with the fewest waves times steps, where splits added in a cluster may pass
    the cap and run down to ``WAVES_CLUSTER_STEPS`` steps; at ``BUSIEST_SM_BLOCKS`` or more, where that
    grid is not clustered, two splits (clustered where they fit) take its place if their busiest SM
    runs no more steps and a split at most ``CLUSTER_PAIR_STEPS`` (the waves rule alone left the
    gate weight 28672x8192 unsplit: 59.7 µs at one row against the pair's 54.7, H100).

    The wide kernels' tiles (rule ``WAVES_WIDE``) take the waves rule's grid too, their partial sums
    allowed ``PARTIAL_FLOOR_BYTES``; under either waves rule each tile's grids are priced by
    ``WAVES_PRICES``. The pair above is the decode kernels' only: the wide 32-token tile holds
    ``BUSIEST_SM_BLOCKS`` or more blocks an SM but no clusters, and a finished pair there gave
    4096x4096 at 32 rows 1.35x the fastest grid's time (H200 sweep).
    ``warps``: the build's warps a block (0: the tile's WARPS)."""
    wide = rule == WAVES_WIDE
    groups, tiles, steps = -(-N // features_per_block(tokens, warps)), -(-M // tokens), steps_of(K, rule)
    partial_bytes = max(PARTIAL_SHARE * (N * K / 2), PARTIAL_FLOOR_BYTES if wide else 0)
    cap = max(1, min(steps // min_split_steps(tokens, rule), MAX_SPLITS, int(partial_bytes // (4 * M * N))))
    units = groups * tiles

    def shape(splits: int) -> tuple[int, int]:  # (splits without an empty one, steps per split)
        per_split = -(-steps // splits)
        return -(-steps // per_split), per_split

    def cost(splits: int) -> tuple[int, int]:
        n, per_split = shape(splits)
        return busiest_sm_steps(units * n, per_split, sms), n

    # Two splits (in a cluster where they fit): what each rule's grid below may give way to. A
    # decode kernel's pair is no slower than n splits where a split runs at most CLUSTER_PAIR_STEPS
    # and its busiest SM no more steps.
    pair_n, pair_steps = shape(2)
    pair_fits = pair_n == 2 and clusters_fit(units, 2, pair_steps, blocks_per_sm, sms, max_clusters)

    def pair_no_slower(n: int) -> bool:
        return pair_n == 2 and pair_steps <= CLUSTER_PAIR_STEPS and cost(2)[0] <= cost(n)[0]

    if wide or rule == WAVES or blocks_per_sm < BUSIEST_SM_BLOCKS:
        # Past the cap, only grids whose splits a cluster adds (no partial sums), down to
        # WAVES_CLUSTER_STEPS steps, and at most CLUSTER_PAST_CAP_BLOCKS_PER_SM blocks an SM.
        most = cap if wide else max(cap, min(steps // WAVES_CLUSTER_STEPS, MAX_SPLITS))
        options = (
            waves_grid(
                groups,
                tiles,
                steps,
                s,
                blocks_per_sm,
                sms,
                max_clusters,
                waves_price(tokens, rule),
                partial_sums_mb(M * N),
            )
            for s in range(1, most + 1)
        )
        allowed = (
            o
            for o in options
            if o[1].splits <= cap or (o[1].clustered and o[1].splits * units <= CLUSTER_PAST_CAP_BLOCKS_PER_SM * sms)
        )
        grid = min(allowed, key=lambda option: option[0])[1]
        n = grid.splits
        # The pair also replaces clusters that only the waves rule's one-wave allowance admits.
        replaceable = not grid.clustered or not clusters_fit(
            units, n, grid.steps_per_split, blocks_per_sm, sms, max_clusters
        )
        decode_pair = not wide and blocks_per_sm >= BUSIEST_SM_BLOCKS
        pair_pays = decode_pair and n != 2 and replaceable and pair_no_slower(n)
        return Grid((groups, 2, tiles), pair_steps, pair_fits) if pair_pays else grid
    fill = next((s for s in range(1, cap + 1) if units * s >= FILL * blocks_per_sm * sms), cap)
    n, per_split = shape(min(range(fill, min(cap, 2 * fill) + 1), key=cost))
    if pair_fits and n > 2 and pair_no_slower(n):  # before a cluster of more splits: the pair measured faster there
        return Grid((groups, 2, tiles), pair_steps, True)
    return Grid((groups, n, tiles), per_split, clusters_fit(units, n, per_split, blocks_per_sm, sms, max_clusters))


def waves_grid(
    groups: int,
    tiles: int,
    steps: int,
    splits: int,
    blocks_per_sm: int,
    sms: int,
    max_clusters: tuple[int, ...],
    price: WavesPrice = WavesPrice(),
    split_mb: float = 0.0,
) -> tuple[tuple[float, int], Grid]:
    """((cost, splits), grid) of the waves rule (``WAVE_STEPS``) for K in ``splits`` splits (fewer where
    one would be empty): the grid of the smallest (cost, splits) is taken, the fewest splits on a tie."""
    per_split = -(-steps // splits)
    n, units = -(-steps // per_split), groups * tiles
    clustered = clusters_fit(units, n, per_split, blocks_per_sm, sms, max_clusters, waves_rule=True)
    grid = Grid((groups, n, tiles), per_split, clustered)
    return (waves_cost(grid, blocks_per_sm, sms, price, split_mb), n), grid


def waves_cost(
    grid: Grid, blocks_per_sm: int, sms: int, price: WavesPrice = WavesPrice(), split_mb: float = 0.0
) -> float:
    """The waves rule's cost of a grid, in steps: its waves (blocks over what the GPU holds at once)
    times a split's steps (longer by ``price.shared_sm_step`` for each further block on the busiest
    SM of a full wave) plus WAVE_STEPS, plus where the finish adds the splits its flat price and its
    price a MB of the splits' partial sums (``split_mb`` MB a split)."""
    groups, splits, tiles = grid.blocks
    blocks = groups * splits * tiles
    waves = -(-blocks // (blocks_per_sm * sms))
    sharing = -(-min(blocks, blocks_per_sm * sms) // sms) - 1
    cost = waves * (grid.steps_per_split * (1 + price.shared_sm_step * sharing) + WAVE_STEPS)
    if grid.finished:
        cost += price.finish_steps + price.finish_steps_per_mb * split_mb * splits
    return cost


def clusters_fit(
    units: int,
    splits: int,
    steps_per_split: int,
    blocks_per_sm: int,
    sms: int,
    max_clusters: tuple[int, ...],
    waves_rule: bool = False,
) -> bool:
    """Whether ``units`` clusters of ``splits`` blocks (one per feature group and token tile) pay:
    clusters of 2, or of more where the grid has at most a block an SM, or at most
    ``LARGE_CLUSTER_BLOCKS_PER_SM`` with splits of at most ``LARGE_CLUSTER_STEPS`` steps (under the
    waves rule, ``waves_rule``: where the grid runs in one wave); and only where they run in as
    many waves as their blocks would on their own."""
    if not 1 < splits < len(max_clusters) or not max_clusters[splits]:
        return False
    blocks = units * splits
    if splits > 2 and blocks > sms:
        if waves_rule:
            if blocks > blocks_per_sm * sms:
                return False
        elif blocks > LARGE_CLUSTER_BLOCKS_PER_SM * sms or steps_per_split > LARGE_CLUSTER_STEPS:
            return False
    return -(-units // max_clusters[splits]) <= -(-blocks // (blocks_per_sm * sms))


@dataclass(frozen=True)
class Plan:
    main: launcher.LoadedKernel
    finish: launcher.LoadedKernel
    threads: int  # a main kernel block's
    blocks_per_sm: int  # main kernel blocks one SM holds at once
    sms: int
    max_clusters: tuple[int, ...]  # [s]: clusters of s splits the GPU holds at once (empty: no clusters)
    rule: str  # the variant's grid rule (GRID_RULES)
    warps: int = 0  # a block's (0: the token tile's WARPS)
    alternative: MatmulVariant | None = None  # the other build of its calls on this GPU (pick_plan)
    columns: MatmulVariant | None = None  # the build its calls of up to COLUMNS_ROWS rows run (plan_for_rows)

    def grid(self, M: int, N: int, K: int, tokens: int) -> Grid:
        return grid_for(
            M, N, K, tokens, self.blocks_per_sm, self.sms, self.max_clusters, rule=self.rule, warps=self.warps
        )

    def cost(self, M: int, N: int, K: int, tokens: int) -> float:
        """Its grid's waves cost (``waves_cost``) times its block's step time (``STEP_TIME``), plus
        the finish's read of the partial sums (``FINISH_STEPS_PER_MB``)."""
        grid = self.grid(M, N, K, tokens)
        # No split_mb: the waves price leaves out the partial sums' read, priced once below.
        steps = waves_cost(grid, self.blocks_per_sm, self.sms, waves_price(tokens, self.rule))
        steps *= STEP_TIME.get((tokens, self.warps), 1.0)
        return steps + FINISH_STEPS_PER_MB * partial_sums_mb(grid.workspace_elements(M, N))

    def runs(self, grid: Grid, M: int, N: int, K: int, tokens: int) -> bool:
        """Whether the main kernel computes a call on ``grid``, picked by the rules or not: a block
        for every feature group and token tile, every step of K in one split and no split empty,
        and clusters only of the sizes its epilogue adds and this GPU holds."""
        groups, splits, tiles = grid.blocks
        per_split, steps = grid.steps_per_split, steps_of(K, self.rule)
        return (
            groups == -(-N // features_per_block(tokens, self.warps))
            and tiles == -(-M // tokens)
            and per_split > 0
            and (splits - 1) * per_split < steps <= splits * per_split
            and (not grid.clustered or (1 < splits < len(self.max_clusters) and self.max_clusters[splits] > 0))
        )


_plans: dict[tuple, Plan] = {}


def plan(variant: MatmulVariant, device_index: int) -> Plan:
    """The plan of ``variant``'s build on this GPU, made once; on a GPU that runs the columns form
    (``columns_on``) it names that form for the calls of up to COLUMNS_ROWS rows (``Plan.columns``):
    the one place the GPU is asked, and so the one a caller's ``plan_of`` stands in for."""
    key = (variant, device_index)
    if (hit := _plans.get(key)) is None:
        spec = functools.partial(spec_for, variant)
        arch = launcher.device_arch(device_index)
        shared = variant.dynamic_shared_bytes(arch)
        main = launcher.load_spec(variant.name, spec, ENTRY, device_index, MAIN_PARAMS, shared)
        finish = launcher.load_spec(f"{variant.name}-finish", spec, FINISH, device_index, FINISH_PARAMS)
        block = threads(variant.tokens, variant.warps)
        sizes = variant.cluster_splits(arch)
        with launcher.device_context(device_index):  # the driver's answers need the GPU's context
            per_sm = main.kernel.occupancy.max_active_blocks_per_multiprocessor(block, shared)
            if sizes > PORTABLE_CLUSTER_BLOCKS:
                launcher.allow_nonportable_clusters(main)
            clusters = tuple(launcher.max_clusters(main, block, (1, s, 1)) for s in range(sizes + 1)) if sizes else ()
        hit = _plans[key] = Plan(
            main, finish, block, max(1, per_sm), _sm_count(device_index), clusters, variant.grid_rule(arch),
            variant.warps, variant.alternative(arch), columns_of(variant, device_index),
        )  # fmt: skip
    return hit


def columns_of(variant: MatmulVariant, device_index: int) -> MatmulVariant | None:
    """The build ``variant``'s calls of up to COLUMNS_ROWS rows run on this GPU in its place: its
    columns form where it has one and the GPU runs it (``columns_on``); else None."""
    form = variant.columns_form()
    return form if form is not None and columns_on(device_index) else None


def plan_for_rows(variant: MatmulVariant, device_index: int, M: int, plan_of=plan) -> Plan:
    """The plan of a call of ``M`` rows of ``variant``'s on its GPU: the columns form's where the
    build's plan names one (``Plan.columns``) and ``M`` <= COLUMNS_ROWS; else the build's own."""
    first = plan_of(variant, device_index)
    if first.columns is not None and M <= COLUMNS_ROWS:
        return plan_of(first.columns, device_index)
    return first


def pick_plan(variant: MatmulVariant, device_index: int, M: int, N: int, K: int, plan_of=plan) -> Plan:
    """The plan of a call of ``variant``'s on its GPU: its rows' (``plan_for_rows``), or its
    alternative build's (``MatmulVariant.alternative``) where that costs less (``Plan.cost``; the
    first on a tie). ``plan_of(variant, device_index)`` gives a build's plan."""
    first = plan_for_rows(variant, device_index, M, plan_of)
    if first.alternative is None:
        return first
    return cheapest((first, plan_of(first.alternative, device_index)), M, N, K, variant.tokens)


def cheapest(plans, M: int, N: int, K: int, tokens: int) -> Plan:
    """The plan of ``plans`` whose grid costs least for the call (``Plan.cost``), the first on a tie."""
    return min(plans, key=lambda p: p.cost(M, N, K, tokens))


@functools.cache
def _sm_count(device_index: int) -> int:
    from cuda.core import Device

    return Device(device_index).properties.multiprocessor_count


@functools.cache
def columns_on(device_index: int) -> bool:
    """Whether this GPU's calls of up to COLUMNS_ROWS rows run the columns form: built for its arch,
    and ``columns_pay`` by the driver's figures (DRAM clock in kHz, double data rate, bus width in
    bits; SM clock in kHz)."""
    from cuda.core import Device

    if launcher.device_arch(device_index) not in WGMMA_TARGETS:
        return False
    props = Device(device_index).properties
    dram = 2 * props.memory_clock_rate * 1e3 * props.global_memory_bus_width / 8
    return columns_pay(dram, _sm_count(device_index), props.clock_rate * 1e3)


def launch_args(
    grid: Grid,
    A_ptr: int,
    scales: tuple[int, int, int, int, int, float],
    workspace_ptr: int,
    bias_ptr: int,
    out_ptr: int,
    M: int,
    N: int,
    K: int,
    blocksize: int,
    blocksize2: int,
) -> tuple[tuple, tuple]:
    """The main kernel's arguments (``MAIN_PARAMS``) and the finish's (``FINISH_PARAMS``);
    ``scales`` holds (packed weights, absmax, code2, absmax2, offset pointer, offset value); the
    workspace holds ``grid.workspace_elements(M, N)`` fp32 (no initial value: every element is
    written). Either value may be a ``recipe.Ref`` the host path fills per call."""
    main_args = (
        A_ptr, *scales, workspace_ptr, bias_ptr, out_ptr, M, N, K, blocksize.bit_length() - 1,
        blocksize2.bit_length() - 1, grid.steps_per_split,
    )  # fmt: skip
    return main_args, (workspace_ptr, bias_ptr, out_ptr, M, N, grid.splits)


def cluster_of(grid: Grid) -> int:
    """Blocks a cluster of the main launch holds along y (1: no cluster)."""
    return grid.splits if grid.clustered else 1
