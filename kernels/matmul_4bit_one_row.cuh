// The one-row path of the pair-table kernel's few-rows build (matmul_4bit_m8_pairs.cu includes it):
// a call of one row (decode at batch 1) of a weight with K % 256 == 0, blocks of 64 and 4-byte
// aligned scale codes. Same arithmetic as the 8-token kernel (a code rounded once to A's dtype, fp32
// mma sums of 32 k of one block, the block's fp32 scale applied by one fma), same grid, same epilogue.
//
// Why: at one row the 8-token kernel's mma feeds 16 features of one k slice, so a warp's weight load
// touches 8 rows and its activation reads come from the staged tile every step; the L1 unit's data
// stage paces it (kernels/NOTES.md). Here the 16 rows of operand A are the four 64-k blocks of a step
// of TWO features (rows g and g + 8 of lane group g: the first and second 32 k of block g % 4 of the
// half warp's feature), and operand B's 8 columns are the activations of the 8 row groups: column g
// holds those of row g's k (or row g + 8's in a second mma). Only the diagonal of C is used: C[g][g]
// is row g's 32-k dot product, C[g + 8][g] row g + 8's. So:
//   - a half warp reads 128 contiguous bytes of one feature (8 bytes a lane): one line a load;
//   - every lane multiplies only its own codes' activations, the same k for every feature: 16
//     activations a lane a step, loaded once for the warp's 16 features, no shared tile, no barrier;
//   - twice the mmas (two a 16-k slice), 0.25 thread instructions a weight: the tensor pipe has room.
//
// Lane (g = lane / 4, t = lane % 4), half h = g / 4, group q = g % 4. Pair p (0..7) of a step is
// features p (h = 0) and p + 8 (h = 1) of the warp's 16; the lane loads the 16 codes at k
// 64 q + 16 t .. + 15 of its half's feature. Row g of the fragment is k 0..31 of block q, row g + 8
// k 32..63: lanes t < 2 hold row g's codes, t >= 2 row g + 8's, so lanes t and t ^ 2 trade one word
// (lane t keeps the word of k ROW_G_K(t) .. + 7 for row g and gets/keeps k 32 + ROW_G_K(t) .. for row
// g + 8). Slice j (0, 1) of a row word is its bytes 2j and 2j + 1: k + 4j .. + 3, fragment slots
// (2t, 2t + 1) and (2t + 8, 2t + 9), with the activations at the same k in operand B.
#pragma once

#define ONE_ROW_PAIRS 8                                      // feature pairs a warp takes a step
#define ROW_G_K(t) (16 * ((t) & 1) + 8 * ((t) >> 1))         // k of lane t's row-g word in its block

// Whether a call takes this path: one row, whole steps, blocks of 64 (a lane group's 64 k are one
// block), scale codes readable 4 at a time (a step's 4 blocks of a feature), second-level blocks
// of a multiple of 4 blocks (the 4 share one second-level scale) and 32-bit byte offsets into W.
__device__ __forceinline__ bool one_row_takes(i64 M, int N, int K, int bs_log2, int bs2_log2, const void* absmax) {
    return M == 1 && K % STEP_K == 0 && bs_log2 == 6 && bs2_log2 >= 2 &&
           (reinterpret_cast<unsigned long long>(absmax) & 3) == 0 && (i64)N * K < (1ll << 32);
}

// What a lane holds of the next step as it computes one: each pair's 8 bytes and one word of scale parts: lanes 0-15 the 4 scale codes (the step's 4 blocks)
// of feature lane % 16, lanes 16-31 that feature's second-level scale.
struct OneRowStep {
    uint2 w[ONE_ROW_PAIRS];
    u32 scales;
};

// The lane's fixed addresses, formed once.
struct OneRowAddresses {
    const unsigned char* w;    // W at the lane's 8 bytes of step 0 of row 0
    const elem_t* xg;          // A at the lane's row-g k of step 0
    const u32* scales;         // lanes 0-15: the scale word of step 0 (a word a step)
    int n0, last_row;          // the half's first feature, N - 1
    unsigned half_k;           // bytes a row
    int a2_block, bs2_log2;    // lanes 16-31: the feature's first block; log2 blocks a second-level scale
};

// Pair p's 8 bytes of step `step` (features past N clamped to the last: their outputs are never
// stored). 32-bit offsets (one_row_takes: the packed weight under 2 GB): 64-bit ones held through the
// step spilled at 128 registers.
__device__ __forceinline__ const unsigned char* one_row_weights(const OneRowAddresses& ad, int p, int step) {
    return ad.w + (static_cast<unsigned>(min(ad.n0 + p, ad.last_row)) * ad.half_k + step * (STEP_K / 2));
}

__device__ __forceinline__ void one_row_load(OneRowStep& s, const OneRowAddresses& ad, int step, unsigned lane,
                                             const float* absmax2) {
#pragma unroll
    for (int p = 0; p < ONE_ROW_PAIRS; ++p) s.w[p] = __ldcs(reinterpret_cast<const uint2*>(one_row_weights(ad, p, step)));
    s.scales = lane < 16 ? __ldg(ad.scales + step)
                         : __float_as_uint(__ldg(absmax2 + ((ad.a2_block + 4 * step) >> ad.bs2_log2)));
}

