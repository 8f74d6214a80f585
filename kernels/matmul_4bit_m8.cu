// Fused 4-bit matmul for up to 16 tokens (decode; one or two mma token tiles of 8): out[m, n] =
// sum_k A[m, k] * W[n, k] (+ bias[n]), W in the bitsandbytes packed format (kernels/dequantize_4bit.cu
// states it) decoded in registers, never written out. More tokens run matmul_4bit.cu (matmul_4bit_sm90.cu on Hopper);
// matmul_4bit_common.cuh holds the macros, the host contract and the arithmetic they share.
//
// mma.sync.m16n8k16 (sm80-sm90) with the weights as operand A (16 output features x 16 k) and the
// activations as operand B (16 k x 8 tokens): small M wastes at most 7 of 8 token columns, not 15
// of 16 rows. One warp owns 16 output features; per step it covers 256 k: lane (g = lane / 4,
// t = lane % 4) loads 32 bytes (64 codes, k = 64t .. 64t+63) of features g and g + 8. The k
// order inside a step is permuted, identically for both operands (a dot product does not care):
// fragment slot s of mma j holds k = 64t + 4j + {0,1,2,3}[s], so a lane's 32 bytes feed its
// operand-A registers of all 16 mmas of the step without a shuffle, and its activations are 128
// contiguous bytes of token g (eight 16-byte reads of the block's activation tile in shared memory,
// staged a step ahead).
//
// Decoding is a register table lookup, not a shared-memory one. With one token tile every decoded
// weight feeds a single mma, so the decode is the work: a shared-memory read per weight (4 bytes of
// the 16-entry fp32 code table) costs as much load/store-pipe time as the DRAM reads, and the
// multiply and rounding per weight as much again in issue slots (NOTES, "the load/store pipe's
// share"). So once per scale block (64 k of a lane at the usual block size) a lane multiplies the
// 16 codes by the block's scale and rounds them to A's dtype: the block's 16 possible weights, the
// dequantization kernel's bits (the same code bits as immediates, the same fp32 multiply, the same
// rounding). Their low and high bytes fill 8 registers, and prmt (a byte permute over 8 bytes)
// looks up 4 codes at once: two permutes per 8-byte half-table and one to pick the half by each
// code's top bit, for the low and the high bytes, then two to pair the bytes into operand
// registers: 2 prmt and about 0.6 other integer instructions per weight.
#define STEP_K 256  // k one warp covers per step: 64 per lane
#include "matmul_4bit_common.cuh"

#if MM_TOKENS != 8 && MM_TOKENS != 16
#error "matmul_4bit_m8.cu takes MM_TOKENS 8 or 16 (more: the wide-tile kernels)"
#endif
// 128 registers a thread (126-128 at 16 tokens, no spills): 4 blocks an SM.
#define MIN_BLOCKS 4

// Every prmt selector here has its nibbles' top bit clear, so no byte is sign-replicated.

// x >> k as a high multiply: the multiply pipe is idle here, the integer pipe is the decode's limit.
__device__ __forceinline__ u32 shr_mul(u32 x, int k) { return __umulhi(x, 1u << (32 - k)); }

// The 16 weights one scale block can hold, as 16-bit patterns split into their low bytes (lo[i]
// holds entries 4i .. 4i+3, one a byte) and their high bytes: two byte tables of 8 bytes each
// per half, the reach of one prmt.
struct Table {
    u32 lo[4], hi[4];
};

// Entry c is code[c] * scale in fp32, rounded once to A's dtype: the dequantization kernel's bits.
__device__ __forceinline__ Table make_table(float scale) {
    Table tb;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        // Entries 4i .. 4i+3 as two pairs: bytes [L(4i) H(4i) L(4i+1) H(4i+1)] and the same for 4i+2.
        const u32 p = pack2(mul_ftz(code_value(4 * i), scale), mul_ftz(code_value(4 * i + 1), scale));
        const u32 q = pack2(mul_ftz(code_value(4 * i + 2), scale), mul_ftz(code_value(4 * i + 3), scale));
        tb.lo[i] = prmt(p, q, 0x6420);
        tb.hi[i] = prmt(p, q, 0x7531);
    }
    return tb;
}

