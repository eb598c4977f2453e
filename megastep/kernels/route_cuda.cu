// The MoE routing of a decode step after the gate GEMV, in one CUDA C++ launch: router.py's
// route_rows (sqrtsoftplus scores, bias top-k or hash rows, ids ascending, normalized weights),
// moe_route.group_pairs (the pairs grouped by expert) and moe_route.quant_row_perm (x quantized
// for the experts kernels). The same operations as those Triton functions, so the same results
// bit for bit; route_cuda.py launches it and says when.
//
// Why CUDA C++: the Triton routing tail is a chain of cross-warp reductions and L2 round trips in
// one program (~17 us of the router's 22 at 16 rows on one H200); here a warp routes a row with
// shuffles and redux.sync, every operand loaded up front. Measured against the Triton launches in
// docs/PERFORMANCE.md, thirteenth measurement (faster at 1-64 rows).
//
// Work: CTAs [0, R) route 8 rows each (warp per row; R = ceil(B / 8)); CTAs past R quantize x, a
// warp per 128-block. With grouping, the last routing CTA to arrive (an arrival counter, reset by
// it; none when R = 1) groups all B * k pairs, a thread per pair.

#include <cuda_bf16.h>
#include <stdint.h>

#include "cuda_common.cuh"

namespace {

#ifndef EXPERTS_PER_LANE
#error "build with -DEXPERTS_PER_LANE=<experts / 32> (route_cuda.py does, per expert count)"
#endif

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
// experts per lane, fixed at build time: every loop over a lane's experts unrolls with no bound
// checks (measured on one H200: the routing after the gate 7.2 -> 4.1 us at 1 row, route_probe.py)
constexpr int kEPL = EXPERTS_PER_LANE;
static_assert(kEPL >= 1 && kEPL <= 16, "1 to 16 experts per lane (32 to 512 experts)");
constexpr int kMaxPairs = kThreads;  // pairs the grouping takes (one thread each)

using megastep::fp8_act_sim4;
using megastep::pdl_release;
using megastep::pdl_wait;

// (value, expert) a beats b: the larger value, or equal values and the lower expert id
__device__ __forceinline__ bool beats(float va, int ea, float vb, int eb) { return va > vb || (va == vb && ea < eb); }

}  // namespace

