// Probe, not part of the harness: the gate weight's packed bytes (28672 rows of 4096) through a
// shared-memory ring per warp fed by cp.async.bulk (sm_90): a warp owns 16 rows, one bulk copy of
// STEPB bytes a row a stage (each row padded by 32 bytes in shared memory, so lane (g, t)'s 8-byte
// reads of rows g and g + 8 are conflict-free), STAGES stages, completion on an mbarrier per stage;
// the lanes read a stage back as matmul_4bit_m8_pairs.cu's lanes read their weights (checked against
// plain loads first), then refill it. PAD KB of static shared memory sets the blocks an SM. Timing as
// in read_pattern.cu.
// Build and run on a GPU: nvcc -O3 -arch=sm_90 -std=c++17 -o read_ring read_ring.cu && ./read_ring
#include <cstdio>
#include <cuda_runtime.h>
#define N 28672
#define ROWB 4096
typedef unsigned u32;

__device__ __forceinline__ void bar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void bar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}

template <int STAGES, int PAD, int STEPB>
__global__ void __launch_bounds__(128, 3) ring16(const unsigned char* __restrict__ W, u32* out, int splits) {
    __shared__ u32 pad[PAD * 256 + 128];
    extern __shared__ __align__(128) unsigned char dyn[];
    constexpr int STRIDE = STEPB + 32;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, wib = threadIdx.x >> 5;
    const int warp = blockIdx.x * 4 + wib;
    const int steps = ROWB / STEPB / splits, first = blockIdx.y * steps;
    unsigned char* ring = dyn + wib * STAGES * 16 * STRIDE;
    const u32 ring_s = (u32)__cvta_generic_to_shared(ring);
    const u32 bars = (u32)__cvta_generic_to_shared(dyn + 4 * STAGES * 16 * STRIDE) + wib * STAGES * 8;
    const unsigned char* row = W + (size_t)(warp * 16 + (lane & 15)) * ROWB + (size_t)first * STEPB;
    if (lane == 0)
        for (int s = 0; s < STAGES; ++s) bar_init(bars + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncwarp();
    for (int s = 0; s < STAGES && s < steps; ++s) {
        if (lane == 0) bar_expect(bars + 8 * s, 16 * STEPB);
        __syncwarp();
        if (lane < 16) bulk(ring_s + s * 16 * STRIDE + lane * STRIDE, row + s * STEPB, STEPB, bars + 8 * s);
    }
    u32 acc = 0;
    for (int step = 0; step < steps; ++step) {
        const int s = step % STAGES;
        bar_wait(bars + 8 * s, (step / STAGES) & 1);
        const unsigned char* st = ring + s * 16 * STRIDE;
#pragma unroll
        for (int q = 0; q < STEPB / 128; ++q) {
            uint2 r[8];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                r[c] = *(const uint2*)(st + g * STRIDE + q * 128 + c * 32 + t * 8);
                r[4 + c] = *(const uint2*)(st + (g + 8) * STRIDE + q * 128 + c * 32 + t * 8);
            }
#pragma unroll
            for (int c = 0; c < 8; ++c) acc ^= r[c].x * 3 + r[c].y;
        }  // the reads done before the stage refills
        __syncwarp();
        if (step + STAGES < steps) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            if (lane == 0) bar_expect(bars + 8 * s, 16 * STEPB);
            __syncwarp();
            if (lane < 16) bulk(ring_s + s * 16 * STRIDE + lane * STRIDE, row + (step + STAGES) * STEPB, STEPB, bars + 8 * s);
        }
    }
    pad[threadIdx.x] = acc;
    __syncthreads();
    out[(size_t)(blockIdx.y * gridDim.x + blockIdx.x) * 128 + threadIdx.x] = acc ^ pad[threadIdx.x ^ 1] ^ pad[threadIdx.x ^ 1];
}

// The same XOR from global memory directly: what each lane must have read.
__global__ void reference(const unsigned char* W, u32* out, int splits) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int warp = blockIdx.x * 4 + (threadIdx.x >> 5);
    const int steps = ROWB / 128 / splits, first = blockIdx.y * steps;
    u32 acc = 0;
    for (int step = 0; step < steps; ++step)
        for (int c = 0; c < 8; ++c) {
            const int row = warp * 16 + g + 8 * (c >= 4), k = (first + step) * 128 + (c & 3) * 32 + t * 8;
            const uint2 v = *(const uint2*)(W + (size_t)row * ROWB + k);
            acc ^= v.x * 3 + v.y;
        }
    out[(size_t)(blockIdx.y * gridDim.x + blockIdx.x) * 128 + threadIdx.x] = acc;
}

