// Device helpers of the hand-written CUDA C++ kernels (moe_lut.cu, route_cuda.cu; the experiments
// under benchmarks/kernels include it too): the streaming weight load, the bf16 rounding, the
// activation quantization's twins of kernels/common.py, PDL.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace megastep {

// weights are read once: keep them out of L1, let L2 fetch the neighbouring 128 bytes too
__device__ __forceinline__ uint4 ld_stream(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

// the twin of common.fp8_pow2_scale: s = 2^ceil(log2(max(amax, 1e-4) / 448)) from amax's bits
__device__ __forceinline__ void pow2_scale(float amax, float& s, float& inv) {
  const int bits = __float_as_int(fmaxf(amax, 1e-4f));
  const int se = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000 ? 1 : 0);
  s = __int_as_float(se << 23);
  inv = __int_as_float((254 - se) << 23);
}

// v rounded to e4m3 (nearest even, saturating: common.fp8_round on the GPU), back in fp32
__device__ __forceinline__ float e4m3_round(float v) {
  uint32_t h;
  asm("{.reg .b16 q;\n\tcvt.rn.satfinite.e4m3x2.f32 q, %1, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, q;}" : "=r"(h) : "f"(v));
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h & 0xFFFF)));
}

// fp8_act_sim of one 128-block (moe_route.quant_blocks_store) by a warp, lane l holding elements
// 4l .. 4l + 3 (bf16 in v, the lane's 8 bytes): q[i] = rnd_e4m3(v[i] / s) * s, s the block's
// power-of-two scale (the max is exact in any order)
__device__ __forceinline__ void fp8_act_sim4(uint2 v, float (&q)[4]) {
  const float f[4] = {bf16_lo(v.x), bf16_hi(v.x), bf16_lo(v.y), bf16_hi(v.y)};
  float amax = fmaxf(fmaxf(fabsf(f[0]), fabsf(f[1])), fmaxf(fabsf(f[2]), fabsf(f[3])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  float s, inv;
  pow2_scale(amax, s, inv);
#pragma unroll
  for (int i = 0; i < 4; ++i) q[i] = __fmul_rn(e4m3_round(__fmul_rn(f[i], inv)), s);
}

// PDL, for kernels launched with programmatic stream serialization (cuda_module's launch(pdl=True);
// without it both are no-ops). pdl_wait blocks until the predecessor grid has completed and its
// writes are visible; pdl_release lets the next kernel's CTAs be placed as SM room frees up (they
// wait for this grid's completion before they read what it writes).
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_release() { asm volatile("griddepcontrol.launch_dependents;" :::); }

}  // namespace megastep
