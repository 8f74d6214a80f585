// The 128-k step both wide-tile kernels share (matmul_4bit.cu, mma.sync; matmul_4bit_sm90.cu,
// wgmma): what a lane loads per step and how it decodes it into operand-A registers. Lane (g, t)
// of a warp owning 16 features covers k = 32t .. 32t+31 of a step for features g and g + 8; the
// k order inside a step is permuted identically for both operands: fragment slot s of mma j holds
// k = 32t + 4j + {0,1,2,3}[s]. The including kernel defines STEP_K 128 first.
#pragma once
#include "matmul_4bit_common.cuh"

#if STEP_K != 128
#error "matmul_4bit_step128.cuh is the 128-k step: define STEP_K 128 before including it"
#endif

// Byte offsets into the fp32 code table of the eight codes of a 32-bit word of packed codes:
// `high` byte b is 4 * (byte b's high nibble), `low` byte b 4 * (its low nibble). Two shifts and two
// masks a word, then one instruction a code to take its byte (decode_frag), where shifting and
// masking each code took two.
struct CodeOffsets {
    u32 high, low;
};

__device__ __forceinline__ CodeOffsets code_offsets(u32 word) {
    return {(word >> 2) & 0x3c3c3c3cu, (word << 2) & 0x3c3c3c3cu};
}

// Byte b of x, zero-extended (b known at compile time: one instruction).
__device__ __forceinline__ u32 byte_of(u32 x, int b) { return __byte_perm(x, 0u, 0x4440u + b); }

__device__ __forceinline__ float code_at(const float* code, u32 offset) {
    return *reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(code) + offset);
}

// Operand-A registers of mma j from half h (bytes 2h, 2h + 1) of a word of packed codes of
// feature g (lo) and of g + 8 (hi): a[0] = (g, k+0 | k+1), a[1] = (g+8, k+0 | k+1),
// a[2] = (g, k+2 | k+3), a[3] = (g+8, k+2 | k+3). Byte 2h holds k+0 (high nibble) and k+1, byte
// 2h+1 holds k+2 and k+3.
__device__ __forceinline__ void decode_frag(u32 a[4], u32 lo_word, u32 hi_word, int h, float s_lo, float s_hi,
                                            const float* code) {
    const CodeOffsets lo = code_offsets(lo_word), hi = code_offsets(hi_word);
    const int b = 2 * h;
    a[0] = pack2(mul_ftz(code_at(code, byte_of(lo.high, b)), s_lo), mul_ftz(code_at(code, byte_of(lo.low, b)), s_lo));
    a[2] = pack2(mul_ftz(code_at(code, byte_of(lo.high, b + 1)), s_lo),
                 mul_ftz(code_at(code, byte_of(lo.low, b + 1)), s_lo));
    a[1] = pack2(mul_ftz(code_at(code, byte_of(hi.high, b)), s_hi), mul_ftz(code_at(code, byte_of(hi.low, b)), s_hi));
    a[3] = pack2(mul_ftz(code_at(code, byte_of(hi.high, b + 1)), s_hi),
                 mul_ftz(code_at(code, byte_of(hi.low, b + 1)), s_hi));
}

// Weights are read once: streaming loads. Activations are read by every warp: read-only cache.
__device__ __forceinline__ uint4 load_weights(const unsigned char* p, bool ok) {
    return ok ? __ldcs(reinterpret_cast<const uint4*>(p)) : make_uint4(0u, 0u, 0u, 0u);
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

// Launch bounds of both wide-tile kernels. 8 warps (64 tokens): two blocks an SM, 128 registers a
// thread; with mma.sync on an H100 that ran 12-15% faster on the large weights than one block an
// SM (NOTES, "Activations in shared memory"). 4 warps keep ptxas' default.
#if MM_TOKENS == 128  // 64 accumulators a thread: one block an SM, up to 255 registers
#define WIDE_BOUNDS MM_WARPS * 32, 1
#elif MM_WARPS == 8
#define WIDE_BOUNDS MM_WARPS * 32, 2
#else
#define WIDE_BOUNDS MM_WARPS * 32
#endif
