// The MoE routing of a decode step after the gate GEMV, in one CUDA C++ launch: router.py's
// route_rows (sqrtsoftplus scores, bias top-k or hash rows, ids ascending, normalized weights),
// moe_route.group_pairs (the pairs grouped by expert) and moe_route.quant_row_perm (x quantized
// for the experts kernels). The same operations as those Triton functions, so the same results
// bit for bit; route_cuda.py launches it and says when. gate_route_group (at the end) takes the
// gate GEMV into the same launch for a few rows.
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
using megastep::mma16816;
using megastep::pdl_release;
using megastep::pdl_wait;

// (value, expert) a beats b: the larger value, or equal values and the lower expert id
__device__ __forceinline__ bool beats(float va, int ea, float vb, int eb) { return va > vb || (va == vb && ea < eb); }

// x quantized for the experts kernels (moe_route.quant_row_perm): 128-block blk of B * D / 128, a
// warp each, a lane 4 elements (the max is exact in any order)
__device__ __forceinline__ void quant_block(int blk, int lane, const __nv_bfloat16* x, long long stride_x,
                                            __nv_bfloat16* xq, long long stride_q, int D, int perm) {
  const int nb = D / 128;
  const int row = blk / nb, c = (blk % nb) * 128 + lane * 4;
  float q[4];
  fp8_act_sim4(*reinterpret_cast<const uint2*>(x + row * stride_x + c), q);
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // with perm each 32-group holds its 16 even elements, then the odd ones
    const int kk = c + i, kp = perm ? (kk / 32) * 32 + (kk % 2) * 16 + (kk % 32) / 2 : kk;
    xq[row * stride_q + kp] = __float2bfloat16_rn(q[i]);
  }
}

// Row b's routing by one warp (route_rows' operations, the same bits) from its E logits at lg (global
// or shared memory); lane l holds experts i * 32 + l. Writes idx and wts of the row; returns lane t's
// t-th expert in ascending order (lanes < k; the others 0). order: this warp's scratch row.
__device__ __forceinline__ int route_row(const float* lg_row, const float* bias, const long long* t2e,
                                         long long stride_t, const long long* tokens, int b, int* idx, float* wts,
                                         float scaling, int k, int lane, int (&order)[32]) {
  float lg[kEPL], bs[kEPL];
  int hv = 0;  // hash routing: this lane's given expert (lanes < k)
  if (t2e != nullptr && lane < k) hv = static_cast<int>(t2e[tokens[b] * stride_t + lane]);
#pragma unroll
  for (int i = 0; i < kEPL; ++i) {  // every load first: nothing in between to order them after
    lg[i] = lg_row[i * 32 + lane];
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
    int base = 0;  // the chosen set in ascending order: each chosen expert writes itself at its position
#pragma unroll
    for (int i = 0; i < kEPL; ++i) {
      const unsigned m = __ballot_sync(0xffffffffu, (chosen >> i) & 1u);
      if ((chosen >> i) & 1u) order[base + __popc(m & ((1u << lane) - 1u))] = i * 32 + lane;
      base += __popc(m);
    }
    __syncwarp();
    if (lane < k) my = order[lane];
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
  }
  return my;
}

