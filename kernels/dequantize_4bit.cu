// Blockwise 4-bit (NF4 / FP4) dequantization in the bitsandbytes storage format.
//
// Layout (bitsandbytes): element 2i is the high nibble of byte i, element 2i+1 the low nibble.
// Element e belongs to quantization block e >> BS_LOG2 and is code[nibble] * scale[block],
// multiplied in fp32 and rounded once to the output type (round-to-nearest-even).
// Nested ("double-quantized") scales: scale[b] = code2[q[b]] * absmax2[b >> BS2_LOG2] + offset,
// each an fp32 operation with its own rounding, exactly as bitsandbytes' three-step path.
// bitsandbytes' CUDA library is built flush-to-zero: both of its multiplies treat subnormal
// inputs and results as signed zeros (measured on an H100 with 0.50.2), so ours use mul.ftz.
// The offset add is a PyTorch op there and keeps subnormals, so ours is a plain add.
//
// Following arXiv 2604.02556 the 16-entry code table is staged once per thread block in shared
// memory (64 bytes) and indexed directly by the nibble; the nested path stages its 256-entry
// code table the same way (1 KiB).
//
// One compiled module per variant; the host compiles with these macros:
//   DQ_OUT     0 = fp16, 1 = bf16, 2 = fp32
//   DQ_QUANT   0 = nf4,  1 = fp4
//   DQ_NESTED  0 = fp32 absmax per block, 1 = uint8 absmax codes decoded in-kernel
//   DQ_THREADS threads per block
//   DQ_UNROLL  independent 8-element chunks in flight per thread
//   DQ_EXTRA_READ  1 = read the packed input twice (a deliberately slower build for the perf gate)
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#if !defined(DQ_OUT) || !defined(DQ_QUANT) || !defined(DQ_NESTED) || !defined(DQ_THREADS) || !defined(DQ_UNROLL)
#error "DQ_OUT, DQ_QUANT, DQ_NESTED, DQ_THREADS and DQ_UNROLL must be defined by the compile spec"
#endif
#ifndef DQ_EXTRA_READ
#define DQ_EXTRA_READ 0
#endif

typedef long long i64;
typedef unsigned int u32;

#if DQ_OUT == 0
typedef __half out_t;
#elif DQ_OUT == 1
typedef __nv_bfloat16 out_t;
#elif DQ_OUT == 2
typedef float out_t;
#else
#error "unknown DQ_OUT"
#endif

// IEEE-754 bit patterns of bitsandbytes' CUDA code tables (csrc/kernels.cu). Bits, not decimal
// literals, so no compiler can round them differently. FP4 index 8 is -0.0: the CUDA kernel
// computes 0 * sign with sign = -1 there.
#if DQ_QUANT == 0
__constant__ u32 kCodeBits[16] = {
    0xbf800000u, 0xbf3239b1u, 0xbf066b30u, 0xbeca32a0u, 0xbe91a24du, 0xbe3d353fu, 0xbdba7871u, 0x00000000u,
    0x3da2faffu, 0x3e24cae3u, 0x3e7c04ddu, 0x3ead033au, 0x3ee1a4b8u, 0x3f1007abu, 0x3f3913b3u, 0x3f800000u};
#elif DQ_QUANT == 1
__constant__ u32 kCodeBits[16] = {
    0x00000000u, 0x3baaaaabu, 0x3f2aaaabu, 0x3f800000u, 0x3eaaaaabu, 0x3f000000u, 0x3e2aaaabu, 0x3e800000u,
    0x80000000u, 0xbbaaaaabu, 0xbf2aaaabu, 0xbf800000u, 0xbeaaaaabu, 0xbf000000u, 0xbe2aaaabu, 0xbe800000u};
#else
#error "unknown DQ_QUANT"
#endif

struct Scales {
    const void* __restrict__ absmax;      // fp32[nblocks], or uint8[nblocks] codes when nested
    const float* __restrict__ code2;      // nested: 256-entry fp32 table (staged in shared memory)
    const float* __restrict__ absmax2;    // nested: fp32 per BS2 blocks
    const float* __restrict__ offset_ptr; // nested: device scalar, or null to use offset_value
    float offset_value;
    int bs_log2;
    int bs2_log2;
};

// fp32 multiply, round-to-nearest-even, subnormal inputs and result flushed to signed zero.
__device__ __forceinline__ float mul_ftz(float a, float b) {
    float r;
    asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float block_scale(const Scales& s, const float* s_code2, float offset, i64 block) {
#if DQ_NESTED
    const unsigned char q = __ldg(static_cast<const unsigned char*>(s.absmax) + block);
    // Two separately rounded fp32 ops, never contracted into an FMA: bitsandbytes does the
    // multiply in its 8-bit dequantize kernel and the add as a separate torch op.
    return __fadd_rn(mul_ftz(s_code2[q], __ldg(s.absmax2 + (block >> s.bs2_log2))), offset);
#else
    (void)s_code2;
    (void)offset;
    return __ldg(static_cast<const float*>(s.absmax) + block);
#endif
}

__device__ __forceinline__ out_t to_out(float v) {
#if DQ_OUT == 0
    return __float2half_rn(v);
#elif DQ_OUT == 1
    return __float2bfloat16_rn(v);
#else
    return v;
#endif
}

#if DQ_OUT == 0
__device__ __forceinline__ unsigned short out_bits(__half h) { return __half_as_ushort(h); }
#elif DQ_OUT == 1
__device__ __forceinline__ unsigned short out_bits(__nv_bfloat16 h) { return __bfloat16_as_ushort(h); }
#endif

// Eight outputs from four packed bytes (little-endian word: byte k holds elements 2k, 2k+1).
__device__ __forceinline__ void decode8(u32 word, float scale, const float* s_code, float v[8]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const u32 byte = (word >> (8 * k)) & 0xffu;
        v[2 * k] = mul_ftz(s_code[byte >> 4], scale);
        v[2 * k + 1] = mul_ftz(s_code[byte & 0xfu], scale);
    }
}