// Four weights from the four codes of two packed bytes [c0 c1][c2 c3] (high nibble first, so
// nibble i of the 16-bit word is code i ^ 1): `low3` holds each code's low 3 bits (a byte of 8),
// `pick` nibble i is i, or i + 4 when code i ^ 1 is 8 or more. w01 = (c0, c1) and w23 = (c2, c3),
// the lower k in the low half as the activations hold them.
__device__ __forceinline__ void lookup4(const Table& tb, u32 low3, u32 pick, u32& w01, u32& w23) {
    const u32 lo = prmt(prmt(tb.lo[0], tb.lo[1], low3), prmt(tb.lo[2], tb.lo[3], low3), pick);
    const u32 hi = prmt(prmt(tb.hi[0], tb.hi[1], low3), prmt(tb.hi[2], tb.hi[3], low3), pick);
    w01 = prmt(lo, hi, 0x4051);
    w23 = prmt(lo, hi, 0x6273);
}

// The eight weights of one 32-bit word of packed codes: w[0..1] for its first two bytes, w[2..3]
// for its last two (pairs of k, the lower k in the low half). prmt reads a selector's low 16 bits.
__device__ __forceinline__ void decode8(const Table& tb, u32 x, u32 w[4]) {
    const u32 low3 = x & 0x77777777u;
    const u32 pick = lop3_and_or(shr_mul(x, 1), 0x44444444u, 0x32103210u);
    lookup4(tb, low3, pick, w[0], w[1]);
    lookup4(tb, shr_mul(low3, 16), shr_mul(pick, 16), w[2], w[3]);
}

// Weights are read once: streaming loads. Activations are read by every warp: read-only cache.
__device__ __forceinline__ uint4 load_weights(const unsigned char* p) {
    return __ldcs(reinterpret_cast<const uint4*>(p));
}

// A lane's rows: its two features' packed bytes and, as element indices of the flattened weight
// (for their scales), their starts; its token row g of the activation tile; its first k in a step
// (64t). Features past N are clamped to the last one: an output depends on its own feature and
// token only, and those outputs are never stored, so nothing but K is bounded.
struct Lane {
    const unsigned char* w_lo;
    const unsigned char* w_hi;
    i64 e_lo, e_hi;
    int g, t, k;
};

// One step's weights of a lane: 32 packed bytes (two 32-k halves) of each of its two features,
// and the scale parts of each half's block (half 1's only when it may lie in another block).
template <bool kOneBlock>
struct StepWeights {
    uint4 lo[2], hi[2];
    ScaleParts p_lo[kOneBlock ? 1 : 2], p_hi[kOneBlock ? 1 : 2];
};

// Addresses are clamped to the row's last 32 k, so no weight load needs a predicate: past K (a
// tail step's missing half, the pipeline's prefetch after its last step) what is read is never
// used, as the half's scale is 0 there (scale_of) or the loop has ended.
template <bool kOneBlock>
__device__ __forceinline__ void load_step(StepWeights<kOneBlock>& w, int step, const Lane& ln, int K,
                                          const void* absmax, const float* absmax2, int bs_log2, int bs2_log2) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int k = min(step * STEP_K + ln.k + 32 * h, K - 32);
        const u32 byte = static_cast<u32>(k) >> 1;  // k >= 0: a shift, not a signed division
        w.lo[h] = load_weights(ln.w_lo + byte);
        w.hi[h] = load_weights(ln.w_hi + byte);
        // 32 k never straddle a scale block: 32-aligned, and block sizes are >= 32.
        if (h == 0 || !kOneBlock) {
            w.p_lo[h] = load_scale(ln.e_lo + k, true, absmax, absmax2, bs_log2, bs2_log2);
            w.p_hi[h] = load_scale(ln.e_hi + k, true, absmax, absmax2, bs_log2, bs2_log2);
        }
    }
}

// Chunk c of token row r sits in slot act_slot(r, c): rows of 32 chunks with one slot of padding
// after every 8, so a lane's reads (chunk 8t + j of rows g and g + 1: slots 36g + 9t + j, 8
// different 16-byte bank groups a quarter warp) are its own base plus offsets known at compile
// time, where an XOR swizzle cost some 30 integer instructions a step (NOTES).
__device__ __forceinline__ constexpr int act_slot(int row, int c, int row_chunks) {
    return row * (row_chunks + row_chunks / 8) + c + (c >> 3);
}

#define ACT_TILE_SLOTS (MM_TOKENS * (ACT_ROW_CHUNKS + ACT_ROW_CHUNKS / 8))  // slots of one stage
#define ACT_ROW_STRIDE (MM_WARPS * 32 / ACT_ROW_CHUNKS)                     // rows a block's threads cover

