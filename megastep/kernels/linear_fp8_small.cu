// The FP8 block-scaled decode linear for a few rows (M <= 16), hand-written: the same bits as
// linear_fp8's Triton "f16" loop, in fewer instructions per weight byte. Semantics, when it runs and
// why it is bit-compatible: linear_fp8_small.py beside this file.
//
// One warp owns a 16-row tile of w and one split's K range (the Triton launch's split, so the same
// partial sums); it streams the e4m3 bytes from HBM into the A operand of mma.m16n8k16 (fp16 in,
// fp32 accumulate). MMA j of a 128-block takes the block's columns [16j, 16j + 16), as Triton's k16
// steps do, in the same order: a lane of quad index q loads word q (4 bytes) of each 16-byte
// segment of its two rows, which its A fragment holds as the k slots (2q, 2q+1, 2q+8, 2q+9), and
// the activation's columns 16j + 4q .. +3 in the same slots of B. A k16 step's fp32 result depends
// on the set of its products only, not on their order inside the instruction nor on mma.sync
// against wgmma (mma_order_probe.py, one H200), so every 128-block's dot has Triton's bits.
// e4m3 -> fp16x2 is one instruction per two elements.
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

// a 4-byte word of weights: read once, through L1 (a warp's load covers half of each 32-byte sector,
// the next segment's load the other half), L2 fetching the neighbouring 256 bytes
__device__ __forceinline__ uint32_t ld_word(const uint8_t* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L2::256B.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// lane q holds words 0..3 of segment 4c + q of a row (u); returns in w[i] word q of segment 4c + i
// (a 4 x 4 transpose over the lanes of a quad: two butterfly steps, two shuffles each)
__device__ __forceinline__ void quad_transpose(const uint4 u, const int q, uint32_t* w) {
  const bool o = q & 1, p = q & 2;
  const uint32_t r0 = __shfl_xor_sync(0xFFFFFFFFu, o ? u.x : u.y, 1);
  const uint32_t r1 = __shfl_xor_sync(0xFFFFFFFFu, o ? u.z : u.w, 1);
  const uint32_t c0 = o ? r0 : u.x, c1 = o ? u.y : r0, c2 = o ? r1 : u.z, c3 = o ? u.w : r1;
  const uint32_t v0 = __shfl_xor_sync(0xFFFFFFFFu, p ? c0 : c2, 2);
  const uint32_t v1 = __shfl_xor_sync(0xFFFFFFFFu, p ? c1 : c3, 2);
  w[0] = p ? v0 : c0;
  w[1] = p ? v1 : c1;
  w[2] = p ? c2 : v0;
  w[3] = p ? c3 : v1;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// four 8 x 8 b16 matrices from shared memory: lane (g, q) gets bytes 4q..4q+3 of row g of each
__device__ __forceinline__ void ldsm_x4(const void* p, uint32_t& d0, uint32_t& d1, uint32_t& d2, uint32_t& d3) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(d0), "=r"(d1), "=r"(d2), "=r"(d3) : "r"(a));
}

