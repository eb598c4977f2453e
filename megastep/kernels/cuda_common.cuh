// Device helpers of the hand-written CUDA C++ kernels (moe_lut.cu, route_cuda.cu; the experiments
// under benchmarks/kernels include it too): the streaming weight load, the bf16 rounding, PDL.
#pragma once

#include <cuda_bf16.h>
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

// PDL, for kernels launched with programmatic stream serialization (cuda_module's launch(pdl=True);
// without it both are no-ops). pdl_wait blocks until the predecessor grid has completed and its
// writes are visible; pdl_release lets the next kernel's CTAs be placed as SM room frees up (they
// wait for this grid's completion before they read what it writes).
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_release() { asm volatile("griddepcontrol.launch_dependents;" :::); }

}  // namespace megastep
