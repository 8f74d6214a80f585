// Fused 4-bit matmul: out[m, n] = sum_k A[m, k] * W[n, k] (+ bias[n]), W in the bitsandbytes
// packed format (kernels/dequantize_4bit.cu states it) decoded in registers, never written out.
//
// Designed from the packed-weight roofline down (kernels/NOTES.md, "Fused matmul"): at decode
// sizes the weights are the traffic (N*K/2 bytes), so every weight byte is read once, by one
// 16-byte load, and decoded straight into the tensor cores' operand registers.
//
// mma.sync.m16n8k16 (sm80-sm90) with the weights as operand A (16 output features x 16 k) and the
// activations as operand B (16 k x 8 tokens): small M wastes at most 7 of 8 token columns, not 15
// of 16 rows. One warp owns 16 output features; per step it covers 128 k: lane (g = lane / 4,
// t = lane % 4) loads 16 bytes (32 codes, k = 32t .. 32t+31) of features g and g + 8. The k
// order inside a step is permuted, identically for both operands (a dot product does not care):
// fragment slot s of mma j holds k = 32t + 4j + {0,1,2,3}[s], so a lane's 16 bytes feed its
// operand-A registers of all 8 mmas of the step without a shuffle, and its activations are 64
// contiguous bytes of token g (four 16-byte loads through the read-only cache, shared by every
// warp of the grid).
//
// Each decoded weight is code[nibble] * scale in fp32 (format_4bit.cuh, as the dequantization
// kernel computes it) rounded once to A's dtype: the dequantization kernel's bits, so with a
// one-hot activation row the output is that weight exactly. Products of fp16/bf16 are exact in
// fp32; sums are fp32 (mma accumulators, then the splits of K added in split order); the bias is
// added in fp32 and the result rounded once to the output dtype. Deterministic: no atomics.
//
// Macros (one compiled module per variant):
//   MM_DTYPE   0 = fp16, 1 = bf16 (activations, decoded weights and output)
//   MM_QUANT   0 = nf4,  1 = fp4
//   MM_NESTED  0 = fp32 absmax per block, 1 = uint8 absmax codes decoded in-kernel
//   MM_TOKENS  tokens per warp tile: 8, 16, 32 or 64 (1 to 8 mma n-tiles sharing each decoded weight)
//   MM_WARPS   warps per block (each owns 16 output features)
// Host contract (harness/runtime/matmul_kernel.py checks it before launching): K % 32 == 0,
// W, A and bias 16-byte aligned, block size >= 32, an fp32 workspace of splits * M * N when K is
// split (none needed otherwise).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#if !defined(MM_DTYPE) || !defined(MM_QUANT) || !defined(MM_NESTED) || !defined(MM_TOKENS) || !defined(MM_WARPS)
#error "MM_DTYPE, MM_QUANT, MM_NESTED, MM_TOKENS and MM_WARPS must be defined by the compile spec"
#endif
#if MM_TOKENS != 8 && MM_TOKENS != 16 && MM_TOKENS != 32 && MM_TOKENS != 64
#error "MM_TOKENS must be 8, 16, 32 or 64"
#endif

typedef long long i64;
typedef unsigned int u32;
#define NT8 (MM_TOKENS / 8)  // mma n-tiles per warp
#define STEP_K 128

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

// Operand-A registers of mma j from two packed bytes of feature g (lo) and g + 8 (hi):
// a[0] = (g, k+0 | k+1), a[1] = (g+8, k+0 | k+1), a[2] = (g, k+2 | k+3), a[3] = (g+8, k+2 | k+3).
// Byte 2j holds k+0 (high nibble) and k+1, byte 2j+1 holds k+2 and k+3.
__device__ __forceinline__ void decode_frag(u32 a[4], u32 lo_pair, u32 hi_pair, float s_lo, float s_hi,
                                            const float* code) {
    a[0] = pack2(mul_ftz(code[(lo_pair >> 4) & 0xfu], s_lo), mul_ftz(code[lo_pair & 0xfu], s_lo));
    a[2] = pack2(mul_ftz(code[(lo_pair >> 12) & 0xfu], s_lo), mul_ftz(code[(lo_pair >> 8) & 0xfu], s_lo));
    a[1] = pack2(mul_ftz(code[(hi_pair >> 4) & 0xfu], s_hi), mul_ftz(code[hi_pair & 0xfu], s_hi));
    a[3] = pack2(mul_ftz(code[(hi_pair >> 12) & 0xfu], s_hi), mul_ftz(code[(hi_pair >> 8) & 0xfu], s_hi));
}

// Weights are read once: streaming loads. Activations are read by every warp: read-only cache.
__device__ __forceinline__ uint4 load_weights(const unsigned char* p, bool ok) {
    return ok ? __ldcs(reinterpret_cast<const uint4*>(p)) : make_uint4(0u, 0u, 0u, 0u);
}

__device__ __forceinline__ uint4 load_activations(const elem_t* p, bool ok) {
    return ok ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0u, 0u, 0u, 0u);
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

// One step's weights of a lane: 16 packed bytes and the scale parts of each of its two features.
struct StepWeights {
    uint4 lo, hi;
    ScaleParts p_lo, p_hi;
};