// 1 + exp(x) as Triton compiles `1.0 + libdevice.exp(x)`: libdevice's __nv_expf, whose last multiply
// the compiler fuses with the add (fma.rn), so the SwiGLU has the Triton loop's bits
__device__ __forceinline__ float one_plus_expf(float x) {
  float y;
  asm("{.reg .b32 t, j, k, r, e, s;\n\t"
      "fma.rn.ftz.f32 t, %1, 0f3BBB989D, 0f3F000000;\n\t"
      "cvt.ftz.sat.f32.f32 t, t;\n\t"
      "fma.rm.ftz.f32 j, t, 0f437C0000, 0f4B400001;\n\t"
      "add.f32 k, j, 0fCB40007F;\n\t"
      "neg.f32 k, k;\n\t"
      "fma.rn.ftz.f32 r, %1, 0f3FB8AA3B, k;\n\t"
      "fma.rn.ftz.f32 r, %1, 0f32A57060, r;\n\t"
      "shl.b32 s, j, 23;\n\t"
      "ex2.approx.ftz.f32 e, r;\n\t"
      "fma.rn.f32 %0, e, s, 0f3F800000;}"
      : "=f"(y) : "f"(x));
  return y;
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
// LOAD: how a lane gets word q of each 16-byte segment of its two rows (the .py's LOADS):
// kWord: one 4-byte load per word (through L1); kShfl: 16-byte loads of whole segments, then a
// transpose over the quad; kLdsm: 16-byte cp.async into a ring in shared memory (kStages blocks per
// warp, segments swizzled), then ldmatrix
constexpr int kWord = 0, kShfl = 1, kLdsm = 2, kStages = 4;

template <int NT, int NB, int LOAD>
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

  // ---- the warp's 16 rows: the first blocks of weight bytes are requested before anything else
  // (they depend on nothing, so also before the PDL wait) and refilled as they are used. A block's
  // words for the MMAs: cur[j] = word q of segment j of row g, cur[8 + j] the same of row g + 8
  const int tile = blockIdx.y * R + warp / G;  // output tile (16 output channels)
  const bool active = tile * 16 < a.N;
  const int row0 = tile * 16 + (warp % G) * a.N;  // w3's rows follow w1's
  const uint8_t* wt = a.w + (long long)row0 * a.stride_wn + k_lo;  // the tile's first row
  const uint8_t* w0 = wt + (long long)g * a.stride_wn + q * (LOAD == kWord ? 4 : 16);
  const uint8_t* w1 = w0 + 8 * a.stride_wn;
  constexpr int PF = NB < 4 ? NB : 4;  // kWord / kShfl: blocks in registers
  constexpr int S = NB < kStages ? NB : kStages;  // kLdsm: blocks in the ring
  uint32_t wr[LOAD == kLdsm ? 1 : PF][16];
  unsigned char* ring = smem + ((MG * XS * 2 + MG * NB * 4 + 15) / 16) * 16 + warp * kStages * 2048;
  auto fetch = [&](int b) {  // block b's requests (kLdsm: into stage b % S, one commit group)
    const int off = b * 128;
    if constexpr (LOAD == kWord) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        wr[b % PF][j] = ld_word(w0 + off + 16 * j);
        wr[b % PF][8 + j] = ld_word(w1 + off + 16 * j);
      }
    } else if constexpr (LOAD == kShfl) {  // row g chunk 0, row g + 8 chunk 0, row g chunk 1, row g + 8 chunk 1
      const uint4 u[4] = {ld_stream(w0 + off), ld_stream(w1 + off), ld_stream(w0 + off + 64), ld_stream(w1 + off + 64)};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        wr[b % PF][4 * i] = u[i].x; wr[b % PF][4 * i + 1] = u[i].y;
        wr[b % PF][4 * i + 2] = u[i].z; wr[b % PF][4 * i + 3] = u[i].w;
      }
    } else {
      unsigned char* st = ring + (b % S) * 2048;
#pragma unroll
      for (int it = 0; it < 4; ++it) {  // 8 lanes per 128-byte row: coalesced
        const int id = it * 32 + lane, r = id >> 3, sg = id & 7;
        cp_async16(st + r * 128 + ((sg ^ (r & 7)) << 4), wt + (long long)r * a.stride_wn + off + sg * 16);
      }
      cp_async_commit();
    }
  };
  auto words = [&](int b, uint32_t* cur) {  // block b's words, once its requests are in
    if constexpr (LOAD == kWord) {
#pragma unroll
      for (int i = 0; i < 16; ++i) cur[i] = wr[b % PF][i];
    } else if constexpr (LOAD == kShfl) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const uint32_t* r = wr[b % PF] + 8 * c;
        quad_transpose(make_uint4(r[0], r[1], r[2], r[3]), q, cur + 4 * c);
        quad_transpose(make_uint4(r[4], r[5], r[6], r[7]), q, cur + 8 + 4 * c);
      }
    } else {
      const unsigned char* st = ring + (b % S) * 2048;
      const int mi = lane >> 3, r = (lane & 7) + 8 * (mi & 1);  // this lane's row address
#pragma unroll
      for (int j = 0; j < 8; j += 2) {  // matrices: rows 0-7 / 8-15 of segments j and j + 1
        const int sg = j + (mi >> 1);
        ldsm_x4(st + r * 128 + ((sg ^ (r & 7)) << 4), cur[j], cur[8 + j], cur[j + 1], cur[9 + j]);
      }
    }
  };
  if (active) {
#pragma unroll
    for (int b = 0; b < (LOAD == kLdsm ? S - 1 : PF); ++b) {
      if (b < NB) fetch(b);
      else if constexpr (LOAD == kLdsm) cp_async_commit();  // an empty group keeps the count
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
      uint32_t cur[16];
      if constexpr (LOAD == kLdsm) {
        __syncwarp();  // every lane is done with stage (b - 1) % S, which block b + S - 1 refills
        if (b + S - 1 < NB) fetch(b + S - 1);
        else cp_async_commit();
        cp_async_wait<S - 1>();  // this lane's copies of block b are in
        __syncwarp();  // and every lane's
        words(b, cur);
      } else {
        words(b, cur);
        if (b + PF < NB) fetch(b + PF);
      }
      float blk[NT][4];  // the block's dot, from zero, as Triton's per-block tl.dot
#pragma unroll
      for (int t = 0; t < NT; ++t) blk[t][0] = blk[t][1] = blk[t][2] = blk[t][3] = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // MMA j: the block's columns [16j, 16j + 16)
        uint32_t a0, a2, a1, a3;
        e4m3x4_to_f16x2(cur[j], a0, a2);      // row g: columns 16j + 4q, +1 and +2, +3
        e4m3x4_to_f16x2(cur[8 + j], a1, a3);  // row g + 8
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const int m = 8 * t + g;  // B: x row m at the same four columns
          uint2 xb = make_uint2(0u, 0u);
          if (m < mv) xb = *reinterpret_cast<const uint2*>(xsh + m * XS + b * 128 + 16 * j + 4 * q);
          mma_f16(blk[t], a0, a1, a2, a3, xb.x, xb.y);
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
      y = __fmul_rn(__fdiv_rn(y, one_plus_expf(__fsub_rn(0.f, y))), u);  // Triton's _swiglu
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

#define LINEAR_SMALL_ENTRY(NT, NB, LOAD, NAME)                                                          \
  extern "C" __global__ void __launch_bounds__(256) linear_fp8_small_##NAME##_nt##NT##_nb##NB(           \
      const void* x, long long stride_xm, int x_f32, const uint8_t* xc, const float* xs,                 \
      long long stride_cm, long long stride_sm, int codes, const uint8_t* w, long long stride_wn,        \
      const uint8_t* ws, long long stride_wsn, void* out, long long stride_om, int out_bf16,             \
      const void* res, long long stride_rm, int res_mode, float* part, int* cnt, int M, int N, int K,    \
      int group_n, int quant, int gated, float limit, int pdl) {                                         \
    const Args a{x, stride_xm, x_f32, xc, xs, stride_cm, stride_sm, codes, w, stride_wn, ws, stride_wsn, \
                 out, stride_om, out_bf16, res, stride_rm, res_mode, part, cnt, M, N, K, group_n, quant, \
                 gated, limit, pdl};                                                                     \
    linear_small<NT, NB, LOAD>(a);                                                                       \
  }

#define LINEAR_SMALL_LOAD(NB, LOAD, NAME) LINEAR_SMALL_ENTRY(1, NB, LOAD, NAME) LINEAR_SMALL_ENTRY(2, NB, LOAD, NAME)
#define LINEAR_SMALL_NB(NB) LINEAR_SMALL_LOAD(NB, kWord, word) LINEAR_SMALL_LOAD(NB, kShfl, shfl) LINEAR_SMALL_LOAD(NB, kLdsm, ldsm)
LINEAR_SMALL_NB(1)
LINEAR_SMALL_NB(2)
LINEAR_SMALL_NB(4)
LINEAR_SMALL_NB(8)
