// An experiment (benchmarks/kernels/moe_gate_up_cuda.py says why and how it is measured): the
// gate-up launch of the MXFP4 experts in CUDA C++, a drop-in for kernels/moe.py's
// _moe_gate_up_kernel (the same inputs and output: act[pair, i] = rnd(r * swiglu(rnd(w1 . x),
// rnd(w3 . x)))).
//
// A warp owns 8 channels of I: the MMA's rows 0-7 are their w1 rows, rows 8-15 the same channels'
// w3 rows, so a lane ends with w1's and w3's sums of the same (channel, pair) and the SwiGLU
// needs no exchange. Per K step each lane loads 16 bytes of its w1 row and 16 of its w3 row: one
// MXFP4 group each (lane q of a quad takes group 4 * step + q), decodes them with their group
// scale folded in (the PTX of moe.py's "dot_asm" decode: exact bf16 values), and feeds them
// straight to mma.m16n8k16 as A fragments. The K order inside an MMA is free; the one used here
// (a 2-byte unit j of the group gives elements 4j, 4j+2 and 4j+1, 4j+3) is exactly the order in
// which moe_route's permuted x (a group's 16 even elements, then its 16 odd ones) stores them, so
// the B fragments are plain 4-byte words of x. Columns are 8 pairs of the slot's expert at a
// time. Each (channel, pair) sum runs over K in one fixed order whatever the batch: the same
// bits alone or in a batch.
// Untested on a GPU when written (2026-11-29): benchmarks/kernels/moe_cuda_variants.py checks it.

#include <cuda_bf16.h>
#include <stdint.h>

#include "cuda_experiments.cuh"

namespace {

using experiments::ld_stream;
using experiments::round_bf16;

constexpr int kPrefetch = 4;  // K steps of weight bytes in flight per lane

__device__ __forceinline__ uint4 ld_shared_x(const void* p) {  // x: read by every warp, keep in L1
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Two packed bytes of `w` (bytes 0-1 for SEL 0x1404, bytes 2-3 for 0x3424) and their group's scale
// as a bf16x2 pattern 2^(s-127) -> the low nibbles (lo) and the high nibbles (hi) as exact bf16x2.
// The operations of moe.py's _DECODE_ASM (measured bit-identical to the Triton decode on an H200).
template <int SEL>
__device__ __forceinline__ void decode2(uint32_t w, uint32_t f, uint32_t& lo, uint32_t& hi) {
  // the constants as register operands: materialized once per kernel, not once per call
  const uint32_t m = 0x81C081C0u, c = 0x7E807E80u, z = 0x80008000u, hi_nib = 0xF000F000u, zero = 0u;
  asm("{\n\t.reg .b32 u, t, v;\n\t"
      "prmt.b32 u, %2, %8, %4;\n\t"
      "shl.b32 t, u, 4;\n\tshr.b32 v, u, 2;\n\tlop3.b32 t, t, v, %5, 0xA8;\n\t"
      "fma.rn.bf16x2 t, t, %6, %7;\n\tfma.rn.bf16x2 %0, t, %3, %7;\n\t"
      "and.b32 t, u, %9;\n\tshr.b32 v, t, 6;\n\tlop3.b32 t, t, v, %5, 0xA8;\n\t"
      "fma.rn.bf16x2 t, t, %6, %7;\n\tfma.rn.bf16x2 %1, t, %3, %7;\n\t}"
      : "=r"(lo), "=r"(hi) : "r"(w), "r"(f), "n"(SEL), "r"(m), "r"(c), "r"(z), "r"(zero), "r"(hi_nib));
}

__device__ __forceinline__ uint32_t scale_pattern(uint32_t s) { return (s << 7) * 0x10001u; }  // bf16 2^(s-127) x2

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

}  // namespace

// The K steps of a program's work items (slot s = group, group + G, ...; its pairs 8 at a time)
// form one sequence; a prefetch cursor runs kPrefetch steps ahead of the compute cursor through
// it, so the weight stream does not drain and refill at each expert (Triton pipelines only the
// innermost loop: each slot's K loop starts its pipeline anew).
struct Cursor {
  int s, c0, k, cnt, start;
  const uint8_t *w1, *w3, *s1, *s3;
};

struct Work {
  const long long* tab;
  const int *slot_e, *slot_start, *slot_cnt;
  int n_slots, G, I, steps, sparse, ch, lane_off, scale_off;
  long long stride_w, stride_s;

