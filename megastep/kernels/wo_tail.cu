// The attention sublayer's output projection, wo_a then wo_b, at few rows (M <= 4) in ONE persistent
// launch: u = wo_a(o) (grouped, bf16 activation unquantized), out = wo_b(u) (fp8 activation
// quantization), with the bits of linear_fp8's two Triton launches. Semantics and when it runs:
// wo_tail.py.
//
// Why: at one row each of the two 33.5 MB weight streams takes ~14-15 us in its own launch (~2.3
// TB/s against 4.3 measured): each launch ramps up and drains, and HBM idles at the boundary. Here
// a warp copies its next tasks' weights while it computes the current one, across the boundary
// between the two projections, and a wo_b task waits only for the group of u it reads.
//
// Work. One CTA per SM, W warps, every warp on its own (no CTA barrier). A task is 16 weight rows x
// one split of K (linear_fp8's split for the shape, so the same partial sums). Warp w's first F
// tasks are w, w + nw, ... (nw warps; F covers the ring's first sub-tiles, copied before the
// predecessor completes); after that, tasks are handed out by a ticket counter. The order is all
// of wo_a's (row tile major, so u's groups complete in order), then all of wo_b's (split major:
// wo_b's split s reads u's group s). A warp waits only for u, at a wo_b task, and every wo_a task is handed out
// before any wo_b ticket, so the launch completes as long as each CTA is placed once SMs free up
// (the grid is at most one CTA per SM, so it need not be resident at once beside other kernels; a
// wait still gives up after ~2 s and flags `err`, never hangs). The counter is touched only after
// griddepcontrol.wait (a launch before this one may still run until then, under PDL) and put back
// by the last warp out.
//
// A task is walked in sub-tiles of 16 rows x KC bytes. A sub-tile's weights and, when they exist
// at that moment, its x columns (M rows x KC bf16) go by cp.async into the warp's ring of R
// shared-memory slots, R sub-tiles ahead of the one it computes (16-byte unit c of weight row r at
// c ^ (r & 7), x rows padded: the lanes' reads below hit distinct banks). x does not exist yet for
// a sub-tile copied before the predecessor completed (o, under PDL) or before its group of u was
// complete: such a slot is marked late, and when it is reached the warp copies its x and that of
// the task's later late slots at once (waiting for u's groups first) and waits for every copy.
//
// Arithmetic, linear_fp8's "f16" loop (linear_fp8_staged.cu's, bit for bit against it on one
// H200): a sub-tile's x is brought, in place, to fp16 codes per 128-block and x row (wo_a: the
// bf16 value times a power-of-two scale into fp16's range; wo_b: e4m3 codes with a power-of-two
// scale); MMA j of a 128-block takes the block's columns [16j, 16j + 16) (Triton's k16 steps) from
// zero; acc += dot * (x scale * weight scale), blocks in order; a row tile's split partials are
// summed in split order 0..S-1 by the warp that completes its last split, rounded to bf16 once.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "cuda_common.cuh"

