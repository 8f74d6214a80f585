// Probe, not part of the harness: issue 38's 128-token design with the decode off the tensor cores'
// path. A block of 128 features runs two consumer warpgroups (wgmma m64nTk16, both operands from
// shared memory) and PW producer warps, which stream the packed weights (the gate weight's 28672 rows
// of 4096 bytes), look each byte up in a 32 KB table of code pairs (conflict-free copies), write the
// decoded bf16 tile in wgmma's K-major layout (128-byte swizzle, or the wide kernel's unswizzled core
// matrices), and stage T tokens' activations by cp.async into the same layout; STAGES stages of both
// tiles on mbarriers (full: producers to consumers, empty: back). Scales are stand-ins (a formula, no
// loads): the variants with the wide kernel's arithmetic (the fp32 code times the block's fp32 scale
// rounded once to bf16: a table of fp32 pairs) and with the codes alone (bf16 pairs) give the
// shared-memory and tensor pipes' ceiling for this traffic, not the kernel. kernels/NOTES.md ("The gate
// weight at 1-128 rows under ncu") predicts it bound by the shared-memory pipe near 1,792 cycles a step
// at 128 tokens (each variant prints its own bound). Every variant that computes is checked against a
// plain reference first; variants without the wgmmas (consumers release at once) and without the
// decode (producers write nothing) separate the pipes. Timing as in read_pattern.cu.
// Build and run on a GPU:
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -std=c++17 -o wgmma_ss_stage wgmma_ss_stage.cu && ./wgmma_ss_stage
#include <cuda_bf16.h>
#include "probe.cuh"
#define FMT_QUANT 0  // nf4
#include "../format_4bit.cuh"

#define K_ELEMS (2 * ROWB)  // 8192 k
#define TOKENS 128          // the activations' rows (a probe of T <= TOKENS tokens reads the first T)
#define FEATURES 128        // a block's rows of the weight
#define STEPS (ROWB / 64)   // steps of 128 k (64 packed bytes a row)
#define TABLE_BYTES (256 * 32 * 4)

// The NF4 codes as the product's kernels hold them: the bit patterns of kernels/format_4bit.cuh.
__constant__ unsigned c_nf4_bits[16] = {CODE_0_3, CODE_4_7, CODE_8_11, CODE_12_15};
__device__ __forceinline__ float nf4(unsigned i) { return __uint_as_float(c_nf4_bits[i]); }

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half): the lower k
    return *reinterpret_cast<const u32*>(&v);
}

// A tile of 128 rows x 128 k (K-major) in one of two wgmma layouts: `at(r, x)`, the byte offset of row
// r's 16-byte chunk x (k 8x .. 8x + 7), and `desc(tile, r0, j)`, the descriptor of rows r0 .. r0 + 63
// (or all 128) for k16 slice j.
template <int SWIZZLE>
struct Layout;
// The 128-byte swizzle: two 64-k halves of 128-byte rows, a row's 16-byte pieces XORed with r mod 8;
// descriptor layout 1, SBO 1024 (8 rows), LBO unused (1); slice j 32 bytes into its half.
template <>
struct Layout<1> {
    static constexpr u32 STRIDE = 32768;  // bytes a tile (1 KB aligned)
    __device__ static u32 at(u32 r, u32 x) { return (x >> 3) * 16384 + r * 128 + (((x & 7) ^ (r & 7)) << 4); }
    __device__ static unsigned long long desc(u32 tile, u32 r0, int j) {
        const u32 addr = tile + (j >> 2) * 16384 + r0 * 128 + (j & 3) * 32;
        return ((addr & 0x3ffffu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
    }
};
// No swizzle (the product's wide kernel's form): core matrices of 8 rows x 16 bytes, a slice's second
// 8 k 128 bytes on (LBO), the next 8 rows 256 on (SBO), slices 4112 bytes apart (16 of padding).
template <>
struct Layout<0> {
    static constexpr u32 SLICE = 4112, STRIDE = 33792;
    __device__ static u32 at(u32 r, u32 x) { return (x >> 1) * SLICE + (x & 1) * 128 + (r >> 3) * 256 + (r & 7) * 16; }
    __device__ static unsigned long long desc(u32 tile, u32 r0, int j) {
        const u32 addr = tile + j * SLICE + (r0 >> 3) * 256;
        return ((addr & 0x3ffffu) >> 4) | ((unsigned long long)(128 >> 4) << 16) |
               ((unsigned long long)(256 >> 4) << 32);
    }
};

// d (64 features x N tokens, fp32: N / 2 a thread) += A (desc) * B (desc), both K-major in shared memory.
template <int N_TOKENS>
__device__ void wgmma_ss(float* d, unsigned long long a, unsigned long long b, int accumulate);
template <>
__device__ __forceinline__ void wgmma_ss<64>(float* d, unsigned long long a, unsigned long long b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(a), "l"(b), "r"(accumulate));
}
template <>
__device__ __forceinline__ void wgmma_ss<128>(float* d, unsigned long long a, unsigned long long b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(a), "l"(b), "r"(accumulate));
}

