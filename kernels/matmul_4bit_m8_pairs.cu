// Fused 4-bit matmul for up to 32 tokens (decode; one, two or four mma token tiles of 8) of a weight with
// nested scales: out[m, n] = sum_k A[m, k] * W[n, k] (+ bias[n]), W in the bitsandbytes packed
// format (kernels/dequantize_4bit.cu states it), never written out. Plain scales run
// matmul_4bit_m8.cu (this arithmetic measured less accurate than bitsandbytes' there:
// kernels/NOTES.md); more tokens matmul_4bit.cu (matmul_4bit_sm90.cu on Hopper);
// matmul_4bit_common.cuh holds the macros, the host contract, the mma and the epilogue they share.
//
// Arithmetic (differs from the wider kernels, which multiply dequantized weights): a weight's code
// is rounded once to A's dtype, multiplied by the activations in mma.sync (exact products, fp32
// sums), and the block's fp32 scale, formed as the dequantization kernel forms it, multiplies the
// fp32 sum of each CHUNK of k inside one scale block, added to the fp32 accumulator by one fma:
//   acc += scale_b * sum_{k in chunk} round(code[c_k]) * a_k,   out = round(acc (+ splits, + bias)).
// So a one-hot row gives round_out(fp32(scale * round(code))), not the dequantized weight's bits,
// and the error against the exact weights (code * scale, fp64) is the codes' rounding (2^-11 fp16,
// 2^-8 bf16, relative) plus fp32 sums: measured below bitsandbytes' with nested (full fp32) scales.
// harness/correctness/matmul_reference.py states the bound and emulates the one-hot case.
//
// Why: decoding a weight is the work at one token tile (every decoded weight feeds one mma). With
// the scale off the weight, the decode is a lookup in a fixed table of pairs, two weights (one
// packed byte) a lookup: a byte placed into an address by one prmt and one shared-memory load (the
// table's base rides in the load's uniform register). 32 copies of each entry, one per bank, so a
// warp's 32 random bytes never conflict: entry e's copy for lane l is word 64 * (e & 127) + 32 *
// (e >> 7) + l, 32 KB. The register tables cost 2 prmt and 0.6 other instructions per weight plus a
// table per scale block; this costs 1.25 per weight (2.71 a weight in all with 8-byte weight
// loads, 3.10 with 16-byte ones, 4.58 with the register tables: NOTES).
//
// Layout: mma.sync.m16n8k16, weights as operand A (16 features x 16 k), activations as operand B
// (16 k x 8 tokens; at 16 and 32 tokens each decoded fragment feeds the mmas of every token tile). One
// warp owns 16 features, lane (g = lane / 4, t = lane % 4) features g and g + 8. A chunk (CHUNK_K
// k, one scale block or less) is CHUNK_K / 16 mmas; lane t holds the chunk's k t * CHUNK_K / 4 ..
// + CHUNK_K / 4 - 1 of both its features (CHUNK_K / 8 bytes each) and mma j takes its codes 4j ..
// 4j + 3: fragment slots (2t, 2t + 1) and (2t + 8, 2t + 9) of mma j are k 4j + {0, 1} and
// 4j + {2, 3} of lane t's run, identically for both operands. Where K % 128 == 0 the weights come
// in 16-byte loads and lane t's run is at position wide_pos(t) instead (trade_halves); in the
// columns build they stay as loaded and a chunk pair shares an mma as its columns (compute_pair_columns).
#define STEP_K 256  // k one warp covers per step
#include "matmul_4bit_common.cuh"

#if MM_TOKENS != 8 && MM_TOKENS != 16 && MM_TOKENS != 32
#error "matmul_4bit_m8_pairs.cu takes MM_TOKENS 8, 16 or 32 (more: the wide-tile kernels)"
#endif
// MM_FEW_ROWS (the build the host picks for calls of at most that many rows, one token tile): only the
// lanes of token rows below it read activations, the others multiply zeros into outputs that are
// never stored. At one row the tile's LDS.128 then take one wavefront instead of four, a fifth of
// the L1 unit's work, which paces this kernel at one row on an H200 (kernels/NOTES.md). Calls of more
// rows run the build without it: at 8 rows every lane is live and the predicate only cost the schedule.
#ifndef MM_FEW_ROWS
#define MM_FEW_ROWS 0
#endif
#if MM_FEW_ROWS && (MM_TOKENS != 8 || MM_FEW_ROWS > 8)
#error "MM_FEW_ROWS is a build of the one-tile kernel (MM_TOKENS 8) for at most 8 rows"
#endif
// MM_COLUMNS (a form of the few-rows build, which the host gives the calls of up to 4 rows on the
// GPUs it pays on): with 16-byte loads the free token columns hold the second chunk of a pair
// instead of a trade between lanes (compute_pair_columns): fewer shuffles and lookups of the L1
// unit's, which pays where that unit paces the call (an H200) and costs where the loads do (an
// H100: kernels/NOTES.md).
#ifndef MM_COLUMNS
#define MM_COLUMNS 0
#endif
#if MM_COLUMNS && (!MM_FEW_ROWS || MM_FEW_ROWS > 4)
#error "MM_COLUMNS is a form of the few-rows build for at most 4 rows (two mma columns a row)"
#endif
// 8 tokens: 128 registers a thread, 4 blocks of 4 warps an SM (at 5 or 6 the compiler's schedule lost
// 25-35%). 16 tokens: 168, 3 blocks (at 4 it spilled and ran the gate weight 14% slower on an H100;
// with today's kernel 4 bytes spilled and 3-18% slower at 9-16 rows on an H200). 32 tokens: 225 on
// sm_90 (245 on sm_80-89), 2 blocks: each decoded fragment feeds 8 mmas, so fewer warps keep the pipes
// busy (0.80-0.94x the wgmma kernel's 32-token tile on an H200). NOTES.
#define MIN_BLOCKS (MM_TOKENS == 8 ? 4 : MM_TOKENS == 16 ? 3 : 2)