// Tiles of at most this many rows stage with branches (kBranchy): most warps have no row there, and
// a branch lets them skip copies that, predicated off, would still take the L1 unit's wavefronts
// (which pace such calls on an H200). Larger tiles copy without a branch, so the step's first wait
// for its loads is at a reader (cp_async16_rows).
#define BRANCHY_STAGING_ROWS 2

// Stage k0 .. k0 + STEP_K of the tile's first `rows` tokens as one cp.async group: each thread
// copies chunk threadIdx.x % 32 of rows ACT_ROW_STRIDE apart, a fixed share (a loop strided over
// rows * 32 chunks cost some 100 instructions a step at 8 rows).
template <bool kBranchy>
__device__ __forceinline__ void stage_activations(uint4* tile, const elem_t* __restrict__ A, i64 m0, int rows, int k0,
                                                  int K) {
    static_assert(ACT_ROW_STRIDE * ACT_ROW_CHUNKS == MM_WARPS * 32 && MM_TOKENS % ACT_ROW_STRIDE == 0,
                  "a block's threads must split the activation tile into whole rows of chunks");
    const int c = threadIdx.x % ACT_ROW_CHUNKS, k = k0 + 8 * c, r = threadIdx.x / ACT_ROW_CHUNKS;
    const bool ok = k < K;
    // The thread's rows r, r + ACT_ROW_STRIDE, ...: those inside `rows`.
    if constexpr (kBranchy) {
#pragma unroll
        for (int i = r; i < MM_TOKENS; i += ACT_ROW_STRIDE)
            if (i < rows) cp_async16(tile + act_slot(i, c, ACT_ROW_CHUNKS), ok ? A + (m0 + i) * K + k : A, ok);
    } else {
        constexpr unsigned kRowBytes = 16 * act_slot(ACT_ROW_STRIDE, 0, ACT_ROW_CHUNKS);  // a thread's rows apart
        const int live = r < rows ? (rows - r + ACT_ROW_STRIDE - 1) / ACT_ROW_STRIDE : 0;
        const long long row_bytes = static_cast<long long>(sizeof(elem_t)) * ACT_ROW_STRIDE * K;
        cp_async16_rows<MM_TOKENS / ACT_ROW_STRIDE, kRowBytes>(tile + act_slot(r, c, ACT_ROW_CHUNKS),
                                                               ok ? A + (m0 + r) * K + k : A, ok ? row_bytes : 0,
                                                               live, ok ? 16 : 0);
    }
    cp_async_commit();
}

// One step of a warp: 16 mmas per token tile. kOneBlock: a lane's 64 k lie in one scale block
// (K % 64 == 0 and blocks of 64 or more), so one table serves both halves; kTail: the step
// reaches past K, so every half has its own table and one past K gets a table of zeros (its
// activations are zeros too, and a zero weight keeps an infinite one out of the sum). `tile`
// holds the step's activations (stage_activations).
template <bool kOneBlock, bool kTail>
__device__ __forceinline__ void compute_step(float (&acc)[NT8][4], const StepWeights<kOneBlock>& w, const uint4* tile,
                                             int step, const Lane& ln, int K, const float* s_code2, float offset) {
    Table t_lo, t_hi;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const bool k_ok = !kTail || step * STEP_K + ln.k + 32 * h < K;
        if (h == 0 || !kOneBlock || kTail) {
            const int p = kOneBlock ? 0 : h;
            t_lo = make_table(scale_of(w.p_lo[p], k_ok, s_code2, offset));
            t_hi = make_table(scale_of(w.p_hi[p], k_ok, s_code2, offset));
        }
        const u32 lo[4] = {w.lo[h].x, w.lo[h].y, w.lo[h].z, w.lo[h].w};
        const u32 hi[4] = {w.hi[h].x, w.hi[h].y, w.hi[h].z, w.hi[h].w};
#pragma unroll
        for (int v = 0; v < 4; ++v) {  // word v of the half: 8 k, mmas 8h + 2v and 8h + 2v + 1
            u32 wl[4], wh[4];
            decode8(t_lo, lo[v], wl);
            decode8(t_hi, hi[v], wh);
            const u32 a0[4] = {wl[0], wh[0], wl[1], wh[1]}, a1[4] = {wl[2], wh[2], wl[3], wh[3]};
#pragma unroll
            for (int i = 0; i < NT8; ++i) {
                const uint4 act = tile[act_slot(8 * i + ln.g, 8 * ln.t + 4 * h + v, ACT_ROW_CHUNKS)];
                mma(acc[i], a0, act.x, act.y);
                mma(acc[i], a1, act.z, act.w);
            }
        }
    }
}

