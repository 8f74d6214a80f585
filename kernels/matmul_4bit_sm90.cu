// Fused 4-bit matmul for 9 to 128 tokens a tile on Hopper (sm_90a): matmul_4bit.cu's decode with
// the tensor cores' warpgroup instruction. wgmma.mma_async takes operand A (64 output features x
// 16 k: the decoded weights) from the registers of a warpgroup's four warps, exactly in the layout
// mma.sync's operand A has per warp, and operand B (16 k x MM_TOKENS tokens: the activations)
// straight from shared memory. So the activation tile a block stages once per step is read by the
// tensor cores themselves, once per warpgroup, with no load instruction: in matmul_4bit.cu every
// warp reads all of it into registers (16-byte shared loads, a quarter of the load/store pipe per
// weight at 64 tokens), which is what holds the wider tiles at 3-5x the packed-weight roofline
// (kernels/NOTES.md, "Warpgroup mma on Hopper").
//
// The k permutation of matmul_4bit_step128.cuh (fragment slot s of k16 slice j holds k = 32t + 4j +
// {0,1,2,3}[s] for lane t) is undone on the activations' side, when they are staged: slice j of the
// tile holds, for each token, the 16 k of that slice in fragment order, so the four 4-byte pieces
// of every 16 bytes of a token's row go to four places (the weights' side would need a byte
// transpose across lanes). A thread loads its 16-byte chunks of the next step's tile into registers
// while the step computes and stores them after the step's barrier, four 4-byte stores a chunk at
// offsets fixed at compile time. The tile is wgmma's K-major layout without swizzle: core matrices
// of 8 tokens x 8 k (16 bytes a token), the second 8 k of a slice CORE_LBO bytes after the first,
// the next 8 tokens CORE_SBO bytes on, slices SLICE_BYTES apart: 16 bytes of padding a slice put
// the 32 lanes of each store in 32 different banks.
#define STEP_K 128
#include "matmul_4bit_step128.cuh"

#if MM_TOKENS != 16 && MM_TOKENS != 32 && MM_TOKENS != 64 && MM_TOKENS != 128
#error "matmul_4bit_sm90.cu takes MM_TOKENS 16, 32, 64 or 128"
#endif
#if MM_WARPS % 4 != 0
#error "matmul_4bit_sm90.cu runs whole warpgroups: MM_WARPS a multiple of 4"
#endif
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "matmul_4bit_sm90.cu needs wgmma: compile it for sm_90a"
#endif

#define SLICES (STEP_K / 16)  // k16 slices of a step: one wgmma each
#ifndef MM_DEEP  // the host's choice (matmul_kernel.MatmulVariant.deep): see WIDE_STAGES
#define MM_DEEP 0
#endif
#if MM_DEEP && MM_TOKENS != 128
#error "MM_DEEP is the 128-token tile's: its third stage is dynamic shared memory"
#endif
#define GROUP (MM_DEEP ? 4 : MM_TOKENS >= 32 ? 2 : 1)  // slices a commit
#define CORE_LBO 128          // bytes from a core matrix to the one holding the slice's next 8 k
#define CORE_SBO 256          // bytes from 8 tokens to the next 8
#define SLICE_BYTES (MM_TOKENS * 32 + 16)
#define STAGE_BYTES (SLICES * SLICE_BYTES)
#define THREADS (MM_WARPS * 32)
// Activation tiles in flight. The deep build (the nested 8-warp 128-token one) has the SM to itself,
// and 3 stages fit beside the pair table, so a step never drains its wgmmas: the stage a step
// refills was read two steps before, and every warpgroup's wait for its next-to-last group has
// covered that; its slices go 4 a commit (16 lookups in flight a warp; 205 registers). Two stages
// wait for all of a step's wgmmas before the next step's barrier.
#define WIDE_STAGES (MM_DEEP ? 3 : ACT_STAGES)
// 16-byte activation chunks a thread moves a step (the last one past the tile's rows for some
// threads where the block's threads do not divide them: 12 warps at 128 tokens)
#define CHUNKS ((MM_TOKENS * (STEP_K / 8) + THREADS - 1) / THREADS)
#define ROW_STRIDE (THREADS / 16)  // tokens between a thread's chunks
#define CHUNKS_PAST_TILE (CHUNKS * THREADS != MM_TOKENS * (STEP_K / 8))
// load_chunks' path without predicates: the 32-token tile and the 8-warp 128-token builds, where it
// measured faster or the same on every weight timed, small ones included (NOTES, "The activation
// staging of a full tile", "The 32-token tile's full-tile path on its small weights"); the 64-token
// build lost 2.2-2.5% on a small weight with it, the 12-warp one 3.4% on the o weight
#define FULL_TILE_PATH (MM_TOKENS == 32 || (MM_TOKENS == 128 && !CHUNKS_PAST_TILE))
#if ROW_STRIDE % 8 != 0
#error "the activation tile's chunks must be 8-token groups apart"
#endif

