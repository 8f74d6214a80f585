// Blockwise 4-bit (NF4 / FP4) dequantization in the bitsandbytes storage format
// (kernels/format_4bit.cuh states the format and its arithmetic), rounded once to the output type
// (round-to-nearest-even).
//
// Following arXiv 2604.02556 the 16-entry code table is staged once per thread block in shared
// memory (64 bytes) and indexed directly by the nibble; the nested path stages its 256-entry
// code table the same way (1 KiB). kernels/NOTES.md records what each design choice bought.
//
// Work unit: a "chunk" is the elements one thread writes with one 16-byte store (8 for fp16/bf16,
// 4 for fp32), read from 4 or 2 packed bytes. Lane i of a warp owns chunk base + i, so every
// load and every store instruction of a warp covers one contiguous span (128 B / 64 B in,
// 512 B out): whole 32-byte sectors, no partial-sector writes.
//
// One compiled module per variant; the host compiles with these macros:
//   DQ_OUT        0 = fp16, 1 = bf16, 2 = fp32
//   DQ_QUANT      0 = nf4,  1 = fp4
//   DQ_NESTED     0 = fp32 absmax per block, 1 = uint8 absmax codes decoded in-kernel
//   DQ_THREADS    threads per block
//   DQ_UNROLL     independent chunks in flight per thread (a block's tile is DQ_THREADS * DQ_UNROLL)
// The host launches one tile per block; the loop below also covers a capped grid.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#if !defined(DQ_OUT) || !defined(DQ_QUANT) || !defined(DQ_NESTED) || !defined(DQ_THREADS) || !defined(DQ_UNROLL)
#error "DQ_OUT, DQ_QUANT, DQ_NESTED, DQ_THREADS and DQ_UNROLL must be defined by the compile spec"
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

#if DQ_OUT == 2
typedef unsigned short in_t;  // 4 codes -> 4 fp32 = one 16-byte store
#define CHUNK_LOG2 2
#else
typedef u32 in_t;  // 8 codes -> 8 fp16/bf16 = one 16-byte store
#define CHUNK_LOG2 3
#endif
#define CHUNK (1 << CHUNK_LOG2)

#define FMT_QUANT DQ_QUANT
#include "format_4bit.cuh"

__device__ __forceinline__ out_t to_out(float v) {
#if DQ_OUT == 0
    return __float2half_rn(v);
#elif DQ_OUT == 1
    return __float2bfloat16_rn(v);
#else
    return v;
#endif
}

// Two outputs (element 2j at the lower address) as one 32-bit word, each rounded to nearest even.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
#if DQ_OUT == 0
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&h);
#elif DQ_OUT == 1
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&h);
#else
    (void)hi;
    return __float_as_uint(lo);
#endif
}

// The raw scale inputs of one chunk, loaded before the tables are staged; decoded afterwards.
struct ScaleRaw {
#if DQ_NESTED
    unsigned char q;  // absmax code
    float absmax2;
#else
    float absmax;
#endif
};

struct Tables {
    const float* code;   // 16 entries
    const float* code2;  // 256 entries, nested only
    float offset;
};

__device__ __forceinline__ ScaleRaw load_scale(const void* absmax, const float* absmax2, i64 block, int bs2_log2) {
    ScaleRaw r;
#if DQ_NESTED
    r.q = __ldg(static_cast<const unsigned char*>(absmax) + block);
    r.absmax2 = __ldg(absmax2 + (block >> bs2_log2));
#else
    (void)absmax2;
    (void)bs2_log2;
    r.absmax = __ldg(static_cast<const float*>(absmax) + block);
#endif
    return r;
}

__device__ __forceinline__ float decode_scale(const ScaleRaw& r, const Tables& t) {
#if DQ_NESTED
    return nested_scale(t.code2[r.q], r.absmax2, t.offset);
#else
    (void)t;
    return r.absmax;
#endif
}

// One chunk: CHUNK outputs from CHUNK / 2 packed bytes (little-endian: byte k holds 2k, 2k+1).
__device__ __forceinline__ uint4 decode_chunk(in_t word, float scale, const Tables& t) {
    float v[CHUNK];
#pragma unroll
    for (int k = 0; k < CHUNK / 2; ++k) {
        const u32 byte = ((u32)word >> (8 * k)) & 0xffu;
        // Two lookups in the 16-entry table: lanes reading the same entry broadcast, different
        // entries sit in different banks, so this never bank-conflicts (a 256-entry pair table
        // does, and measured no faster: NOTES.md).
        v[2 * k] = mul_ftz(t.code[byte >> 4], scale);
        v[2 * k + 1] = mul_ftz(t.code[byte & 0xfu], scale);
    }
#if DQ_OUT == 2
    return make_uint4(pack2(v[0], 0.f), pack2(v[1], 0.f), pack2(v[2], 0.f), pack2(v[3], 0.f));
#else
    return make_uint4(pack2(v[0], v[1]), pack2(v[2], v[3]), pack2(v[4], v[5]), pack2(v[6], v[7]));
#endif
}