template <bool kOneBlock, bool kBranchy>
__device__ __forceinline__ void run_split(float (&acc)[NT8][4],
                                          uint4 (&s_act)[ACT_STAGES][ACT_TILE_SLOTS], int first,
                                          int last, const Lane& ln, const elem_t* __restrict__ A, i64 m0, int rows,
                                          int K, const void* absmax, const float* absmax2, const float* s_code2,
                                          float offset, int bs_log2, int bs2_log2) {
    const int full = K / STEP_K;
    // Software-pipelined: the next step's weights and scale parts (registers) and activations (the
    // other stage of the shared tile) are in flight while this one decodes.
    if (first < last) stage_activations<kBranchy>(s_act[0], A, m0, rows, first * STEP_K, K);
    StepWeights<kOneBlock> cur;
    load_step(cur, first, ln, K, absmax, absmax2, bs_log2, bs2_log2);
    for (int step = first; step < last; ++step) {
        const int stage = (step - first) & 1;
        StepWeights<kOneBlock> next;
        load_step(next, step + 1, ln, K, absmax, absmax2, bs_log2, bs2_log2);
        cp_async_wait<0>();
        // This step's tile (and, the first time, the code book) visible to every warp, and every
        // warp done with the other stage (the step before), which the next step's tile refills.
        __syncthreads();
        stage_activations<kBranchy>(s_act[stage ^ 1], A, m0, step + 1 < last ? rows : 0, (step + 1) * STEP_K, K);
        if (step < full)
            compute_step<kOneBlock, false>(acc, cur, s_act[stage], step, ln, K, s_code2, offset);
        else
            compute_step<kOneBlock, true>(acc, cur, s_act[stage], step, ln, K, s_code2, offset);
        cur = next;
    }
}

// Grid: x = groups of MM_WARPS * 16 features, y = splits of K (each steps_per_split steps of 256 k),
// z = tiles of MM_TOKENS tokens. With one split the block writes out (+ bias) itself; with more,
// launched as clusters of the splits (sm_90 on), the cluster adds them (add_splits_in_cluster);
// else split s writes its partial sums to slice s of `partial` [splits, M, N] (fp32, every element
// written by exactly one lane) and matmul_4bit_finish adds the slices in split order: the same
// bits on every run, whatever order the blocks ran in.
extern "C" __global__ void __launch_bounds__(MM_WARPS * 32, MIN_BLOCKS) matmul_4bit_kernel(MM_MAIN_PARAMS) {
    __shared__ uint4 s_act[ACT_STAGES][ACT_TILE_SLOTS];
    MM_SCALES_PROLOGUE;

    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n_lo = (blockIdx.x * MM_WARPS + (threadIdx.x >> 5)) * 16 + g, n_hi = n_lo + 8;
    const BlockWork work = block_work(M, K, steps_per_split);
    const i64 m0 = work.m0;
    const int rows = work.rows, first = work.first, last = work.last;

    Lane ln;
    ln.g = g;
    ln.t = t;
    ln.k = 64 * t;
    ln.e_lo = (i64)min(n_lo, N - 1) * K;
    ln.e_hi = (i64)min(n_hi, N - 1) * K;
    ln.w_lo = W + ln.e_lo / 2;
    ln.w_hi = W + ln.e_hi / 2;

    float acc[NT8][4];
#pragma unroll
    for (int i = 0; i < NT8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    // A lane's 64 k start at a multiple of 64 of the flattened weight when K is one. The branchy
    // staging's loop only where a tile can be that small and the common case (the 8-token build).
    if (K % 64 == 0 && bs_log2 >= 6 && MM_TOKENS == 8 && rows <= BRANCHY_STAGING_ROWS)
        run_split<true, true>(acc, s_act, first, last, ln, A, m0, rows, K, absmax, absmax2, s_code2, offset, bs_log2,
                              bs2_log2);
    else if (K % 64 == 0 && bs_log2 >= 6)
        run_split<true, false>(acc, s_act, first, last, ln, A, m0, rows, K, absmax, absmax2, s_code2, offset, bs_log2,
                               bs2_log2);
    else
        run_split<false, false>(acc, s_act, first, last, ln, A, m0, rows, K, absmax, absmax2, s_code2, offset,
                                bs_log2, bs2_log2);

    static_assert(sizeof(s_act) >= MM_TOKENS * MM_WARPS * 16 * sizeof(float), "the splits' sums borrow the stages");
    store_tile(acc, n_lo, m0, t, M, N, partial, bias, out, reinterpret_cast<float*>(s_act));
}
