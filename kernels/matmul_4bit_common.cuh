// What the fused 4-bit matmul kernels share (matmul_4bit.cu for 9 to 128 tokens a tile, or on
// Hopper matmul_4bit_sm90.cu; matmul_4bit_m8.cu for up to 8): their macros, the mma, the decoded
// weight's rounding, the scales' loads and arithmetic, the epilogue and the finish that adds the
// splits of K.
//
// Macros (one compiled module per variant):
//   MM_DTYPE   0 = fp16, 1 = bf16 (activations, decoded weights and output)
//   MM_QUANT   0 = nf4,  1 = fp4
//   MM_NESTED  0 = fp32 absmax per block, 1 = uint8 absmax codes decoded in-kernel
//   MM_TOKENS  tokens per warp tile (8 or 16 for matmul_4bit_m8.cu, 8, 16 or 32 for matmul_4bit_m8_pairs.cu;
//              32, 64 or 128 for the wide-tile kernels)
//   MM_WARPS   warps per block (each owns 16 output features)
//   MM_CLUSTER_SPLITS  the most splits of K a thread block cluster adds (0: the kernel has no cluster
//              epilogue; harness/runtime/matmul_kernel.py's CLUSTER_SPLITS says which kernels do)
// Host contract (harness/runtime/matmul_kernel.py checks it before launching): K % 32 == 0,
// W, A and bias 16-byte aligned, block size >= 32, an fp32 workspace of splits * M * N when K is
// split (none needed otherwise).
//
// Products of fp16/bf16 are exact in fp32; sums are fp32 (mma accumulators, then the splits of K
// added in split order); the bias is added in fp32 and the result rounded once to the output
// dtype. Each decoded weight is code[nibble] * scale in fp32, rounded once to A's dtype: the
// dequantization kernel's bits, so with a one-hot activation row the output is that weight
// exactly. Deterministic: no atomics.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#if !defined(MM_DTYPE) || !defined(MM_QUANT) || !defined(MM_NESTED) || !defined(MM_TOKENS) || !defined(MM_WARPS) || \
    !defined(MM_CLUSTER_SPLITS)
#error "MM_DTYPE, MM_QUANT, MM_NESTED, MM_TOKENS, MM_WARPS and MM_CLUSTER_SPLITS must be defined by the compile spec"
#endif

typedef long long i64;
typedef unsigned int u32;
#define NT8 (MM_TOKENS / 8)  // mma n-tiles per warp

#if MM_DTYPE == 0
typedef __half elem_t;
#elif MM_DTYPE == 1
typedef __nv_bfloat16 elem_t;
#else
#error "unknown MM_DTYPE"
#endif

#define FMT_QUANT MM_QUANT
#include "format_4bit.cuh"

// Two decoded weights (the lower k in the low half), each rounded to nearest even.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
#if MM_DTYPE == 0
    const __half2 h = __floats2half2_rn(lo, hi);
#else
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
#endif
    return *reinterpret_cast<const u32*>(&h);
}

// prmt.b32 (byte permute) as PTX states it: byte i of the result is byte (selector nibble i) & 7 of
// {b, a}, or that byte's sign bit replicated where the nibble's top bit is set (CUDA's __byte_perm
// masks its selector first, an instruction more).
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 selector) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
    return d;
}

// (a & b) | c in one lop3: with two constants the compiler splits it into two, one immediate each.
__device__ __forceinline__ u32 lop3_and_or(u32 a, u32 b, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The code table's bits as a constant array, for kernels that build tables of code pairs from it.
__constant__ unsigned c_code_bits[16] = {CODE_0_3, CODE_4_7, CODE_8_11, CODE_12_15};

// Tables of code pairs (a packed byte e indexes the pair of its two codes), one copy of each entry a
// lane of a shared-memory access phase, the copy's offset `lane_bytes` (below 128) in every byte of
// a word: entry e's copy sits at (e & 127) * 256 + (e >> 7) * 128 + that offset. Its low 7 bits go
// to the address's second byte, its top bit with the lane's offset to the first, zeros above (the
// sign of a byte whose top bit is clear). Two instructions a word of 4 bytes, then one prmt a byte.
struct PairAddresses {
    u32 low7, top;
};

__device__ __forceinline__ PairAddresses pair_addresses(u32 x, u32 lane_bytes) {
    return {x & 0x7f7f7f7fu, lop3_and_or(x, 0x80808080u, lane_bytes)};
}

template <int kByte>
__device__ __forceinline__ u32 pair_offset(const PairAddresses& a) {
    constexpr u32 sel = ((8u | kByte) << 12) | ((8u | kByte) << 8) | (kByte << 4) | (4u + kByte);
    return prmt(a.low7, a.top, sel);
}

__device__ __forceinline__ void mma(float c[4], const u32 a[4], u32 b0, u32 b1) {
#if MM_DTYPE == 0
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// The activations of one step live in shared memory, staged once per block by cp.async and read
// by every warp of it: read straight from global memory, the four lanes of a token row hit four
// 16-byte pieces at a lane's stride, so one warp-wide load touched 16-32 cache lines, and each warp
// read the same bytes again (NOTES, "Activations in shared memory"). A tile is MM_TOKENS rows of
// ACT_ROW_CHUNKS 16-byte chunks (8 k each); each mma.sync kernel places them by its own act_slot,
// which keeps the 8 lanes of a quarter warp in 8 different 16-byte bank groups, and stages them by
// its own stage_activations: chunks past K as zeros (a zero weight times them stays zero, never
// NaN; K % 32 == 0, so a chunk's 8 k are all in or all out), rows past M not at all (whatever they
// hold only reaches outputs that are never stored).
#define ACT_ROW_CHUNKS (STEP_K / 8)  // a token's 16-byte chunks in one step (STEP_K: the kernel's)
#define ACT_STAGES 2                 // tiles in flight: the step computed and the next one

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool fill) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(fill ? 16 : 0));
}