__device__ __forceinline__ void bar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void cp16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// A stand-in block scale of feature n at 64-k block b (the real kernel forms it from the nested codes).
__device__ __host__ __forceinline__ float probe_scale(int n, int b) { return 1.0f + ((n + b) & 7) * 0.125f; }

// PW producer warps; STAGES stages; WGMMA 0: the consumers release each stage at once; DECODE 0: the
// producers load the weights but write no tile; SCALED 1: the wide kernel's arithmetic, each weight the
// fp32 code times its block's fp32 scale rounded once to bf16 (a 32 KB table of fp32 pairs, 16 copies
// 8 bytes apart, one 64-bit lookup a byte, 2 FMUL and a pack), SCALED 0 the codes alone (a 32-bit lookup
// a byte of bf16 pairs). out: [TOKENS][N] fp32.
template <int PW, int STAGES, int WGMMA, int DECODE, int SCALED = 0, int SWIZZLE = 1, int T = 128>
__global__ void __launch_bounds__(256 + 32 * PW, 1)
    stage_probe(const unsigned char* __restrict__ W, const __nv_bfloat16* __restrict__ act, float* __restrict__ out) {
    extern __shared__ __align__(1024) unsigned char dyn[];
    const u32 dyn_s = (u32)__cvta_generic_to_shared(dyn), base = (dyn_s + 1023) & ~1023u;
    using L = Layout<SWIZZLE>;
    const u32 table = base, tiles = base + TABLE_BYTES;  // stage s: A at tiles + 2s STRIDE, B after it
    const u32 bars = tiles + 2 * STAGES * L::STRIDE;     // full[s] at 8s, empty[s] at 8 (STAGES + s)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * FEATURES;
    if (SCALED)
        for (int i = threadIdx.x; i < 256 * 16; i += blockDim.x) {  // entry e, copy c: 8 bytes at 16 e + c
            const int e = i >> 4;
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(table + 8 * i), "f"(nf4(e >> 4)),
                         "f"(nf4(e & 15)));
        }
    else
        for (int i = threadIdx.x; i < 256 * 32; i += blockDim.x) {  // entry e, copy (lane) c: word 32 e + c
            const int e = i >> 5;
            asm volatile("st.shared.u32 [%0], %1;" ::"r"(table + 4 * i), "r"(pack_bf16(nf4(e >> 4), nf4(e & 15))));
        }
    if (threadIdx.x == 0)
        for (int s = 0; s < STAGES; ++s) {
            bar_init(bars + 8 * s, 32 * PW);
            bar_init(bars + 8 * (STAGES + s), 256);
        }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();

    if (warp >= 8) {  // producers
        constexpr int RW = FEATURES / PW, J = RW / 8, CH = T * 16 / (32 * PW), D = STAGES - 2;
        const int pw = warp - 8, pt = threadIdx.x - 256;
        const unsigned char* rows = W + (size_t)(n0 + pw * RW + g) * ROWB + t * 16;
        auto load_b = [&](int step) {  // the activation tile of `step` into its stage, one cp.async group
            const u32 b = tiles + (2 * (step % STAGES) + 1) * L::STRIDE;
#pragma unroll
            for (int i = 0; i < CH; ++i) {
                const int idx = pt + 32 * PW * i, m = idx >> 4, x = idx & 15;
                cp16(b + L::at(m, x), act + (size_t)m * K_ELEMS + step * 128 + x * 8);
            }
            asm volatile("cp.async.commit_group;" ::: "memory");
        };
        uint4 cur[J], nxt[J];
#pragma unroll
        for (int j = 0; j < J; ++j) cur[j] = __ldcs(reinterpret_cast<const uint4*>(rows + (size_t)8 * j * ROWB));
        for (int s = 0; s < D; ++s) load_b(s);
        // the decode's shared loads and stores as plain C++ (the compiler may hoist and overlap them, as in
        // the product's kernels); byte offsets from the dynamic block's start
        const unsigned char* tab = dyn + (table - dyn_s);
        const u32 lane4 = 4 * lane, lane16 = 8 * (lane & 15);
        for (int step = 0; step < STEPS; ++step) {
            const int ahead = step + D;
            if (ahead < STEPS) {
                if (ahead >= STAGES) bar_wait(bars + 8 * (STAGES + ahead % STAGES), ((ahead / STAGES) - 1) & 1);
                load_b(ahead);
            } else {
                asm volatile("cp.async.commit_group;" ::: "memory");  // keeps the group count in step
            }
            if (step + 1 < STEPS)
#pragma unroll
                for (int j = 0; j < J; ++j)
                    nxt[j] = __ldcs(reinterpret_cast<const uint4*>(rows + (size_t)8 * j * ROWB + (step + 1) * 64));
            if (DECODE) {
                unsigned char* a = dyn + (tiles - dyn_s) + 2 * (step % STAGES) * L::STRIDE;
#pragma unroll
                for (int j = 0; j < J; ++j) {
                    const u32 r = pw * RW + g + 8 * j;
                    const float sc = probe_scale(n0 + r, 2 * step + (t >> 1));
                    const u32 v[4] = {cur[j].x, cur[j].y, cur[j].z, cur[j].w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        // in the swizzled layout lanes t and t + 2 write word i or i ^ 2, so a quarter warp's
                        // 16-byte pieces fall in 8 bank groups (the unswizzled one's slices do that already)
                        const int q = SWIZZLE ? i ^ ((t >> 1) << 1) : i;
                        const u32 word = SWIZZLE && (t >> 1) ? v[i ^ 2] : v[i];
                        u32 p[4];
#pragma unroll
                        for (int b = 0; b < 4; ++b) {
                            const u32 e = (word >> (8 * b)) & 255u;
                            if (SCALED) {
                                const float2 xy = *reinterpret_cast<const float2*>(tab + e * 128 + lane16);
                                p[b] = pack_bf16(xy.x * sc, xy.y * sc);
                            } else {
                                p[b] = *reinterpret_cast<const u32*>(tab + e * 128 + lane4);
                            }
                        }
                        *reinterpret_cast<uint4*>(a + L::at(r, 4 * t + q)) = make_uint4(p[0], p[1], p[2], p[3]);
                    }
                }
            }
            if (D == 0) asm volatile("cp.async.wait_group 0;" ::: "memory");
            else asm volatile("cp.async.wait_group %0;" ::"n"(D) : "memory");
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic writes, then wgmma's reads
            bar_arrive(bars + 8 * (step % STAGES));
#pragma unroll
            for (int j = 0; j < J; ++j) cur[j] = nxt[j];
        }
        return;
    }

    // consumers: warpgroup wg, features n0 + 64 wg ..
    const int wg = warp >> 2;
    float d[T / 2];
