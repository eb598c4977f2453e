// FP8 block-scaled linear for decode, hand-written: y = fp8q(x, 128) @ dequant(w)^T for small M.
// Semantics, tiling, the reasons and the measurements: gemv_fp8_cuda.py beside this file.
//
// One warp owns a 16-row tile of w and one K range of the CTA; it streams the e4m3 bytes straight
// from HBM into the A operand of mma.m16n8k16 (fp16 in, fp32 accumulate), one 128-wide scale block
// at a time. The K order inside an MMA is free (a dot product), so a lane loads 16 contiguous
// weight bytes per row and 64-wide chunk and uses them as its fragment of four MMAs: no shared
// memory and no permutes for the weight; e4m3 -> fp16x2 is one instruction per two elements.
// The activation codes of the CTA's K range are made once per CTA (or copied from x_codes) into
// shared memory as fp16, in the same permuted order, and enter as the B operand (8 rows per
// n-tile). Per 128-block the warp's fp32 MMA sum is multiplied by activation scale x weight scale
// (powers of two: exact) and added to its accumulator, in block order. CTAs split K (gridDim.z);
// their fp32 partials are summed in split order 0..S-1 by the last CTA to arrive, which also runs
// the epilogue: output rounding, SwiGLU of the w1/w3 pair (gated), residual add.
//
// The wgmma form (kWg, entries gemv_fp8_wg_*; sm_90a): the same weight path, the same K order and the same
// per-block arithmetic, but each group of 4 warps (64 consecutive output channels) issues one
// wgmma.m64nNk16 per k16 step with its A fragments in registers and x (N = 8 NT rows) as the B operand
// read by the tensor cores from shared memory: no B fragment loads and one MMA instruction per k16 step
// whatever the rows, where mma.sync takes one per 8 rows. x is staged in the K-major layout with 128-byte
// swizzle that Triton 3.6's linear gives its own wgmma B operand (descriptor 0x4000004000000000 | addr >> 4:
// 8-row groups 1024 bytes apart, k16 steps 32 bytes apart, each 64-wide K half of a block its own tile).

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include <cooperative_groups.h>

#include "cuda_experiments.cuh"

namespace {

using experiments::ld_stream;
using experiments::round_bf16;
using megastep::add_block;
using megastep::cp_async16;
using megastep::cp_async_commit;
using megastep::e4m3x4_to_f16x2;
using megastep::e8m0_to_f32;
using megastep::fp8_pair;
using megastep::pow2_scale;
using megastep::splitk_sum;
using megastep::store_rows;

constexpr int kPad = 8;  // fp16 elements of padding per shared x row (spreads rows over banks)
constexpr int kMaxSplit = 32;  // CTAs along K at most (gemv_fp8_cuda.py's MAX_SPLIT)

// ---- wgmma (sm_90a): fences, the B descriptor, m64nNk16 with A in registers
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// keeps the compiler from moving a register's use across the wait above (its value is written asynchronously)
__device__ __forceinline__ void wg_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
// st.shared (generic proxy) before wgmma reads the same memory (async proxy)
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// 4 bytes global -> shared (the staged form's activation scales), and the wait for every copy issued
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src)
               : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
// K-major B operand, 128-byte swizzle, 8-row groups 1024 bytes apart (a shared address, 1024-aligned tile)
__device__ __forceinline__ uint64_t b_desc(uint32_t saddr) { return 0x4000004000000000ull | ((saddr & 0x3FFFFu) >> 4); }

// d (n8 tile t's four values at d[4t .. 4t+3], mma16816's order) (+)= A (the warp's 16 rows, 4 fp16x2
// registers in mma16816's A order) x B (k16 x N at desc); acc == 0: d = A x B
template <int N>
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t (&a)[4], uint64_t desc, int acc);