// 16 bytes of each of the first `n` of kRows rows (2, 4 or 8; row r at smem + r * kSmemStride bytes, gmem
// + r * gmem_stride bytes; `fill` 16, or 0 for zeros), as one asm block of predicated copies. Copies
// behind branches (a loop with `if (r < n)`, or a helper called under a condition) make the compiler
// wait there for every global load in flight, which share one scoreboard: at a step's top, before
// any of the step has run (`python -m harness.compile_check.schedule` shows where each step waits).
template <int kRows, unsigned kSmemStride>
__device__ __forceinline__ void cp_async16_rows(void* smem, const void* gmem, long long gmem_stride, int n, int fill) {
    static_assert(kRows == 2 || kRows == 4 || kRows == 8, "two, four or eight rows a thread");
    if constexpr (kRows == 8) {  // two fours; the second's rows past n are predicated off, not branched around
        cp_async16_rows<4, kSmemStride>(smem, gmem, gmem_stride, n, fill);
        cp_async16_rows<4, kSmemStride>(static_cast<char*>(smem) + 4 * kSmemStride,
                                        static_cast<const char*>(gmem) + 4 * gmem_stride, gmem_stride, n - 4, fill);
        return;
    }
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    if constexpr (kRows == 2) {
        asm volatile(
            "{\n.reg .pred p0, p1;\n.reg .u64 g1;\n"
            "setp.gt.s32 p0, %3, 0;\nsetp.gt.s32 p1, %3, 1;\nadd.u64 g1, %1, %4;\n"
            "@p0 cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
            "@p1 cp.async.cg.shared.global [%0+%5], [g1], 16, %2;\n}\n" ::"r"(s),
            "l"(gmem), "r"(fill), "r"(n), "l"(gmem_stride), "n"(kSmemStride));
    } else {
        asm volatile(
            "{\n.reg .pred p0, p1, p2, p3;\n.reg .u64 g1, g2, g3;\n"
            "setp.gt.s32 p0, %3, 0;\nsetp.gt.s32 p1, %3, 1;\nsetp.gt.s32 p2, %3, 2;\nsetp.gt.s32 p3, %3, 3;\n"
            "add.u64 g1, %1, %4;\nadd.u64 g2, g1, %4;\nadd.u64 g3, g2, %4;\n"
            "@p0 cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
            "@p1 cp.async.cg.shared.global [%0+%5], [g1], 16, %2;\n"
            "@p2 cp.async.cg.shared.global [%0+%6], [g2], 16, %2;\n"
            "@p3 cp.async.cg.shared.global [%0+%7], [g3], 16, %2;\n}\n" ::"r"(s),
            "l"(gmem), "r"(fill), "r"(n), "l"(gmem_stride), "n"(kSmemStride), "n"(2 * kSmemStride),
            "n"(3 * kSmemStride));
    }
}

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// The main kernel's parameters, one list for every fused kernel (harness/runtime/matmul_kernel.py's
// MAIN_PARAMS gives their kinds to the launch; tests/test_launcher_cpu.py holds the two together).
#define MM_MAIN_PARAMS                                                                                                \
    const elem_t *__restrict__ A, const unsigned char *__restrict__ W, const void *__restrict__ absmax,              \
        const float *__restrict__ code2, const float *__restrict__ absmax2, const float *__restrict__ offset_ptr,    \
        float offset_value, float *__restrict__ partial, const elem_t *__restrict__ bias, elem_t *__restrict__ out, \
        i64 M, int N, int K, int bs_log2, int bs2_log2, int steps_per_split

