// Pieces of the CUDA C++ experiments (gemv_fp8_cuda.cu): the streaming weight load, the bf16
// rounding and the m16n8k16 MMA on fp16 or bf16 operands (fp32 accumulate), all the runtime's
// (megastep/kernels/cuda_common.cuh).
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "../../megastep/kernels/cuda_common.cuh"

namespace experiments {

using megastep::ld_stream;
using megastep::mma16816;
using megastep::round_bf16;

}  // namespace experiments