#pragma unroll
    for (int i = 0; i < T / 2; ++i) d[i] = 0.0f;
    for (int step = 0; step < STEPS; ++step) {
        const int s = step % STAGES;
        bar_wait(bars + 8 * s, (step / STAGES) & 1);
        const u32 a = tiles + 2 * s * L::STRIDE, b = tiles + (2 * s + 1) * L::STRIDE;
        if (WGMMA) {
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                wgmma_ss<T>(d, L::desc(a, 64 * wg, j), L::desc(b, 0, j), step > 0 || j > 0);
            }
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            if (step > 0) bar_arrive(bars + 8 * (STAGES + (step - 1) % STAGES));
        } else {
            bar_arrive(bars + 8 * (STAGES + s));
        }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
    for (int i = 0; i < T / 2; ++i) asm volatile("" : "+f"(d[i])::"memory");
    const int f = n0 + wg * 64 + (warp & 3) * 16 + g;
#pragma unroll
    for (int nt = 0; nt < T / 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int token = 8 * nt + 2 * t + (c & 1), feature = f + 8 * (c >> 1);
            out[(size_t)token * N + feature] = d[4 * nt + c];
        }
}

// out[m][n] = sum_k actT[k][m] * w(n, k) in fp32, one block a feature, a thread a token; w the code
// rounded to bf16, or (SCALED) the code times its block's scale rounded once to bf16.
template <int SCALED>
__global__ void reference_mm(const unsigned char* W, const __nv_bfloat16* actT, float* out) {
    const int n = blockIdx.x, m = threadIdx.x;
    float s = 0.0f;
    for (int k = 0; k < K_ELEMS; k += 2) {
        const unsigned byte = W[(size_t)n * ROWB + k / 2];
        const float sc = SCALED ? probe_scale(n, k / 64) : 1.0f;
        s += __bfloat162float(actT[(size_t)k * TOKENS + m]) * __bfloat162float(__float2bfloat16(nf4(byte >> 4) * sc));
        s += __bfloat162float(actT[(size_t)(k + 1) * TOKENS + m]) *
             __bfloat162float(__float2bfloat16(nf4(byte & 15) * sc));
    }
    out[(size_t)m * N + n] = s;
}