// (moe_route.group_pairs) the P = B * k pairs of ids (shared memory, every row's experts) grouped by
// expert, by the whole CTA (P <= kThreads): pair p's position in (expert, pair) order; for the first
// pair of each expert its slot (id, first position, count); the slots are the present experts ascending
__device__ __forceinline__ void group_pairs(const int* ids, unsigned* present, int P, int* pairs, int* slot_e,
                                            int* slot_start, int* slot_cnt, int* nslot) {
  if (threadIdx.x < kEPL) present[threadIdx.x] = 0u;
  __syncthreads();
  const int p = threadIdx.x;
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

// Whether this CTA is the last of n to arrive at counter, for every thread of it (flag: a shared int);
// each CTA's earlier writes are issued before its count, and the last one fences before it reads
// them. The caller resets the counter once it has read what the others wrote.
__device__ __forceinline__ bool last_to_arrive(int* counter, int n, int& flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) flag = atomicAdd(counter, 1) == n - 1;
  __syncthreads();
  if (flag) __threadfence();
  return flag;
}

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
  __shared__ int order[kWarps][32];
  __shared__ int is_last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int R = (B + kWarps - 1) / kWarps;
  pdl_wait();  // the logits and x are the previous kernels' outputs
  pdl_release();

  if (blockIdx.x >= R) {
    const int blk = (blockIdx.x - R) * kWarps + warp;
    if (blk < B * (D / 128)) quant_block(blk, lane, x, stride_x, xq, stride_q, D, perm);
    return;
  }
  const int b = blockIdx.x * kWarps + warp;  // routing, a warp per row
  if (b < B) {
    const int my = route_row(logits + b * stride_l, bias, t2e, stride_t, tokens, b, idx, wts, scaling, k, lane,
                             order[warp]);
    if (group && R == 1 && lane < k) ids[b * k + lane] = my;
  }
  if (!group) return;

  // grouping: only the last routing CTA (every row's experts visible to it), or the only one
  if (R > 1) {
    if (!last_to_arrive(counter, R, is_last)) return;  // (this CTA's ids written before its count)
    for (int p = threadIdx.x; p < B * k; p += kThreads) ids[p] = __ldcg(idx + p);  // past L1
    if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (and graph replay)
  }
  group_pairs(ids, present, B * k, pairs, slot_e, slot_start, slot_cnt, nslot);
}

