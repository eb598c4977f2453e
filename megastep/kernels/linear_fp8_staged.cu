// The FP8 block-scaled decode linear for a few rows (M <= 16) with its weights staged in shared
// memory before its input exists: the same bits as linear_fp8's Triton "f16" loop (plain
// launches: no SwiGLU pair, no residual). Semantics, when it runs and why: linear_fp8_staged.py.
//
// Why: at one row the big FP8 linears stream at ~2.3 TB/s per launch, bound by their own loop
// (weights already in L2 made them only 8-17 % faster: docs/PERFORMANCE.md, ninth measurement),
// while the kernel before them (attention before wo_a) is bound by one warp's chain and leaves
// HBM idle. A weight never depends on the predecessor, so a CTA placed early (PDL) copies all of
// its weight bytes into shared memory before griddepcontrol.wait; once the input is there only
// the MMAs remain. CTAs placed later (no room beside the predecessor) run the same code.
//
// Work: a CTA of W warps (4 or 8) takes W 16-row tiles of w (16 W output channels) and one split
// of K (the Triton launch's split, so the same partial sums), for MG = 8 NT rows of x. Its warp
// copies its 16 rows x KC bytes with 16-byte cp.async, one commit group per 128-block (the
// compute waits for each block in turn), the 16-byte chunks of row r swizzled (chunk c at
// c ^ (r & 7): the lanes' 4-byte reads below hit 32 distinct banks). MMA j of a 128-block takes
// the block's columns [16j, 16j + 16) as Triton's k16 steps do: lane (g, q) holds word q of
// segment j of rows g and g + 8 as the k slots (2q, 2q+1, 2q+8, 2q+9), and x's columns
// 16j + 4q .. +3 in the same slots of B. A k16 step's fp32 result depends on the set of its
// products only (docs/PERFORMANCE.md, nineteenth measurement: mma_order_probe.py on one H200), so
// each 128-block's dot has Triton's bits; the block's dot times (activation scale x weight
// scale) is added in block order, the splits summed in split order by the last CTA to arrive,
// as Triton's loop and combine do. This is the "word" loop of the CUDA few-rows linear measured on
// 2026-11-30 (bit for bit against Triton at every V4-Flash plain shape, 1-16 rows; the code at
// 087e231), reading its words from shared memory instead of global memory.

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
using megastep::l2_prefetch;
using megastep::mma16816;
using megastep::pdl_release;
using megastep::pdl_wait;
using megastep::splitk_sum;
using megastep::store_rows;

constexpr int kPad = 8;        // fp16 elements of padding per shared x row (spreads rows over banks)
constexpr int kMaxSplit = 32;  // CTAs along K at most (linear_fp8_staged.py's MAX_SPLIT)

// cp.async.wait_group n for n in 0..7 (its operand must be an immediate: in the unrolled block
// loop below the switch folds away)
__device__ __forceinline__ void cp_async_wait_pending(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
  }
}

