// One k16 step of a tensor-core dot, D = A B + C (fp16 in, fp32 accumulate), with mma.sync m16n8k16
// and the 16 products placed in the instruction in a chosen order. mma_order_probe.py beside this
// file asks whether the bits depend on that order, or on the instruction (Triton's dot on Hopper).
//
// One warp per trial: A [64, 16] and C [64, 16] row-major, B [16, 16] (k, n) row-major, D like C;
// 4 x 2 tiles of m16n8k16. Instruction position p of the k dimension takes source column perm[p]
// of A and row perm[p] of B. Fragments (PTX ISA, mma.m16n8k16 .row.col, f16): g = lane / 4,
// t = lane % 4; A holds (g, 2t..2t+1), (g+8, 2t..2t+1), (g, 2t+8..2t+9), (g+8, 2t+8..2t+9); B holds
// (k 2t..2t+1, n g), (k 2t+8..2t+9, n g); C and D hold (g, 2t..2t+1), (g+8, 2t..2t+1).

#include <cuda_fp16.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ uint32_t pack(half lo, half hi) {
    return (uint32_t)__half_as_ushort(lo) | ((uint32_t)__half_as_ushort(hi) << 16);
}

}  // namespace

extern "C" __global__ void mma_k16_perm(const half* __restrict__ A, const half* __restrict__ B,
                                        const float* __restrict__ C, const int* __restrict__ perm,
                                        float* __restrict__ D, int trials) {
    const int trial = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (trial >= trials) return;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const half* a = A + (size_t)trial * 64 * 16;
    const half* b = B + (size_t)trial * 16 * 16;
    const float* c = C + (size_t)trial * 64 * 16;
    float* d = D + (size_t)trial * 64 * 16;
    int p[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) p[i] = perm[i];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
        const int r0 = mt * 16 + g, r1 = r0 + 8;
        uint32_t a0 = pack(a[r0 * 16 + p[2 * t]], a[r0 * 16 + p[2 * t + 1]]);
        uint32_t a1 = pack(a[r1 * 16 + p[2 * t]], a[r1 * 16 + p[2 * t + 1]]);
        uint32_t a2 = pack(a[r0 * 16 + p[2 * t + 8]], a[r0 * 16 + p[2 * t + 9]]);
        uint32_t a3 = pack(a[r1 * 16 + p[2 * t + 8]], a[r1 * 16 + p[2 * t + 9]]);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const int n = nt * 8 + g, cn = nt * 8 + 2 * t;
            uint32_t b0 = pack(b[p[2 * t] * 16 + n], b[p[2 * t + 1] * 16 + n]);
            uint32_t b1 = pack(b[p[2 * t + 8] * 16 + n], b[p[2 * t + 9] * 16 + n]);
            float c0 = c[r0 * 16 + cn], c1 = c[r0 * 16 + cn + 1], c2 = c[r1 * 16 + cn], c3 = c[r1 * 16 + cn + 1];
            float d0, d1, d2, d3;
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                "{%8, %9}, {%10, %11, %12, %13};\n"
                : "=f"(d0), "=f"(d1), "=f"(d2), "=f"(d3)
                : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c0), "f"(c1), "f"(c2), "f"(c3));
            d[r0 * 16 + cn] = d0;
            d[r0 * 16 + cn + 1] = d1;
            d[r1 * 16 + cn] = d2;
            d[r1 * 16 + cn + 1] = d3;
        }
    }
}
