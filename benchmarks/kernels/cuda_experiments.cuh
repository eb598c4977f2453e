// Pieces of the CUDA C++ experiments (gemv_fp8_cuda.cu): the streaming weight load and the bf16
// rounding (the runtime's, megastep/kernels/cuda_common.cuh), and the m16n8k16 MMA on fp16 or bf16
// operands (fp32 accumulate).
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "../../megastep/kernels/cuda_common.cuh"

namespace experiments {

using megastep::ld_stream;
using megastep::round_bf16;

// d += A . B on tensor cores; BF16 picks bf16 operands, else fp16
template <bool BF16>
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  if constexpr (BF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

}  // namespace experiments
