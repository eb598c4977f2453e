// The FP8 block-scaled decode linear for a few rows (M <= 16), hand-written: the same bits as
// linear_fp8's Triton "f16" loop, in fewer instructions per weight byte. Semantics, when it runs and
// why it is bit-compatible: linear_fp8_small.py beside this file.
//
// One warp owns a 16-row tile of w and one split's K range (the Triton launch's split, so the same
// partial sums); it streams the e4m3 bytes straight from HBM into the A operand of mma.m16n8k16
// (fp16 in, fp32 accumulate). A lane loads 16 contiguous bytes of its row per 64-byte chunk c and
// uses word j of them in the chunk's MMA j: MMA (c, j) takes columns {64c + 16q + 4j + r} (q the
// lane's quad index, r < 4), the very sets linear_fp8's `_k16_sets` hands Triton's k16 steps, in the
// same order (c, j). A k16 step's fp32 result depends on the set of its products only, not on their
// order inside the instruction nor on mma.sync against wgmma (mma_order_probe.py, one H200), so
// every 128-block's dot has Triton's bits; e4m3 -> fp16x2 is one instruction per two elements.
// The activation codes of the CTA's K range are made once per CTA (or copied from x_codes) into
// shared memory as fp16 and enter as the B operand (8 rows of x per n-tile). Per 128-block the
// warp's fp32 MMA sum times (activation scale x weight scale) is added to its accumulator, in block
// order, as Triton's loop does; the splits' fp32 partials are summed in split order 0..S-1 by the
// last CTA to arrive, which also runs the epilogue (output rounding, SwiGLU of the w1/w3 pair,
// residual add), each operation as Triton's `_epilogue` does it.
// Under PDL the first weight blocks are requested before the wait: weights never depend on the
// predecessor.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "cuda_common.cuh"

namespace {

using megastep::ld_stream;
using megastep::pdl_release;
using megastep::pdl_wait;
using megastep::round_bf16;

constexpr int kPad = 8;        // fp16 elements of padding per shared x row (spreads rows over banks)
constexpr int kMaxSplit = 32;  // CTAs along K at most (linear_fp8_small.py's MAX_SPLIT)
// common.py's PDL modes
constexpr int kPdlLate = 1, kPdlEarly = 2, kPdlPlain = 3;

__device__ __forceinline__ void mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// four e4m3 bytes -> (bytes 0,1) and (bytes 2,3) as fp16x2, low byte in the low half
__device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;}"
      : "=r"(lo), "=r"(hi) : "r"(w));
}

__device__ __forceinline__ float e8m0_to_f32(uint8_t b) {  // common.e8m0_to_f32
  return b == 0 ? __int_as_float(0x00400000) : __int_as_float(int(b) << 23);
}

// fp32 a, b -> their e4m3 codes (round to nearest even, saturating: common.fp8_round) as fp16x2
__device__ __forceinline__ uint32_t fp8_pair(float a, float b) {
  uint32_t out;
  asm("{.reg .b16 q;\n\tcvt.rn.satfinite.e4m3x2.f32 q, %2, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, q;}"
      : "=r"(out) : "f"(a), "f"(b));
  return out;
}

// fp32 a, b -> fp16x2 (round to nearest even: Triton's .to(tl.float16))
__device__ __forceinline__ uint32_t f16_pair(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// common.fp8_pow2_scale: s = 2^ceil(log2(max(amax, 1e-4) / 448)) from amax's bits
__device__ __forceinline__ void fp8_pow2_scale(float amax, float& s, float& inv) {
  const int bits = __float_as_int(fmaxf(amax, 1e-4f));
  const int se = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000 ? 1 : 0);
  s = __int_as_float(se << 23);
  inv = __int_as_float((254 - se) << 23);
}

// common.f16_pow2_scale: s = 2^(floor(log2(max(amax, 2^-64))) - 14)
__device__ __forceinline__ void f16_pow2_scale(float amax, float& s, float& inv) {
  const int se = ((__float_as_int(fmaxf(amax, 5.421010862427522e-20f)) >> 23) & 0xFF) - 14;
  s = __int_as_float(se << 23);
  inv = __int_as_float((254 - se) << 23);
}