#define PAIR_ROWS 128      // entries e and e | 128 share a row of the table
#define PAIR_ROW_WORDS 64  // 32 copies of each
#define PAIR_TABLE_BYTES (PAIR_ROWS * PAIR_ROW_WORDS * 4)

// Entry e: code[e >> 4] (the byte's high nibble, the lower k) in the low half, code[e & 15] in the
// high half, each rounded to nearest in A's dtype. Slot i of the table (16 bytes: 4 copies) holds
// entry pair_entry(i / 16, i % 16): rows of 64 words, entries e and e | 128 side by side.
__device__ __forceinline__ constexpr int pair_entry(int row, int quarter) { return row | (quarter >= 8 ? 128 : 0); }

__device__ __forceinline__ float code_of(int i) { return __uint_as_float(c_code_bits[i]); }

// The table by the block's threads, 16 bytes a store. Thread x stores slots x + 128 n (n < 16), all
// of one quarter (x % 16) and of rows x / 16 + 8 n: their entries' high nibbles are n / 2 (+ 8 in
// the upper half of a row), one for a pair of slots, and their low nibbles x / 16 or x / 16 + 8,
// two for all 16. So 10 constant loads a thread at 2 addresses a warp, where loading each entry's
// own two codes took 32 at 2 (the build was 14% of a one-row call's stall samples on an H200:
// kernels/NOTES.md, "The pair table's build with fewer constant loads").
__device__ __forceinline__ void stage_pair_table(u32* table) {
    static_assert(MM_WARPS * 32 == 128 && PAIR_ROWS * PAIR_ROW_WORDS / 4 == 16 * 128, "16 slots a thread");
    const int x = threadIdx.x, quarter = x % 16, row0 = x / 16;
    const float low[2] = {code_of(pair_entry(row0, quarter) & 15), code_of(pair_entry(row0 + 8, quarter) & 15)};
#pragma unroll 1  // staged while the first weights are in flight, in the registers they leave
    for (int m = 0; m < 8; ++m) {
        const float high = code_of(pair_entry(row0 + 16 * m, quarter) >> 4);  // rows 16 m + row0 and + 8 alike
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const u32 v = pack2(high, low[s]);  // the entry of row row0 + 16 * m + 8 * s
            reinterpret_cast<uint4*>(table)[x + 256 * m + 128 * s] = make_uint4(v, v, v, v);
        }
    }
}

// Looks up byte kByte of a packed word for one lane (pair_addresses with lane * 4 in every byte:
// 32 copies of 4 bytes, a warp's 32 lanes in 32 banks).
template <int kByte>
__device__ __forceinline__ u32 lookup(const u32* table, const PairAddresses& a) {
    return *reinterpret_cast<const u32*>(reinterpret_cast<const char*>(table) + pair_offset<kByte>(a));
}

// The thread's index read again (a volatile read: the compiler cannot keep an earlier one live).
__device__ __forceinline__ unsigned fresh_tid() {
    unsigned tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    return tid;
}

// Weights are read once: streaming loads. kWords 32-bit words of a lane's run of one feature.
template <int kWords>
struct Run {
    u32 w[kWords];
};

template <int kWords>
__device__ __forceinline__ Run<kWords> load_run(const unsigned char* p) {
    Run<kWords> r;
    if constexpr (kWords == 2) {
        const uint2 v = __ldcs(reinterpret_cast<const uint2*>(p));
        r.w[0] = v.x;
        r.w[1] = v.y;
    } else {
        r.w[0] = __ldcs(reinterpret_cast<const unsigned*>(p));
    }
    return r;
}

// A lane's rows: its first feature's packed bytes from the lane's run of the first chunk on (the
// second's are to_hi elements on), and, as an element index of the flattened weight (for the
// scales), the first k whose scale the lane loads; its token row g of the activation tile. Features past N are clamped to the last one: an
// output depends on its own feature and token only, and those outputs are never stored, so nothing
// but K is bounded.
struct Lane {
    const unsigned char* w_lo;
    i64 e_lo;
    int to_hi;  // elements from the first feature's row to the second's (8 rows, fewer when clamped)
    int t;  // the lane's run position in a chunk: lane % 4, or wide_pos of it with 16-byte loads
    // The token row whose activations the lane reads in the first token tile (in the second, 8 on);
    // in the columns build with 16-byte loads, the slot of its first piece, or -1 for none.
    // One tile: g clamped to the tile's last row, so at fewer than 8 rows lanes past M (never
    // stored) read a real row; held instead of g, which the step forms again from the thread's
    // index (held as well, it spilled at 128 registers on sm_80). Two tiles: g, as before
    // (measured: the clamp and the re-formed g cost the 16-token kernel about 1%).
    int act_row;
};