template <>
__device__ __forceinline__ void wgmma_rs<8>(float* d, const uint32_t (&a)[4], uint64_t desc, int acc) {
  asm volatile(
      "{.reg .pred p;\n\tsetp.ne.b32 p, %9, 0;\n\t"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
}

template <>
__device__ __forceinline__ void wgmma_rs<16>(float* d, const uint32_t (&a)[4], uint64_t desc, int acc) {
  asm volatile(
      "{.reg .pred p;\n\tsetp.ne.b32 p, %13, 0;\n\t"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0;}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
}

template <>
__device__ __forceinline__ void wgmma_rs<32>(float* d, const uint32_t (&a)[4], uint64_t desc, int acc) {
  asm volatile(
      "{.reg .pred p;\n\tsetp.ne.b32 p, %21, 0;\n\t"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
      "}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
}

template <>
__device__ __forceinline__ void wgmma_rs<64>(float* d, const uint32_t (&a)[4], uint64_t desc, int acc) {
  asm volatile(
      "{.reg .pred p;\n\tsetp.ne.b32 p, %37, 0;\n\t"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(acc));
}

struct Args {
  const void* x; long long stride_xm; int x_f32;          // bf16 or fp32 activation [M, K]
  const uint8_t* xc; const float* xs;                      // or its e4m3 codes and scales (x_codes)
  long long stride_cm, stride_sm; int codes;
  const uint8_t* w; long long stride_wn;                   // e4m3 [N (x2 gated), K]
  const uint8_t* ws; long long stride_wsn;                 // e8m0 [N/128, K/128]
  void* out; long long stride_om; int out_bf16;            // [M, N]
  const void* res; long long stride_rm; int res_mode;      // 0 none, 1 fp32, 2 bf16
  float* part; int* cnt;                                   // split-K partials and arrival counters
  int M, N, gated; float limit;
};

// NT: n-tiles of 8 rows of x per CTA (MG = 8 NT rows); NB: 128-blocks of K per CTA (Kc = 128 NB).
// kWg: the wgmma form (its warps in groups of 4 over 64 consecutive channels; gated: 8 warps, w1's then w3's).
// kCp (with kWg): the CTA's x slice (or its codes and scales) copied to shared memory by cp.async in one
// round trip, beside the weight's first loads, before any conversion (the staged form).
// kS > 1: the kS K splits are one thread-block cluster (the entry's __cluster_dims__(1, 1, kS)); the splits'
// partials are summed from each other's shared memory (DSMEM) in split order, each CTA of the cluster taking
// every kS-th output, instead of through global memory by the last CTA to arrive: the same sums, the same bits.
template <int NT, int NB, bool kWg = false, bool kCp = false, int kS = 1>
__device__ __forceinline__ void gemv_fp8(const Args& a) {
  constexpr int MG = 8 * NT, KC = 128 * NB, XS = KC + kPad;
  constexpr int kHalf = MG * 128;  // kWg: a 64-wide K half of a block's x tile, bytes (a multiple of 1024)
  extern __shared__ __align__(16) unsigned char smem[];
  __half* xsh = reinterpret_cast<__half*>(smem);                        // [MG][XS] fp16 codes
  // kWg: the tiles [NB][2 halves][MG rows][128 bytes, swizzled] from the first 1024-aligned byte
  unsigned char* xw = kWg ? smem + ((1024u - static_cast<uint32_t>(__cvta_generic_to_shared(smem))) & 1023u) : smem;
  float* scsh = reinterpret_cast<float*>(kWg ? xw + NB * 2 * kHalf : smem + MG * XS * sizeof(__half));  // [MG][NB]
  float* red = reinterpret_cast<float*>(smem);                          // [warps * 16][MG], reused
  // kCp: the raw x slice [MG][KC] (bf16, fp32 or e4m3 codes), after the scales (16-byte aligned)
  unsigned char* stg = reinterpret_cast<unsigned char*>(scsh + MG * NB);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int G = a.gated ? 2 : 1, R = nwarps / G;  // R row tiles (w1/w3 pairs when gated) per CTA
  const int m0 = blockIdx.x * MG, mv = min(MG, a.M - m0);
  const int k_lo = blockIdx.z * KC;

  // ---- the warp's 16 rows: the first PF blocks of weight bytes are requested before anything else
  // (they depend on nothing), PF x 64 bytes per lane, refilled as they are used
  // The mma form pairs w1's and w3's tiles on neighbouring warps; the wgmma form needs 4 warps on 64 consecutive
  // rows, so gated it takes 8 warps: w1's 4 tiles on warps 0-3, the same 4 tiles of w3 on warps 4-7.
  const bool wg_gated = kWg && a.gated;
  const int tile = blockIdx.y * R + (wg_gated ? warp % 4 : warp / G);  // output tile (16 output channels)
  const bool active = tile * 16 < a.N;
  const int row0 = tile * 16 + (wg_gated ? warp / 4 : warp % G) * a.N;  // w3's rows follow w1's
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

  // ---- the CTA's activation codes: fp16 in shared memory, scales beside them
  if (kWg && mv < MG) {  // rows past M enter the MMAs: zeros (their sums are dropped)
    for (int i = threadIdx.x; i < NB * 2 * kHalf / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(xw)[i] = make_uint4(0u, 0u, 0u, 0u);
    __syncthreads();
  }
  const int eb = a.codes ? 1 : (a.x_f32 ? 4 : 2);  // bytes of an x element as given
  if constexpr (kCp) {  // every thread's copies issued, then one wait: a single round trip for the slice
    const int chunks = KC * eb / 16;  // 16-byte copies per row
    for (int i = threadIdx.x; i < mv * chunks; i += blockDim.x) {
      const int m = i / chunks, c = i % chunks;
      const unsigned char* src =
          a.codes ? a.xc + (m0 + m) * a.stride_cm + k_lo
                  : static_cast<const unsigned char*>(a.x) + ((m0 + m) * a.stride_xm + k_lo) * eb;
      cp_async16(stg + m * KC * eb + c * 16, src + c * 16);
    }
    if (a.codes)  // the scales straight to where the blocks' sums read them
      for (int i = threadIdx.x; i < mv * NB; i += blockDim.x)
        cp_async4(scsh + i, a.xs + (m0 + i / NB) * a.stride_sm + k_lo / 128 + i % NB);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
  }
  // kU of a warp's x tasks at a time: their loads first, in flight together, then their codes (one task at a
  // time made a warp wait for each load in turn: 32 tasks a warp at 16 rows)
  constexpr int kU = 4;
  const int tasks = mv * NB;
  for (int i0 = warp; i0 < tasks; i0 += nwarps * kU) {
    float v[kU][4], cs[kU];
    uint32_t cw[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = i0 + u * nwarps;
      if (i >= tasks) break;
      const int m = i / NB, kc = (i % NB) * 128 + lane * 4, k = k_lo + kc;
      // x's element (m, k) as given: in the staged slice (kCp) or in global memory
      const unsigned char* src =
          kCp ? stg + (m * KC + kc) * eb
              : (a.codes ? a.xc + (m0 + m) * a.stride_cm + k
                         : static_cast<const unsigned char*>(a.x) + ((m0 + m) * a.stride_xm + k) * eb);
      if (a.codes) {
        cw[u] = *reinterpret_cast<const uint32_t*>(src);
        cs[u] = lane == 0 && !kCp ? a.xs[(m0 + m) * a.stride_sm + k / 128] : 0.f;
      } else if (a.x_f32) {
        const float4 f = *reinterpret_cast<const float4*>(src);
        v[u][0] = f.x; v[u][1] = f.y; v[u][2] = f.z; v[u][3] = f.w;
      } else {
        const uint2 w = *reinterpret_cast<const uint2*>(src);
        v[u][0] = __uint_as_float(w.x << 16); v[u][1] = __uint_as_float(w.x & 0xFFFF0000u);
        v[u][2] = __uint_as_float(w.y << 16); v[u][3] = __uint_as_float(w.y & 0xFFFF0000u);
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = i0 + u * nwarps;
      if (i >= tasks) break;
      const int m = i / NB, b = i % NB;
      uint32_t lo, hi;
      if (a.codes) {
        e4m3x4_to_f16x2(cw[u], lo, hi);
        if (lane == 0 && !kCp) scsh[m * NB + b] = cs[u];  // kCp: copied there already
      } else {
        float amax = fmaxf(fmaxf(fabsf(v[u][0]), fabsf(v[u][1])), fmaxf(fabsf(v[u][2]), fabsf(v[u][3])));
#pragma unroll
        for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
        float s, inv;
        pow2_scale(amax, s, inv);
        lo = fp8_pair(v[u][0] * inv, v[u][1] * inv);
        hi = fp8_pair(v[u][2] * inv, v[u][3] * inv);
        if (lane == 0) scsh[m * NB + b] = s;
      }
      if constexpr (kWg) {
        // block positions p .. p+3 (p = 4 lane) feed MMA mm = 4c + j (c = p / 64, j = p % 16 / 4) in its k slots
        // 2q, 2q+1 (lo) and 2q+8, 2q+9 (hi), q = p % 64 / 16: where the lanes of the weight hold them (below)
        const int p = lane * 4, c = p >> 6, q4 = (p & 63) >> 4, j = (p & 15) >> 2;
        unsigned char* row = xw + (b * 2 + c) * kHalf + (m >> 3) * 1024 + (m & 7) * 128;
        const int k0 = j * 16 + 2 * q4, k1 = k0 + 8;  // k within the half
        *reinterpret_cast<uint32_t*>(row + ((((k0 >> 3) ^ (m & 7)) << 4) | ((k0 & 7) << 1))) = lo;
        *reinterpret_cast<uint32_t*>(row + ((((k1 >> 3) ^ (m & 7)) << 4) | ((k1 & 7) << 1))) = hi;
      } else {
        *reinterpret_cast<uint2*>(xsh + m * XS + b * 128 + lane * 4) = make_uint2(lo, hi);
      }
    }
  }
  if (kWg) fence_async_shared();
  __syncthreads();

  // ---- the warp's 16 rows over the CTA's K range
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
      float blk[NT][4];
#pragma unroll
      for (int t = 0; t < NT; ++t) blk[t][0] = blk[t][1] = blk[t][2] = blk[t][3] = 0.f;
      if constexpr (kWg) {
        uint32_t af[8][4];  // MMA mm = 4c + j: row g's and row g + 8's k pairs, as mma16816 below takes them
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const uint4 r0 = cur[2 * c], r1 = cur[2 * c + 1];
          const uint32_t w0w[4] = {r0.x, r0.y, r0.z, r0.w}, w1w[4] = {r1.x, r1.y, r1.z, r1.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            e4m3x4_to_f16x2(w0w[j], af[4 * c + j][0], af[4 * c + j][2]);
            e4m3x4_to_f16x2(w1w[j], af[4 * c + j][1], af[4 * c + j][3]);
          }
        }
        const uint32_t tile0 = static_cast<uint32_t>(__cvta_generic_to_shared(xw)) + b * 2 * kHalf;
        float* d = &blk[0][0];
        wg_fence();
#pragma unroll
        for (int mm = 0; mm < 8; ++mm) wgmma_rs<MG>(d, af[mm], b_desc(tile0 + (mm >> 2) * kHalf + (mm & 3) * 32), mm);
        wg_commit();
        wg_wait_all();
#pragma unroll
        for (int i = 0; i < 4 * NT; ++i) wg_operand(d[i]);
      } else {
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
          for (int j = 0; j < 4; ++j) {
            uint32_t a0, a2, a1, a3;
            e4m3x4_to_f16x2(w0w[j], a0, a2);  // row g: k pairs (2q, 2q+1) and (2q+8, 2q+9)
            e4m3x4_to_f16x2(w1w[j], a1, a3);  // row g + 8
#pragma unroll
            for (int t = 0; t < NT; ++t)
              experiments::mma16816<false>(blk[t], a0, a1, a2, a3, xa[t][2 * j], xa[t][2 * j + 1]);
          }
        }
      }
      add_block<NT>(acc, blk, scsh + b, NB, e8m0_to_f32(wsr[b]), mv, q);
    }
  }
  __syncthreads();  // the x codes are dead: `red` reuses their memory
  store_rows<NT>(red + warp * 16 * MG, acc, g, q, MG);
  __syncthreads();

  namespace cg = cooperative_groups;
  if constexpr (kS > 1) {
    cg::this_cluster().sync();  // every split's partials are in its CTA's red
  } else if (!splitk_sum<kMaxSplit>(red, a.part, a.cnt, nwarps * 16, MG, mv)) {
    return;  // the last split to arrive goes on
  }
  // element idx of red summed over the splits in split order 0..kS-1 (splitk_sum's order); the loads go out first
  auto summed = [&](int idx) -> float {
    if constexpr (kS > 1) {
      cg::cluster_group cluster = cg::this_cluster();
      float v[kS];
#pragma unroll
      for (int r = 0; r < kS; ++r) v[r] = *cluster.map_shared_rank(red + idx, r);
      float sum = v[0];
#pragma unroll
      for (int r = 1; r < kS; ++r) sum += v[r];
      return sum;
    } else {
      return red[idx];
    }
  };
  const int e_first = kS > 1 ? int(cg::this_cluster().block_rank()) * blockDim.x + threadIdx.x : threadIdx.x;

  // ---- epilogue: one output element per thread and step, channels fastest (coalesced stores)
  const int rows = R * 16;
  for (int e = e_first; e < rows * MG; e += blockDim.x * kS) {
    const int m = e / rows, r = e % rows, n = blockIdx.y * rows + r;
    if (m >= mv || n >= a.N) continue;
    const int pair = r / 16, rr = r % 16;
    const int yw = wg_gated ? pair : pair * G, uw = wg_gated ? pair + 4 : pair * G + 1;  // the warps of w1, w3
    float y = summed((yw * 16 + rr) * MG + m);
    if (a.out_bf16) y = round_bf16(y);
    if (a.gated) {
      float u = summed((uw * 16 + rr) * MG + m);
      if (a.out_bf16) u = round_bf16(u);
      if (a.limit > 0.f) {
        y = fminf(y, a.limit);
        u = fminf(fmaxf(u, -a.limit), a.limit);
      }
      y = __fmul_rn(__fdiv_rn(y, __fadd_rn(1.f, expf(-y))), u);  // torch's fp32 silu, times u
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
  if constexpr (kS > 1) cg::this_cluster().sync();  // no CTA leaves while the others read its partials
}

}  // namespace

// FORM: empty (the mma form), wg_ (the wgmma form, WG true) or wgc_ (its staged form, WG and CP true), then
// clS_ for the entries whose S K splits are one cluster (ATTR: their __cluster_dims__)
#define GEMV_FP8_ENTRY(FORM, WG, CP, S, ATTR, NT, NB)                                                     \
  extern "C" __global__ void ATTR __launch_bounds__(256) gemv_fp8_##FORM##nt##NT##_nb##NB(               \
      const void* x, long long stride_xm, int x_f32, const uint8_t* xc, const float* xs,                 \
      long long stride_cm, long long stride_sm, int codes, const uint8_t* w, long long stride_wn,        \
      const uint8_t* ws, long long stride_wsn, void* out, long long stride_om, int out_bf16,             \
      const void* res, long long stride_rm, int res_mode, float* part, int* cnt, int M, int N, int gated, \
      float limit) {                                                                                     \
    const Args a{x, stride_xm, x_f32, xc, xs, stride_cm, stride_sm, codes, w, stride_wn, ws, stride_wsn, \
                 out, stride_om, out_bf16, res, stride_rm, res_mode, part, cnt, M, N, gated, limit};      \
    gemv_fp8<NT, NB, WG, CP, S>(a);                                                                      \
  }