// From 64 tokens up the codes are looked up two at a time: a byte of packed codes indexes a table of
// 256 fp32 pairs (code[e >> 4], code[e & 15]) in dynamic shared memory before the stages. A 64-bit
// shared load is served a half-warp at a time, so 16 copies of each entry, copy c for lanes c and
// c + 16, 8 bytes apart, put a half-warp's 16 loads in 16 different bank pairs whatever their bytes
// (32 KB; pair_addresses' layout). A pair is then its share of two instructions a word, a prmt, one
// 64-bit load, 2 FMUL and the pack, where one code a lookup was a prmt, a load and an FMUL a code,
// the pack, and two shifts and two masks a word. Each weight is still the fp32 code times the fp32
// scale rounded once to A's dtype: the same bits. Below 64 tokens the table would cap the blocks an
// SM (kernels/NOTES.md, "Code pairs in the Hopper wide kernel").
#define WIDE_PAIRS (MM_TOKENS >= 64)
#define WIDE_PAIR_TABLE_BYTES (256 * 16 * 8)

#if WIDE_PAIRS
// The table by the block's threads, two copies of an entry a 16-byte store.
__device__ __forceinline__ void stage_wide_pairs(float2* table) {
#pragma unroll 1
    for (int i = threadIdx.x; i < WIDE_PAIR_TABLE_BYTES / 16; i += THREADS) {
        const int row = i / 16, half = (i / 8) & 1;  // 16 stores a row of 256 bytes: entries e, e | 128
        const int e = (row % 128) | (half ? 128 : 0);
        const float x = __uint_as_float(c_code_bits[e >> 4]), y = __uint_as_float(c_code_bits[e & 15]);
        reinterpret_cast<float4*>(table)[i] = make_float4(x, y, x, y);
    }
}

template <int kByte>
__device__ __forceinline__ u32 scaled_pair(const float2* table, const PairAddresses& a, float s) {
    const float2 p = *reinterpret_cast<const float2*>(reinterpret_cast<const char*>(table) + pair_offset<kByte>(a));
    return pack2(mul_ftz(p.x, s), mul_ftz(p.y, s));
}

// decode_frag's registers from the pair table: the same products, the same order.
template <int kHalf>
__device__ __forceinline__ void decode_frag_pairs(u32 a[4], u32 lo_word, u32 hi_word, float s_lo, float s_hi,
                                                  const float2* table, u32 lane8) {
    const PairAddresses lo = pair_addresses(lo_word, lane8), hi = pair_addresses(hi_word, lane8);
    a[0] = scaled_pair<2 * kHalf>(table, lo, s_lo);
    a[2] = scaled_pair<2 * kHalf + 1>(table, lo, s_lo);
    a[1] = scaled_pair<2 * kHalf>(table, hi, s_hi);
    a[3] = scaled_pair<2 * kHalf + 1>(table, hi, s_hi);
}
#endif

// The shared-memory matrix descriptor of a K-major operand without swizzle (PTX ISA, "Matrix
// Descriptor Format"): start address, leading (k) and stride (8-row) byte offsets, each >> 4.
__device__ __forceinline__ unsigned long long smem_desc(const void* p) {
    const unsigned long long addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
    return ((addr & 0x3ffffull) >> 4) | ((unsigned long long)(CORE_LBO >> 4) << 16) |
           ((unsigned long long)(CORE_SBO >> 4) << 32);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// The accumulators as the compiler sees them after a wait: wgmma writes them asynchronously, so
// nothing may read them before the wait that covers it (an empty asm that "rewrites" each one).
__device__ __forceinline__ void settle(float (&d)[NT8][4]) {
#pragma unroll
    for (int i = 0; i < NT8; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) asm volatile("" : "+f"(d[i][c])::"memory");
}

// d (64 features x MM_TOKENS, fp32) += A (registers: this warp's 16 features x 16 k) * B (desc).
// The accumulator layout per warp is mma.sync's: d[i][c] is n-tile i, slot c (store_tile).
#if MM_TOKENS == 0
#elif MM_TOKENS == 16
#define WGMMA_ASM(type)                                                                                      \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32." type "." type " {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n" \
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])                                                                                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1))
#elif MM_TOKENS == 32
#define WGMMA_ASM(type)                                                                                      \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32." type "." type " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n" \
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])                                                                                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1))
#elif MM_TOKENS == 64
#define WGMMA_ASM(type)                                                                                      \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." type "." type " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n" \
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])                                                                                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1))
#elif MM_TOKENS == 128
#define WGMMA_ASM(type)                                                                                      \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." type "." type " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n" \
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])                                                                                     \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1))
#endif

