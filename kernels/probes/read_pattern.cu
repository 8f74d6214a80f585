// Probe, not part of the harness: the read bandwidth of two load patterns over the gate weight's packed
// bytes (28672 rows of 4096), kernels that only XOR what they load. "rows16" loads as
// matmul_4bit_m8_pairs.cu does (a lane 8 bytes of rows g and g + 8 at each 32-byte chunk, DEPTH steps
// ahead in registers; checked against plain loads first); "contiguous" reads 512 bytes a warp
// instruction. PAD KB of static shared memory sets the blocks an SM (43: the pair-table kernel's 4).
// Four copies of the weight in turn and a 256 MB memset before each launch keep it out of L2; CUDA
// events, median of 25. kernels/NOTES.md has the figures.
// Build and run on a GPU: nvcc -O3 -arch=sm_90 -std=c++17 -o read_pattern read_pattern.cu && ./read_pattern
#include "probe.cuh"

// Pattern "kernel": a warp owns 16 rows; lane (g, t) reads 8 bytes of rows g and g+8 at chunk c (32 bytes)
// offset t*8; a step is 4 chunks (128 bytes a row); DEPTH steps in registers ahead.
template <int DEPTH, int PAD>
__global__ void __launch_bounds__(128, 4) rows16(const unsigned char* __restrict__ W, u32* out, int splits) {
    __shared__ u32 pad[PAD * 256 + 128];
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int warp = blockIdx.x * 4 + (threadIdx.x >> 5);
    const int steps = ROWB / 128 / splits, first = blockIdx.y * steps;
    const unsigned char* lo = W + (size_t)(warp * 16 + g) * ROWB + t * 8 + first * 128;
    const unsigned char* hi = lo + 8 * ROWB;
    uint2 r[DEPTH][8];
    u32 acc = 0;
#pragma unroll
    for (int d = 0; d < DEPTH; ++d)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            r[d][c] = __ldcs((const uint2*)(lo + d * 128 + c * 32));
            r[d][4 + c] = __ldcs((const uint2*)(hi + d * 128 + c * 32));
        }
    for (int s = 0; s < steps; s += DEPTH) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d)
#pragma unroll
            for (int c = 0; c < 8; ++c) {
                acc ^= r[d][c].x * 3 + r[d][c].y;
                const int ns = s + d + DEPTH;
                if (ns < steps) {
                    const unsigned char* p = (c < 4 ? lo : hi) + ns * 128 + (c & 3) * 32;
                    r[d][c] = __ldcs((const uint2*)p);
                }
            }
    }
    store_lane(pad, out, acc);
}

// Pattern "contiguous": each warp reads 512 contiguous bytes an instruction (16 a lane), one row after another.
template <int DEPTH, int PAD>
__global__ void __launch_bounds__(128, 4) contiguous(const unsigned char* __restrict__ W, u32* out, int splits) {
    __shared__ u32 pad[PAD * 256 + 128];
    const int lane = threadIdx.x & 31;
    const int warp = blockIdx.x * 4 + (threadIdx.x >> 5);
    // the same 16 rows a warp, read row by row in 512-byte pieces
    const size_t bytes = (size_t)16 * ROWB / splits;
    const unsigned char* base = W + (size_t)warp * 16 * ROWB + blockIdx.y * bytes + lane * 16;
    const int iters = bytes / 512;
    u32 acc = 0;
    uint4 r[DEPTH * 4];
#pragma unroll
    for (int d = 0; d < DEPTH * 4; ++d) r[d] = __ldcs((const uint4*)(base + d * 512));
    for (int i = 0; i < iters; i += DEPTH * 4) {
#pragma unroll
        for (int d = 0; d < DEPTH * 4; ++d) {
            acc ^= r[d].x + r[d].y * 3 + r[d].z * 5 + r[d].w;
            if (i + d + DEPTH * 4 < iters) r[d] = __ldcs((const uint4*)(base + (size_t)(i + d + DEPTH * 4) * 512));
        }
    }
    if (acc == 0x12345678u) pad[threadIdx.x] = acc;
    if (acc == 0x12345679u) out[0] = pad[lane];
}

int main() {
    Weights weights;
    u32* out;
    cudaMalloc(&out, 64 << 20);
    const unsigned char* varied = weights.copy[0];
    printf("rows16 depth 1 reads vs plain loads, 4 splits: %d lanes differ\n",
           lanes_differ_4_warps(weights, [&](dim3 grid, u32* o) { rows16<1, 43><<<grid, 128>>>(varied, o, 4); }));
    printf("rows16 depth 2 reads vs plain loads, 4 splits: %d lanes differ\n",
           lanes_differ_4_warps(weights, [&](dim3 grid, u32* o) { rows16<2, 43><<<grid, 128>>>(varied, o, 4); }));
    for (int splits : {1, 4, 16}) {
        dim3 grid(N / 64, splits);
        char label[64];
#define T(NAME, K, D, P)                                                 \
    snprintf(label, 64, NAME " d%d pad%d s%d", D, P, splits);            \
    time_reads(label, weights, [&] { K<D, P><<<grid, 128>>>(weights.copy[weights.next], out, splits); });
        T("rows16", rows16, 1, 43) T("rows16", rows16, 2, 43) T("rows16", rows16, 1, 0) T("rows16", rows16, 2, 0)
        T("contig", contiguous, 1, 43) T("contig", contiguous, 2, 43) T("contig", contiguous, 1, 0) T("contig", contiguous, 2, 0)
        T("rows16", rows16, 1, 20) T("rows16", rows16, 2, 20)
    }
    // copy bandwidth for reference (read + write)
    char* dst;
    cudaMalloc(&dst, (size_t)N * ROWB);
    time_reads("memcpy d2d (bytes read)", weights, [&] {
        cudaMemcpyAsync(dst, weights.copy[weights.next], (size_t)N * ROWB, cudaMemcpyDeviceToDevice);
    });
    return 0;
}