namespace {

using megastep::add_block;
using megastep::cp_async16;
using megastep::cp_async_commit;
using megastep::e4m3x4_to_f16x2;
using megastep::e8m0_to_f32;
using megastep::f16_pair;
using megastep::f16_pow2_scale;
using megastep::fp8_pair;
using megastep::global_ns;
using megastep::ld_acquire_gpu;
using megastep::mma16816;
using megastep::pdl_wait;

constexpr int kRows = 4;                     // x rows at most (wo_tail.py's MAX_ROWS)
constexpr int kPad = 16;                     // bf16 / fp16 elements of padding per x row in a slot (conflict-free B reads)
constexpr int kQueue = 8;                    // posted tasks per warp (>= R + 1)
constexpr int kMaxGroups = 16;               // wo_a groups (V4-Flash: 8)
constexpr long long kSpinNs = 2000000000LL;  // a wait gives up after ~2 s
// sync[]: [0] the ticket counter, [1] warps out, [2, 2 + kMaxGroups) u's groups (row tiles stored),
// then the row tiles' split arrivals, wo_a's and then wo_b's (wo_tail.py's sync_words)
constexpr int kGroupDone = 2, kTileArrivals = 2 + kMaxGroups;

struct Args {
  const __nv_bfloat16* o;  // [M, G Ka] (row stride so)
  long long so;
  const uint8_t *wa, *wsa;  // wo_a e4m3 [G R, Ka], e8m0 [G R / 128, Ka / 128]
  const uint8_t *wb, *wsb;  // wo_b e4m3 [N, G R], e8m0 [N / 128, G R / 128]
  __nv_bfloat16* u;         // [M, G R], rows contiguous
  __nv_bfloat16* out;       // [M, N] (row stride sout)
  long long sout;
  float *pa, *pb;  // split partials, fp32 [Sa, kRows, G R] and [Sb, kRows, N]
  unsigned* sync;
  int* err;
  int M, G, R, Ka, N, Sa, Sb, F;
};

// Task t: layer 0 (wo_a) or 1 (wo_b), its 16-row tile, its split, the layer's shape and x
struct Task {
  int layer, tile, s, N, K, KT, S;
  const uint8_t* w;
  const __nv_bfloat16* x;  // the task's first x column of row 0
  long long sx;            // x's row stride
};

__device__ __forceinline__ Task task_of(const Args& a, int t) {
  const int na = a.G * a.R, ta = na / 16 * a.Sa;
  Task k;
  if (t < ta) {  // row tile major: u's groups complete in order
    k.layer = 0, k.tile = t / a.Sa, k.s = t % a.Sa, k.N = na, k.K = a.Ka, k.S = a.Sa, k.w = a.wa, k.sx = a.so;
    k.KT = a.Ka / a.Sa;
    k.x = a.o + (long long)(k.tile * 16 / a.R) * a.Ka + k.s * k.KT;  // group g reads o's columns [g Ka, (g+1) Ka)
  } else {  // split major: the first tasks read u's first group
    t -= ta;
    const int tiles = a.N / 16;
    k.layer = 1, k.tile = t % tiles, k.s = t / tiles, k.N = a.N, k.K = na, k.S = a.Sb, k.w = a.wb, k.sx = na;
    k.KT = na / a.Sb;
    k.x = a.u + k.s * k.KT;
  }
  return k;
}

// wo_b task k's groups of u: [g0, g1]
__device__ __forceinline__ void groups_of(const Args& a, const Task& k, int& g0, int& g1) {
  g0 = k.s * k.KT / a.R;
  g1 = ((k.s + 1) * k.KT - 1) / a.R;
}

// lane 0: wait until u's group g has all of its R / 16 row tiles (gives up after ~2 s: err)
__device__ __forceinline__ void wait_group(const Args& a, int g) {
  const unsigned need = unsigned(a.R / 16);
  const unsigned* done = a.sync + kGroupDone + g;
  if (ld_acquire_gpu(done) >= need) return;
  const unsigned long long t0 = global_ns();
  while (ld_acquire_gpu(done) < need) {
    __nanosleep(64);
    if (global_ns() - t0 > (unsigned long long)kSpinNs) {
      atomicExch(a.err, 1);
      return;
    }
  }
}

template <int W, int RING, int KC>
__device__ __forceinline__ void wo_tail(const Args& a, int pdl) {
  static_assert(RING + 1 <= kQueue, "the queue holds the ring's tasks and the one being computed");
  constexpr int NB = KC / 128, XS = KC + kPad;    // 128-blocks per sub-tile, x row stride (elements)
  constexpr int WBYTES = 16 * KC;                 // a slot's weights
  constexpr int SLOT = WBYTES + kRows * XS * 2;   // and its x rows
  constexpr int XUNITS = KC / 8;                  // 16-byte units of one x row of a sub-tile
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int nw = gridDim.x * W, wid = blockIdx.x * W + warp;
  unsigned char* ring = smem + warp * RING * SLOT;
  unsigned char* mine = smem + W * RING * SLOT + warp * (kRows * NB * 4 + kQueue * 4 + RING * 4);
  float* xsc = reinterpret_cast<float*>(mine);               // [kRows][NB] the sub-tile's x scales
  int* posted_t = reinterpret_cast<int*>(mine + kRows * NB * 4);  // [kQueue] tickets, in task order
  int* late = posted_t + kQueue;                             // [RING] slot's x not copied
  unsigned* tickets = a.sync;
  const int total = a.G * a.R / 16 * a.Sa + a.N / 16 * a.Sb;

  // ---- the producer side: copy the next sub-tile of the warp's tasks into its ring slot
  bool waited = !pdl;   // the predecessor is complete (o exists; the counters are this launch's)
  bool owed = false;    // a ticket to ask for once waited
  unsigned ahead = 0;   // lane 0: the counter's answer for the next task
  int taken = 0;        // tasks taken so far (the first F are the warp's own)
  unsigned ready = 0;   // u's groups this warp has seen complete
  int pt = 0, pk = 0, posted = 0, issued = 0;  // the task being copied, its next sub-tile, tasks posted
  Task ptask{};
  unsigned pneed = 0;  // the groups of u the task copied reads (wo_b)
  auto ask = [&]() {
    if (lane == 0) ahead = atomicAdd(tickets, 1u);
  };
  auto issue = [&]() {
    if (pt < total) {
      if (pk == 0) {  // the next task: its ticket, posted for the consumer side
        pt = taken < a.F ? wid + taken * nw : a.F * nw + int(__shfl_sync(0xFFFFFFFFu, ahead, 0));
        ++taken;
        if (lane == 0) posted_t[posted % kQueue] = pt;
        ++posted;
        if (pt < total) {
          ptask = task_of(a, pt);
          if (taken >= a.F) {  // the next task's ticket, asked for while this one's copies go out
            if (waited) ask(); else owed = true;
          }
          pneed = 0;
          if (ptask.layer == 1) {
            int g0, g1;
            groups_of(a, ptask, g0, g1);
            pneed = ((2u << g1) - 1) & ~((1u << g0) - 1);
            if (waited && (ready & pneed) != pneed) {  // complete already? (one look a task, no wait)
              for (int gg = g0; gg <= g1; ++gg) {
                unsigned v = 0;
                if (lane == 0 && !(ready >> gg & 1u)) v = ld_acquire_gpu(a.sync + kGroupDone + gg);
                if (__shfl_sync(0xFFFFFFFFu, v, 0) >= unsigned(a.R / 16)) ready |= 1u << gg;
              }
              __syncwarp();  // lane 0's acquire orders the other lanes' copies of u too
            }
          }
        }
      }
      if (pt < total) {
        // x goes with the weights once it exists: o after the predecessor, u once its groups are complete
        const bool px = waited && (ready & pneed) == pneed;
        unsigned char* slot = ring + (issued % RING) * SLOT;
        const uint8_t* src = ptask.w + (long long)ptask.tile * 16 * ptask.K + ptask.s * ptask.KT + pk * KC;
        constexpr int UNITS = KC / 16;  // 16-byte units per weight row
#pragma unroll
        for (int i = lane; i < 16 * UNITS; i += 32) {
          const int r = i / UNITS, c = i % UNITS;
          cp_async16(slot + r * KC + ((c ^ (r & 7)) << 4), src + (long long)r * ptask.K + c * 16);
        }
        if (px) {  // (cp.async.cg reads L2: u, written by other SMs, is seen once its group is)
          for (int i = lane; i < a.M * XUNITS; i += 32) {
            const int m = i / XUNITS, c = i % XUNITS;
            cp_async16(slot + WBYTES + (m * XS + c * 8) * 2, ptask.x + m * ptask.sx + pk * KC + c * 8);
          }
        }
        if (lane == 0) late[issued % RING] = !px;
        if (++pk == ptask.KT / KC) pk = 0;
      }
    }
    cp_async_commit();  // an empty group past the end: group i is always sub-tile i's
    ++issued;
  };
#pragma unroll
  for (int i = 0; i < RING; ++i) issue();  // under PDL weights only: x may not exist yet
  if (pdl) {
    pdl_wait();
    waited = true;
    if (owed) ask();
  }

  // ---- the consumer side, a task at a time
  int i = 0;
  for (int c = 0;; ++c) {
    __syncwarp();  // lane 0's post of task c
    const int t = posted_t[c % kQueue];
    if (t >= total) break;
    const Task k = task_of(a, t);
    const uint8_t* wsr = (k.layer == 0 ? a.wsa : a.wsb) + (long long)(k.tile * 16 / 128) * (k.K / 128) +
                         (k.s * k.KT) / 128;
    float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
    for (int sub = 0; sub < k.KT / KC; ++sub, ++i) {
      unsigned char* slot = ring + (i % RING) * SLOT;
      __half* xs = reinterpret_cast<__half*>(slot + WBYTES);
      asm volatile("cp.async.wait_group %0;" ::"n"(RING - 1) : "memory");
      __syncwarp();  // every lane's copies of the slot, and lane 0's `late`, visible to the warp
      if (late[i % RING]) {  // x now (o exists; u: wait for its groups), for this slot and the task's later ones
        if (k.layer == 1) {
          int g0, g1;
          groups_of(a, k, g0, g1);
          for (int gg = g0; gg <= g1; ++gg) {
            if (!(ready >> gg & 1u)) {
              if (lane == 0) wait_group(a, gg);
              ready |= 1u << gg;
            }
          }
          __syncwarp();  // lane 0's acquire orders the other lanes' copies of u too
        }
        for (int j = 0; j < RING && i + j < issued && sub + j < k.KT / KC; ++j) {
          if (!late[(i + j) % RING]) continue;
          __half* xj = reinterpret_cast<__half*>(ring + ((i + j) % RING) * SLOT + WBYTES);
          for (int e = lane; e < a.M * XUNITS; e += 32) {
            const int m = e / XUNITS, cc = e % XUNITS;
            cp_async16(xj + m * XS + cc * 8, k.x + m * k.sx + (sub + j) * KC + cc * 8);
          }
        }
        // every copy in flight done, these too (a later sub-tile's wait then finds fewer groups pending)
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncwarp();
        if (lane == 0) {
          for (int j = 0; j < RING && i + j < issued && sub + j < k.KT / KC; ++j) late[(i + j) % RING] = 0;
        }
        __syncwarp();
      }
      // x's codes, in place: per 128-block and row, a lane's 4 values (each lane rewrites its own)
#pragma unroll
      for (int e = 0; e < kRows * NB; ++e) {
        const int m = e / NB, b = e % NB;
        if (m >= a.M) break;
        uint2* p = reinterpret_cast<uint2*>(xs + m * XS + b * 128 + lane * 4);
        const uint2 v2 = *p;
        const float v[4] = {megastep::bf16_lo(v2.x), megastep::bf16_hi(v2.x), megastep::bf16_lo(v2.y),
                            megastep::bf16_hi(v2.y)};
        float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
        for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
        float s, inv;
        if (k.layer == 1) {
          megastep::pow2_scale(amax, s, inv);
          *p = make_uint2(fp8_pair(v[0] * inv, v[1] * inv), fp8_pair(v[2] * inv, v[3] * inv));
        } else {  // wo_a: the bf16 activation itself, scaled into fp16's range
          f16_pow2_scale(amax, s, inv);
          *p = make_uint2(f16_pair(v[0] * inv, v[1] * inv), f16_pair(v[2] * inv, v[3] * inv));
        }
        if (lane == 0) xsc[m * NB + b] = s;
      }
      __syncwarp();  // the codes and scales, visible to the warp
      const unsigned char* rg = slot + g * KC + 4 * q;  // row g, word q (row g + 8: the same swizzle)
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        float blk[1][4] = {{0.f, 0.f, 0.f, 0.f}};  // the block's dot, from zero, as Triton's per-block tl.dot
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // MMA j: the block's columns [16j, 16j + 16)
          const int off = ((8 * b + j) ^ g) << 4;
          uint32_t a0, a1, a2, a3;
          e4m3x4_to_f16x2(*reinterpret_cast<const uint32_t*>(rg + off), a0, a2);           // row g
          e4m3x4_to_f16x2(*reinterpret_cast<const uint32_t*>(rg + 8 * KC + off), a1, a3);  // row g + 8
          uint2 xb = make_uint2(0u, 0u);  // B: x row g (rows past M: zero)
          if (g < a.M) xb = *reinterpret_cast<const uint2*>(xs + g * XS + b * 128 + 16 * j + 4 * q);
          mma16816<false>(blk[0], a0, a1, a2, a3, xb.x, xb.y);
        }
        add_block<1>(acc, blk, xsc + b, NB, e8m0_to_f32(wsr[sub * NB + b]), a.M, q);
      }
      __syncwarp();  // every lane is done with the slot
      issue();       // sub-tile i + R into the slot just freed (possibly another task's, or wo_b's)
    }