// The block's share of a call: its token tile (first row m0, the tile's rows inside M) and its
// split of K (steps first .. last - 1 of the call's steps, STEP_K k each: the including kernel's).
struct BlockWork {
    i64 m0;
    int rows, steps, first, last;
};

__device__ __forceinline__ BlockWork block_work(i64 M, int K, int steps_per_split) {
    const i64 m0 = (i64)blockIdx.z * MM_TOKENS;
    const int steps = (K + STEP_K - 1) / STEP_K;
    const int first = blockIdx.y * steps_per_split;
    return {m0, (int)min((i64)MM_TOKENS, M - m0), steps, first, min(steps, first + steps_per_split)};
}

// The scale parts of one block, as loaded (every load of a step is issued before any is used):
// nested, its 8-bit code and its second-level scale; plain, its fp32 absmax.
struct ScaleParts {
#if MM_NESTED
    unsigned q;
    float absmax2;
#else
    float absmax;
#endif
};

__device__ __forceinline__ ScaleParts load_scale(i64 e, bool ok, const void* absmax, const float* absmax2, int bs_log2,
                                                 int bs2_log2) {
    ScaleParts p;
    const i64 block = e >> bs_log2;
#if MM_NESTED
    p.q = ok ? __ldg(static_cast<const unsigned char*>(absmax) + block) : 0u;
    p.absmax2 = ok ? __ldg(absmax2 + (block >> bs2_log2)) : 0.0f;
#else
    (void)absmax2;
    (void)bs2_log2;
    p.absmax = ok ? __ldg(static_cast<const float*>(absmax) + block) : 0.0f;
#endif
    return p;
}

// The block's scale as the dequantization kernel computes it (two separately rounded fp32 ops
// when nested); 0 outside the weight, so padding decodes to zeros.
__device__ __forceinline__ float scale_of(const ScaleParts& p, bool ok, const float* s_code2, float offset) {
#if MM_NESTED
    return ok ? nested_scale(s_code2[p.q], p.absmax2, offset) : 0.0f;
#else
    (void)s_code2;
    (void)offset;
    return ok ? p.absmax : 0.0f;
#endif
}

__device__ __forceinline__ float to_float(elem_t v) {
#if MM_DTYPE == 0
    return __half2float(v);
#else
    return __bfloat162float(v);
#endif
}

__device__ __forceinline__ elem_t from_float(float v) {
#if MM_DTYPE == 0
    return __float2half_rn(v);
#else
    return __float2bfloat16_rn(v);
#endif
}

// A kernel's first statements: `s_code2` (nested: the scales' code book, staged in shared memory
// so a scale is a shared-memory read, not a dependent global one) and `offset`, from the kernel's
// code2, offset_ptr and offset_value parameters. The book is copied by cp.async, committed with the
// first cp.async group the kernel commits: a plain load and store held every thread's first weight
// loads back by the book's round trip to memory (the store waits for the load, and ptxas kept the
// weight loads after it), a memory latency of every block. The kernel waits for its cp.async groups
// and synchronizes before using them.
#if MM_NESTED
// Unrolled, each copy guarded only where the threads do not divide the 256 (12 warps).
#define MM_SCALES_PROLOGUE                                                 \
    __shared__ float s_code2[256];                                        \
    for (int i = threadIdx.x, n = 0; n < (256 + MM_WARPS * 32 - 1) / (MM_WARPS * 32); ++n, i += MM_WARPS * 32) \
        if (256 % (MM_WARPS * 32) == 0 || i < 256) cp_async4(s_code2 + i, code2 + i); \
    const float offset = offset_ptr ? __ldg(offset_ptr) : offset_value
#else
#define MM_SCALES_PROLOGUE             \
    const float* s_code2 = nullptr;    \
    (void)code2;                       \
    (void)offset_ptr;                  \
    (void)offset_value;                \
    const float offset = 0.0f
#endif

#if MM_CLUSTER_SPLITS > 1 && __CUDA_ARCH__ < 900
#error "thread block clusters need sm_90 or later"
#endif
#if MM_CLUSTER_SPLITS > 1
#define MM_CLUSTERS 1
// K split over a thread block cluster (sm_90 on, where the compile spec asks for it): the host may
// launch the splits of each feature group and token tile as one cluster of (1, splits, 1)
// blocks, so split s is the cluster's block s. Each block leaves its partial sums in its own shared
// memory; after a cluster barrier the blocks read each other's (distributed shared memory) and add
// them in split order, in fp32, the finish kernel's arithmetic: the same bits, without the finish
// launch (about 4 µs a call on an H100) or a workspace.
__device__ __forceinline__ unsigned cluster_blocks() {
    unsigned n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
}