__global__ void fill_act(__nv_bfloat16* act, __nv_bfloat16* actT) {
    const size_t n = (size_t)TOKENS * K_ELEMS;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t m = i / K_ELEMS, k = i % K_ELEMS;
        const float x = (float)((int)((i * 2654435761u) >> 20) % 2001 - 1000) / 1000.0f;
        act[i] = __float2bfloat16(x);
        actT[k * TOKENS + m] = __float2bfloat16(x);
    }
}

template <int PW, int STAGES, int WGMMA, int DECODE, int SCALED = 0, int SWIZZLE = 1, int T = 128>
void run(const char* label, Weights& weights, const __nv_bfloat16* act, float* out, const float* ref) {
    const int smem = 1024 + TABLE_BYTES + 2 * STAGES * Layout<SWIZZLE>::STRIDE + 16 * STAGES;
    auto kern = stage_probe<PW, STAGES, WGMMA, DECODE, SCALED, SWIZZLE, T>;
    cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const int threads = 256 + 32 * PW;
    if (ref) {  // the first copy of the weight (varied bytes) against the reference
        cudaMemset(out, 0xff, (size_t)T * N * 4);
        kern<<<N / FEATURES, threads, smem>>>(weights.copy[0], act, out);
        cudaDeviceSynchronize();
        float *h = new float[(size_t)TOKENS * N], *r = new float[(size_t)TOKENS * N];
        cudaMemcpy(h, out, (size_t)TOKENS * N * 4, cudaMemcpyDeviceToHost);
        cudaMemcpy(r, ref, (size_t)TOKENS * N * 4, cudaMemcpyDeviceToHost);
        double worst = 0, scale = 0;
        for (size_t i = 0; i < (size_t)T * N; ++i) {  // the first T token rows: [T][N] of both
            scale = fmax(scale, fabs(r[i]));
            worst = fmax(worst, h[i] == h[i] ? fabs((double)h[i] - r[i]) : 1e30);
        }
        printf("%s: max |probe - reference| / max |reference| = %.2e (%s)\n", label, worst / scale,
               cudaGetErrorString(cudaGetLastError()));
        delete[] h;
        delete[] r;
    }
    const float us = time_reads(label, weights, [&] {
        kern<<<N / FEATURES, threads, smem>>>(weights.copy[weights.next], act, out);
    });
    int sms = 0, clock_khz = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
    const double steps_per_sm = (double)(N / FEATURES) * STEPS / sms;
    // a block-step's shared-memory bytes at 128 a cycle: the decoded tile written (32 KB) and read by both
    // warpgroups (32), the activations written (T / 4 KB) and read by both (T / 2), the lookups' wavefronts
    // (64-bit: 64 KB; 32-bit: 32)
    const int bound = (32 + 32 + T / 4 + T / 2 + (SCALED ? 64 : 32)) * 1024 / 128;
    printf("%-36s %8.0f cycles a block-step at %d MHz (%d SMs; the tensor floor %d, the shared-memory bound %d)\n", "",
           us * 1e-6 * clock_khz * 1e3 / steps_per_sm, clock_khz / 1000, sms, 8 * T, bound);
}