__global__ void fill(unsigned char* W, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        W[i] = (unsigned char)((i * 2654435761u) >> 13);
}

int main() {
    unsigned char* Ws[4]; unsigned char* W; u32* out; char* flush; int it = 0;
    for (auto& w : Ws) { cudaMalloc(&w, (size_t)N * ROWB); cudaMemset(w, 1, (size_t)N * ROWB); } W = Ws[0]; cudaMalloc(&out, 64 << 20); cudaMalloc(&flush, 256 << 20);
    cudaMemset(W, 1, (size_t)N * ROWB);
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    auto time = [&](const char* name, auto launch) {
        float v[25]; int n = 25;
        for (int i = 0; i < n; ++i) {
            cudaMemsetAsync(flush, i, 256 << 20); W = Ws[++it % 4];
            cudaEventRecord(a); launch(); cudaEventRecord(b); cudaEventSynchronize(b);
            cudaEventElapsedTime(&v[i], a, b);
        }
        for (int i = 0; i < n; ++i) for (int j = i + 1; j < n; ++j) if (v[j] < v[i]) { float x = v[i]; v[i] = v[j]; v[j] = x; }
        const float us = v[n / 2] * 1e3f;
        printf("%-28s %8.1f us %7.0f GB/s  err=%s\n", name, us, (double)N * ROWB / us / 1e3, cudaGetErrorString(cudaGetLastError()));
    };
    for (int splits : {1, 4}) {
        dim3 grid(N / 64, splits);
        char label[64];
#define CHECK(S, P, B)                                                                                    \
    {                                                                                                     \
        fill<<<1024, 256>>>(Ws[0], (size_t)N * ROWB);                                                   \
        const int dyn = 4 * S * 16 * (B + 32) + 4 * S * 8;                                               \
        cudaFuncSetAttribute(ring16<S, P, B>, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);         \
        u32 *ref, *got;                                                                                   \
        cudaMalloc(&ref, 64 << 20); cudaMalloc(&got, 64 << 20);                                           \
        dim3 grid(N / 64, 4);                                                                             \
        reference<<<grid, 128>>>(Ws[0], ref, 4);                                                          \
        ring16<S, P, B><<<grid, 128, dyn>>>(Ws[0], got, 4);                                               \
        cudaDeviceSynchronize();                                                                          \
        static u32 h1[N / 64 * 4 * 128], h2[N / 64 * 4 * 128];                                            \
        cudaMemcpy(h1, ref, sizeof(h1), cudaMemcpyDeviceToHost);                                          \
        cudaMemcpy(h2, got, sizeof(h2), cudaMemcpyDeviceToHost);                                          \
        int bad = 0;                                                                                      \
        for (size_t i = 0; i < sizeof(h1) / 4; ++i) bad += h1[i] != h2[i];                                \
        printf("ring B%d reads vs direct, 4 splits: %d lanes differ\n", B, bad);                         \
        cudaFree(ref); cudaFree(got);                                                                     \
    }
    CHECK(1, 43, 128) CHECK(2, 16, 256) CHECK(1, 16, 512)
#define T(S, P, B)                                                                                          \
    {                                                                                                    \
        const int dyn = 4 * S * 16 * (B + 32) + 4 * S * 8;                                                 \
        cudaFuncSetAttribute(ring16<S, P, B>, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);            \
        int blocks = 0;                                                                                  \
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, ring16<S, P, B>, 128, dyn);                  \
        snprintf(label, 64, "ring st%d pad%d B%d s%d b/SM %d", S, P, B, splits, blocks);                       \
        time(label, [&] { ring16<S, P, B><<<grid, 128, dyn>>>(W, out, splits); });                         \
    }
        T(1, 43, 128) T(2, 16, 256) T(3, 8, 256) T(1, 16, 512) T(2, 0, 512) T(1, 0, 1024)
    }
    return 0;
}