struct Args {
  const void* x; long long stride_xm; int x_f32;          // bf16 or fp32 activation [M, groups * K]
  const uint8_t* xc; const float* xs;                      // or its e4m3 codes and scales (x_codes)
  long long stride_cm, stride_sm; int codes;
  const uint8_t* w; long long stride_wn;                   // e4m3 [N (x2 gated), K]
  const uint8_t* ws; long long stride_wsn;                 // e8m0 [rows/128, K/128]
  void* out; long long stride_om; int out_bf16;            // [M, N]
  const void* res; long long stride_rm; int res_mode;      // 0 none, 1 fp32, 2 bf16
  float* part; int* cnt;                                   // split-K partials and arrival counters
  int M, N, K, group_n, quant, gated; float limit; int pdl;
};

// NT: n-tiles of 8 rows of x per CTA (MG = 8 NT rows); NB: 128-blocks of K per split (Kc = 128 NB).
template <int NT, int NB>
__device__ __forceinline__ void linear_small(const Args& a) {
  constexpr int MG = 8 * NT, KC = 128 * NB, XS = KC + kPad;
  extern __shared__ __align__(16) unsigned char smem[];
  __half* xsh = reinterpret_cast<__half*>(smem);                            // [MG][XS] fp16 codes
  float* scsh = reinterpret_cast<float*>(smem + MG * XS * sizeof(__half));  // [MG][NB] act scales
  float* red = reinterpret_cast<float*>(smem);                              // [warps * 16][MG], reused

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int G = a.gated ? 2 : 1, R = nwarps / G;  // R row tiles (w1/w3 pairs when gated) per CTA
  const int m0 = blockIdx.x * MG, mv = min(MG, a.M - m0);
  const int k_lo = blockIdx.z * KC;

  // ---- the warp's 16 rows: the first PF blocks of weight bytes are requested before anything else
  // (they depend on nothing, so also before the PDL wait), PF x 64 bytes per lane, refilled as used
  const int tile = blockIdx.y * R + warp / G;  // output tile (16 output channels)
  const bool active = tile * 16 < a.N;
  const int row0 = tile * 16 + (warp % G) * a.N;  // w3's rows follow w1's
  const uint8_t* w0 = a.w + (long long)(row0 + g) * a.stride_wn + k_lo + q * 16;
  const uint8_t* w1 = w0 + 8 * a.stride_wn;
  constexpr int PF = NB < 4 ? NB : 4;
  uint4 wr[PF][4];
  if (active) {
#pragma unroll
    for (int b = 0; b < PF; ++b) {
      wr[b][0] = ld_stream(w0 + b * 128);
      wr[b][1] = ld_stream(w1 + b * 128);
      wr[b][2] = ld_stream(w0 + b * 128 + 64);
      wr[b][3] = ld_stream(w1 + b * 128 + 64);
    }
  }
  if (a.pdl == kPdlEarly) pdl_release();
  if (a.pdl == kPdlEarly || a.pdl == kPdlLate) pdl_wait();

  // ---- the CTA's activation codes: fp16 in shared memory, scales beside them. Grouped (wo_a):
  // output rows [g N/G, (g+1) N/G) read x's columns [g K, (g+1) K); a CTA's tiles share one group
  const long long x_col = (long long)((blockIdx.y * R * 16) / a.group_n) * a.K + k_lo;
  for (int i = warp; i < mv * NB; i += nwarps) {
    const int m = i / NB, b = i % NB, k = b * 128 + lane * 4;
    uint32_t lo, hi;
    if (a.codes) {
      const uint32_t c = *reinterpret_cast<const uint32_t*>(a.xc + (m0 + m) * a.stride_cm + k_lo + k);
      e4m3x4_to_f16x2(c, lo, hi);
      if (lane == 0) scsh[m * NB + b] = a.xs[(m0 + m) * a.stride_sm + (k_lo + k) / 128];
    } else {
      float v[4];
      const long long off = (m0 + m) * a.stride_xm + x_col + k;
      if (a.x_f32) {
        const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(a.x) + off);
        v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
      } else {
        const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(a.x) + off);
        v[0] = __uint_as_float(u.x << 16); v[1] = __uint_as_float(u.x & 0xFFFF0000u);
        v[2] = __uint_as_float(u.y << 16); v[3] = __uint_as_float(u.y & 0xFFFF0000u);
      }
      float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
      for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
      float s, inv;
      if (a.quant) {
        fp8_pow2_scale(amax, s, inv);
        lo = fp8_pair(v[0] * inv, v[1] * inv);
        hi = fp8_pair(v[2] * inv, v[3] * inv);
      } else {  // wo_a: the bf16 activation itself, scaled into fp16's range
        f16_pow2_scale(amax, s, inv);
        lo = f16_pair(v[0] * inv, v[1] * inv);
        hi = f16_pair(v[2] * inv, v[3] * inv);
      }
      if (lane == 0) scsh[m * NB + b] = s;
    }
    *reinterpret_cast<uint2*>(xsh + m * XS + b * 128 + lane * 4) = make_uint2(lo, hi);
  }
  __syncthreads();

  // ---- the warp's 16 rows over the split's K range
  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  if (active) {
    const uint8_t* wsr = a.ws + (long long)(row0 / 128) * a.stride_wsn + k_lo / 128;
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      const uint4 cur[4] = {wr[b % PF][0], wr[b % PF][1], wr[b % PF][2], wr[b % PF][3]};
      if (b + PF < NB) {
        const int nb = (b + PF) * 128;
        wr[b % PF][0] = ld_stream(w0 + nb);
        wr[b % PF][1] = ld_stream(w1 + nb);
        wr[b % PF][2] = ld_stream(w0 + nb + 64);
        wr[b % PF][3] = ld_stream(w1 + nb + 64);
      }
      float blk[NT][4];  // the block's dot, from zero, as Triton's per-block tl.dot
#pragma unroll
      for (int t = 0; t < NT; ++t) blk[t][0] = blk[t][1] = blk[t][2] = blk[t][3] = 0.f;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const uint4 r0 = cur[2 * c], r1 = cur[2 * c + 1];
        const uint32_t w0w[4] = {r0.x, r0.y, r0.z, r0.w}, w1w[4] = {r1.x, r1.y, r1.z, r1.w};
        uint32_t xa[NT][8];  // B fragments: 16 fp16 of row m = 8t + g at this lane's 16 positions
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const int m = 8 * t + g;
          if (m < mv) {
            const uint4* p = reinterpret_cast<const uint4*>(xsh + m * XS + b * 128 + c * 64 + q * 16);
            const uint4 u = p[0], v = p[1];
            xa[t][0] = u.x; xa[t][1] = u.y; xa[t][2] = u.z; xa[t][3] = u.w;
            xa[t][4] = v.x; xa[t][5] = v.y; xa[t][6] = v.z; xa[t][7] = v.w;
          } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) xa[t][i] = 0u;
          }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // MMA (c, j): columns 64c + 16q' + 4j + r of the block
          uint32_t a0, a2, a1, a3;
          e4m3x4_to_f16x2(w0w[j], a0, a2);  // row g
          e4m3x4_to_f16x2(w1w[j], a1, a3);  // row g + 8