__device__ __forceinline__ void wgmma(float (&d)[NT8][4], const u32 a[4], unsigned long long desc) {
#if MM_DTYPE == 0
    WGMMA_ASM("f16");
#else
    WGMMA_ASM("bf16");
#endif
}

// A thread's chunks of a step's tile: chunk x = threadIdx.x % 16 (k0 + 8x .. k0 + 8x + 7) of
// tokens threadIdx.x / 16 + ROW_STRIDE * i. Zeros past K and for tokens past M.
struct ActChunks {
    uint4 v[CHUNKS];
};

__device__ __forceinline__ void load_chunks(ActChunks& c, const elem_t* __restrict__ A, i64 m0, int rows, int k0,
                                            int K) {
    const int x = threadIdx.x & 15, k = k0 + 8 * x;
    // A step whose tile lies inside M and K (block-uniform: every step of a full token tile but a
    // last partial k step) needs neither the predicate nor the zeros: one pointer and a stride,
    // where the general path re-tests, zeroes and re-reads A's address a chunk.
    if (FULL_TILE_PATH && rows == MM_TOKENS && k0 + STEP_K <= K) {
        const elem_t* p = A + (m0 + (threadIdx.x >> 4)) * K + k;
        const i64 stride = (i64)ROW_STRIDE * K;
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) c.v[i] = __ldg(reinterpret_cast<const uint4*>(p + stride * i));
        return;
    }
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        const int r = (threadIdx.x >> 4) + ROW_STRIDE * i;
        c.v[i] = r < rows && k < K ? __ldg(reinterpret_cast<const uint4*>(A + (m0 + r) * K + k))
                                   : make_uint4(0u, 0u, 0u, 0u);
    }
}

// Word w of chunk x holds k = 32t + 4j + 2c + {0, 1} with t = x / 4, j = 2(x % 4) + w / 2, c = w % 2:
// slice j, core matrix c, byte 4t of the token's 16.
__device__ __forceinline__ void store_chunks(unsigned char* stage, const ActChunks& c) {
    const int x = threadIdx.x & 15, r = threadIdx.x >> 4;
    unsigned char* base = stage + 2 * (x & 3) * SLICE_BYTES + (r >> 3) * CORE_SBO + (r & 7) * 16 + 4 * (x >> 2);
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        if (CHUNKS_PAST_TILE && i == CHUNKS - 1 && r + ROW_STRIDE * i >= MM_TOKENS) break;
        unsigned char* row = base + (ROW_STRIDE / 8) * CORE_SBO * i;
        const u32 w[4] = {c.v[i].x, c.v[i].y, c.v[i].z, c.v[i].w};
#pragma unroll
        for (int q = 0; q < 4; ++q) *reinterpret_cast<u32*>(row + (q >> 1) * SLICE_BYTES + (q & 1) * CORE_LBO) = w[q];
    }
}