// grid: R + ceil(B * D / 128 / 8) CTAs of 256 threads (R = ceil(B / 8); no quantization CTAs when
// xq is 0). Pointers that may be 0: bias (no bias); t2e (0: top-k routing; else hash routing, row
// b's experts are t2e[tokens[b]]); xq. group = 0 skips the grouping (which needs B * k <= 256).
extern "C" __global__ void __launch_bounds__(kThreads) route_group(
    const float* logits, long long stride_l, const float* bias, const long long* t2e, long long stride_t,
    const long long* tokens, int* idx, float* wts, float scaling, const __nv_bfloat16* x, long long stride_x,
    __nv_bfloat16* xq, long long stride_q, int* pairs, int* slot_e, int* slot_start, int* slot_cnt, int* nslot,
    int* counter, int B, int D, int k, int group, int perm) {
  __shared__ int ids[kMaxPairs];  // every row's experts, for the grouping
  __shared__ unsigned present[kEPL];
  __shared__ int is_last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int R = (B + kWarps - 1) / kWarps;
  pdl_wait();  // the logits and x are the previous kernels' outputs
  pdl_release();

  if (blockIdx.x >= R) {  // x quantized: a warp per 128-block, a lane 4 elements (the max is exact in any order)
    const int nb = D / 128, blk = (blockIdx.x - R) * kWarps + warp;
    if (blk >= B * nb) return;
    const int row = blk / nb, c = (blk % nb) * 128 + lane * 4;
    float q[4];
    fp8_act_sim4(*reinterpret_cast<const uint2*>(x + row * stride_x + c), q);
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // with perm each 32-group holds its 16 even elements, then the odd ones
      const int kk = c + i, kp = perm ? (kk / 32) * 32 + (kk % 2) * 16 + (kk % 32) / 2 : kk;
      xq[row * stride_q + kp] = __float2bfloat16_rn(q[i]);
    }
    return;
  }

  // routing, a warp per row (route_rows' operations, the same bits); lane l holds experts i * 32 + l
  const int b = blockIdx.x * kWarps + warp;
  if (b < B) {
    float lg[kEPL], bs[kEPL];
    int hv = 0;  // hash routing: this lane's given expert (lanes < k)
    if (t2e != nullptr && lane < k) hv = static_cast<int>(t2e[tokens[b] * stride_t + lane]);
#pragma unroll
    for (int i = 0; i < kEPL; ++i) {  // every load first: nothing in between to order them after
      lg[i] = logits[b * stride_l + i * 32 + lane];
      bs[i] = bias != nullptr ? bias[i * 32 + lane] : 0.f;
    }
    float s[kEPL];
#pragma unroll
    for (int i = 0; i < kEPL; ++i)  // torch's softplus (x > 20: x), then the sqrt
      s[i] = __fsqrt_rn(lg[i] > 20.f ? lg[i] : log1pf(expf(lg[i])));
    int my = 0;  // lane t < k: the row's t-th expert in ascending order
    if (t2e != nullptr) {  // the given experts sorted by counting ranks (ties in input order)
      int rank = 0;
      for (int q = 0; q < k; ++q) {
        const int vq = __shfl_sync(0xffffffffu, hv, q);
        rank += (vq < hv || (vq == hv && q < lane)) ? 1 : 0;
      }
      for (int q = 0; q < k; ++q) {
        const int vq = __shfl_sync(0xffffffffu, hv, q), rq = __shfl_sync(0xffffffffu, rank, q);
        if (rq == lane) my = vq;
      }
    } else {  // k rounds of argmax over the not yet chosen, the lowest id among equal maxima
      float key[kEPL];
#pragma unroll
      for (int i = 0; i < kEPL; ++i) key[i] = bias != nullptr ? __fadd_rn(s[i], bs[i]) : s[i];
      unsigned chosen = 0;  // bit i: expert i * 32 + lane
      for (int r = 0; r < k; ++r) {
        float bv = -INFINITY;
        int be = 0x7FFFFFFF;
#pragma unroll
        for (int i = 0; i < kEPL; ++i)
          if (!((chosen >> i) & 1u) && beats(key[i], i * 32 + lane, bv, be)) {
            bv = key[i];
            be = i * 32 + lane;
          }
        {  // the warp's best in two redux.sync: the largest key (its bits made unsigned-ordered, -0 as
           // +0 as float compares see it), then the lowest id among the lanes holding it
          uint32_t u = __float_as_uint(bv);
          u = u == 0x80000000u ? 0u : u;
          u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
          const uint32_t top = __reduce_max_sync(0xffffffffu, u);
          be = __reduce_min_sync(0xffffffffu, u == top ? be : 0x7FFFFFFF);
        }
        if ((be & 31) == lane) chosen |= 1u << (be >> 5);
      }
      __shared__ int order[kWarps][32];  // the chosen set in ascending order: each chosen expert
      int base = 0;                       // writes itself at its position
#pragma unroll
      for (int i = 0; i < kEPL; ++i) {
        const unsigned m = __ballot_sync(0xffffffffu, (chosen >> i) & 1u);
        if ((chosen >> i) & 1u) order[warp][base + __popc(m & ((1u << lane) - 1u))] = i * 32 + lane;
        base += __popc(m);
      }
      __syncwarp();
      if (lane < k) my = order[warp][lane];
    }
    // the weights: the chosen scores over their sum in ascending expert order, times the scaling
    float sv = 0.f;
#pragma unroll
    for (int i = 0; i < kEPL; ++i) {
      const float cand = __shfl_sync(0xffffffffu, s[i], my & 31);
      if ((my >> 5) == i) sv = cand;
    }
    float total = __shfl_sync(0xffffffffu, sv, 0);
    for (int t = 1; t < k; ++t) total = __fadd_rn(total, __shfl_sync(0xffffffffu, sv, t));
    if (lane < k) {
      idx[b * k + lane] = my;
      wts[b * k + lane] = __fmul_rn(__fdiv_rn(sv, total), scaling);
      if (group && R == 1) ids[b * k + lane] = my;
    }
  }
  if (!group) return;

  // grouping: only the last routing CTA (every row's experts visible to it), or the only one
  if (R > 1) {
    __threadfence();  // this CTA's ids are issued before its count
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == R - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (int p = threadIdx.x; p < B * k; p += kThreads) ids[p] = __ldcg(idx + p);  // past L1
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (and graph replay)
  }
  if (threadIdx.x < kEPL) present[threadIdx.x] = 0u;
  __syncthreads();
  // (moe_route.group_pairs) pair p's position in (expert, pair) order; for the first pair of each
  // expert its slot (id, first position, count); the slots are the present experts ascending
  const int P = B * k, p = threadIdx.x;
  int id = 0, rank = 0, dup_before = 0, count = 0;
  if (p < P) {
    id = ids[p];
    atomicOr(&present[id >> 5], 1u << (id & 31));
    for (int q = 0; q < P; ++q) {
      const int iq = ids[q];
      rank += (iq < id || (iq == id && q < p)) ? 1 : 0;
      dup_before += (iq == id && q < p) ? 1 : 0;
      count += iq == id ? 1 : 0;
    }
  }
  __syncthreads();
  if (p < P) {
    int slot = __popc(present[id >> 5] & ((1u << (id & 31)) - 1u));
    for (int w = 0; w < (id >> 5); ++w) slot += __popc(present[w]);
    pairs[rank] = p;
    if (dup_before == 0) {
      slot_e[slot] = id;
      slot_start[slot] = rank;
      slot_cnt[slot] = count;
    }
  }
  if (threadIdx.x == 0) {
    int n = 0;
    for (int w = 0; w < kEPL; ++w) n += __popc(present[w]);
    *nslot = n;
  }
}
