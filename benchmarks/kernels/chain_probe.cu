// A probe, not used by the runtime: a chain of FP8 block-scaled GEMVs at one row (x [1, K] fp32 ->
// y [N] fp32, each layer's y the next layer's x) in ONE persistent launch, against the same work in
// one launch per layer. Semantics, tiling, the question and how it is measured: chain_probe.py.
//
// One CTA per SM, W warps, every warp on its own (no CTA barrier). A task is 16 weight rows x one
// split of K (K / S bytes, S from the layer's descriptor); a warp's tasks of every layer form one
// list, walked in sub-tiles of 16 rows x KC bytes. The sub-tiles go by cp.async into the warp's ring
// of R shared-memory slots, R sub-tiles ahead of the one it computes. Weights depend on nothing, so
// the copies of a layer's first sub-tiles are issued while the warp still works on, or waits at the
// end of, the layer before: HBM need not idle at a layer boundary. A layer's input is read only after
// all of the previous layer's row tiles are stored (a counter per layer, spun on by lane 0 of a
// waiting warp; after ~2 s it gives up and flags `err`, so a launch whose CTAs are not all resident
// fails instead of hanging). A layer's `gap` (ns) stands for the latency-bound stage before it (the
// attention between wq_b and wo_a): a warp that found the layer's input complete waits that long
// more before it reads it, its copies of the layer's first sub-tiles already in flight (in per-layer
// launches: after the launch's first copies). A layer reads the first G x K values of the layer
// before's output.
//
// Arithmetic per task, the FP8 linear's (linear_fp8_ref): the task's x slice is fp8-quantized per
// 128-block (power-of-two scale, e4m3 codes as fp16); each 128-block's dot is 8 chained
// mma.m16n8k16 (fp16 in, fp32 sum) from zero; then acc += dot * (x scale * weight scale), blocks in
// order. Split-K partials [S, N] are summed in split order 0..S-1 by the warp that completes a row
// tile's last split. Two orders of K inside a block (which products share a k16 step):
// - "own" (chain_gemv_*): a lane's 16 contiguous weight bytes of a row spread over 4 MMAs
//   (benchmarks/kernels/gemv_fp8_cuda.cu's loop, the fastest CUDA loop measured at one row);
// - "tri" (chain_tri_*): MMA j takes the block's columns [16j, 16j + 16), as Triton's k16 steps do,
//   lane (g, q) holding word q of each 16-byte segment (the loop of kernels/linear_fp8_staged.cu,
//   removed; read it at 00105ef). With the launch's splits set to linear_fp8's, every output has
//   linear_fp8's bits.
// Either way the result does not depend on timing or on how the launches are cut: the chain and the
// per-layer launches give the same bits. The `xor` entries (chain_xor_*) keep the copies, waits and
// stores but only XOR the tiles: the floor of the same launch without the arithmetic (their
// outputs mean nothing).
//
// The bulk loader (chain_bulk_*, chain_bxor_*: "tri" and "xor" otherwise): a slot is filled by 16
// cp.async.bulk copies, one row segment of KC bytes per lane 0..15, completing on the slot's mbarrier
// (lane 0 arrives expecting 16 x KC bytes); the consumer waits on the barrier's phase parity instead of
// a cp.async group. One bulk copy cannot swizzle, so rows sit KC + 16 bytes apart instead.

#include <cuda_fp16.h>
#include <stdint.h>

#include "../../megastep/kernels/cuda_common.cuh"