int main() {
    Weights weights;
    __nv_bfloat16 *act, *actT;
    float *out, *ref, *ref_scaled;
    cudaMalloc(&act, (size_t)TOKENS * K_ELEMS * 2);
    cudaMalloc(&actT, (size_t)TOKENS * K_ELEMS * 2);
    cudaMalloc(&out, (size_t)TOKENS * N * 4);
    cudaMalloc(&ref, (size_t)TOKENS * N * 4);
    cudaMalloc(&ref_scaled, (size_t)TOKENS * N * 4);
    fill_act<<<1024, 256>>>(act, actT);
    reference_mm<0><<<N, TOKENS>>>(weights.copy[0], actT, ref);
    reference_mm<1><<<N, TOKENS>>>(weights.copy[0], actT, ref_scaled);
    cudaDeviceSynchronize();
    printf("reference: %s\n", cudaGetErrorString(cudaGetLastError()));
    run<4, 2, 1, 1>("pw4 st2", weights, act, out, ref);
    run<8, 2, 1, 1>("pw8 st2", weights, act, out, ref);
    run<4, 3, 1, 1>("pw4 st3", weights, act, out, ref);
    run<8, 3, 1, 1>("pw8 st3", weights, act, out, ref);
    run<8, 2, 0, 1>("pw8 st2 no wgmma", weights, act, out, nullptr);
    run<8, 2, 1, 0>("pw8 st2 no decode", weights, act, out, nullptr);
    run<8, 2, 1, 1, 1>("pw8 st2 scaled", weights, act, out, ref_scaled);
    run<8, 3, 1, 1, 1>("pw8 st3 scaled", weights, act, out, ref_scaled);
    run<4, 3, 1, 1, 1>("pw4 st3 scaled", weights, act, out, ref_scaled);
    // the product's no-swizzle layout (its descriptors are proven there), two stages: what fits
    run<8, 2, 1, 1, 0, 0>("pw8 st2 no swizzle", weights, act, out, ref);
    run<8, 2, 1, 1, 1, 0>("pw8 st2 scaled no swizzle", weights, act, out, ref_scaled);
    // 64 tokens (33-64 rows): the same block, half the tensor work a step
    run<8, 2, 1, 1, 1, 1, 64>("t64 pw8 st2 scaled", weights, act, out, ref_scaled);
    run<8, 3, 1, 1, 1, 1, 64>("t64 pw8 st3 scaled", weights, act, out, ref_scaled);
    return 0;
}