// The gate GEMV, the routing, the grouping and x's quantization in one launch, for B <= 8 rows
// (route_cuda.py's FUSED_GATE_ROWS): logits = x @ gate^T with dense.linear_bf16's sums for the gate's
// configuration (128 columns per split, route_cuda.py checks it), then route_group's operations on
// them. Why: at one row the gate GEMV (2 MB) and the routing are two latency-bound launches, 5.2 and
// 4.3 us after their inputs in the 1-row timeline (docs/PERFORMANCE.md, 2026-12-04 late night), with
// HBM idle before the experts. Here each warp's weights are loaded before griddepcontrol.wait (they
// never depend on the predecessor), the logits never leave the last CTA, and one launch waits.
//
// Work: G = (E / 16) * S / 8 gate CTAs (S = D / 128 splits): warp task t = blockIdx * 8 + warp takes
// the 16 experts of tile t / S and split t % S, one m16n8k16 MMA chain over the split's 8 k16 steps
// in ascending order from zero, in the standard fragment layout (lane (g, q): rows g and g + 8, the
// columns 2q, 2q+1, 2q+8, 2q+9 of each step), x's rows as the MMA's 8 columns. That is what Triton
// 3.6 compiles dense.bf16_tile's dot to for (BLOCK_N 32, BLOCK_M 16, BLOCK_K 128) with 4 warps (mma.sync
// m16n8k16 bf16, warps 2 x 2 over the 32 x 16 tile, each warp's 16 x 8 over 8 ascending k16 steps,
// read from its PTX), so each split's partial has its bits; the partials go to `part` [S][E][8]. The
// last gate CTA to arrive sums each logit's splits in order as bf16_tile's combine does (GROUP 4:
// past the last split the masked loads add +0.0), into shared memory, routes the rows (a warp each) and
// groups the pairs. CTAs G.. quantize x. Pointers that may be 0: bias, t2e (as route_group's).
extern "C" __global__ void __launch_bounds__(kThreads) gate_route_group(
    const __nv_bfloat16* x, long long stride_x, const __nv_bfloat16* gate, long long stride_g, float* part,
    const float* bias, const long long* t2e, long long stride_t, const long long* tokens, int* idx, float* wts,
    float scaling, __nv_bfloat16* xq, long long stride_q, int* pairs, int* slot_e, int* slot_start, int* slot_cnt,
    int* nslot, int* counter, int B, int D, int k, int perm) {
  constexpr int E = 32 * kEPL, kGroup = 4;  // kGroup: dense.py's GROUP (the combine's loads per step)
  __shared__ float lg[kWarps][E];            // the last CTA: every row's logits
  __shared__ int ids[kMaxPairs];
  __shared__ unsigned present[kEPL];
  __shared__ int order[kWarps][32];
  __shared__ int is_last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int S = D / 128, G = (E / 16) * S / kWarps;
  if (blockIdx.x >= G) {  // x quantized
    pdl_wait();
    pdl_release();
    const int blk = (blockIdx.x - G) * kWarps + warp;
    if (blk < B * (D / 128)) quant_block(blk, lane, x, stride_x, xq, stride_q, D, perm);
    return;
  }
  // the warp's weights first (A fragments of the 8 k16 steps: words 8j + q and 8j + q + 4 of rows g, g + 8)
  const int t = blockIdx.x * kWarps + warp, tile = t / S, split = t % S;
  const uint32_t* w0 = reinterpret_cast<const uint32_t*>(gate + (tile * 16 + g) * stride_g + split * 128);
  const uint32_t* w1 = reinterpret_cast<const uint32_t*>(gate + (tile * 16 + g + 8) * stride_g + split * 128);
  uint32_t a[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    a[j][0] = w0[8 * j + q];
    a[j][1] = w1[8 * j + q];
    a[j][2] = w0[8 * j + q + 4];
    a[j][3] = w1[8 * j + q + 4];
  }
  pdl_wait();  // x is the previous kernel's output
  pdl_release();
  uint32_t xb[8][2];  // B fragments: x row g (zero past B) at the same k slots
  const uint32_t* xr = reinterpret_cast<const uint32_t*>(x + (g < B ? g : 0) * stride_x + split * 128);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    xb[j][0] = g < B ? xr[8 * j + q] : 0u;
    xb[j][1] = g < B ? xr[8 * j + q + 4] : 0u;
  }
  float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = 0; j < 8; ++j) mma16816<true>(d, a[j][0], a[j][1], a[j][2], a[j][3], xb[j][0], xb[j][1]);
  // d[0], d[1]: expert tile * 16 + g at rows 2q, 2q + 1; d[2], d[3]: expert + 8
  const int e0 = tile * 16 + g, n0 = 2 * q;
  float* ps = part + static_cast<long long>(split) * E * 8;
  if (n0 < B) ps[e0 * 8 + n0] = d[0], ps[(e0 + 8) * 8 + n0] = d[2];
  if (n0 + 1 < B) ps[e0 * 8 + n0 + 1] = d[1], ps[(e0 + 8) * 8 + n0 + 1] = d[3];
  if (!last_to_arrive(counter, G, is_last)) return;
  // every logit: its splits in order 0..S-1 (bf16_tile's combine: groups of kGroup loads from split 1 on,
  // a masked one adding +0.0)
  for (int i = threadIdx.x; i < E * B; i += kThreads) {
    const int e = i % E, n = i / E;
    float tot = __ldcg(part + e * 8 + n);
    for (int s0 = 1; s0 < S; s0 += kGroup)
#pragma unroll
      for (int u = 0; u < kGroup; ++u)
        tot = __fadd_rn(tot, s0 + u < S ? __ldcg(part + (static_cast<long long>(s0 + u) * E + e) * 8 + n) : 0.f);
    lg[n][e] = tot;
  }
  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (and graph replay)
  __syncthreads();
  if (warp < B) {
    const int my = route_row(lg[warp], bias, t2e, stride_t, tokens, warp, idx, wts, scaling, k, lane, order[warp]);
    if (lane < k) ids[warp * k + lane] = my;
  }
  __syncthreads();
  group_pairs(ids, present, B * k, pairs, slot_e, slot_start, slot_cnt, nslot);
}