namespace {

using megastep::cp_async16;
using megastep::cp_async_commit;
using megastep::e4m3x4_to_f16x2;
using megastep::e8m0_to_f32;
using megastep::fp8_pair;
using megastep::global_ns;
using megastep::ld_acquire_gpu;
using megastep::mma16816;
using megastep::pdl_release;
using megastep::pdl_wait;
using megastep::pow2_scale;

constexpr int kMaxLayers = 4;
constexpr int kMaxTiles = 4096;           // row tiles (16 rows) per layer at most: N <= 65536
constexpr int kTileCounters = 64;         // counters[0, kMaxLayers): layers done; [kMaxLayers]: warps out
constexpr long long kSpinLimit = 4000000000LL;  // ~2 s of clock64 at the H200's clocks: then give up
constexpr int kOwn = 0, kTri = 1, kXor = 2;     // what a sub-tile's compute does (file comment)
constexpr int kBulk = 3, kBxor = 4;             // kTri / kXor with the bulk-copy loader (file comment)

// desc[l * kDesc + i]: w (e4m3 [N, K]), ws (e8m0 [N/128, K/128]), x (fp32 [G*K]), y (fp32 [N]),
// part (fp32 [S, N], unused with one split), N, K, G, S, gap (ns)
constexpr int kDesc = 10;

struct Layer {
  const uint8_t* w;
  const uint8_t* ws;
  const float* x;
  float* y;
  float* part;
  int N, K, G, S, KT, tiles, gap;  // KT: bytes of K per task (one split)
};

__device__ __forceinline__ Layer layer_of(const long long* desc, int l) {
  const long long* d = desc + l * kDesc;
  Layer L;
  L.w = reinterpret_cast<const uint8_t*>(d[0]);
  L.ws = reinterpret_cast<const uint8_t*>(d[1]);
  L.x = reinterpret_cast<const float*>(d[2]);
  L.y = reinterpret_cast<float*>(d[3]);
  L.part = reinterpret_cast<float*>(d[4]);
  L.N = int(d[5]);
  L.K = int(d[6]);
  L.G = int(d[7]);
  L.S = int(d[8]);
  L.gap = int(d[9]);
  L.KT = L.K / L.S;
  L.tiles = L.N / 16;
  return L;
}

// Where 16-byte unit u of weight row r sits in its slot row. "own": at u ^ 4 when r is odd, so a
// quarter warp's LDS.128 (rows g and g + 1, four units each) covers 8 distinct bank groups; "tri":
// at u ^ (r & 7), so the 32 lanes' 4-byte reads (rows g, segments j ^ g, words q) hit 32 banks
template <int KIND>
__host__ __device__ constexpr bool bulk_kind() {  // the bulk-copy loader's kinds
  return KIND == kBulk || KIND == kBxor;
}
template <int KIND>
__host__ __device__ constexpr bool xor_kind() {  // the copy-only floors
  return KIND == kXor || KIND == kBxor;
}

template <int KIND>
__device__ __forceinline__ int swz(int r, int u) {
  if constexpr (bulk_kind<KIND>()) return u;  // a bulk copy writes its row segment as it is
  return KIND == kTri ? u ^ (r & 7) : u ^ ((r & 1) << 2);
}

// The bulk loader's rows are KC + 16 bytes apart (one bulk copy per row cannot swizzle): row g's word q
// of unit u sits in bank (4 g + 4 u + q) mod 32, so the 32 lanes of a "tri" read hit 32 banks
template <int KIND, int KC>
__host__ __device__ constexpr int row_stride() {
  return bulk_kind<KIND>() ? KC + 16 : KC;
}

// The bulk loader: a slot's 16 row segments are 16 cp.async.bulk copies (one per lane 0..15) that
// complete on the slot's mbarrier (one arrival, lane 0's, expecting 16 x KC bytes)
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n"
      "WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}"
      ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}
// this warp's generic reads of a slot before the async proxy's next writes into it
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// A warp's walk over its sub-tiles: sub-tile k of task t of layer l, for t = wid, wid + nw, ...
struct Cursor {
  int l, t, k;
};

__device__ __forceinline__ void next_task(Cursor& c, const long long* desc, int L, int wid, int nw) {
  c.t += nw;
  c.k = 0;
  while (c.l < L) {
    const long long* d = desc + c.l * kDesc;
    if (c.t < int(d[5] / 16 * d[8])) return;  // tiles x splits
    ++c.l;
    c.t = wid;
  }
}

template <int KC>
__device__ __forceinline__ void advance(Cursor& c, const long long* desc, int L, int wid, int nw) {
  const long long* d = desc + c.l * kDesc;
  if (++c.k < int(d[6] / d[8]) / KC) return;  // sub-tiles per task: KT / KC
  next_task(c, desc, L, wid, nw);
}

// Sub-tile i's weights are in: cp.async group i, with at most R - 1 newer groups pending.
template <int R>
__device__ __forceinline__ void wait_tile() {
  asm volatile("cp.async.wait_group %0;" ::"n"(R - 1) : "memory");
  __syncwarp();  // every lane's copies, visible to the whole warp
}

// The task's x slice (KT fp32 values at xg, read past L1: another SM wrote them in this launch) ->
// per-128-block e4m3 codes (fp16) and power-of-two scales in the warp's shared memory
__device__ __forceinline__ void quantize_x(const float* xg, int KT, __half* xs, float* xsc, int lane) {
  for (int b = 0; b < KT / 128; ++b) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(xg + b * 128) + lane);
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float sc, inv;
    pow2_scale(amax, sc, inv);
    *reinterpret_cast<uint2*>(xs + b * 128 + lane * 4) =
        make_uint2(fp8_pair(v.x * inv, v.y * inv), fp8_pair(v.z * inv, v.w * inv));
    if (lane == 0) xsc[b] = sc;
  }
}

