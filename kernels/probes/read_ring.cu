// Probe, not part of the harness: the gate weight's packed bytes (28672 rows of 4096) through a
// shared-memory ring per warp fed by cp.async.bulk (sm_90): a warp owns 16 rows, one bulk copy of
// STEPB bytes a row a stage (each row padded by 32 bytes in shared memory, so lane (g, t)'s 8-byte
// reads of rows g and g + 8 are conflict-free), STAGES stages, completion on an mbarrier per stage;
// the lanes read a stage back as matmul_4bit_m8_pairs.cu's lanes read their weights (checked against
// plain loads first), then refill it. PAD KB of static shared memory sets the blocks an SM. Timing as
// in read_pattern.cu.
// Build and run on a GPU: nvcc -O3 -arch=sm_90 -std=c++17 -o read_ring read_ring.cu && ./read_ring
#include "probe.cuh"

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
    store_lane(pad, out, acc);
}

int main() {
    Weights weights;
    u32* out;
    cudaMalloc(&out, 64 << 20);
    const unsigned char* varied = weights.copy[0];
#define CHECK(S, P, B)                                                                                           \
    {                                                                                                            \
        const int dyn = 4 * S * 16 * (B + 32) + 4 * S * 8;                                                       \
        cudaFuncSetAttribute(ring16<S, P, B>, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);                 \
        const int bad = lanes_differ_4_warps(                                                                    \
            weights, [&](dim3 grid, u32* o) { ring16<S, P, B><<<grid, 128, dyn>>>(varied, o, 4); });              \
        printf("ring B%d reads vs direct, 4 splits: %d lanes differ\n", B, bad);                               \
    }
    CHECK(1, 43, 128) CHECK(2, 16, 256) CHECK(1, 16, 512)
    for (int splits : {1, 4}) {
        dim3 grid(N / 64, splits);
        char label[64];
#define T(S, P, B)                                                                                       \
    {                                                                                                    \
        const int dyn = 4 * S * 16 * (B + 32) + 4 * S * 8;                                               \
        cudaFuncSetAttribute(ring16<S, P, B>, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);         \
        int blocks = 0;                                                                                  \
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, ring16<S, P, B>, 128, dyn);               \
        snprintf(label, 64, "ring st%d pad%d B%d s%d b/SM %d", S, P, B, splits, blocks);                 \
        time_reads(label, weights, [&] { ring16<S, P, B><<<grid, 128, dyn>>>(weights.copy[weights.next], out, splits); }); \
    }
        T(1, 43, 128) T(2, 16, 256) T(3, 8, 256) T(1, 16, 512) T(2, 0, 512) T(1, 0, 1024)
    }
    return 0;
}