// A step at or past K (the pipeline's last prefetch) loads nothing and decodes to zeros.
__device__ __forceinline__ void load_step(StepWeights& w, int step, const unsigned char* __restrict__ W,
                                          const void* absmax, const float* absmax2, int n_lo, int n_hi, int N, int K,
                                          int t, int bs_log2, int bs2_log2) {
    const int k = step * STEP_K + 32 * t;
    const bool lo_ok = k < K && n_lo < N, hi_ok = k < K && n_hi < N;
    w.lo = load_weights(W + ((i64)n_lo * K + k) / 2, lo_ok);
    w.hi = load_weights(W + ((i64)n_hi * K + k) / 2, hi_ok);
    // A lane's 32 k never straddle a scale block: 32-aligned, and block sizes are >= 32.
    w.p_lo = load_scale((i64)n_lo * K + k, lo_ok, absmax, absmax2, bs_log2, bs2_log2);
    w.p_hi = load_scale((i64)n_hi * K + k, hi_ok, absmax, absmax2, bs_log2, bs2_log2);
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

// Grid: x = groups of MM_WARPS * 16 features, y = splits of K (each steps_per_split steps of 128 k),
// z = tiles of MM_TOKENS tokens. With one split the block writes out (+ bias) itself; with more,
// split s writes its partial sums to slice s of `partial` [splits, M, N] (fp32, every element
// written by exactly one lane) and matmul_4bit_finish adds the slices in split order: the same
// bits on every run, whatever order the blocks ran in.
extern "C" __global__ void __launch_bounds__(MM_WARPS * 32) matmul_4bit_kernel(
    const elem_t* __restrict__ A, const unsigned char* __restrict__ W, const void* __restrict__ absmax,
    const float* __restrict__ code2, const float* __restrict__ absmax2, const float* __restrict__ offset_ptr,
    float offset_value, float* __restrict__ partial, const elem_t* __restrict__ bias, elem_t* __restrict__ out, i64 M,
    int N, int K, int bs_log2, int bs2_log2, int steps_per_split) {
    __shared__ __align__(16) float s_code[16];
#if MM_NESTED
    __shared__ float s_code2[256];  // the scales' code book: a shared-memory read, not a dependent global one
    for (int i = threadIdx.x; i < 256; i += MM_WARPS * 32) s_code2[i] = __ldg(code2 + i);
    const float offset = offset_ptr ? __ldg(offset_ptr) : offset_value;
#else
    const float* s_code2 = nullptr;
    (void)code2;
    (void)offset_ptr;
    (void)offset_value;
    const float offset = 0.0f;
#endif
    if (threadIdx.x == 0) stage_code_table(s_code);
    __syncthreads();

    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n_lo = (blockIdx.x * MM_WARPS + (threadIdx.x >> 5)) * 16 + g, n_hi = n_lo + 8;
    const i64 m0 = (i64)blockIdx.z * MM_TOKENS;
    const int steps = (K + STEP_K - 1) / STEP_K;
    const int first = blockIdx.y * steps_per_split;
    const int last = min(steps, first + steps_per_split);

    float acc[NT8][4];
#pragma unroll
    for (int i = 0; i < NT8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    // Software-pipelined: the next step's weights and scale parts are in flight while this one decodes.
    StepWeights cur;
    load_step(cur, first < last ? first : steps, W, absmax, absmax2, n_lo, n_hi, N, K, t, bs_log2, bs2_log2);
    for (int step = first; step < last; ++step) {
        StepWeights next;
        load_step(next, step + 1 < last ? step + 1 : steps, W, absmax, absmax2, n_lo, n_hi, N, K, t, bs_log2,
                  bs2_log2);
        const int k = step * STEP_K + 32 * t;  // this lane's first k
        const bool k_ok = k < K;               // K % 32 == 0: a lane's 32 k are all in or all out
        const float s_lo = scale_of(cur.p_lo, k_ok && n_lo < N, s_code2, offset);
        const float s_hi = scale_of(cur.p_hi, k_ok && n_hi < N, s_code2, offset);
        const u32 lo[4] = {cur.lo.x, cur.lo.y, cur.lo.z, cur.lo.w}, hi[4] = {cur.hi.x, cur.hi.y, cur.hi.z, cur.hi.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // 16-byte quarter q of the lane's 64 activation bytes: mmas 2q, 2q+1
            uint4 act[NT8];
#pragma unroll
            for (int i = 0; i < NT8; ++i) {
                const i64 m = m0 + i * 8 + g;
                act[i] = load_activations(A + m * K + k + 8 * q, k_ok && m < M);
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // mma j = 2q + h: bytes 2j, 2j+1 of the lane's 16
                const int j = 2 * q + h;
                const u32 lo_pair = (lo[j >> 1] >> (16 * (j & 1))) & 0xffffu;
                const u32 hi_pair = (hi[j >> 1] >> (16 * (j & 1))) & 0xffffu;
                u32 a[4];
                decode_frag(a, lo_pair, hi_pair, s_lo, s_hi, s_code);
#pragma unroll
                for (int i = 0; i < NT8; ++i) {
                    const u32 b0 = h ? act[i].z : act[i].x, b1 = h ? act[i].w : act[i].y;
                    mma(acc[i], a, b0, b1);
                }
            }
        }
        cur = next;
    }

    // Accumulator (i, c): feature n_lo (c < 2) or n_hi, token m0 + 8i + 2t + (c & 1).
    const bool direct = gridDim.y == 1;
    float* slice = partial + (i64)blockIdx.y * M * N;
#pragma unroll
    for (int i = 0; i < NT8; ++i) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const i64 m = m0 + i * 8 + 2 * t + (c & 1);
            const int n = c < 2 ? n_lo : n_hi;
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