// 16-byte stores of eight outputs; out + 8 * chunk is 16-byte aligned on this path.
__device__ __forceinline__ void store8(out_t* out, i64 chunk, const float v[8]) {
#if DQ_OUT == 2
    float4* dst = reinterpret_cast<float4*>(out) + 2 * chunk;
    __stcs(dst, make_float4(v[0], v[1], v[2], v[3]));
    __stcs(dst + 1, make_float4(v[4], v[5], v[6], v[7]));
#else
    u32 w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = (u32)out_bits(to_out(v[2 * j])) | ((u32)out_bits(to_out(v[2 * j + 1])) << 16);
    __stcs(reinterpret_cast<uint4*>(out) + chunk, make_uint4(w[0], w[1], w[2], w[3]));
#endif
}

// Scalars and pointers are flat parameters so any launcher can pass them without a struct layout.
extern "C" __global__ void __launch_bounds__(DQ_THREADS) dequantize_4bit_kernel(
    const unsigned char* __restrict__ A, const void* __restrict__ absmax, const float* __restrict__ code2,
    const float* __restrict__ absmax2, const float* __restrict__ offset_ptr, float offset_value,
    out_t* __restrict__ out, i64 n, int bs_log2, int bs2_log2, int vectorized) {
    const Scales s = {absmax, code2, absmax2, offset_ptr, offset_value, bs_log2, bs2_log2};
    __shared__ float s_code[16];
#if DQ_NESTED
    __shared__ float s_code2[256];
    for (int i = threadIdx.x; i < 256; i += DQ_THREADS) s_code2[i] = __ldg(s.code2 + i);
    const float offset = s.offset_ptr ? __ldg(s.offset_ptr) : s.offset_value;
#else
    const float* s_code2 = nullptr;
    const float offset = 0.0f;
#endif
    if (threadIdx.x < 16) s_code[threadIdx.x] = __uint_as_float(kCodeBits[threadIdx.x]);
    __syncthreads();

    const i64 stride_threads = (i64)gridDim.x * DQ_THREADS;
    i64 scalar_begin = 0;

#if DQ_EXTRA_READ
    {
        // One more pass over the packed bytes; the result only guards a store that never happens.
        u32 acc = 0;
        for (i64 i = (i64)blockIdx.x * DQ_THREADS + threadIdx.x; i < ((n + 1) >> 1); i += stride_threads)
            acc += __ldcs(A + i);
        if (acc == 0xffffffffu) out[0] = to_out(0.0f);
    }
#endif

    if (vectorized) {
        // Chunks of 8 elements (4 input bytes, 16 or 32 output bytes). The smallest block size
        // is 32 elements, so a chunk never straddles two quantization blocks.
        const i64 chunks = n >> 3;
        const u32* __restrict__ A32 = reinterpret_cast<const u32*>(A);
        const i64 step = stride_threads * DQ_UNROLL;
        for (i64 base = (i64)blockIdx.x * DQ_THREADS * DQ_UNROLL + threadIdx.x; base < chunks; base += step) {
            u32 word[DQ_UNROLL];
            float scale[DQ_UNROLL];
#pragma unroll
            for (int u = 0; u < DQ_UNROLL; ++u) {
                const i64 c = base + (i64)u * DQ_THREADS;
                if (c < chunks) {
                    word[u] = __ldcs(A32 + c);
                    scale[u] = block_scale(s, s_code2, offset, (c << 3) >> s.bs_log2);
                }
            }
#pragma unroll
            for (int u = 0; u < DQ_UNROLL; ++u) {
                const i64 c = base + (i64)u * DQ_THREADS;
                if (c < chunks) {
                    float v[8];
                    decode8(word[u], scale[u], s_code, v);
                    store8(out, c, v);
                }
            }
        }
        scalar_begin = chunks << 3;
    }

    // Scalar path: the whole tensor when pointers are misaligned, else the last n % 8 elements.
    for (i64 e = scalar_begin + (i64)blockIdx.x * DQ_THREADS + threadIdx.x; e < n; e += stride_threads) {
        const unsigned char byte = __ldg(A + (e >> 1));
        const u32 nib = (e & 1) ? (byte & 0xfu) : (byte >> 4);
        const float scale = block_scale(s, s_code2, offset, e >> s.bs_log2);
        out[e] = to_out(mul_ftz(s_code[nib], scale));
    }
}