template <int kChunk>
struct Shape {
    static constexpr int chunks = STEP_K / kChunk;  // chunks a step
    static constexpr int run = kChunk / 4;          // k of a lane's run in a chunk
    static constexpr int words = kChunk / 32;       // 32-bit words of packed codes in a run
    static constexpr int scales = chunks / 4;       // chunks whose scales a lane loads (c % 4 == t)
};

// Weights in 16-byte loads (K % 128 == 0, chunks of 64; kWide): a quad reads 64 bytes of a row at
// once, two chunks, with half the load instructions and tag lookups of 8-byte loads (the L1 unit
// bounds this kernel: NOTES). Lane t's 16 bytes (32 k) lie in chunk t / 2, but every mma sums 16 k
// of one chunk (one scale): lanes t and t ^ 2 trade halves (a shuffle a word), after which lane t
// holds 16 k of each chunk at run position wide_pos(t); its activation pieces and the scales it
// loads for the quad follow that position.
__device__ __forceinline__ constexpr int wide_pos(int t) { return ((t & 1) << 1) | (t >> 1); }

// One step's weights of a lane (each chunk's runs of its two features) and the scale parts of the
// chunks c with c % 4 == t, which lanes share by shuffles (the 4 lanes of a feature pair need the
// same scales).
template <int kChunk>
struct StepWeights {
    Run<Shape<kChunk>::words> lo[Shape<kChunk>::chunks], hi[Shape<kChunk>::chunks];
    ScaleParts p_lo[Shape<kChunk>::scales], p_hi[Shape<kChunk>::scales];
};

// Chunk c of step `step` of a lane's runs. A step inside K (kInside) reads its chunks at fixed
// offsets from the step's start; the tail reads a chunk past K at K's last chunk instead (never
// used: its compute skips it), so no load faults.
template <int kChunk, bool kInside>
__device__ __forceinline__ void load_chunk(StepWeights<kChunk>& w, int c, int step, const Lane& ln, int K) {
    using S = Shape<kChunk>;
    const int k0 = step * STEP_K;
    const int at = kInside ? c * kChunk / 2 : (min(k0 + c * kChunk, K - kChunk) - k0) >> 1;  // even: exact
    const unsigned char* lo = ln.w_lo + (static_cast<u32>(k0) >> 1) + at;
    w.lo[c] = load_run<S::words>(lo);
    w.hi[c] = load_run<S::words>(lo + (ln.to_hi >> 1));
}

// Chunks c and c + 1 (c even) of step `step`, 16 bytes of each feature (kWide); as load_chunk past K.
template <int kChunk, bool kInside>
__device__ __forceinline__ void load_pair(StepWeights<kChunk>& w, int c, int step, const Lane& ln, int K) {
    const int k0 = step * STEP_K;
    const int at = kInside ? c * kChunk / 2 : (min(k0 + c * kChunk, K - 2 * kChunk) - k0) >> 1;
    const unsigned char* lo = ln.w_lo + (static_cast<u32>(k0) >> 1) + at;
    const uint4 a = __ldcs(reinterpret_cast<const uint4*>(lo));
    const uint4 b = __ldcs(reinterpret_cast<const uint4*>(lo + (ln.to_hi >> 1)));
    w.lo[c].w[0] = a.x, w.lo[c].w[1] = a.y, w.lo[c + 1].w[0] = a.z, w.lo[c + 1].w[1] = a.w;
    w.hi[c].w[0] = b.x, w.hi[c].w[1] = b.y, w.hi[c + 1].w[0] = b.z, w.hi[c + 1].w[1] = b.w;
}

// A pair of chunks as loaded (lanes t < 2, `low`: both runs in `first`'s chunk; the others: in
// `second`'s) made into 16 k of each: a low lane keeps its first run and sends its second to lane
// t ^ 2, which keeps its second and sends its first.
__device__ __forceinline__ void trade_halves(Run<2>& first, Run<2>& second, bool low) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const u32 got = __shfl_xor_sync(0xffffffffu, low ? second.w[i] : first.w[i], 2);
        first.w[i] = low ? first.w[i] : got;
        second.w[i] = low ? got : second.w[i];
    }
}