    // ---- the row tile's result: this split's partial, then (the last split to arrive) the sum
    const int n0 = k.tile * 16;
    float* part = k.layer == 0 ? a.pa : a.pb;
    __nv_bfloat16* y = k.layer == 0 ? a.u : a.out;
    const long long sy = k.layer == 0 ? (long long)a.G * a.R : a.sout;
    bool last = true;
    if (k.S > 1) {
      float* p = part + (long long)k.s * kRows * k.N;
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // acc[0][e]: weight row g + 8 (e >> 1), x row 2q + (e & 1)
        const int m = 2 * q + (e & 1);
        if (m < a.M) p[(long long)m * k.N + n0 + g + 8 * (e >> 1)] = acc[0][e];
      }
      __threadfence();
      __syncwarp();
      unsigned* arrivals = a.sync + kTileArrivals + (k.layer == 0 ? 0 : a.G * a.R / 16) + k.tile;
      unsigned arrived = 0;
      if (lane == 0) arrived = atomicAdd(arrivals, 1u);
      arrived = __shfl_sync(0xFFFFFFFFu, arrived, 0);
      last = arrived == unsigned(k.S - 1);
      if (last) {
        __threadfence();
        for (int e = lane; e < 16 * a.M; e += 32) {
          const int r = e & 15, m = e >> 4;
          const float* pp = part + (long long)m * k.N + n0 + r;
          float sum = __ldcg(pp);
          for (int s = 1; s < k.S; ++s) sum += __ldcg(pp + (long long)s * kRows * k.N);  // split order
          y[m * sy + n0 + r] = __float2bfloat16_rn(sum);
        }
        if (lane == 0) *arrivals = 0;  // ready for the next launch
      }
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = 2 * q + (e & 1);
        if (m < a.M) y[m * sy + n0 + g + 8 * (e >> 1)] = __float2bfloat16_rn(acc[0][e]);
      }
    }
    if (last && k.layer == 0) {  // one more row tile of u's group
      __threadfence();
      __syncwarp();
      if (lane == 0) atomicAdd(a.sync + kGroupDone + n0 / a.R, 1u);
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");

  // the last warp out puts the counters back for the next launch (every wait is behind it)
  __syncwarp();
  if (lane == 0) {
    __threadfence();
    if (atomicAdd(a.sync + 1, 1u) == unsigned(nw - 1)) {
      a.sync[0] = 0;
      for (int gg = 0; gg < kMaxGroups; ++gg) a.sync[kGroupDone + gg] = 0;
      a.sync[1] = 0;
      __threadfence();
    }
  }
}

}  // namespace

#define WO_TAIL_PARAMS                                                                                        \
  const __nv_bfloat16 *o, long long so, const uint8_t *wa, const uint8_t *wsa, const uint8_t *wb,             \
      const uint8_t *wsb, __nv_bfloat16 *u, __nv_bfloat16 *out, long long sout, float *pa, float *pb,         \
      unsigned *sync, int *err, int M, int G, int R, int Ka, int N, int Sa, int Sb, int F, int pdl
#define WO_TAIL_ENTRY(NW, NR, NKC)                                                                            \
  extern "C" __global__ void __launch_bounds__(NW * 32, 1) wo_tail_w##NW##_r##NR##_kc##NKC(WO_TAIL_PARAMS) {  \
    const Args args{o, so, wa, wsa, wb, wsb, u, out, sout, pa, pb, sync, err, M, G, R, Ka, N, Sa, Sb, F};    \
    wo_tail<NW, NR, NKC>(args, pdl);                                                                          \
  }

WO_TAIL_ENTRY(8, 4, 256)
WO_TAIL_ENTRY(8, 3, 256)
WO_TAIL_ENTRY(12, 2, 256)
WO_TAIL_ENTRY(8, 2, 512)
WO_TAIL_ENTRY(8, 4, 128)
