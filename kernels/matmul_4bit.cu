// Fused 4-bit matmul for 9 to 128 tokens a tile: out[m, n] = sum_k A[m, k] * W[n, k] (+ bias[n]),
// W in the bitsandbytes packed format (kernels/dequantize_4bit.cu states it) decoded in registers,
// never written out. Up to 8 tokens run matmul_4bit_m8.cu; matmul_4bit_common.cuh holds the macros,
// the host contract and the arithmetic both share.
//
// Designed from the packed-weight roofline down (kernels/NOTES.md, "Fused matmul"): at decode
// sizes the weights are the traffic (N*K/2 bytes), so every weight byte is read once, by one
// 16-byte load, and decoded straight into the tensor cores' operand registers.
//
// mma.sync.m16n8k16 (sm80-sm90) with the weights as operand A (16 output features x 16 k) and the
// activations as operand B (16 k x 8 tokens), 2 to 8 n-tiles sharing each decoded weight. One warp
// owns 16 output features; per step it covers 128 k: lane (g = lane / 4, t = lane % 4) loads 16
// bytes (32 codes, k = 32t .. 32t+31) of features g and g + 8. The k order inside a step is
// permuted, identically for both operands (a dot product does not care): fragment slot s of mma j
// holds k = 32t + 4j + {0,1,2,3}[s], so a lane's 16 bytes feed its operand-A registers of all 8
// mmas of the step without a shuffle, and its activations are 64 contiguous bytes of token g (four
// 16-byte reads of the block's activation tile in shared memory, staged a step ahead). A weight is decoded
// by one lookup in the 16-entry code table in shared memory, an fp32 multiply and a rounding: with
// two or more n-tiles that cost is shared by more mmas, and its few registers keep more warps in
// flight (the per-block register tables of matmul_4bit_m8.cu measured slower here, NOTES).
#define STEP_K 128
#include "matmul_4bit_step128.cuh"

#if MM_TOKENS != 16 && MM_TOKENS != 32 && MM_TOKENS != 64 && MM_TOKENS != 128
#error "matmul_4bit.cu takes MM_TOKENS 16, 32, 64 or 128 (8: matmul_4bit_m8.cu)"
#endif

// Chunk c of token row r sits in slot act_slot(r, c): the XOR puts the 8 lanes of a quarter warp
// (two rows, four lanes each reading chunk 4t + q) into 8 different 16-byte bank groups when they
// read, and into 8 when they write 8 chunks of a row.
__device__ __forceinline__ int act_slot(int row, int c, int row_chunks) {
    return row * row_chunks + (c ^ ((c >> 3) << 1) ^ (row & 1));
}

#define ACT_TILE_SLOTS (MM_TOKENS * ACT_ROW_CHUNKS)  // slots of one stage

// Stage k0 .. k0 + STEP_K of the tile's first `rows` tokens as one cp.async group.
__device__ __forceinline__ void stage_activations(uint4* tile, const elem_t* __restrict__ A, i64 m0, int rows, int k0,
                                                  int K) {
    for (int e = threadIdx.x; e < rows * ACT_ROW_CHUNKS; e += MM_WARPS * 32) {
        const int r = e / ACT_ROW_CHUNKS, c = e % ACT_ROW_CHUNKS, k = k0 + 8 * c;
        const bool ok = k < K;
        cp_async16(tile + act_slot(r, c, ACT_ROW_CHUNKS), ok ? A + (m0 + r) * K + k : A, ok);
    }
    cp_async_commit();
}

// Grid: x = groups of MM_WARPS * 16 features, y = splits of K (each steps_per_split steps of 128 k),
// z = tiles of MM_TOKENS tokens. With one split the block writes out (+ bias) itself; with more,
// split s writes its partial sums to slice s of `partial` [splits, M, N] (fp32, every element
// written by exactly one lane) and matmul_4bit_finish adds the slices in split order: the same
// bits on every run, whatever order the blocks ran in.
extern "C" __global__ void __launch_bounds__(WIDE_BOUNDS) matmul_4bit_kernel(MM_MAIN_PARAMS) {
    __shared__ __align__(16) float s_code[16];
#if MM_TOKENS == 128  // two stages (64 KB) pass the 48 KB a kernel may declare: the launch passes them
    extern __shared__ __align__(16) unsigned char s_dynamic[];
    auto& s_act = *reinterpret_cast<uint4(*)[ACT_STAGES][ACT_TILE_SLOTS]>(s_dynamic);
#else
    __shared__ uint4 s_act[ACT_STAGES][ACT_TILE_SLOTS];
#endif
    MM_SCALES_PROLOGUE;
    if (threadIdx.x == 0) stage_code_table(s_code);

    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n_lo = (blockIdx.x * MM_WARPS + (threadIdx.x >> 5)) * 16 + g, n_hi = n_lo + 8;
    const BlockWork work = block_work(M, K, steps_per_split);
    const i64 m0 = work.m0;
    const int rows = work.rows, steps = work.steps, first = work.first, last = work.last;

    float acc[NT8][4];
#pragma unroll
    for (int i = 0; i < NT8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    // Software-pipelined: the next step's weights (registers) and activations (the other stage of
    // the shared tile) are in flight while this one decodes.
    if (first < last) stage_activations(s_act[0], A, m0, rows, first * STEP_K, K);
    StepWeights cur;
    load_step(cur, first < last ? first : steps, W, absmax, absmax2, n_lo, n_hi, N, K, t, bs_log2, bs2_log2);
    for (int step = first; step < last; ++step) {
        const int stage = (step - first) & 1;
        StepWeights next;
        load_step(next, step + 1 < last ? step + 1 : steps, W, absmax, absmax2, n_lo, n_hi, N, K, t, bs_log2,
                  bs2_log2);
        cp_async_wait<0>();
        // This step's tile (and, the first time, the code tables) visible to every warp, and every
        // warp done with the other stage (the step before), which the next step's tile refills.
        __syncthreads();
        if (step + 1 < last)
            stage_activations(s_act[stage ^ 1], A, m0, rows, (step + 1) * STEP_K, K);
        const uint4* tile = s_act[stage];
        const int k = step * STEP_K + 32 * t;  // this lane's first k
        const bool k_ok = k < K;               // K % 32 == 0: a lane's 32 k are all in or all out
        const float s_lo = scale_of(cur.p_lo, k_ok && n_lo < N, s_code2, offset);
        const float s_hi = scale_of(cur.p_hi, k_ok && n_hi < N, s_code2, offset);
        const u32 lo[4] = {cur.lo.x, cur.lo.y, cur.lo.z, cur.lo.w}, hi[4] = {cur.hi.x, cur.hi.y, cur.hi.z, cur.hi.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // 16-byte quarter q of the lane's 64 activation bytes: mmas 2q, 2q+1
            u32 a[2][4];  // operand A of mma 2q + h: bytes 2(2q + h), 2(2q + h) + 1 of the lane's 16
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                decode_frag(a[h], lo[q], hi[q], h, s_lo, s_hi, s_code);
            }
            // One token tile's activations at a time: few registers live, so 8 warps fit 128 a thread.
#pragma unroll
            for (int i = 0; i < NT8; ++i) {
                const uint4 act = tile[act_slot(8 * i + g, 4 * t + q, ACT_ROW_CHUNKS)];
                mma(acc[i], a[0], act.x, act.y);
                mma(acc[i], a[1], act.z, act.w);
            }
        }
        cur = next;
    }

    store_tile(acc, n_lo, m0, t, M, N, partial, bias, out, reinterpret_cast<float*>(s_act));
}