// The scale parts of step `step` a lane loads; zeros past K.
template <int kChunk, bool kInside>
__device__ __forceinline__ void load_scales(StepWeights<kChunk>& w, int step, const Lane& ln, int K,
                                            const void* absmax, const float* absmax2, int bs_log2, int bs2_log2) {
#pragma unroll
    for (int i = 0; i < Shape<kChunk>::scales; ++i) {
        const int k = step * STEP_K + 4 * i * kChunk;  // the lane's scale chunk starts at e + k (e: its first)
        const bool ok = kInside || k + ln.t * kChunk < K;
        w.p_lo[i] = load_scale(ln.e_lo + k, ok, absmax, absmax2, bs_log2, bs2_log2);
        w.p_hi[i] = load_scale(ln.e_lo + ln.to_hi + k, ok, absmax, absmax2, bs_log2, bs2_log2);
    }
}

// The whole of step `step` (a split's first).
template <int kChunk, bool kWide>
__device__ __forceinline__ void load_step(StepWeights<kChunk>& w, int step, const Lane& ln, int K, const void* absmax,
                                          const float* absmax2, int bs_log2, int bs2_log2) {
    if ((step + 1) * STEP_K <= K) {
#pragma unroll
        for (int c = 0; c < Shape<kChunk>::chunks; c += kWide ? 2 : 1)
            if constexpr (kWide)
                load_pair<kChunk, true>(w, c, step, ln, K);
            else
                load_chunk<kChunk, true>(w, c, step, ln, K);
        load_scales<kChunk, true>(w, step, ln, K, absmax, absmax2, bs_log2, bs2_log2);
    } else {
#pragma unroll
        for (int c = 0; c < Shape<kChunk>::chunks; c += kWide ? 2 : 1)
            if constexpr (kWide)
                load_pair<kChunk, false>(w, c, step, ln, K);
            else
                load_chunk<kChunk, false>(w, c, step, ln, K);
        load_scales<kChunk, false>(w, step, ln, K, absmax, absmax2, bs_log2, bs2_log2);
    }
}

// Piece p (16 bytes, 8 k) of token row r sits in slot r * stride + p: one padding slot a row at
// chunks of 64 (a quarter warp reads pieces 2t + h of rows 2q and 2q + 1: 8 different 16-byte bank
// groups), four at chunks of 32 (pieces t of the same rows).
// ALIGNED_ROWS (the 16- and 32-token tiles): rows 8 slots of padding apart, each on a 128-byte line, so a
// quarter warp's cp.async of 8 consecutive pieces writes one line and takes one wavefront (two where
// a row starts mid-line: 2.75x the staging's ideal wavefronts); in odd rows p ^ 1 at chunks of 64,
// p ^ 4 at chunks of 32, so the reads of rows 2q and 2q + 1 still hit 8 different bank groups. On
// an H200 2.4-3.4% faster at 16 rows on the large weights; at 6-8 rows the 8-token build was 0.6-1.1%
// slower on two of them with it, so it keeps the rows above (kernels/NOTES.md, "The activation
// tile's rows on 128-byte lines").
// kCols (the columns build: chunks as mma columns, compute_pair_columns): its live lanes read
// pieces 8c + 4t + j of rows 0 to 3, so a slot of padding every 8 pieces and rows 38 slots apart
// put them in the fewest wavefronts (8 lanes at 1-2 rows: 8 different 16-byte bank groups, one
// wavefront; 16 lanes at 3-4 rows: no group hit more than twice, two).
#define ALIGNED_ROWS (MM_TOKENS >= 16)
template <int kChunk, bool kCols = false>
__device__ __forceinline__ constexpr int act_slot(int row, int piece) {
    if constexpr (kCols) return row * (ACT_ROW_CHUNKS + 6) + piece + (piece >> 3);
    if constexpr (ALIGNED_ROWS) return row * (ACT_ROW_CHUNKS + 8) + (piece ^ ((row & 1) * (kChunk == 64 ? 1 : 4)));
    return row * (ACT_ROW_CHUNKS + (kChunk == 64 ? 1 : 4)) + piece;
}

// Rows of the activation tile: the columns build holds only the rows it reads (its M <= MM_FEW_ROWS = 4),
// 4.9 KB less shared memory a block, so 4 blocks an SM fit sm_90's 164 KB carveout and leave L1 92 KB for
// the scale codes, not 60 (kernels/NOTES.md, "The columns build's tile of 4 rows").
#define ACT_TILE_ROWS (MM_COLUMNS ? MM_FEW_ROWS : MM_TOKENS)
#define ACT_TILE_SLOTS (ACT_TILE_ROWS * (ACT_ROW_CHUNKS + (MM_COLUMNS ? 6 : 4 + 4 * ALIGNED_ROWS)))  // one stage
#define ACT_ROW_STRIDE (MM_WARPS * 32 / ACT_ROW_CHUNKS)    // rows a block's threads cover
#define ACT_ROWS_A_THREAD (ACT_TILE_ROWS / ACT_ROW_STRIDE)
static_assert(ACT_ROW_STRIDE % 2 == 0, "a thread's rows ACT_ROW_STRIDE apart keep their parity (act_slot's swap)");
static_assert(ACT_ROW_STRIDE * ACT_ROW_CHUNKS == MM_WARPS * 32 && ACT_TILE_ROWS % ACT_ROW_STRIDE == 0,
              "a block's threads must split the activation tile into whole rows of pieces");