__device__ __forceinline__ unsigned cluster_block() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// Every block's shared-memory writes before it visible to every block of the cluster after it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// Every block of the cluster has arrived; orders no memory (no fence before the arrive).
__device__ __forceinline__ void cluster_sync_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
}

// `p` (this block's shared memory) in the cluster's block `block`.
__device__ __forceinline__ float load_in_block(const float* p, unsigned block) {
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p));
    unsigned remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(block));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

// `scratch`: MM_TOKENS x MM_WARPS * 16 floats of the block's shared memory the main loop is done with
// (its activation stages). Token-major, so the adding threads write consecutive features of out.
__device__ __forceinline__ void add_splits_in_cluster(const float (&acc)[NT8][4], int n_lo, i64 m0, int t, i64 M,
                                                      int N, const elem_t* __restrict__ bias,
                                                      elem_t* __restrict__ out, float* scratch) {
    constexpr int F = MM_WARPS * 16;  // features of the block
    const int f0 = n_lo - blockIdx.x * F;
    __syncthreads();  // every warp done with the stages `scratch` borrows
#pragma unroll
    for (int i = 0; i < NT8; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) scratch[(i * 8 + 2 * t + (c & 1)) * F + f0 + (c < 2 ? 0 : 8)] = acc[i][c];
    cluster_sync();
    const unsigned splits = cluster_blocks(), me = cluster_block();
    const int elements = F * static_cast<int>(min((i64)MM_TOKENS, M - m0));  // tokens inside M only
    for (int e = me * MM_WARPS * 32 + threadIdx.x; e < elements; e += splits * MM_WARPS * 32) {
        const int n = blockIdx.x * F + e % F;
        if (n >= N) continue;
        float v = load_in_block(scratch + e, 0);
        for (unsigned s = 1; s < splits; ++s) v = __fadd_rn(v, load_in_block(scratch + e, s));
        if (bias) v = __fadd_rn(v, to_float(bias[n]));
        out[(m0 + e / F) * N + n] = from_float(v);
    }
    // No block leaves, taking its shared memory, while another still reads it. A thread's remote
    // reads are complete here (their sums are stored), so the arrive needs no release: the release
    // form waits on a GPU-wide fence for the block's output stores first (NOTES: 3-5% at k).
    cluster_sync_relaxed();
}
#else
#define MM_CLUSTERS 0
#endif

// The epilogue. Accumulator (i, c) of lane (g, t): feature n_lo (c < 2) or n_hi = n_lo + 8,
// token m0 + 8i + 2t + (c & 1). With one split the output (+ bias) is written here; launched as
// clusters of the splits, the cluster adds them (add_splits_in_cluster, through `scratch`: shared
// memory the main loop is done with); else this split's slice of `partial` [splits, M, N], which
// matmul_4bit_finish adds in split order.
__device__ __forceinline__ void store_tile(const float (&acc)[NT8][4], int n_lo, i64 m0, int t, i64 M, int N,
                                           float* __restrict__ partial, const elem_t* __restrict__ bias,
                                           elem_t* __restrict__ out, float* scratch) {
#if MM_CLUSTERS
    if (cluster_blocks() > 1) return add_splits_in_cluster(acc, n_lo, m0, t, M, N, bias, out, scratch);
#endif
    (void)scratch;
    const bool direct = gridDim.y == 1;
    float* slice = partial + (i64)blockIdx.y * M * N;
#pragma unroll
    for (int i = 0; i < NT8; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const i64 m = m0 + i * 8 + 2 * t + (c & 1);
            const int n = c < 2 ? n_lo : n_lo + 8;
            if (m >= M || n >= N) continue;
            if (direct) {
                float v = acc[i][c];
                if (bias) v = __fadd_rn(v, to_float(bias[n]));
                out[m * N + n] = from_float(v);
            } else {
                slice[m * N + n] = acc[i][c];
            }
        }
    }
}

// out = the splits' partial sums added in split order (+ bias), in fp32, then one rounding.
extern "C" __global__ void __launch_bounds__(256) matmul_4bit_finish(const float* __restrict__ partial,
                                                                    const elem_t* __restrict__ bias,
                                                                    elem_t* __restrict__ out, i64 M, int N, int splits) {
    const i64 total = M * (i64)N;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (i64)gridDim.x * blockDim.x) {
        float v = partial[e];
#pragma unroll 16
        for (int s = 1; s < splits; ++s) v = __fadd_rn(v, partial[s * total + e]);  // loads in flight together
        if (bias) v = __fadd_rn(v, to_float(bias[e % N]));
        out[e] = from_float(v);
    }
}