#pragma unroll
          for (int t = 0; t < NT; ++t) mma_f16(blk[t], a0, a1, a2, a3, xa[t][2 * j], xa[t][2 * j + 1]);
        }
      }
      const float sw = e8m0_to_f32(wsr[b]);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const int m = 8 * t + 2 * q;  // this lane's two columns
        const float s0 = m < mv ? scsh[m * NB + b] * sw : 0.f, s1 = m + 1 < mv ? scsh[(m + 1) * NB + b] * sw : 0.f;
        acc[t][0] += blk[t][0] * s0;
        acc[t][1] += blk[t][1] * s1;
        acc[t][2] += blk[t][2] * s0;
        acc[t][3] += blk[t][3] * s1;
      }
    }
  }
  if (a.pdl == kPdlLate || a.pdl == kPdlPlain) pdl_release();  // every weight byte is requested
  __syncthreads();  // the x codes are dead: `red` reuses their memory
  float* my = red + warp * 16 * MG;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int m = 8 * t + 2 * q;
    my[g * MG + m] = acc[t][0];
    my[g * MG + m + 1] = acc[t][1];
    my[(g + 8) * MG + m] = acc[t][2];
    my[(g + 8) * MG + m + 1] = acc[t][3];
  }
  __syncthreads();

  if (gridDim.z > 1) {  // split-K: partials out, the last CTA of this (tile group, row group) sums them
    // only the mv real rows of x travel: element i is (row i / mv of the CTA's tiles, x row i % mv)
    __shared__ int last;
    const int E = nwarps * 16 * mv;
    const long long cta = (long long)blockIdx.y * gridDim.x + blockIdx.x;
    const long long stride = (long long)gridDim.x * gridDim.y * nwarps * 16 * MG;  // one split's partials
    float* mine = a.part + blockIdx.z * stride + cta * nwarps * 16 * MG;
    for (int i = threadIdx.x; i < E; i += blockDim.x) mine[i] = red[(i / mv) * MG + i % mv];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      const int arrived = atomicAdd(a.cnt + cta, 1);
      last = arrived == int(gridDim.z) - 1;
      if (last) a.cnt[cta] = 0;  // ready for the next launch (and graph replay)
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int S = gridDim.z;  // <= kMaxSplit (the wrapper checks)
    for (int i = threadIdx.x; i < E; i += blockDim.x) {
      const float* p = a.part + cta * nwarps * 16 * MG + i;
      float v[kMaxSplit];
#pragma unroll
      for (int s = 0; s < kMaxSplit; ++s) v[s] = s < S ? __ldcg(p + s * stride) : 0.f;  // all in flight at once
      float sum = v[0];
#pragma unroll
      for (int s = 1; s < kMaxSplit; ++s) if (s < S) sum += v[s];  // split order, as Triton's combine
      red[(i / mv) * MG + i % mv] = sum;
    }
    __syncthreads();
  }

  // ---- epilogue (linear_fp8's `_epilogue`): one output element per thread and step, channels
  // fastest (coalesced stores)
  const int rows = R * 16;
  for (int e = threadIdx.x; e < rows * MG; e += blockDim.x) {
    const int m = e / rows, r = e % rows, n = blockIdx.y * rows + r;
    if (m >= mv || n >= a.N) continue;
    const int pair = r / 16, rr = r % 16;
    float y = red[((pair * G) * 16 + rr) * MG + m];
    if (a.out_bf16) y = round_bf16(y);
    if (a.gated) {
      float u = red[((pair * G + 1) * 16 + rr) * MG + m];
      if (a.out_bf16) u = round_bf16(u);
      if (a.limit > 0.f) {
        y = fminf(y, a.limit);
        u = fminf(fmaxf(u, -a.limit), a.limit);
      }
      y = __fmul_rn(__fdiv_rn(y, __fadd_rn(1.f, expf(-y))), u);  // libdevice expf, IEEE division
    }
    const long long mm = m0 + m;
    if (a.res_mode) {
      const float rv = a.res_mode == 1 ? static_cast<const float*>(a.res)[mm * a.stride_rm + n]
                                       : __bfloat162float(static_cast<const __nv_bfloat16*>(a.res)[mm * a.stride_rm + n]);
      y = __fadd_rn(rv, y);
    }
    if (a.out_bf16) {
      static_cast<__nv_bfloat16*>(a.out)[mm * a.stride_om + n] = __float2bfloat16_rn(y);
    } else {
      static_cast<float*>(a.out)[mm * a.stride_om + n] = y;
    }
  }
}

}  // namespace