#define GEMV_FP8_FORM(FORM, WG, CP, S, ATTR, NB)                                                          \
  GEMV_FP8_ENTRY(FORM, WG, CP, S, ATTR, 1, NB) GEMV_FP8_ENTRY(FORM, WG, CP, S, ATTR, 2, NB)                \
  GEMV_FP8_ENTRY(FORM, WG, CP, S, ATTR, 4, NB) GEMV_FP8_ENTRY(FORM, WG, CP, S, ATTR, 8, NB)
#define GEMV_FP8_NB(NB)                                                                    \
  GEMV_FP8_FORM(, false, false, 1, , NB) GEMV_FP8_FORM(wg_, true, false, 1, , NB) \
  GEMV_FP8_FORM(wgc_, true, true, 1, , NB)
GEMV_FP8_NB(1)
GEMV_FP8_NB(2)
GEMV_FP8_NB(4)
GEMV_FP8_NB(8)
// the cluster combine at the V4-Flash shapes' splits of 4 (shared w1/w3 and w2) and 8 (wo_b)
#define GEMV_FP8_CL(S, NB)                                                       \
  GEMV_FP8_FORM(cl##S##_, false, false, S, __cluster_dims__(1, 1, S), NB) \
  GEMV_FP8_FORM(wgc_cl##S##_, true, true, S, __cluster_dims__(1, 1, S), NB)
GEMV_FP8_CL(4, 4)
GEMV_FP8_CL(4, 8)
GEMV_FP8_CL(8, 8)