// NT: n-tiles of 8 rows of x per CTA (MG = 8 NT rows); NB: 128-blocks of K per split (KC = 128 NB);
// W: warps per CTA (16 output channels each). pdl: 0 launched without PDL; 1 with it, the next
// kernel released once the weights are read; 2 released at entry. pf: 0, or the CTAs of the first
// wave (the CTA slots of the device, at least): those prefetch the later waves' weights into L2.
template <int NT, int NB, int W>
__device__ __forceinline__ void linear_staged(const __nv_bfloat16* x, long long stride_xm, const uint8_t* w,
                                              long long stride_wn, const uint8_t* ws, long long stride_wsn,
                                              void* out, long long stride_om, int out_bf16, float* part, int* cnt,
                                              int M, int N, int K, int group_n, int quant, int pdl, int pf) {
  constexpr int MG = 8 * NT, KC = 128 * NB, XS = KC + kPad;
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* wsh = smem;                                                  // [W][16][KC] e4m3, swizzled
  __half* xsh = reinterpret_cast<__half*>(smem + W * 16 * KC);          // [MG][XS] fp16 codes
  float* scsh = reinterpret_cast<float*>(smem + W * 16 * KC + MG * XS * 2);  // [MG][NB] act scales
  float* red = reinterpret_cast<float*>(smem);  // [W * 16][MG], once the weights are used

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int m0 = blockIdx.x * MG, mv = min(MG, M - m0);
  const int k_lo = blockIdx.z * KC;
  const int tile = blockIdx.y * W + warp;  // the warp's 16 output channels
  const bool active = tile * 16 < N;
  unsigned char* mine = wsh + warp * 16 * KC;

  // ---- every weight byte of the warp, requested before anything else: weights depend on nothing
  // the predecessor writes, so this runs while it drains (launched with PDL). One commit group per
  // 128-block, so that a CTA placed after its predecessor has completed starts on block 0 while
  // the others are in flight.
  const uint8_t* wt = w + (long long)tile * 16 * stride_wn + k_lo;
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    if (active) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // 16 rows x 8 chunks: 8 lanes per row, each row's 128 bytes at once
        const int id = i * 32 + lane, r = id >> 3, c = b * 8 + (id & 7);
        cp_async16(mine + r * KC + ((c ^ (r & 7)) << 4), wt + (long long)r * stride_wn + c * 16);
      }
    }
    cp_async_commit();
  }
  // ---- the CTAs that find no slot until a first-wave CTA leaves would stream their weights from
  // HBM then, after the input exists. CTA c < pf has its row of each later CTA c + j pf fetched
  // into L2 now (while the predecessor drains, HBM is idle), so those CTAs copy from L2. No value
  // depends on it. CTAs of another x tile (blockIdx.x > 0) read the same weights as tile 0's.
  const int me = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (me < pf && threadIdx.x < 16 * W) {
    const int ctas = gridDim.x * gridDim.y * gridDim.z;
    for (int c = me + pf; c < ctas; c += pf) {
      const int cy = (c / gridDim.x) % gridDim.y, cz = c / (gridDim.x * gridDim.y);
      const int row = cy * W * 16 + threadIdx.x;
      if (c % gridDim.x == 0 && row < N) l2_prefetch(w + (long long)row * stride_wn + cz * KC, KC);
    }
  }
  if (pdl == 2) pdl_release();  // at entry: the next kernel (another staged launch) copies beside us
  if (pdl) pdl_wait();

  // ---- the CTA's activation codes: fp16 in shared memory, scales beside them. Grouped (wo_a):
  // output rows [g N/G, (g+1) N/G) read x's columns [g K, (g+1) K); a CTA's tiles share one group
  const long long x_col = (long long)((blockIdx.y * W * 16) / group_n) * K + k_lo;
  for (int i = warp; i < mv * NB; i += W) {
    const int m = i / NB, b = i % NB, k = b * 128 + lane * 4;
    const uint2 u = *reinterpret_cast<const uint2*>(x + (m0 + m) * stride_xm + x_col + k);
    const float v[4] = {megastep::bf16_lo(u.x), megastep::bf16_hi(u.x), megastep::bf16_lo(u.y),
                        megastep::bf16_hi(u.y)};
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    float s, inv;
    uint32_t lo, hi;
    if (quant) {
      megastep::pow2_scale(amax, s, inv);
      lo = fp8_pair(v[0] * inv, v[1] * inv);
      hi = fp8_pair(v[2] * inv, v[3] * inv);
    } else {  // wo_a: the bf16 activation itself, scaled into fp16's range
      f16_pow2_scale(amax, s, inv);
      lo = f16_pair(v[0] * inv, v[1] * inv);
      hi = f16_pair(v[2] * inv, v[3] * inv);
    }
    if (lane == 0) scsh[m * NB + b] = s;
    *reinterpret_cast<uint2*>(xsh + m * XS + b * 128 + lane * 4) = make_uint2(lo, hi);
  }
  __syncthreads();  // x's codes

  // ---- the warp's 16 rows over the split's K range
  float acc[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  if (active) {
    const uint8_t* wsr = ws + (long long)(tile * 16 / 128) * stride_wsn + k_lo / 128;
    const unsigned char* rg = mine + g * KC + 4 * q;  // row g, word q (row g + 8 has the same swizzle)
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      // block b's copies (this lane's: at most NB - 1 - b groups may still be pending), then every lane's
      cp_async_wait_pending(NB - 1 - b);
      __syncwarp();
      float blk[NT][4];  // the block's dot, from zero, as Triton's per-block tl.dot
#pragma unroll
      for (int t = 0; t < NT; ++t) blk[t][0] = blk[t][1] = blk[t][2] = blk[t][3] = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // MMA j: the block's columns [16j, 16j + 16)
        const int off = b * 128 + ((j ^ g) << 4);  // segment j of the block, swizzled by the row
        uint32_t a0, a1, a2, a3;
        e4m3x4_to_f16x2(*reinterpret_cast<const uint32_t*>(rg + off), a0, a2);           // row g
        e4m3x4_to_f16x2(*reinterpret_cast<const uint32_t*>(rg + 8 * KC + off), a1, a3);  // row g + 8
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const int m = 8 * t + g;  // B: x row m at the same four columns
          uint2 xb = make_uint2(0u, 0u);
          if (m < mv) xb = *reinterpret_cast<const uint2*>(xsh + m * XS + b * 128 + 16 * j + 4 * q);
          mma16816<false>(blk[t], a0, a1, a2, a3, xb.x, xb.y);
        }
      }
      add_block<NT>(acc, blk, scsh + b, NB, e8m0_to_f32(wsr[b]), mv, q);
    }
  }
  if (pdl == 1) pdl_release();  // every weight byte is read
  __syncthreads();  // the weights are dead: `red` reuses their memory
  store_rows<NT>(red + warp * 16 * MG, acc, g, q, MG);
  __syncthreads();

  if (!splitk_sum<kMaxSplit>(red, part, cnt, W * 16, MG, mv)) return;  // the last split to arrive goes on

  // ---- the output, rounded once (linear_fp8's plain `_epilogue`): channels fastest (coalesced)
  constexpr int kRows = W * 16;
  for (int e = threadIdx.x; e < kRows * MG; e += (32 * W)) {
    const int m = e / kRows, r = e % kRows, n = blockIdx.y * kRows + r;
    if (m >= mv || n >= N) continue;
    const float y = red[r * MG + m];
    const long long mm = m0 + m;
    if (out_bf16) {
      static_cast<__nv_bfloat16*>(out)[mm * stride_om + n] = __float2bfloat16_rn(y);
    } else {
      static_cast<float*>(out)[mm * stride_om + n] = y;
    }
  }
}

}  // namespace