#define LINEAR_SMALL_ENTRY(NT, NB)                                                                       \
  extern "C" __global__ void __launch_bounds__(256) linear_fp8_small_nt##NT##_nb##NB(                    \
      const void* x, long long stride_xm, int x_f32, const uint8_t* xc, const float* xs,                 \
      long long stride_cm, long long stride_sm, int codes, const uint8_t* w, long long stride_wn,        \
      const uint8_t* ws, long long stride_wsn, void* out, long long stride_om, int out_bf16,             \
      const void* res, long long stride_rm, int res_mode, float* part, int* cnt, int M, int N, int K,    \
      int group_n, int quant, int gated, float limit, int pdl) {                                         \
    const Args a{x, stride_xm, x_f32, xc, xs, stride_cm, stride_sm, codes, w, stride_wn, ws, stride_wsn, \
                 out, stride_om, out_bf16, res, stride_rm, res_mode, part, cnt, M, N, K, group_n, quant, \
                 gated, limit, pdl};                                                                     \
    linear_small<NT, NB>(a);                                                                             \
  }

#define LINEAR_SMALL_NB(NB) LINEAR_SMALL_ENTRY(1, NB) LINEAR_SMALL_ENTRY(2, NB)
LINEAR_SMALL_NB(1)
LINEAR_SMALL_NB(2)
LINEAR_SMALL_NB(4)
LINEAR_SMALL_NB(8)
