// The bitsandbytes 4-bit format's arithmetic, shared by every kernel that decodes it.
//
// Layout: element 2i is the high nibble of byte i, element 2i+1 the low nibble. Element e
// belongs to quantization block e >> BS_LOG2 and is code[nibble] * scale[block], multiplied in
// fp32. Nested ("double-quantized") scales: scale[b] = code2[q[b]] * absmax2[b >> BS2_LOG2] +
// offset, each an fp32 operation with its own rounding, exactly as bitsandbytes' three-step path.
// bitsandbytes' CUDA library is built flush-to-zero: both of its multiplies treat subnormal
// inputs and results as signed zeros (measured on an H100 with 0.50.2), so ours use mul.ftz.
// The offset add is a PyTorch op there and keeps subnormals, so ours is a plain add.
//
// The including kernel defines FMT_QUANT (0 = nf4, 1 = fp4) first.
#pragma once

#if !defined(FMT_QUANT)
#error "define FMT_QUANT before including format_4bit.cuh"
#endif

// IEEE-754 bit patterns of bitsandbytes' CUDA code tables (csrc/kernels.cu). Bits, not decimal
// literals, so no compiler can round them differently. FP4 index 8 is -0.0: the CUDA kernel
// computes 0 * sign with sign = -1 there. Four words a macro, so a kernel can write the table to
// shared memory as 16-byte immediates (no memory read before the first decode).
#if FMT_QUANT == 0
#define CODE_0_3 0xbf800000u, 0xbf3239b1u, 0xbf066b30u, 0xbeca32a0u
#define CODE_4_7 0xbe91a24du, 0xbe3d353fu, 0xbdba7871u, 0x00000000u
#define CODE_8_11 0x3da2faffu, 0x3e24cae3u, 0x3e7c04ddu, 0x3ead033au
#define CODE_12_15 0x3ee1a4b8u, 0x3f1007abu, 0x3f3913b3u, 0x3f800000u
#elif FMT_QUANT == 1
#define CODE_0_3 0x00000000u, 0x3baaaaabu, 0x3f2aaaabu, 0x3f800000u
#define CODE_4_7 0x3eaaaaabu, 0x3f000000u, 0x3e2aaaabu, 0x3e800000u
#define CODE_8_11 0x80000000u, 0xbbaaaaabu, 0xbf2aaaabu, 0xbf800000u
#define CODE_12_15 0xbeaaaaabu, 0xbf000000u, 0xbe2aaaabu, 0xbe800000u
#else
#error "unknown FMT_QUANT"
#endif

// The 16-entry table into 64 bytes of shared memory, by one thread.
__device__ __forceinline__ void stage_code_table(float* s_code) {
    uint4* d = reinterpret_cast<uint4*>(s_code);
    d[0] = make_uint4(CODE_0_3);
    d[1] = make_uint4(CODE_4_7);
    d[2] = make_uint4(CODE_8_11);
    d[3] = make_uint4(CODE_12_15);
}

// Code i as a float: with a compile-time i, an instruction's immediate operand (no memory read).
__device__ __forceinline__ float code_value(int i) {
    const unsigned bits[16] = {CODE_0_3, CODE_4_7, CODE_8_11, CODE_12_15};
    return __uint_as_float(bits[i]);
}

// fp32 multiply, round-to-nearest-even, subnormal inputs and result flushed to signed zero.
__device__ __forceinline__ float mul_ftz(float a, float b) {
    float r;
    asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// A nested scale from its parts: two separately rounded fp32 ops, never contracted into an FMA
// (bitsandbytes does the multiply in its 8-bit dequantize kernel and the add as a torch op).
__device__ __forceinline__ float nested_scale(float code2_q, float absmax2, float offset) {
    return __fadd_rn(mul_ftz(code2_q, absmax2), offset);
}
