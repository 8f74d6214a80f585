// Probe, not part of the harness: the gate weight's packed bytes (28672 rows of 4096) through a ring
// per warp fed by the tensor memory accelerator: a 3D tensor map (128 bytes, 128-byte units, rows),
// one copy of U_BOX units of 16 rows a stage with the 128-byte swizzle, so the lanes' 8-byte reads
// of rows g and g + 8 are conflict-free without padding (unit u of row r sits in unit r * U_BOX + u,
// its 16-byte pieces XORed with that index mod 8); checked against plain loads first. Timing as in
// read_pattern.cu.
// Build and run on a GPU: nvcc -O3 -arch=sm_90 -std=c++17 -DU_BOX=2 -o read_tma read_tma.cu -lcuda && ./read_tma
// (where no libcuda.so is on the linker's path: -L$CUDA_HOME/lib64/stubs)
#include <cuda.h>
#include "probe.cuh"
#ifndef U_BOX
#define U_BOX 2
#endif

__device__ __forceinline__ void tma_load(u32 dst, const CUtensorMap* map, int unit, int row, u32 bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
                 ::"r"(dst), "l"(map), "r"(0), "r"(unit), "r"(row), "r"(bar) : "memory");
}

template <int WARPS, int STAGES, int PAD, int U>
__global__ void __launch_bounds__(WARPS * 32, 1) tma16(const __grid_constant__ CUtensorMap map, u32* out, int splits) {
    __shared__ u32 pad[PAD * 256 + 32];
    extern __shared__ __align__(16) unsigned char dyn[];
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, wib = threadIdx.x >> 5;
    const int warp = blockIdx.x * WARPS + wib;
    const int steps = ROWB / 128 / U / splits, first = blockIdx.y * steps;  // steps of U units
    constexpr int SB = 2048 * U;
    const u32 dyn_s = (u32)__cvta_generic_to_shared(dyn), base = (dyn_s + 1023) & ~1023u;  // 128-byte swizzle: 1 KB aligned
    const u32 ring_s = base + wib * STAGES * SB;
    const unsigned char* ring = dyn + (ring_s - dyn_s);
    const u32 bars = base + WARPS * STAGES * SB + wib * STAGES * 8;
    if (lane == 0)
        for (int s = 0; s < STAGES; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bars + 8 * s) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncwarp();
    if (lane == 0)
        for (int s = 0; s < STAGES && s < steps; ++s) tma_load(ring_s + s * SB, &map, (first + s) * U, warp * 16, bars + 8 * s, SB);
    u32 acc = 0;
    for (int step = 0; step < steps; ++step) {
        const int s = step % STAGES;
        bar_wait(bars + 8 * s, (step / STAGES) & 1);
        const unsigned char* st = ring + s * SB;
#pragma unroll
        for (int q = 0; q < U; ++q) {
            uint2 r[8];
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int u = (c * 32 + t * 8) >> 4, lo = g * U + q, hi = (g + 8) * U + q;  // 128-byte units
                r[c] = *(const uint2*)(st + lo * 128 + ((u ^ (lo & 7)) << 4) + ((t * 8) & 15));
                r[4 + c] = *(const uint2*)(st + hi * 128 + ((u ^ (hi & 7)) << 4) + ((t * 8) & 15));
            }
#pragma unroll
            for (int c = 0; c < 8; ++c) acc ^= r[c].x * 3 + r[c].y;
        }
        __syncwarp();
        if (step + STAGES < steps && lane == 0) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            tma_load(ring_s + s * SB, &map, (first + step + STAGES) * U, warp * 16, bars + 8 * s, SB);
        }
    }
    store_lane(pad, out, acc);
}

int main() {
    Weights weights;
    u32* out;
    cudaMalloc(&out, 64 << 20);
    CUtensorMap maps[4];
    for (int i = 0; i < 4; ++i) {
        cuuint64_t dims[3] = {128, ROWB / 128, N}, strides[2] = {128, ROWB};
        cuuint32_t box[3] = {128, (cuuint32_t)U_BOX, 16}, estr[3] = {1, 1, 1};
        CUresult r = cuTensorMapEncodeTiled(&maps[i], CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, weights.copy[i], dims, strides,
                                            box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
        if (r) {
            printf("encode failed %d\n", r);
            return 1;
        }
    }
    {  // the swizzled reads against direct ones, on varied bytes
        const int dyn = 8 * 2 * 2048 * U_BOX + 8 * 2 * 8 + 1024;
        cudaFuncSetAttribute(tma16<8, 2, 16, U_BOX>, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);
        const dim3 checked(N / 128, 2);
        const size_t lanes = (size_t)checked.x * checked.y * 256;
        const int bad = lanes_differ(
            lanes, [&](u32* o) { reference<8><<<checked, 256>>>(weights.copy[0], o, 2); },
            [&](u32* o) { tma16<8, 2, 16, U_BOX><<<checked, 256, dyn>>>(maps[0], o, 2); });
        printf("swizzled reads vs direct: %d of %zu lanes differ (%s)\n", bad, lanes, cudaGetErrorString(cudaGetLastError()));
    }
    char label[64];
#define T(W, S, P)                                                                                         \
    for (int splits : {1, 2, 4}) {                                                                         \
        const int dyn = W * S * 2048 * U_BOX + W * S * 8 + 1024;                                           \
        cudaFuncSetAttribute(tma16<W, S, P, U_BOX>, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);     \
        int blocks = 0;                                                                                    \
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, tma16<W, S, P, U_BOX>, W * 32, dyn);        \
        snprintf(label, 64, "tma U%d w%d st%d pad%d s%d b/SM %d", U_BOX, W, S, P, splits, blocks);         \
        dim3 grid(N / (16 * W), splits);                                                                   \
        time_reads(label, weights, [&] { tma16<W, S, P, U_BOX><<<grid, W * 32, dyn>>>(maps[weights.next], out, splits); }); \
    }
    T(4, 1, 43) T(4, 2, 27) T(8, 2, 43) T(8, 1, 43) T(4, 3, 24)
    // deeper rings: more bytes in flight an SM than 16 warps' registers hold
    T(4, 4, 0) T(8, 3, 0) T(8, 4, 0) T(16, 2, 0) T(16, 3, 0)
    return 0;
}