// What a thread stages each step: piece threadIdx.x % 32 of rows ACT_ROW_STRIDE apart, from its
// rows' first k on (rows past M: none). Its slot and k are formed again each step: registers held
// through the main loop are the scarce ones.
struct ActSource {
    int from;  // the first row's piece, elements from A (this kernel's M is at most 16 rows: no overflow)
    int rows;  // of the thread's rows, those inside M; each next one ACT_ROW_STRIDE * K elements on
};

template <int kChunk>
__device__ __forceinline__ ActSource act_source(i64 m0, int rows, int K) {
    const int r = threadIdx.x / ACT_ROW_CHUNKS;
    return {static_cast<int>((m0 + min(r, rows - 1)) * K) + 8 * static_cast<int>(threadIdx.x % ACT_ROW_CHUNKS),
            r < rows ? (rows - r + ACT_ROW_STRIDE - 1) / ACT_ROW_STRIDE : 0};
}

// Stage k0 .. k0 + STEP_K as one cp.async group (empty unless `copy`); pieces past K as zeros. No
// branch around the copies (cp_async16_rows), so the step's global loads are not waited for here;
// except in the few-rows build, where most warps have no row: a branch lets them skip copies that,
// predicated off, would still take the L1 unit's wavefronts, which pace the one-row call on an H200
// (2% on the large weights there, kernels/NOTES.md).
template <int kChunk, bool kCols>
__device__ __forceinline__ void stage_activations(uint4* tile, const ActSource& s, const elem_t* __restrict__ A,
                                                  int k0, int K, bool copy = true) {
    const int c = threadIdx.x % ACT_ROW_CHUNKS, slot = act_slot<kChunk, kCols>(threadIdx.x / ACT_ROW_CHUNKS, c);
    const bool ok = k0 + 8 * c < K;
#if MM_FEW_ROWS
    if (copy)
#pragma unroll
        for (int i = 0; i < ACT_ROWS_A_THREAD; ++i)
            if (i < s.rows)
                cp_async16(tile + slot + i * act_slot<kChunk, kCols>(ACT_ROW_STRIDE, 0),
                           ok ? A + s.from + i * ACT_ROW_STRIDE * K + k0 : A, ok);
#else
    constexpr unsigned kRowBytes = 16 * act_slot<kChunk, kCols>(ACT_ROW_STRIDE, 0);  // a thread's rows apart
    const long long row_bytes = static_cast<long long>(sizeof(elem_t)) * ACT_ROW_STRIDE * K;
    cp_async16_rows<ACT_ROWS_A_THREAD, kRowBytes>(tile + slot, ok ? A + s.from + k0 : A, ok ? row_bytes : 0,
                                                  copy ? s.rows : 0, ok ? 16 : 0);
#endif
    cp_async_commit();
}

// mma with a zero accumulator in (the chunk's first).
__device__ __forceinline__ void mma_zero(float c[4], const u32 a[4], u32 b0, u32 b1) {
    c[0] = c[1] = c[2] = c[3] = 0.0f;
    mma(c, a, b0, b1);
}

// Chunks c and c + 1 of a step in the columns build with 16-byte loads, as mma columns: at M <= 4 rows
// an mma's 8 token columns have room for a row's two chunks, so the lanes keep their runs as loaded
// (lane t: 32 k of chunk c + t / 2, no trade) and column 2m + s takes row m's activations from the
// lanes whose run is in chunk c + s, zeros from the others. Column 2t + s of the result is then
// chunk c + s of token t, each scaled by its chunk's scale into lane t's acc[0][0] (feature g) and
// acc[0][2] (g + 8), in chunk order as the other builds; columns_to_tokens moves them for the
// epilogue. Same products and scales as the trading path; only the order of the fp32 sums inside
// a chunk differs (kernels/NOTES.md, "Chunks as mma columns").
template <int kChunk, bool kTail, bool kNextInside>
__device__ __forceinline__ void compute_pair_columns(float (&acc)[NT8][4], StepWeights<kChunk>& w, int c, bool more,
                                                     const uint4* tile, const u32* table, int step, const Lane& ln,
                                                     int K, u32 lane_bytes, int quad, const float (&s_lo)[1],
                                                     const float (&s_hi)[1]) {
    float sc[2][2];                // [chunk c + s][feature g, g + 8], from the lanes that loaded them
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        sc[h][0] = __shfl_sync(0xffffffffu, s_lo[0], quad | wide_pos((c + h) % 4));
        sc[h][1] = __shfl_sync(0xffffffffu, s_hi[0], quad | wide_pos((c + h) % 4));
    }
    float part[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // word j of the lane's 16 bytes: k 32t + 8j .. + 7 of the pair
        const u32 word_lo = j < 2 ? w.lo[c].w[j] : w.lo[c + 1].w[j - 2];
        const u32 word_hi = j < 2 ? w.hi[c].w[j] : w.hi[c + 1].w[j - 2];
        // Piece 8c + 4t + j of the lane's row: act_slot<64, true> is its first piece's slot + 9c + j.
        const uint4 act = ln.act_row >= 0 ? tile[ln.act_row + 9 * c + j] : make_uint4(0u, 0u, 0u, 0u);
        const PairAddresses lo = pair_addresses(word_lo, lane_bytes);
        const PairAddresses hi = pair_addresses(word_hi, lane_bytes);
        const u32 a0[4] = {lookup<0>(table, lo), lookup<0>(table, hi), lookup<1>(table, lo), lookup<1>(table, hi)};
        const u32 a1[4] = {lookup<2>(table, lo), lookup<2>(table, hi), lookup<3>(table, lo), lookup<3>(table, hi)};
        if (j == 0)
            mma_zero(part, a0, act.x, act.y);
        else
            mma(part, a0, act.x, act.y);
        mma(part, a1, act.z, act.w);
    }
    if (!kTail && more) load_pair<kChunk, kNextInside>(w, c, step + 1, ln, K);
    acc[0][0] = __fmaf_rn(sc[1][0], part[1], __fmaf_rn(sc[0][0], part[0], acc[0][0]));
    acc[0][2] = __fmaf_rn(sc[1][1], part[3], __fmaf_rn(sc[0][1], part[2], acc[0][2]));
}

