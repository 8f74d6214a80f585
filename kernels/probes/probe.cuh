// What the read probes share: the weight they read (the gate weight's packed bytes, 28672 rows of
// 4096), the XOR each lane must get from plain loads of its rows (lane (g, t) of a warp of 16 rows:
// 8 bytes of rows g and g + 8 at each 32-byte chunk), and the timing: four copies of the weight read
// in turn and a 256 MB memset before each launch keep it out of L2; CUDA events, median of 25.
#pragma once
#include <cstdio>
#include <cuda_runtime.h>

#define N 28672
#define ROWB 4096
typedef unsigned u32;

// The XOR of a lane's plain loads, per thread of a grid of WARPS-warp blocks: what a probe's lane
// must have read.
template <int WARPS>
__global__ void reference(const unsigned char* W, u32* out, int splits) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int warp = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int steps = ROWB / 128 / splits, first = blockIdx.y * steps;
    u32 acc = 0;
    for (int step = 0; step < steps; ++step)
        for (int c = 0; c < 8; ++c) {
            const int row = warp * 16 + g + 8 * (c >= 4), k = (first + step) * 128 + (c & 3) * 32 + t * 8;
            const uint2 v = *(const uint2*)(W + (size_t)row * ROWB + k);
            acc ^= v.x * 3 + v.y;
        }
    out[(size_t)(blockIdx.y * gridDim.x + blockIdx.x) * WARPS * 32 + threadIdx.x] = acc;
}

__global__ void fill(unsigned char* W, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        W[i] = (unsigned char)((i * 2654435761u) >> 13);
}

// A lane's XOR leaves the block through shared memory (so a probe's PAD array is not dropped) and
// lands in its own slot of `out`.
__device__ __forceinline__ void store_lane(u32* pad, u32* out, u32 acc) {
    pad[threadIdx.x] = acc;
    __syncthreads();
    out[(size_t)(blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x] =
        acc ^ pad[threadIdx.x ^ 1] ^ pad[threadIdx.x ^ 1];
}

__device__ __forceinline__ void bar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}

// Four copies of the weight, the first filled with varied bytes for the checks.
struct Weights {
    unsigned char* copy[4];
    int next = 0;
    Weights() {
        for (auto& w : copy) {
            cudaMalloc(&w, (size_t)N * ROWB);
            cudaMemset(w, 1, (size_t)N * ROWB);
        }
        fill<<<1024, 256>>>(copy[0], (size_t)N * ROWB);
    }
    int rotate() { return next = (next + 1) % 4; }
};

// Lanes whose XOR differs between `probe` and `reference` (each writes `lanes` u32 into its buffer).
template <class Reference, class Probe>
int lanes_differ(size_t lanes, Reference reference_launch, Probe probe_launch) {
    u32 *ref, *got;
    cudaMalloc(&ref, lanes * 4);
    cudaMalloc(&got, lanes * 4);
    reference_launch(ref);
    probe_launch(got);
    cudaDeviceSynchronize();
    u32* h1 = new u32[lanes];
    u32* h2 = new u32[lanes];
    cudaMemcpy(h1, ref, lanes * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(h2, got, lanes * 4, cudaMemcpyDeviceToHost);
    int bad = 0;
    for (size_t i = 0; i < lanes; ++i) bad += h1[i] != h2[i];
    delete[] h1;
    delete[] h2;
    cudaFree(ref);
    cudaFree(got);
    return bad;
}

// lanes_differ for a probe of 4-warp blocks over 4 splits of K, on the first copy (the varied bytes):
// `probe_launch(grid, out)` launches it.
template <class Probe>
int lanes_differ_4_warps(Weights& weights, Probe probe_launch) {
    const dim3 grid(N / 64, 4);
    return lanes_differ((size_t)grid.x * grid.y * 128,
                        [&](u32* o) { reference<4><<<grid, 128>>>(weights.copy[0], o, 4); },
                        [&](u32* o) { probe_launch(grid, o); });
}

// Median GPU time of `launch` over 25 launches, each after a 256 MB memset and the next copy of the
// weight (`weights.rotate()` picks it; `launch` reads `weights.next`); prints a line and returns µs.
template <class Launch>
float time_reads(const char* name, Weights& weights, Launch launch) {
    static char* flush = nullptr;
    static cudaEvent_t a, b;
    if (!flush) {
        cudaMalloc(&flush, 256 << 20);
        cudaEventCreate(&a);
        cudaEventCreate(&b);
    }
    float v[25];
    const int n = 25;
    for (int i = 0; i < n; ++i) {
        cudaMemsetAsync(flush, i, 256 << 20);
        weights.rotate();
        cudaEventRecord(a);
        launch();
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        cudaEventElapsedTime(&v[i], a, b);
    }
    for (int i = 0; i < n; ++i)
        for (int j = i + 1; j < n; ++j)
            if (v[j] < v[i]) {
                const float x = v[i];
                v[i] = v[j];
                v[j] = x;
            }
    const float us = v[n / 2] * 1e3f;
    printf("%-36s %8.1f us %7.0f GB/s  err=%s\n", name, us, (double)N * ROWB / us / 1e3,
           cudaGetErrorString(cudaGetLastError()));
    return us;
}
