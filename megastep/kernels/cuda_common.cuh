// Device helpers of the hand-written CUDA C++ kernels (moe_lut.cu, route_cuda.cu, sidecar_zero_copy.cu;
// the experiments under benchmarks/kernels include it too): the streaming weight load, the bf16 rounding,
// the activation quantization's twins of kernels/common.py, the FP8 GEMV's pieces, PDL, flags.
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

// d += A . B on tensor cores (mma.m16n8k16, fp32 accumulate); BF16 picks bf16 operands, else fp16
template <bool BF16>
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
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

// 16 bytes global -> shared without a register (L2 asked for the neighbouring 256 bytes), and the
// commit of the copies issued so far as one group. dst is only an address here (moe_lut's ring
// slots are held as const views), so it is taken as const.
__device__ __forceinline__ void cp_async16(const void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)),
               "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// ---- the FP8 block-scaled GEMV pieces (benchmarks/kernels/gemv_fp8_cuda.cu, chain_probe.cu) ----

// four e4m3 bytes -> (bytes 0,1) and (bytes 2,3) as fp16x2, low byte in the low half
__device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;}"
      : "=r"(lo), "=r"(hi) : "r"(w));
}

__device__ __forceinline__ float e8m0_to_f32(uint8_t b) {  // common.e8m0_to_f32 (byte 0: 2^-127, as torch)
  return b == 0 ? __int_as_float(0x00400000) : __int_as_float(int(b) << 23);
}

// fp32 a, b -> their e4m3 codes (round to nearest even, saturating: common.fp8_round) as fp16x2, b high
__device__ __forceinline__ uint32_t fp8_pair(float a, float b) {
  uint32_t out;
  asm("{.reg .b16 q;\n\tcvt.rn.satfinite.e4m3x2.f32 q, %2, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, q;}"
      : "=r"(out) : "f"(a), "f"(b));
  return out;
}

// A lane's four outputs after a 128-block's dot blk (from zero, as Triton's per-block tl.dot), for
// its NT n-tiles of 8 rows of x: acc += blk * (activation scale x weight scale sw), the scales of x
// row m of the block at sc[m * nb] (rows past mv add nothing), Triton's "f16" loop's arithmetic
template <int NT>
__device__ __forceinline__ void add_block(float (&acc)[NT][4], const float (&blk)[NT][4], const float* sc, int nb,
                                          float sw, int mv, int q) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int m = 8 * t + 2 * q;  // this lane's two columns
    const float s0 = m < mv ? sc[m * nb] * sw : 0.f, s1 = m + 1 < mv ? sc[(m + 1) * nb] * sw : 0.f;
    acc[t][0] += blk[t][0] * s0;
    acc[t][1] += blk[t][1] * s1;
    acc[t][2] += blk[t][2] * s0;
    acc[t][3] += blk[t][3] * s1;
  }
}

// A warp's results (its 16 rows, the lane's four outputs of each n-tile) into my[row * MG + x row]
template <int NT>
__device__ __forceinline__ void store_rows(float* my, const float (&acc)[NT][4], int g, int q, int MG) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int m = 8 * t + 2 * q;
    my[g * MG + m] = acc[t][0];
    my[g * MG + m + 1] = acc[t][1];
    my[(g + 8) * MG + m] = acc[t][2];
    my[(g + 8) * MG + m + 1] = acc[t][3];
  }
}

// Split-K over the CTAs along gridDim.z: each CTA's fp32 results red[r * MG + m] (rows r < rows of its
// tiles, x rows m < mv) go out to `part` as its partial; the last CTA of (blockIdx.y, blockIdx.x) to
// arrive (an arrival counter that it resets, ready for the next launch and graph replay) sums the
// splits in split order 0..S-1, as Triton's combine does, back into red. Returns whether this CTA
// holds the sums (always with one split). S <= kMaxSplit; every thread of the CTA calls it.
template <int kMaxSplit>
__device__ __forceinline__ bool splitk_sum(float* red, float* part, int* cnt, int rows, int MG, int mv) {
  if (gridDim.z == 1) return true;
  __shared__ int last;
  const int E = rows * mv;  // only the mv real rows of x travel: element i is (row i / mv, x row i % mv)
  const long long cta = (long long)blockIdx.y * gridDim.x + blockIdx.x;
  const long long stride = (long long)gridDim.x * gridDim.y * rows * MG;  // one split's partials
  float* mine = part + blockIdx.z * stride + cta * rows * MG;
  for (int i = threadIdx.x; i < E; i += blockDim.x) mine[i] = red[(i / mv) * MG + i % mv];
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int arrived = atomicAdd(cnt + cta, 1);
    last = arrived == int(gridDim.z) - 1;
    if (last) cnt[cta] = 0;
  }
  __syncthreads();
  if (!last) return false;
  __threadfence();
  const int S = gridDim.z;
  for (int i = threadIdx.x; i < E; i += blockDim.x) {
    const float* p = part + cta * rows * MG + i;
    float v[kMaxSplit];
#pragma unroll
    for (int s = 0; s < kMaxSplit; ++s) v[s] = s < S ? __ldcg(p + s * stride) : 0.f;  // all in flight at once
    float sum = v[0];
#pragma unroll
    for (int s = 1; s < kMaxSplit; ++s)
      if (s < S) sum += v[s];  // split order
    red[(i / mv) * MG + i % mv] = sum;
  }
  __syncthreads();
  return true;
}

// PDL, for kernels launched with programmatic stream serialization (cuda_module's launch(pdl=True);
// without it both are no-ops). pdl_wait blocks until the predecessor grid has completed and its
// writes are visible; pdl_release lets the next kernel's CTAs be placed as SM room frees up (they
// wait for this grid's completion before they read what it writes).
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_release() { asm volatile("griddepcontrol.launch_dependents;" :::); }

// Flags between CTAs (gpu scope) or with a host thread (sys scope), and the clock a wait on them
// reads to give up (a spin must never hang the device)
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

}  // namespace megastep