// After compute_pair_columns: lane t holds token t; the epilogue wants tokens 2t and 2t + 1 (the
// mma's layout), so lanes t < 2 gather them from their quad (the others hold tokens past 4: never stored).
__device__ __forceinline__ void columns_to_tokens(float (&acc)[NT8][4]) {
    const unsigned quad = threadIdx.x & 0x1c, t = threadIdx.x & 3;
    const float lo0 = __shfl_sync(0xffffffffu, acc[0][0], quad | ((2 * t) & 3));
    const float lo1 = __shfl_sync(0xffffffffu, acc[0][0], quad | ((2 * t + 1) & 3));
    const float hi0 = __shfl_sync(0xffffffffu, acc[0][2], quad | ((2 * t) & 3));
    const float hi1 = __shfl_sync(0xffffffffu, acc[0][2], quad | ((2 * t + 1) & 3));
    acc[0][0] = lo0, acc[0][1] = lo1, acc[0][2] = hi0, acc[0][3] = hi1;
}

// One step of a warp, from `w` (its weights and scale parts), which it refills with the next step's
// as it goes (when `more`): each chunk's registers right after its mmas read them, the scale parts
// once the scales are formed, so every load has a step of decoding to arrive in, with one step's
// registers. kTail: the step reaches past K, whose chunks it skips (and the split ends with it);
// kNextInside: the next step lies inside K. `tile` holds the step's activations (stage_activations).
template <int kChunk, bool kWide, bool kTail, bool kNextInside>
__device__ __forceinline__ void compute_step(float (&acc)[NT8][4], StepWeights<kChunk>& w, bool more,
                                             const uint4* tile, const u32* table, int step, const Lane& ln, int K,
                                             u32 lane_bytes, const float* s_code2, float offset, const void* absmax,
                                             const float* absmax2, int bs_log2, int bs2_log2) {
    using S = Shape<kChunk>;
    float s_lo[S::scales], s_hi[S::scales];
#pragma unroll
    for (int i = 0; i < S::scales; ++i) {
        s_lo[i] = scale_of(w.p_lo[i], true, s_code2, offset);
        s_hi[i] = scale_of(w.p_hi[i], true, s_code2, offset);
    }
    if (!kTail && more) load_scales<kChunk, kNextInside>(w, step + 1, ln, K, absmax, absmax2, bs_log2, bs2_log2);
    const int quad = NT8 == 1 ? fresh_tid() & 0x1c : ln.act_row << 2;  // the feature pair's first lane, g * 4
    if constexpr (kWide && MM_COLUMNS) {
#pragma unroll
        for (int c = 0; c < S::chunks; c += 2) {
            if (kTail && step * STEP_K + c * kChunk >= K) break;
            compute_pair_columns<kChunk, kTail, kNextInside>(acc, w, c, more, tile, table, step, ln, K, lane_bytes,
                                                             quad, s_lo, s_hi);
        }
        return;
    }
    const bool act_live = !MM_FEW_ROWS || quad < 4 * MM_FEW_ROWS;  // a lane of a row the build reads
#pragma unroll
    for (int c = 0; c < S::chunks; ++c) {
        if (kTail && step * STEP_K + c * kChunk >= K) break;
        if constexpr (kWide) {
            if (c % 2 == 0) {
                const bool low = (ln.t & 1) == 0;  // lane t < 2: run position 0 or 2
                trade_halves(w.lo[c], w.lo[c + 1], low);
                trade_halves(w.hi[c], w.hi[c + 1], low);
            }
        }
        // The chunk's scales, from the lane of this feature pair that loaded them.
        const int owner = kWide ? wide_pos(c % 4) : c % 4;  // c is unrolled: a constant
        const float sc_lo = __shfl_sync(0xffffffffu, s_lo[c / 4], quad | owner);
        const float sc_hi = __shfl_sync(0xffffffffu, s_hi[c / 4], quad | owner);
        float part[NT8][4];
#pragma unroll
        for (int v = 0; v < S::words; ++v) {  // word v of the run: mmas 2v and 2v + 1 of each token tile
            uint4 act[NT8];  // piece v of the run in each token tile's row g
#pragma unroll
            for (int i = 0; i < NT8; ++i)
                act[i] = act_live ? tile[act_slot<kChunk>(ln.act_row + 8 * i, (c * kChunk + ln.t * S::run) / 8 + v)]
                                  : make_uint4(0u, 0u, 0u, 0u);
            const PairAddresses lo = pair_addresses(w.lo[c].w[v], lane_bytes);
            const PairAddresses hi = pair_addresses(w.hi[c].w[v], lane_bytes);
            const u32 a0[4] = {lookup<0>(table, lo), lookup<0>(table, hi), lookup<1>(table, lo), lookup<1>(table, hi)};
            const u32 a1[4] = {lookup<2>(table, lo), lookup<2>(table, hi), lookup<3>(table, lo), lookup<3>(table, hi)};
#pragma unroll
            for (int i = 0; i < NT8; ++i) {
                if (v == 0)
                    mma_zero(part[i], a0, act[i].x, act[i].y);
                else
                    mma(part[i], a0, act[i].x, act[i].y);
                mma(part[i], a1, act[i].z, act[i].w);
            }
        }
        if constexpr (kWide) {
            if (!kTail && more && c % 2 == 1) load_pair<kChunk, kNextInside>(w, c - 1, step + 1, ln, K);
        } else {
            if (!kTail && more) load_chunk<kChunk, kNextInside>(w, c, step + 1, ln, K);
        }
#pragma unroll
        for (int i = 0; i < NT8; ++i) {
            acc[i][0] = __fmaf_rn(sc_lo, part[i][0], acc[i][0]);
            acc[i][1] = __fmaf_rn(sc_lo, part[i][1], acc[i][1]);
            acc[i][2] = __fmaf_rn(sc_hi, part[i][2], acc[i][2]);
            acc[i][3] = __fmaf_rn(sc_hi, part[i][3], acc[i][3]);
        }
    }
}