// Grid and workspace as matmul_4bit.cu's (x = groups of MM_WARPS * 16 features, y = splits of K,
// z = token tiles; partial sums added by matmul_4bit_finish in split order), except that at 64
// tokens (MM_CLUSTER_SPLITS 2) two splits may run as a cluster that adds them (add_splits_in_cluster).
extern "C" __global__ void __launch_bounds__(WIDE_BOUNDS) matmul_4bit_kernel(MM_MAIN_PARAMS) {
#if WIDE_PAIRS  // the pair table (and at 128 tokens the stages) pass the 48 KB a kernel may declare
    extern __shared__ __align__(128) unsigned char s_dynamic[];
    const float2* s_pairs = reinterpret_cast<const float2*>(s_dynamic);
#else
    __shared__ __align__(16) float s_code[16];
#endif
#if MM_TOKENS == 128
    auto& s_act = *reinterpret_cast<unsigned char(*)[WIDE_STAGES][STAGE_BYTES]>(s_dynamic + WIDE_PAIR_TABLE_BYTES);
#else
    __shared__ __align__(128) unsigned char s_act[WIDE_STAGES][STAGE_BYTES];
#endif
    MM_SCALES_PROLOGUE;
    cp_async_commit();  // the scales' code book: this kernel's only cp.async group
#if !WIDE_PAIRS
    if (threadIdx.x == 0) stage_code_table(s_code);
#endif

    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n_lo = (blockIdx.x * MM_WARPS + (threadIdx.x >> 5)) * 16 + g, n_hi = n_lo + 8;
    const BlockWork work = block_work(M, K, steps_per_split);
    const i64 m0 = work.m0;
    const int rows = work.rows, steps = work.steps, first = work.first, last = work.last;

    float acc[NT8][4];
#pragma unroll
    for (int i = 0; i < NT8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    // Software-pipelined: the next step's weights and the step after's activations (registers) are
    // in flight while this one decodes; the wgmmas of a slice run while the next slice decodes (two
    // sets of operand-A registers).
    // The first weights are in flight before the first tile's store waits for its loads: a short
    // split (the small weights' 4 steps) pays one memory latency in its prologue, not two.
    StepWeights cur;
    load_step(cur, first < last ? first : steps, W, absmax, absmax2, n_lo, n_hi, N, K, t, bs_log2, bs2_log2);
    ActChunks act;
    if (first < last) load_chunks(act, A, m0, rows, first * STEP_K, K);
#if WIDE_PAIRS  // under the first loads: a split of a few steps (small weights) pays little for it
    stage_wide_pairs(reinterpret_cast<float2*>(s_dynamic));
    const u32 lane8 = (threadIdx.x & 15) * 0x08080808u;  // the lane's copy, 8 bytes each, in every byte
#endif
    if (first < last) {
        store_chunks(s_act[0], act);
        if (first + 1 < last) load_chunks(act, A, m0, rows, (first + 1) * STEP_K, K);
    }
    for (int step = first; step < last; ++step) {
        const int stage = WIDE_STAGES == 2 ? (step - first) & 1 : (step - first) % WIDE_STAGES;
        const int refill = WIDE_STAGES == 2 ? stage ^ 1 : (stage + 1 == WIDE_STAGES ? 0 : stage + 1);
        StepWeights next;
        load_step(next, step + 1 < last ? step + 1 : steps, W, absmax, absmax2, n_lo, n_hi, N, K, t, bs_log2,
                  bs2_log2);
        cp_async_wait<0>();  // the code book (nothing is pending after the first step)
        // The tile was written through the generic proxy; the tensor cores read it through the async one.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        // This step's tile (and, the first time, the code tables) visible to every warp, and every
        // warpgroup's wgmmas that read the stage to refill done (each waited for its own).
        __syncthreads();
        if (step + 1 < last) {
            store_chunks(s_act[refill], act);
            if (step + 2 < last) load_chunks(act, A, m0, rows, (step + 2) * STEP_K, K);
        }
        // Slice j's descriptor is the tile's plus j * SLICE_BYTES in the address field (in 16-byte
        // units, and no carry: shared addresses stay below 2^18): one add a wgmma, not five.
        const unsigned long long tile = smem_desc(s_act[stage]);
        const int k = step * STEP_K + 32 * t;
        const bool k_ok = k < K;
        const float s_lo = scale_of(cur.p_lo, k_ok && n_lo < N, s_code2, offset);
        const float s_hi = scale_of(cur.p_hi, k_ok && n_hi < N, s_code2, offset);
        const u32 lo[4] = {cur.lo.x, cur.lo.y, cur.lo.z, cur.lo.w}, hi[4] = {cur.hi.x, cur.hi.y, cur.hi.z, cur.hi.w};
        // Slices go to the tensor cores GROUP at a time, one commit a group, the group before still
        // running while this one decodes (two groups of operand-A registers). Waiting a slice at a time
        // measured 5% slower from 64 tokens up and one a group 13% slower at 16 (NOTES).
        u32 a[2 * GROUP][4];
#pragma unroll
        for (int p = 0; p < SLICES / GROUP; ++p) {
#pragma unroll
            for (int s = 0; s < GROUP; ++s) {
                const int j = GROUP * p + s, q = j >> 1, h = j & 1;  // slice j: bytes 2j, 2j + 1 (word q, half h)
#if WIDE_PAIRS
                if (h == 0)
                    decode_frag_pairs<0>(a[GROUP * (p & 1) + s], lo[q], hi[q], s_lo, s_hi, s_pairs, lane8);
                else
                    decode_frag_pairs<1>(a[GROUP * (p & 1) + s], lo[q], hi[q], s_lo, s_hi, s_pairs, lane8);
#else
                decode_frag(a[GROUP * (p & 1) + s], lo[q], hi[q], h, s_lo, s_hi, s_code);
#endif
            }
            wgmma_fence();  // the decoded registers before the wgmmas that read them
#pragma unroll
            for (int s = 0; s < GROUP; ++s)
                wgmma(acc, a[GROUP * (p & 1) + s], tile + (GROUP * p + s) * SLICE_BYTES / 16);
            wgmma_commit();
            wgmma_wait<1>();  // group p - 1 done: its registers are free for group p + 1
        }
        if (WIDE_STAGES == 2) wgmma_wait<0>();  // this stage is refilled after the next barrier
        cur = next;
    }
    if (WIDE_STAGES != 2) wgmma_wait<0>();
    settle(acc);
    static_assert(!MM_CLUSTERS || sizeof(s_act) >= MM_TOKENS * MM_WARPS * 16 * sizeof(float),
                  "the splits' sums borrow the stages");
    store_tile(acc, n_lo, m0, t, M, N, partial, bias, out, reinterpret_cast<float*>(s_act));
}