// Steps first .. last - 1 of one row; the lane's sums of its diagonal, per pair (lanes off the
// diagonal hold sums of other rows' products: the epilogue drops them).
__device__ __forceinline__ void one_row_run(float (&acc)[ONE_ROW_PAIRS], const OneRowAddresses& ad, int first, int last,
                                            u32* table, const float* s_code2, float offset,
                                            const float* absmax2) {
    const unsigned lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool low = t < 2, odd = g & 1;
    const u32 lane_bytes = lane * 4 * 0x01010101u;
    const u32 code_byte = 0x4440u | (g & 3);  // prmt: byte g % 4 of a scale word, zero-extended
    const unsigned src = 8 * (lane >> 4);     // pair p's feature in the scale words: lane p + src (+ 16)
    OneRowStep s;
    one_row_load(s, ad, first, lane, absmax2);
    stage_pair_table(table);
    cp_async_commit();  // the scales' code book (MM_SCALES_PROLOGUE)
    cp_async_wait<0>();
    __syncthreads();
    for (int step = first; step < last; ++step) {
        const bool more = step + 1 < last;
        // This step's activations: every warp of the SM reads the same row, so after the first
        // they come from L1, a short wait; held a step ahead as well, they spilled at 128 registers.
        const elem_t* x = ad.xg + step * STEP_K;
        const uint4 xg = __ldg(reinterpret_cast<const uint4*>(x)), xh = __ldg(reinterpret_cast<const uint4*>(x + 32));
        const u32 scales = s.scales;
        if (more)
            s.scales = lane < 16 ? __ldg(ad.scales + (step + 1))
                                 : __float_as_uint(__ldg(absmax2 + ((ad.a2_block + 4 * (step + 1)) >> ad.bs2_log2)));
#pragma unroll
        for (int p = 0; p < ONE_ROW_PAIRS; ++p) {
            // The block's scale: its code from the half's feature's scale word, its second-level scale.
            const u32 q = prmt(__shfl_sync(0xffffffffu, scales, p + src), 0u, code_byte);
            const float a2 = __uint_as_float(__shfl_sync(0xffffffffu, scales, 16 + p + src));
            const float sc = nested_scale(s_code2[q], a2, offset);
            const uint2 v = s.w[p];
            const u32 got = __shfl_xor_sync(0xffffffffu, low ? v.y : v.x, 2);
            const u32 wg = low ? v.x : got, wh = low ? got : v.y;
            if (more) s.w[p] = __ldcs(reinterpret_cast<const uint2*>(one_row_weights(ad, p, step + 1)));
            const PairAddresses lo = pair_addresses(wg, lane_bytes), hi = pair_addresses(wh, lane_bytes);
            float cg[4], ch[4];
            const u32 a0[4] = {lookup<0>(table, lo), lookup<0>(table, hi), lookup<1>(table, lo), lookup<1>(table, hi)};
            mma_zero(cg, a0, xg.x, xg.y);
            mma_zero(ch, a0, xh.x, xh.y);
            const u32 a1[4] = {lookup<2>(table, lo), lookup<2>(table, hi), lookup<3>(table, lo), lookup<3>(table, hi)};
            mma(cg, a1, xg.z, xg.w);
            mma(ch, a1, xh.z, xh.w);
            acc[p] = __fmaf_rn(sc, odd ? cg[1] : cg[0], acc[p]);  // C[g][g]: k 0..31 of the block
            acc[p] = __fmaf_rn(sc, odd ? ch[3] : ch[2], acc[p]);  // C[g + 8][g]: k 32..63
        }
    }
}

// The one-row call of a block: its split's sums, added over each feature's 4 diagonal lanes, into
// the 8-token kernel's accumulator layout for store_tile (feature g in slot 0, g + 8 in slot 2, of
// token 0: lanes t == 0 store them).
__device__ __forceinline__ void one_row(const elem_t* __restrict__ A, const unsigned char* __restrict__ W,
                                        const void* absmax, const float* absmax2, const float* s_code2, float offset,
                                        float* partial, const elem_t* __restrict__ bias, elem_t* __restrict__ out,
                                        int N, int K, int bs2_log2, int steps_per_split, u32* table) {
    const unsigned tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const BlockWork work = block_work(1, K, steps_per_split);
    const int fbase = (blockIdx.x * MM_WARPS + (tid >> 5)) * 16;
    OneRowAddresses ad;
    ad.n0 = fbase + 8 * (lane >> 4);
    ad.last_row = N - 1;
    ad.half_k = K / 2;
    ad.w = W + (g & 3) * 32 + t * 8;
    ad.xg = A + (g & 3) * 64 + ROW_G_K(t);
    const i64 scale_feature = min(fbase + (int)(lane & 15), N - 1);
    ad.scales = static_cast<const u32*>(absmax) + scale_feature * (K / STEP_K);  // a step's 4 codes a word
    ad.a2_block = static_cast<int>(scale_feature * (K / 64));
    ad.bs2_log2 = bs2_log2;
    float acc[ONE_ROW_PAIRS];
#pragma unroll
    for (int p = 0; p < ONE_ROW_PAIRS; ++p) acc[p] = 0.0f;
    one_row_run(acc, ad, work.first, work.last, table, s_code2, offset, absmax2);
    // Each feature's sum over its half's 4 diagonal lanes (t == g / 2), the others' sums dropped.
    const bool diagonal = t == (g >> 1);
    float tile[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int p = 0; p < ONE_ROW_PAIRS; ++p) {
        float v = diagonal ? acc[p] : 0.0f;
#pragma unroll
        for (int d = 1; d < 16; d <<= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, d));
        const float other = __shfl_xor_sync(0xffffffffu, v, 16);  // the other half's feature of the pair
        if (p == static_cast<int>(g)) {
            tile[0][0] = lane < 16 ? v : other;  // feature p
            tile[0][2] = lane < 16 ? other : v;  // feature p + 8
        }
    }
    store_tile(tile, fbase + g, 0, t, 1, N, partial, bias, out, reinterpret_cast<float*>(table));
}