// The arguments every step of a split reads, in the order run_split takes them.
#define SPLIT_ARGS                                                                                                  \
    const Lane &ln, const ActSource &src, uint4(&s_act)[ACT_STAGES][ACT_TILE_SLOTS], u32 *table,           \
        const elem_t *__restrict__ A, const void *absmax, const float *absmax2, const float *s_code2, float offset, \
        int K, int last, int bs_log2, int bs2_log2, u32 lane_bytes
#define SPLIT_PASS ln, src, s_act, table, A, absmax, absmax2, s_code2, offset, K, last, bs_log2, bs2_log2, lane_bytes

// Steps first .. last - 1: each step's activations (one stage of the shared tile) and weights
// (registers, refilled as they are used) load while the step before decodes. `table` is staged here.
template <int kChunk, bool kWide>
__device__ __forceinline__ void run_split(float (&acc)[NT8][4], int first, SPLIT_ARGS) {
    if (first >= last) return;
    stage_activations<kChunk, kWide && MM_COLUMNS>(s_act[0], src, A, first * STEP_K, K);
    StepWeights<kChunk> w;
    load_step<kChunk, kWide>(w, first, ln, K, absmax, absmax2, bs_log2, bs2_log2);
    // The table after the first loads are issued: staging it overlaps their trip to memory.
    stage_pair_table(table);
    for (int step = first; step < last; ++step) {
        const int stage = (step - first) & 1;
        const bool more = step + 1 < last;
        cp_async_wait<0>();
        // This step's tile (and, the first time, the tables) visible to every warp, and every warp
        // done with the other stage (the step before), which the next step's tile refills.
        __syncthreads();
        stage_activations<kChunk, kWide && MM_COLUMNS>(s_act[stage ^ 1], src, A, (step + 1) * STEP_K, K, more);
        const uint4* tile = s_act[stage];
        if ((step + 2) * STEP_K <= K)
            compute_step<kChunk, kWide, false, true>(acc, w, more, tile, table, step, ln, K, lane_bytes, s_code2, offset,
                                              absmax, absmax2, bs_log2, bs2_log2);
        else if ((step + 1) * STEP_K <= K)
            compute_step<kChunk, kWide, false, false>(acc, w, more, tile, table, step, ln, K, lane_bytes, s_code2, offset,
                                               absmax, absmax2, bs_log2, bs2_log2);
        else
            compute_step<kChunk, kWide, true, false>(acc, w, more, tile, table, step, ln, K, lane_bytes, s_code2, offset,
                                              absmax, absmax2, bs_log2, bs2_log2);
    }
}

template <int kChunk, bool kWide>
__device__ __forceinline__ void run(float (&acc)[NT8][4], uint4 (&s_act)[ACT_STAGES][ACT_TILE_SLOTS], u32* table, int first, int last, const Lane& ln,
                                    const elem_t* __restrict__ A, i64 m0, int rows, int K, const void* absmax,
                                    const float* absmax2, const float* s_code2, float offset, int bs_log2,
                                    int bs2_log2) {
    const ActSource src = act_source<kChunk>(m0, rows, K);
    const u32 lane_bytes = (threadIdx.x & 31) * 4 * 0x01010101u;
    run_split<kChunk, kWide>(acc, first, SPLIT_PASS);
}