// One sub-tile: 16 weight rows x KC bytes (in `slot`) against the matching KC x codes (xs, scales
// xsc, weight scales wsr, all of the sub-tile's blocks). Adds row g's sum to acc[0] and row g + 8's
// to acc[2]: every column of B holds x (the lanes of every g load the same words), so all 8 output
// columns are the same dot, and acc[1], acc[3] are copies.
template <int KIND, int KC>
__device__ __forceinline__ void gemv_sub(const unsigned char* slot, const __half* xs, const float* xsc,
                                         const uint8_t* wsr, int lane, float (&acc)[4]) {
  const int g = lane >> 2, q = lane & 3;
  constexpr int RS = row_stride<KIND, KC>();
#pragma unroll
  for (int b = 0; b < KC / 128; ++b) {
    float blk[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (KIND == kOwn) {
#pragma unroll
      for (int cidx = 0; cidx < 2; ++cidx) {  // the block's two 64-byte halves, 4 MMAs each
        const int c = 2 * b + cidx, u = 4 * c + q;
        const uint4 r0 = *reinterpret_cast<const uint4*>(slot + g * KC + swz<KIND>(g, u) * 16);
        const uint4 r1 = *reinterpret_cast<const uint4*>(slot + (g + 8) * KC + swz<KIND>(g + 8, u) * 16);
        const uint4 x0 = *reinterpret_cast<const uint4*>(xs + 64 * c + 16 * q);
        const uint4 x1 = *reinterpret_cast<const uint4*>(xs + 64 * c + 16 * q + 8);
        const uint32_t w0w[4] = {r0.x, r0.y, r0.z, r0.w}, w1w[4] = {r1.x, r1.y, r1.z, r1.w};
        const uint32_t xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t a0, a1, a2, a3;
          e4m3x4_to_f16x2(w0w[j], a0, a2);  // row g: bytes 4j, 4j+1 in k slots 2q, 2q+1; 4j+2, 4j+3 in 2q+8, 2q+9
          e4m3x4_to_f16x2(w1w[j], a1, a3);  // row g + 8
          mma16816<false>(blk, a0, a1, a2, a3, xw[2 * j], xw[2 * j + 1]);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // MMA j: the block's columns [16j, 16j + 16), word q of each row's segment
        const int off = (swz<KIND>(g, 8 * b + j) << 4) + 4 * q;  // rows g and g + 8 share the swizzle
        uint32_t a0, a1, a2, a3;
        e4m3x4_to_f16x2(*reinterpret_cast<const uint32_t*>(slot + g * RS + off), a0, a2);
        e4m3x4_to_f16x2(*reinterpret_cast<const uint32_t*>(slot + (g + 8) * RS + off), a1, a3);
        const uint2 xb = *reinterpret_cast<const uint2*>(xs + b * 128 + 16 * j + 4 * q);
        mma16816<false>(blk, a0, a1, a2, a3, xb.x, xb.y);
      }
    }
    const float f = xsc[b] * e8m0_to_f32(wsr[b]);  // powers of two: exact
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[e] += blk[e] * f;
  }
}

// The floor: the sub-tile only XORed (the outputs mean nothing)
template <int KIND, int KC>
__device__ __forceinline__ void xor_sub(const unsigned char* slot, int lane, float (&acc)[4]) {
  uint32_t h = __float_as_uint(acc[0]);
  constexpr int UNITS = KC / 16;
#pragma unroll
  for (int k = lane; k < KC; k += 32) {  // 16 rows x KC bytes = KC 16-byte words
    const uint4 v = *reinterpret_cast<const uint4*>(slot + (k / UNITS) * row_stride<KIND, KC>() + (k % UNITS) * 16);
    h ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  acc[0] = acc[2] = __uint_as_float(h & 0x3fffffffu);
}

// W warps, R ring slots per warp, KC bytes of K per sub-tile, XMAX the most K one task may take
template <int W, int R, int KC, int XMAX, int KIND>
__device__ __forceinline__ void chain(const long long* desc, int L, unsigned* counters, int* err, int pdl) {
  constexpr bool BULK = bulk_kind<KIND>();
  constexpr int SLOT = 16 * row_stride<KIND, KC>();  // bytes of one sub-tile's slot
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int nw = gridDim.x * W, wid = blockIdx.x * W + warp;
  unsigned char* ring = smem + warp * R * SLOT;
  __half* xs = reinterpret_cast<__half*>(smem + W * R * SLOT + warp * (XMAX * 2 + 64));
  float* xsc = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(xs) + XMAX * 2);
  unsigned* done = counters;
  unsigned* out = counters + kMaxLayers;
  unsigned* tcnt = counters + kTileCounters;
  // the bulk loader's mbarriers, R per warp, after every warp's x codes
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + W * R * SLOT + W * (XMAX * 2 + 64)) + warp * R;
  if constexpr (BULK) {
    if (lane < R) mbar_init(bars + lane);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // (as CUTLASS after its barriers' init)
    fence_proxy_async();  // the initialized barriers, visible to the copies' completions
    __syncwarp();
  }

  // ---- the producer side: copy the next sub-tile in the list into its slot
  Cursor pc{0, wid - nw, 0};
  next_task(pc, desc, L, wid, nw);
  int issued = 0;
  auto issue = [&]() {
    if (pc.l < L) {
      const Layer ly = layer_of(desc, pc.l);
      const int tile = pc.t / ly.S, s = pc.t % ly.S;
      const uint8_t* src = ly.w + (long long)tile * 16 * ly.K + s * ly.KT + pc.k * KC;
      unsigned char* dst = ring + (issued % R) * SLOT;
      if constexpr (BULK) {
        uint64_t* bar = bars + issued % R;
        fence_proxy_async();  // (the slot's reads by this warp, done: the __syncwarp before issue)
        if (lane == 0) mbar_expect(bar, 16 * KC);
        __syncwarp();
        if (lane < 16) bulk_copy(dst + lane * (KC + 16), src + (long long)lane * ly.K, KC, bar);
      } else {
        constexpr int UNITS = KC / 16;  // 16-byte units per row
#pragma unroll
        for (int i = lane; i < 16 * UNITS; i += 32) {
          const int r = i / UNITS, u = i % UNITS;
          cp_async16(dst + r * KC + swz<KIND>(r, u) * 16, src + (long long)r * ly.K + u * 16);
        }
      }
      advance<KC>(pc, desc, L, wid, nw);
    }
    if constexpr (!BULK) cp_async_commit();  // an empty group when the list is done: group i is always sub-tile i's
    ++issued;
  };
#pragma unroll
  for (int i = 0; i < R; ++i) issue();
  pdl_release();  // per-layer launches: the next layer's CTAs may be placed (and copy) as SMs free up

  // ---- the consumer side, a task at a time
  Cursor cc{0, wid - nw, 0};
  next_task(cc, desc, L, wid, nw);
  int cur = -1, i = 0;
  for (; cc.l < L; next_task(cc, desc, L, wid, nw)) {
    const Layer ly = layer_of(desc, cc.l);
    if (cc.l != cur) {  // the first task of a layer: its input must be complete
      if (cur < 0 && pdl) pdl_wait();
      cur = cc.l;
      if (lane == 0) {
        if (cur > 0) {
          const unsigned need = unsigned(layer_of(desc, cur - 1).tiles);
          const long long t0 = clock64();
          while (ld_acquire_gpu(done + cur - 1) < need) {
            __nanosleep(32);
            if (clock64() - t0 > kSpinLimit) {
              atomicExch(err, 1 + cur);
              break;
            }
          }
        }
        if (ly.gap > 0) {
          const unsigned long long t0 = global_ns();
          while (global_ns() - t0 < (unsigned long long)ly.gap) __nanosleep(64);
        }
      }
      __syncwarp();
    }
    const int tile = cc.t / ly.S, s = cc.t % ly.S;
    const int n0 = tile * 16, grp = n0 / (ly.N / ly.G);
    const int k0 = s * ly.KT;  // the task's first byte of K
    if constexpr (!xor_kind<KIND>()) quantize_x(ly.x + (long long)grp * ly.K + k0, ly.KT, xs, xsc, lane);
    const uint8_t* wsr = ly.ws + (long long)(n0 / 128) * (ly.K / 128) + k0 / 128;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int k = 0; k < ly.KT / KC; ++k, ++i) {
      if constexpr (BULK) {
        mbar_wait(bars + i % R, (i / R) & 1);  // the slot's (i / R)-th fill
      } else {
        wait_tile<R>();
      }
      const unsigned char* slot = ring + (i % R) * SLOT;
      if constexpr (xor_kind<KIND>()) {
        xor_sub<KIND, KC>(slot, lane, acc);
      } else {
        gemv_sub<KIND, KC>(slot, xs + k * KC, xsc + k * (KC / 128), wsr + k * (KC / 128), lane, acc);
      }
      __syncwarp();  // every lane is done with the slot
      issue();       // sub-tile i + R into the slot just freed (possibly the next layer's)
    }

    // ---- the row tile's result
    bool last = true;
    if (ly.S > 1) {
      if (q == 0) {
        ly.part[(long long)s * ly.N + n0 + g] = acc[0];
        ly.part[(long long)s * ly.N + n0 + g + 8] = acc[2];
      }
      __threadfence();
      __syncwarp();
      unsigned arrived = 0;
      if (lane == 0) arrived = atomicAdd(tcnt + cc.l * kMaxTiles + tile, 1u);
      arrived = __shfl_sync(0xffffffffu, arrived, 0);
      last = arrived == unsigned(ly.S - 1);
      if (last) {
        __threadfence();
        if (lane < 16) {
          const float* p = ly.part + n0 + lane;
          float sum = __ldcg(p);
          for (int k = 1; k < ly.S; ++k) sum += __ldcg(p + (long long)k * ly.N);  // split order
          ly.y[n0 + lane] = sum;
        }
        if (lane == 0) tcnt[cc.l * kMaxTiles + tile] = 0;  // ready for the next launch
      }
    } else if (q == 0) {
      ly.y[n0 + g] = acc[0];
      ly.y[n0 + g + 8] = acc[2];
    }
    if (last) {
      __threadfence();
      __syncwarp();
      if (lane == 0) atomicAdd(done + cc.l, 1u);
    }
    __syncwarp();  // the x codes are free for the next task
  }
  if constexpr (!BULK) asm volatile("cp.async.wait_all;" ::: "memory");  // (bulk: every copy was waited for)

  // the last warp out resets the layer counters for the next launch (every wait is behind it)
  __syncwarp();
  if (lane == 0) {
    __threadfence();
    if (atomicAdd(out, 1u) == unsigned(nw - 1)) {
      for (int l = 0; l < kMaxLayers; ++l) done[l] = 0;
      *out = 0;
      __threadfence();
    }
  }
}

}  // namespace