struct Tile {
    in_t word[DQ_UNROLL];
    ScaleRaw scale[DQ_UNROLL];
};

// Chunks base, base + DQ_THREADS, ... (DQ_UNROLL of them): all loads issued before any is used.
__device__ __forceinline__ void load_tile(Tile& tile, const in_t* __restrict__ A, const void* absmax,
                                          const float* absmax2, i64 base, i64 chunks, int bs_log2, int bs2_log2) {
#pragma unroll
    for (int u = 0; u < DQ_UNROLL; ++u) {
        const i64 c = base + (i64)u * DQ_THREADS;
        if (c < chunks) {
            tile.word[u] = __ldcs(A + c);  // read once: streaming
            tile.scale[u] = load_scale(absmax, absmax2, (c << CHUNK_LOG2) >> bs_log2, bs2_log2);
        }
    }
}

__device__ __forceinline__ void store_tile(const Tile& tile, uint4* __restrict__ out, i64 base, i64 chunks,
                                           const Tables& t) {
#pragma unroll
    for (int u = 0; u < DQ_UNROLL; ++u) {
        const i64 c = base + (i64)u * DQ_THREADS;
        // A plain write-back store: measured ~2% faster than st.cs on large outputs (NOTES.md).
        if (c < chunks) out[c] = decode_chunk(tile.word[u], decode_scale(tile.scale[u], t), t);
    }
}

// Scalars and pointers are flat parameters so any launcher can pass them without a struct layout.
extern "C" __global__ void __launch_bounds__(DQ_THREADS) dequantize_4bit_kernel(
    const unsigned char* __restrict__ A, const void* __restrict__ absmax, const float* __restrict__ code2,
    const float* __restrict__ absmax2, const float* __restrict__ offset_ptr, float offset_value,
    out_t* __restrict__ out, i64 n, int bs_log2, int bs2_log2, int vectorized) {
    __shared__ __align__(16) float s_code[16];
#if DQ_NESTED
    __shared__ float s_code2[256];
#endif

    // Vectorized path: chunk c is CHUNK elements at out + CHUNK * c (16-byte aligned, checked by
    // the host). The smallest block size is 32 elements, so a chunk never straddles two blocks.
    const i64 chunks = vectorized ? (n >> CHUNK_LOG2) : 0;
    const in_t* __restrict__ Ain = reinterpret_cast<const in_t*>(A);
    uint4* __restrict__ out16 = reinterpret_cast<uint4*>(out);
    const i64 tile_chunks = (i64)DQ_THREADS * DQ_UNROLL;
    const i64 step = (i64)gridDim.x * tile_chunks;
    i64 base = (i64)blockIdx.x * tile_chunks + threadIdx.x;

    // The first tile's loads go out before the tables are staged, so their latency overlaps the
    // staging (which, nested, is itself a global read) instead of following it.
    Tile cur;
    load_tile(cur, Ain, absmax, absmax2, base, chunks, bs_log2, bs2_log2);

    Tables t;
    t.code = s_code;
    t.code2 = nullptr;
    t.offset = 0.0f;
    if (threadIdx.x == 0) stage_code_table(s_code);
#if DQ_NESTED
    for (int i = threadIdx.x; i < 256; i += DQ_THREADS) s_code2[i] = __ldg(code2 + i);
    t.code2 = s_code2;
    t.offset = offset_ptr ? __ldg(offset_ptr) : offset_value;
#else
    (void)code2;
    (void)offset_ptr;
    (void)offset_value;
#endif
    __syncthreads();

    // Software-pipelined: the next tile's loads are in flight while this one is decoded.
    for (; base < chunks; base += step) {
        Tile next;
        load_tile(next, Ain, absmax, absmax2, base + step, chunks, bs_log2, bs2_log2);
        store_tile(cur, out16, base, chunks, t);
        cur = next;
    }

    // Scalar path: the whole tensor when pointers are misaligned, else the last n % CHUNK elements.
    const i64 stride_threads = (i64)gridDim.x * DQ_THREADS;
    for (i64 e = (chunks << CHUNK_LOG2) + (i64)blockIdx.x * DQ_THREADS + threadIdx.x; e < n; e += stride_threads) {
        const unsigned char byte = __ldg(A + (e >> 1));
        const u32 nib = (e & 1) ? (byte & 0xfu) : (byte >> 4);
        const float scale = decode_scale(load_scale(absmax, absmax2, e >> bs_log2, bs2_log2), t);
        out[e] = to_out(mul_ftz(s_code[nib], scale));
    }
}