// The lane's weight pointers at its run of the first chunk (kWide: of the first pair of chunks);
// its scale elements at its chunk (t; kWide: its run position), which ln.t becomes.
template <int kChunk, bool kWide>
__device__ __forceinline__ void with_chunk(Lane& ln, const unsigned char* __restrict__ W, int t) {
    ln.w_lo = W + ln.e_lo / 2 + t * Shape<kChunk>::run / (kWide ? 1 : 2);
    ln.t = kWide ? wide_pos(t) : t;
    ln.e_lo += ln.t * kChunk;
}

// The first of a lane's two features (the second is 8 on).
__device__ __forceinline__ int first_feature(unsigned tid) {
    return (blockIdx.x * MM_WARPS + (tid >> 5)) * 16 + ((tid & 31) >> 2);
}

// Grid: x = groups of MM_WARPS * 16 features, y = splits of K (each steps_per_split steps of 256 k),
// z = tiles of MM_TOKENS tokens. With one split the block writes out (+ bias) itself; with more,
// launched as clusters of the splits (sm_90 on), the cluster adds them (add_splits_in_cluster);
// else split s writes its partial sums to slice s of `partial` [splits, M, N] (fp32, every element
// written by exactly one lane) and matmul_4bit_finish adds the slices in split order: the same
// bits on every run, whatever order the blocks ran in.
extern "C" __global__ void __launch_bounds__(MM_WARPS * 32, MIN_BLOCKS) matmul_4bit_kernel(MM_MAIN_PARAMS) {
#if MM_TOKENS == 8
    __shared__ __align__(16) u32 s_pairs[PAIR_ROWS * PAIR_ROW_WORDS];
    __shared__ uint4 s_act[ACT_STAGES][ACT_TILE_SLOTS];
#else  // past the 48 KB of static shared memory: the launch passes PAIR_TABLE_BYTES + the stages
    extern __shared__ __align__(128) unsigned char s_dynamic[];  // ALIGNED_ROWS' lines
    u32* s_pairs = reinterpret_cast<u32*>(s_dynamic);
    auto& s_act = *reinterpret_cast<uint4(*)[ACT_STAGES][ACT_TILE_SLOTS]>(s_dynamic + PAIR_TABLE_BYTES);
#endif
    MM_SCALES_PROLOGUE;

    float acc[NT8][4];
#pragma unroll
    for (int i = 0; i < NT8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    {
        const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
        const int n_lo = first_feature(threadIdx.x), n_hi = n_lo + 8;
        const BlockWork work = block_work(M, K, steps_per_split);
        const i64 m0 = work.m0;
        const int rows = work.rows, first = work.first, last = work.last;

        Lane ln;
        ln.t = t;
        ln.act_row = NT8 == 1 ? min(g, rows - 1) : g;
        ln.e_lo = (i64)min(n_lo, N - 1) * K;
        ln.to_hi = (min(n_hi, N - 1) - min(n_lo, N - 1)) * K;

        // Chunks of 64 k lie inside one scale block when blocks hold 64 or more and every row starts
        // at a multiple of 64 of the flattened weight; chunks of 32 always do (K % 32 == 0, blocks >= 32).
        if (K % 128 == 0 && bs_log2 >= 6) {
            // compute_pair_columns: column 2m + s reads row m from the lanes of chunk s, the others nothing.
            if constexpr (MM_COLUMNS)  // here the slot of the lane's first piece (compute_pair_columns)
                ln.act_row = g < 2 * rows && (t >> 1) == (g & 1) ? act_slot<64, true>(g >> 1, 4 * t) : -1;
            with_chunk<64, true>(ln, W, t);
            run<64, true>(acc, s_act, s_pairs, first, last, ln, A, m0, rows, K, absmax, absmax2, s_code2, offset,
                          bs_log2, bs2_log2);
            if constexpr (MM_COLUMNS) columns_to_tokens(acc);
        } else if (K % 64 == 0 && bs_log2 >= 6) {
            with_chunk<64, false>(ln, W, t);
            run<64, false>(acc, s_act, s_pairs, first, last, ln, A, m0, rows, K, absmax, absmax2, s_code2, offset, bs_log2,
                    bs2_log2);
        } else {
            with_chunk<32, false>(ln, W, t);
            run<32, false>(acc, s_act, s_pairs, first, last, ln, A, m0, rows, K, absmax, absmax2, s_code2, offset, bs_log2,
                    bs2_log2);
        }
    }
    // The epilogue's indices formed again, not held in registers through the main loop.
    static_assert(PAIR_TABLE_BYTES >= MM_TOKENS * MM_WARPS * 16 * sizeof(float), "the splits' sums borrow the table");
    const unsigned tid = fresh_tid();
    store_tile(acc, first_feature(tid), (i64)blockIdx.z * MM_TOKENS, tid & 3, M, N, partial, bias, out,
               reinterpret_cast<float*>(s_pairs));
}