#define CHAIN_ENTRY_OF(NAME, KIND, W, R, KC, XMAX)                                                   \
  extern "C" __global__ void __launch_bounds__(W * 32, 1)                                            \
      chain_##NAME##_w##W##_r##R##_kc##KC(const long long* desc, int L, unsigned* counters, int* err, int pdl) { \
    chain<W, R, KC, XMAX, KIND>(desc, L, counters, err, pdl);                                        \
  }
// own order and xor: a task is one sub-tile (the host sets S = K / KC); tri: linear_fp8's splits, a
// task of at most 1024 bytes of K (every V4-Flash shape the probe runs)
#define CHAIN_ENTRY(W, R, KC) CHAIN_ENTRY_OF(gemv, kOwn, W, R, KC, KC)
#define CHAIN_TRI_ENTRY(W, R, KC) CHAIN_ENTRY_OF(tri, kTri, W, R, KC, 1024)
#define CHAIN_XOR_ENTRY(W, R, KC) CHAIN_ENTRY_OF(xor, kXor, W, R, KC, KC)
// the bulk-copy loader: "tri"'s arithmetic (so linear_fp8's bits) and "xor"'s floor
#define CHAIN_BULK_ENTRY(W, R, KC) CHAIN_ENTRY_OF(bulk, kBulk, W, R, KC, 1024)
#define CHAIN_BXOR_ENTRY(W, R, KC) CHAIN_ENTRY_OF(bxor, kBxor, W, R, KC, KC)

CHAIN_ENTRY(8, 3, 512)
CHAIN_ENTRY(12, 2, 512)
CHAIN_ENTRY(16, 3, 256)
CHAIN_ENTRY(8, 6, 256)
CHAIN_ENTRY(16, 2, 256)
CHAIN_TRI_ENTRY(8, 3, 512)
CHAIN_TRI_ENTRY(16, 3, 256)
CHAIN_TRI_ENTRY(16, 2, 256)
CHAIN_XOR_ENTRY(8, 3, 512)
CHAIN_XOR_ENTRY(16, 3, 256)
CHAIN_BULK_ENTRY(8, 3, 512)
CHAIN_BULK_ENTRY(8, 6, 256)
CHAIN_BULK_ENTRY(16, 2, 256)
CHAIN_BULK_ENTRY(4, 6, 512)
CHAIN_BULK_ENTRY(4, 3, 1024)
CHAIN_BULK_ENTRY(6, 2, 1024)
CHAIN_BXOR_ENTRY(8, 3, 512)
CHAIN_BXOR_ENTRY(16, 3, 256)