#define LINEAR_STAGED_PARAMS                                                                                  \
  const __nv_bfloat16 *x, long long stride_xm, const uint8_t *w, long long stride_wn, const uint8_t *ws,     \
      long long stride_wsn, void *out, long long stride_om, int out_bf16, float *part, int *cnt, int M, int N, \
      int K, int group_n, int quant, int pdl, int pf
#define LINEAR_STAGED_ARGS \
  x, stride_xm, w, stride_wn, ws, stride_wsn, out, stride_om, out_bf16, part, cnt, M, N, K, group_n, quant, pdl, pf
#define LINEAR_STAGED_ENTRY(NT, NB, W)                                                                       \
  extern "C" __global__ void __launch_bounds__(32 * W) linear_fp8_staged_nt##NT##_nb##NB##_w##W(LINEAR_STAGED_PARAMS) { \
    linear_staged<NT, NB, W>(LINEAR_STAGED_ARGS);                                                                \
  }
#define LINEAR_STAGED_NB(NB, W) LINEAR_STAGED_ENTRY(1, NB, W) LINEAR_STAGED_ENTRY(2, NB, W)
#define LINEAR_STAGED_W(W) LINEAR_STAGED_NB(1, W) LINEAR_STAGED_NB(2, W) LINEAR_STAGED_NB(4, W) LINEAR_STAGED_NB(8, W)
LINEAR_STAGED_W(4)
LINEAR_STAGED_W(8)