  // point c at slot c.s, or the next slot with pairs here; c.s >= n_slots: the sequence is done
  __device__ void enter(Cursor& c) const {
    for (; c.s < n_slots; c.s += G) {
      const int e = slot_e[c.s];
      const uint8_t* w13 = reinterpret_cast<const uint8_t*>(tab[4LL * e]);
      c.cnt = sparse && w13 == nullptr ? 0 : slot_cnt[c.s];  // held by another rank: nothing here
      if (c.cnt == 0) continue;
      const uint8_t* s13 = reinterpret_cast<const uint8_t*>(tab[4LL * e + 1]);
      c.start = slot_start[c.s];
      c.w1 = w13 + (long long)ch * stride_w + lane_off;
      c.w3 = c.w1 + (long long)I * stride_w;
      c.s1 = s13 + (long long)ch * stride_s + scale_off;
      c.s3 = c.s1 + (long long)I * stride_s;
      return;
    }
  }
  __device__ void advance(Cursor& c) const {
    if (++c.k < steps) return;
    c.k = 0;
    c.c0 += 8;
    if (c.c0 < c.cnt) return;
    c.c0 = 0;
    c.s += G;
    enter(c);
  }
};

// grid (I / (8 * warps), G slot groups), block 32 * warps. xq: bf16 [M, D] permuted per 32-group;
// tab: int64 [E, 4] (w13, w13_scale, w2, w2_scale) addresses; act: [P, I] bf16.
extern "C" __global__ void __launch_bounds__(256) moe_gate_up_cuda(
    const __nv_bfloat16* xq, long long stride_q, const long long* tab, const float* rw, const int* pair_ptr,
    const int* slot_e, const int* slot_start, const int* slot_cnt, const int* nslot, __nv_bfloat16* act,
    long long stride_a, int D, int I, long long stride_w, long long stride_s, float limit, int round_out, int topk,
    int sparse) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int ch0 = (blockIdx.x * (blockDim.x >> 5) + warp) * 8;  // this warp's first channel of I
  if (ch0 >= I) return;  // no barrier below
  const Work wk{tab, slot_e, slot_start, slot_cnt, *nslot, (int)gridDim.y, I, D / 128, sparse, ch0 + g, q * 16, q,
                stride_w, stride_s};
  Cursor cur{(int)blockIdx.y, 0, 0, 0, 0, nullptr, nullptr, nullptr, nullptr};
  wk.enter(cur);
  Cursor pf = cur;
  uint4 r1[kPrefetch], r3[kPrefetch];
  uint32_t f1[kPrefetch], f3[kPrefetch];
#pragma unroll
  for (int i = 0; i < kPrefetch; ++i) {
    if (pf.s < wk.n_slots) {
      r1[i] = ld_stream(pf.w1 + pf.k * 64);
      r3[i] = ld_stream(pf.w3 + pf.k * 64);
      f1[i] = scale_pattern(pf.s1[pf.k * 4]);
      f3[i] = scale_pattern(pf.s3[pf.k * 4]);
      wk.advance(pf);
    }
  }
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int np = 0, pb = -1;
  while (cur.s < wk.n_slots) {
#pragma unroll
    for (int i = 0; i < kPrefetch; ++i) {  // ring slot i holds step number t with t % kPrefetch == i
      if (cur.s >= wk.n_slots) break;
      const uint4 a1 = r1[i], a3 = r3[i];
      const uint32_t g1 = f1[i], g3 = f3[i];
      if (pf.s < wk.n_slots) {  // refill the slot: the step kPrefetch ahead
        r1[i] = ld_stream(pf.w1 + pf.k * 64);
        r3[i] = ld_stream(pf.w3 + pf.k * 64);
        f1[i] = scale_pattern(pf.s1[pf.k * 4]);
        f3[i] = scale_pattern(pf.s3[pf.k * 4]);
        wk.advance(pf);
      }
      if (cur.k == 0) {  // a new chunk: this lane's B column is its pair c0 + g
        np = min(8, cur.cnt - cur.c0);
        pb = g < np ? pair_ptr[cur.start + cur.c0 + g] : -1;
      }
      // x of pair c0 + g over this lane's group: its 16 even elements, then its 16 odd ones
      uint4 x0 = make_uint4(0, 0, 0, 0), x1 = x0, x2 = x0, x3 = x0;
      if (pb >= 0) {
        const __nv_bfloat16* xp = xq + (long long)(pb / topk) * stride_q + cur.k * 128 + q * 32;
        x0 = ld_shared_x(xp);
        x1 = ld_shared_x(xp + 8);
        x2 = ld_shared_x(xp + 16);
        x3 = ld_shared_x(xp + 24);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // 2-byte unit j of the group: elements 4j, 4j+2 | 4j+1, 4j+3
        uint32_t lo1, hi1, lo3, hi3;
        const uint32_t w1w = word(a1, j >> 1), w3w = word(a3, j >> 1);
        if (j & 1) {
          decode2<0x3424>(w1w, g1, lo1, hi1);
          decode2<0x3424>(w3w, g3, lo3, hi3);
        } else {
          decode2<0x1404>(w1w, g1, lo1, hi1);
          decode2<0x1404>(w3w, g3, lo3, hi3);
        }
        const uint32_t b0 = j < 4 ? word(x0, j) : word(x1, j - 4);  // even elements 4j, 4j+2
        const uint32_t b1 = j < 4 ? word(x2, j) : word(x3, j - 4);  // odd elements 4j+1, 4j+3
        experiments::mma<true>(acc, lo1, lo3, hi1, hi3, b0, b1);
      }
      if (cur.k == wk.steps - 1) {
        // acc: (w1 of channel ch0+g, pair 2q), (w1, pair 2q+1), (w3, pair 2q), (w3, pair 2q+1)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = 2 * q + c;
          if (col < np) {
            const int p = pair_ptr[cur.start + cur.c0 + col];
            float gv = acc[c], uv = acc[2 + c];
            if (round_out) {
              gv = round_bf16(gv);
              uv = round_bf16(uv);
            }
            gv = fminf(gv, limit);
            uv = fminf(fmaxf(uv, -limit), limit);
            float a = __fmul_rn(__fdiv_rn(gv, __fadd_rn(1.f, expf(-gv))), uv);
            a = __fmul_rn(a, rw[p]);
            act[(long long)p * stride_a + ch0 + g] = __float2bfloat16_rn(a);
          }
        }
        acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
      }
      wk.advance(cur);
    }
  }
}
