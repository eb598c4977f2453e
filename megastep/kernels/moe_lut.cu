// The routed MXFP4 experts' two weight launches in CUDA C++: the "lut" mode of kernels/moe.py
// (moe_lut.py launches them; moe.py's module doc has the semantics and moe_experts_mxfp4_ref the
// torch reference). They take the places of _moe_gate_up_kernel and _moe_down_kernel, with the
// same inputs and outputs, on x in natural order (not permuted per 32-group). The activation
// quantization between them stays a launch of its own: done by the last CTA of each (pair,
// 128-block) inside gate-up (same bits) it cost 2.5-3 us per call at 1 row and 5 % at 4-16 rows on
// the H200, against 1.1-1.6 us for the launch (docs/PERFORMANCE.md, tenth measurement).
//
// The decode is a table lookup: a byte of packed MXFP4 (two e2m1 codes) indexes a 256-entry table
// in shared memory whose entry is the two exact values as bf16x2. One prmt forms the address (the
// byte lands in bits 8-15 next to the lane's word offset: entries are 256 B apart and every lane
// reads its own copy, so a warp's 32 lookups never share a bank), one ld.shared fetches the MMA
// operand register: 1 integer op + 1 shared load per byte, where the arithmetic decode of
// "dot_asm" issues ~3.5 integer ops per byte.
//
// MMA layout (mma.m16n8k16, bf16 in, fp32 out). A warp owns 16 MMA rows: gate-up 8 channels of w1
// (rows 0-7) and the same channels of w3 (rows 8-15), so a lane ends with w1's and w3's sums of
// one channel; down 16 rows of w2. Lane (g, t) of the warp (g = lane / 4, t = lane % 4) reads rows
// g and g + 8 over the whole of K, its two halves summed apart. A step covers 128 contiguous bytes
// of each row (8 MXFP4 groups) and lane t takes groups t and t + 4 of them, so each L2 line is
// consumed whole by the step that loads it (a first version gave each lane its own 256-byte range,
// 32 B a step: the L2 evicted the prefetched rest before its use and DRAM read each byte ~2.6
// times).
// The scale of a group must multiply only that group's sum, and each lane brings its own group to
// an MMA: so the B operand is block-diagonal, column 4p + o holds pair p's x only in the K slots
// of lane o of a quad (zeros elsewhere: 4 lanes per pair load x, the others keep zero registers).
// Then C[g][4p + o] is exactly lane (g, o)'s group sum for pair p. It sits in lane (g, 2p + o / 2)'s
// c0/c1, which applies the group's E8M0 scale (its quad neighbour o's scale byte: a lane loads
// all 8 of a step's scale bytes of its rows): acc += C * 2^(s - 127) (exact product). Two pairs
// per MMA; more pairs of an expert run further passes over its rows. The columns are pair-major
// so that at one pair per pass (every pass at 1 row, most at 16) the lanes that load x lie in one
// half-warp: one shared-memory wavefront per x load. Until 2026-12-01 column 2t + p held (owner t,
// pair p), whose 8 loading lanes spanned both halves: the same sums in the same order (the same
// bits, GPU-tested), 2-4 % slower per experts call and 1.6-2.4 % per 30-layer step at 1, 4, 16
// and 64 rows on one H200 (docs/PERFORMANCE.md, twenty-second measurement).
//
// Order of sums, fixed whatever the batch or the routing of other rows: per (row, pair) a group's
// 32 products in one MMA chain (8 MMAs, fp32), the groups of each K half of a lane in order (t,
// t + 4, t + 8, ...), the 4 lanes of a quad by a butterfly ((q0 + q1) + (q2 + q3)) per half, then
// half 0 + half 1. Deterministic and batch invariant (a pair's column never meets another pair's
// values).
//
// Work: a CTA (8 warps: 8 row blocks, each streaming its rows' whole K) takes items (slot, 128 MMA
// rows) in turn over a grid of at most 2 CTAs per SM (gate-up at 1-2 rows may instead deal the
// warps' 16-row tasks out over one 12-warp CTA per SM: run_spread); x of the item's pairs is
// staged in shared memory, swizzled so that the 4 lanes loading a pair's x hit distinct banks.
// Until 2026-11-30 a CTA was 4 row blocks x 2 K halves (items of 64 MMA rows,
// twice as many, the halves added through shared memory): the same sums in the same order, so the
// same bits (GPU-tested against each other), and 3-12 % slower per call on one H200 at 1-64 rows,
// 4 % per 30-layer step at 4-64 rows, 1 % at 1 row (docs/PERFORMANCE.md, fourteenth measurement).

#include <cuda_bf16.h>
#include <stdint.h>

#include "cuda_common.cuh"

// Steps of weight bytes in flight per lane (64 B a step). Measured on one H200 at V4-Flash shapes
// (benchmarks/kernels/moe_cuda_variants.py): 3 spills registers and is 15-25 % slower; issuing a
// pass's first loads before its x is staged (to overlap the staging) was 1-4 % slower; L2
// prefetches of each warp's line 2, 4 or 8 steps past the ring were 1-7 % slower
// (docs/PERFORMANCE.md, fifteenth measurement).
constexpr int KPF = 2;

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kLutBytes = 256 * 256;
// The mixed decode (kMix: moe_gate_up_lut_ring_mix) holds x's block exponents after the table: 2 CTA
// halves x 2 rows x at most 64 blocks (K <= 8192; moe_lut.py's EXP_BYTES).
constexpr int kExpBytes = 2 * 2 * 64 * 4;
using megastep::bf16_hi;
using megastep::bf16_lo;
using megastep::ld_stream;
using megastep::pow2_scale;
using megastep::round_bf16;

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// the table entry of byte K of w: bits 0-7 the lane's word offset (lane * 4), bits 8-15 the byte
template <int K>
__device__ __forceinline__ uint32_t lut(const char* table, uint32_t w, uint32_t lane_off) {
  return *reinterpret_cast<const uint32_t*>(table + prmt(w, lane_off, 0x5504u | (K << 4)));
}

// d += A . B on the tensor cores, bf16 or (kF16: the mixed decode's odd blocks) fp16 operands, fp32 sums
#define MMA_16816(T)                                                                                          \
  asm("mma.sync.aligned.m16n8k16.row.col.f32." T "." T ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, " \
      "{%0, %1, %2, %3};"                                                                                     \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                        \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))
template <bool kF16 = false>
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  if constexpr (kF16)
    MMA_16816("f16");
  else
    MMA_16816("bf16");
}
#undef MMA_16816

// The decode in registers (the mixed decode's odd 128-blocks of K; moe_lut.py's RING_MIX). In
// fp16 every e2m1 value has a zero low byte (0.5 = 0x3800 ... 6 = 0x4600), so a code's fp16 is its
// magnitude's high byte, looked up by prmt in an 8-byte table held in two constants, with the sign
// bit set beside it: word w's 8 codes -> d[b] = byte b's two values as fp16x2 (low nibble in the low
// half), 13 integer instructions for 4 bytes and no shared memory. x is then staged in fp16 as its
// e4m3 codes (x / s, s its 128-block's power-of-two scale: exact), and s joins the group's scale:
// the same products and, as the GPU tests found on the H200, the same sums (an fp16 k16 step rounds
// as a bf16 one). Why mixed: the table's lookups are LSU instructions (one per 4 weight bytes of a
// warp), this decode's are ALU ones (~108 per 1 KB). In the ring gate-up, whose weights also pass
// through shared memory (cp.async in, ld.shared out), the LSU pipe was the busiest on one H200 (51 %
// of its peak on average, 70 % on the SMs that ran two items; ALU 28 / 39 %); half of each step in
// registers moves it to 35 / 49 % (ALU 47 / 64 %) and the kernel is 4-6 % faster at 1, 16 and 64 rows.
// All in registers ("f16") was 4-16 % slower, and the mixed decode in down and the register ring
// 1-7 % slower: their LSU pipe was not the busiest (docs/PERFORMANCE.md, twenty-fourth measurement).
__device__ __forceinline__ void decode_f16(uint32_t w, uint32_t (&d)[4]) {
  constexpr uint32_t kT0 = 0x3E3C3800u, kT1 = 0x46444240u;  // fp16 high bytes of magnitudes 0 .. 7
  const uint32_t m = w & 0x77777777u, ws = w << 4;
  // bytes of w and of w << 4 whose bit 7 is the sign of codes 0 .. 3 (0x1504) and 4 .. 7 (0x3726)
  const uint32_t lo = prmt(kT0, kT1, m) | (prmt(w, ws, 0x1504u) & 0x80808080u);
  const uint32_t hi = prmt(kT0, kT1, m >> 16) | (prmt(w, ws, 0x3726u) & 0x80808080u);
  d[0] = prmt(lo, 0u, 0x1404u);  // [0, code 0, 0, code 1]
  d[1] = prmt(lo, 0u, 0x3424u);  // [0, code 2, 0, code 3]
  d[2] = prmt(hi, 0u, 0x1404u);
  d[3] = prmt(hi, 0u, 0x3424u);
}

__device__ __forceinline__ uint32_t e2m1_bf16(uint32_t n) {  // exact bf16 bits of an e2m1 code
  const uint32_t m = n & 7, e = m >> 1, f = m & 1;
  const uint32_t mag = e == 0 ? (f ? 0x3F00u : 0u) : (((126u + e) << 7) | (f << 6));
  return mag | ((n & 8) << 12);
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ void prefetch_l2(const uint8_t* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// PDL (cuda_common.cuh; moe_lut.py launches with it when the step uses PDL): a grid of these
// kernels (at most 2 CTAs per SM) is resident from its start, so the next kernel's CTAs, placed
// after pdl_release, never take a slot one of its own CTAs needs.
using megastep::pdl_release;
using megastep::pdl_wait;

__device__ __forceinline__ float scale_f(uint32_t s) { return __uint_as_float(s << 23); }  // 2^(s-127), s >= 1

// Shared memory after the table: x of 2 pairs, a group of x (32 bf16) in 64 B. The 4 lanes that
// load a pair's x read groups 8s + t (t = 0..3) at the same element: banks 16t apart, so groups t
// and t + 2 would meet; the 8-byte units of groups with (q / 2) odd are stored swapped in pairs
// (unit j at j ^ 1), which puts the 4 reads on distinct banks (pair 1's readers are in the other
// half-warp). (Until 2026-12-01 groups took 80 B to the same end.)
struct Layout {
  int rowpitch, bytes;
  __device__ __host__ explicit Layout(int K) : rowpitch(K * 2), bytes(K * 4) {}
};
constexpr int kGroupPitch = 64;

struct Args {
  const __nv_bfloat16* x;  // gate-up: xq [M, D] (row = pair / topk); down: aq [P, I] (row = pair)
  long long stride_x;
  const long long* tab;    // [E, 4] addresses: w13, w13 scale, w2, w2 scale
  const int *pair_ptr, *slot_e, *slot_start, *slot_cnt, *nslot;
  int K, w3_rows, topk, sparse, down;  // w3_rows: gate-up I (w3 follows w1); down 0
  long long stride_w, stride_s;
  int spread;  // gate-up's spread schedule (run_spread): the rows of x (1 or 2); 0: run
  int slots;   // run_gm's kPairs deal: the routing's slots (the launch's bound on nslot); else 0
};

// One step of a warp's 16 rows (pass() below): its 16 MMAs on the lane's weight words a0 / a1
// (row g, groups t and t + 4 of the step) and b0 / b1 (row g + 8), then the scaled adds into acc.
// Groups t (x's block 2s, c0) by the table; groups t + 4 (block 2s + 1, c1) by the table or (kMix)
// decode_f16.
// xe / xo: the lane's x at the step's group t for even / odd 8-byte units j (the swizzle); an
// inactive lane keeps x0 / x1 at zero. fa / fb: the step's 8 scale bytes of each row; sha / shb:
// the bit offsets of the lane's two columns' owners in them.
template <bool kMix = false>
__device__ __forceinline__ void step_sums(const char* table, uint32_t lane_off, const char* xe, const char* xo,
                                          bool active, const uint4& a0, const uint4& a1, const uint4& b0,
                                          const uint4& b1, uint2 fa, uint2 fb, int sha, int shb, uint2& x0, uint2& x1,
                                          float (&acc)[4], int ex1 = 0) {
  float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
  uint32_t da1[4], db1[4];  // (kMix) the decoded words of the current j pair
#pragma unroll
  for (int j = 0; j < 8; ++j) {  // bytes 2j, 2j + 1 of each group: elements 4j .. 4j + 3
    // (16-byte x loads for two j at once: 128 registers, spills, 10-20 % slower on the H200)
    if (active) {
      const char* xs = j & 1 ? xo : xe;
      x0 = *reinterpret_cast<const uint2*>(xs + j * 8);
      x1 = *reinterpret_cast<const uint2*>(xs + 4 * kGroupPitch + j * 8);
    }
    const uint32_t wa0 = word(a0, j >> 1), wb0 = word(b0, j >> 1), wa1 = word(a1, j >> 1), wb1 = word(b1, j >> 1);
    if (j & 1)
      mma(c0, lut<2>(table, wa0, lane_off), lut<2>(table, wb0, lane_off), lut<3>(table, wa0, lane_off),
          lut<3>(table, wb0, lane_off), x0.x, x0.y);
    else
      mma(c0, lut<0>(table, wa0, lane_off), lut<0>(table, wb0, lane_off), lut<1>(table, wa0, lane_off),
          lut<1>(table, wb0, lane_off), x0.x, x0.y);
    if constexpr (kMix) {
      if (!(j & 1)) {
        decode_f16(wa1, da1);
        decode_f16(wb1, db1);
      }
      const int k = (j & 1) * 2;
      mma<true>(c1, da1[k], db1[k], da1[k + 1], db1[k + 1], x1.x, x1.y);
    } else if (j & 1) {
      mma(c1, lut<2>(table, wa1, lane_off), lut<2>(table, wb1, lane_off), lut<3>(table, wa1, lane_off),
          lut<3>(table, wb1, lane_off), x1.x, x1.y);
    } else {
      mma(c1, lut<0>(table, wa1, lane_off), lut<0>(table, wb1, lane_off), lut<1>(table, wa1, lane_off),
          lut<1>(table, wb1, lane_off), x1.x, x1.y);
    }
  }
  // groups o (c0) and o + 4 (c1) of the step, o the column's owner
  // (kMix: c1 times x's block scale 2^ex1 too; else ex1 = 0)
  const float sa0 = scale_f((fa.x >> sha) & 0xFF), sa1 = scale_f(((fa.y >> sha) & 0xFF) + ex1);
  const float sb0 = scale_f((fb.x >> sha) & 0xFF), sb1 = scale_f(((fb.y >> sha) & 0xFF) + ex1);
  const float ta0 = scale_f((fa.x >> shb) & 0xFF), ta1 = scale_f(((fa.y >> shb) & 0xFF) + ex1);
  const float tb0 = scale_f((fb.x >> shb) & 0xFF), tb1 = scale_f(((fb.y >> shb) & 0xFF) + ex1);
  acc[0] = fmaf(c0[0], sa0, acc[0]);
  acc[1] = fmaf(c0[1], ta0, acc[1]);
  acc[2] = fmaf(c0[2], sb0, acc[2]);
  acc[3] = fmaf(c0[3], tb0, acc[3]);
  acc[0] = fmaf(c1[0], sa1, acc[0]);
  acc[1] = fmaf(c1[1], ta1, acc[1]);
  acc[2] = fmaf(c1[2], sb1, acc[2]);
  acc[3] = fmaf(c1[3], tb1, acc[3]);
}

// A warp's weight stream over its 16 rows. wa / wb: the lane's first group of rows g / g + 8;
// sa_p / sb_p: the scale bytes of those rows. Two kinds, with the same members: Stream keeps
// kDepth steps in flight in registers; RingStream (kRingDepth steps) copies the weights into the
// warp's slots in shared memory (cp.async) and keeps only the scale bytes in registers. fill()
// issues the first steps; take(i, s, ...) gives step s's operands (ring slot i = s % kDepth) and
// after(i, s) refills slot i with step s + kDepth once they are read.
struct StreamBase {
  const uint8_t *wa, *wb, *sa_p, *sb_p;
  int steps;
};

struct Stream : StreamBase {
  static constexpr int kDepth = KPF;
  static constexpr bool kSlots = false;  // (RingStream: true, its `ring` to set)
  uint4 ra[KPF][2], rb[KPF][2];
  uint2 sa[KPF], sb[KPF];  // the step's 8 scale bytes of each row (this lane's: bytes t and 4 + t)

  __device__ __forceinline__ void load(int i, int n) {
#ifdef MOE_LUT_NO_LOAD  // (the probe build's loop without its memory: operands made from n)
    const uint32_t v = 0x9E3779B9u * (n + 1);
    ra[i][0] = ra[i][1] = rb[i][0] = rb[i][1] = make_uint4(v, v ^ 1u, v ^ 2u, v ^ 3u);
    sa[i] = sb[i] = make_uint2(0x7F7F7F7Fu, 0x7F7F7F7Fu);
#else
    ra[i][0] = ld_stream(wa + n * 128);
    ra[i][1] = ld_stream(wa + n * 128 + 64);
    rb[i][0] = ld_stream(wb + n * 128);
    rb[i][1] = ld_stream(wb + n * 128 + 64);
    sa[i] = __ldg(reinterpret_cast<const uint2*>(sa_p + n * 8));
    sb[i] = __ldg(reinterpret_cast<const uint2*>(sb_p + n * 8));
#endif
  }

  __device__ __forceinline__ void fill() {
#pragma unroll
    for (int i = 0; i < KPF; ++i)
      if (i < steps) load(i, i);
  }

  __device__ __forceinline__ void take(int i, int s, uint4& a0, uint4& a1, uint4& b0, uint4& b1, uint2& fa,
                                       uint2& fb) {
    a0 = ra[i][0], a1 = ra[i][1], b0 = rb[i][0], b1 = rb[i][1], fa = sa[i], fb = sb[i];
    if (s + KPF < steps) load(i, s + KPF);  // (the registers are free once copied)
  }
  __device__ __forceinline__ void after(int, int) {}
};

// Steps in flight of RingStream: 16 warps x 4 slots x 2 KB = 128 KB of shared memory per SM, beside
// the table (64 KB) and two CTA halves' x (32 KB at K = 4096).
constexpr int kRingDepth = 4;

using megastep::cp_async16;
using megastep::cp_async_commit;

// A slot holds a step's 2 KB as 4 pieces of 512 B (the lane's 16 bytes of row g's groups t and t + 4,
// then of row g + 8's), lane-major within a piece: a lane reads back only its own bytes, and a
// warp's 16-byte reads or copies of a piece cover 512 contiguous bytes (no bank conflict).
struct RingStream : StreamBase {
  static constexpr int kDepth = kRingDepth;
  static constexpr bool kSlots = true;
  const char* ring;  // the warp's slot 0, at this lane's 16 bytes of piece 0
  uint2 sa[kRingDepth], sb[kRingDepth];

  __device__ __forceinline__ void load(int i, int n) {
#ifdef MOE_LUT_NO_LOAD  // (the probe build's loop without its memory: the slots are read as they are)
    sa[i] = sb[i] = make_uint2(0x7F7F7F7Fu, 0x7F7F7F7Fu + n);
#else
    const char* d = ring + i * 2048;
    cp_async16(d, wa + n * 128);
    cp_async16(d + 512, wa + n * 128 + 64);
    cp_async16(d + 1024, wb + n * 128);
    cp_async16(d + 1536, wb + n * 128 + 64);
    sa[i] = __ldg(reinterpret_cast<const uint2*>(sa_p + n * 8));
    sb[i] = __ldg(reinterpret_cast<const uint2*>(sb_p + n * 8));
#endif
  }

  // one commit group per step, empty past the last: at take(s) groups 0 .. s are complete once at
  // most kDepth - 1 are pending
  __device__ __forceinline__ void fill() {
#pragma unroll
    for (int i = 0; i < kRingDepth; ++i) {
      if (i < steps) load(i, i);
      cp_async_commit();
    }
  }

  __device__ __forceinline__ void take(int i, int, uint4& a0, uint4& a1, uint4& b0, uint4& b1, uint2& fa,
                                       uint2& fb) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kRingDepth - 1) : "memory");
    const char* d = ring + i * 2048;
    a0 = *reinterpret_cast<const uint4*>(d);
    a1 = *reinterpret_cast<const uint4*>(d + 512);
    b0 = *reinterpret_cast<const uint4*>(d + 1024);
    b1 = *reinterpret_cast<const uint4*>(d + 1536);
    fa = sa[i], fb = sb[i];
  }

  // after the step's MMAs have read a0 .. b1: the slot is free for step s + kDepth
  __device__ __forceinline__ void after(int i, int s) {
    if (s + kRingDepth < steps) load(i, s + kRingDepth);
    cp_async_commit();
  }
};

// One pass (2 pairs at most): per-lane partial sums of the lane's four MMA outputs c[0..3] =
// (row g, column 2t), (row g, 2t + 1), (row g + 8, 2t), (row g + 8, 2t + 1), each over the
// groups of its column's owner, of K half 0 in lo and of half 1 in acc (at step steps / 2 the
// sums so far move to lo and acc starts again from zero). Column 4p + o is (owner o, pair p):
// lane t's columns are owners 2(t & 1) and 2(t & 1) + 1 of pair t / 2, and it scales each by
// its owner's group. t: the lane's group within 4; xl: the lane's x at its first group, read
// only by an active lane (the others keep zero registers).
template <typename S, bool kMix = false>
__device__ __forceinline__ void pass(S& st, const char* table, uint32_t lane_off, const char* xl, int t, bool active,
                                     float (&acc)[4], float (&lo)[4], const int* xexp = nullptr) {
  const int sha = 16 * (t & 1), shb = sha + 8;  // bit offsets of the scale bytes of the two owners
  const int sw = t & 2 ? 8 : 0;                 // x's swizzle (Layout): unit j of group t at j ^ (t / 2)
  uint2 x0 = make_uint2(0u, 0u), x1 = make_uint2(0u, 0u);
  for (int s0 = 0; s0 < st.steps; s0 += S::kDepth) {
#pragma unroll
    for (int i = 0; i < S::kDepth; ++i) {
      const int s = s0 + i;
      if (s >= st.steps) break;
      if (2 * s == st.steps) {
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          lo[v] = acc[v];
          acc[v] = 0.f;
        }
      }
      uint4 a0, a1, b0, b1;
      uint2 fa, fb;
      st.take(i, s, a0, a1, b0, b1, fa, fb);
      const char* xs = xl + s * 8 * kGroupPitch;  // the step's groups t and t + 4 of x
      // (kMix) the exponent of x's scale of block 2s + 1 (groups 4-7 of the step)
      const int ex1 = kMix ? xexp[2 * s + 1] - 127 : 0;
      step_sums<kMix>(table, lane_off, xs + sw, xs - sw, active, a0, a1, b0, b1, fa, fb, sha, shb, x0, x1, acc, ex1);
      st.after(i, s);
    }
  }
}

struct Item {  // the item (expert slot, tile) of a pass: its pairs start at `start`
  int start, cnt, tile;
};

// The decode table: entry v (256 B apart) holds 32 copies of byte v's two values. Thread v
// (CTAs of at least 256 threads) decodes entry v once and writes its 128 B as 8 16-byte stores,
// store k at chunk (k + v) % 8 so that the 8 threads of a store phase hit distinct banks. (One
// word per store and each value decoded for every copy took ~250 instructions per warp, ~1-2 us
// per launch at 1 row: docs/PERFORMANCE.md, twenty-second measurement.)
__device__ __forceinline__ void prologue(char* smem) {
  const int v = threadIdx.x;
  if (v < 256) {
    const uint32_t e = e2m1_bf16(v & 15) | (e2m1_bf16(v >> 4) << 16);
    const uint4 q = make_uint4(e, e, e, e);
#pragma unroll
    for (int k = 0; k < 8; ++k) *reinterpret_cast<uint4*>(smem + v * 256 + ((k + v) & 7) * 16) = q;
  }
}

// unit u of row slot r of the Layout (16 bytes: 8-byte units 2(u % 4) and 2(u % 4) + 1 of group
// u / 4, swapped when the group's (q / 2) is odd)
__device__ __forceinline__ void store_unit(char* xsm, const Layout& L, int r, int u, uint4 v) {
  if (u & 8) v = make_uint4(v.z, v.w, v.x, v.y);  // (group u / 4 with bit 1 set)
  *reinterpret_cast<uint4*>(xsm + r * L.rowpitch + u * 16) = v;
}

// The mixed decode's form of unit u (8 values v) of a row of x: an even 128-block's unit as it is; an odd
// block's as its values in fp16 x / s, s the block's power-of-two scale (pow2_scale of the block's max:
// the block's 16 units are a half-warp's, the callers' units running in warp order, every lane taking
// part in the max), whose biased exponent goes to sexp. Returns whether the block is odd.
__device__ __forceinline__ bool mix_unit(uint4& v, int u, int& sexp) {
  const float f[8] = {bf16_lo(v.x), bf16_hi(v.x), bf16_lo(v.y), bf16_hi(v.y),
                      bf16_lo(v.z), bf16_hi(v.z), bf16_lo(v.w), bf16_hi(v.w)};
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (!(u & 16)) return false;  // (an even block: half-warp-uniform)
  float sc, inv;
  pow2_scale(amax, sc, inv);
  uint32_t h[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2 q = __floats2half2_rn(f[2 * i] * inv, f[2 * i + 1] * inv);
    h[i] = *reinterpret_cast<const uint32_t*>(&q);
  }
  v = make_uint4(h[0], h[1], h[2], h[3]);
  sexp = __float_as_int(sc) >> 23;
  return true;
}

// x row `src` into row slot r of the Layout: unit u by the calling thread. kMix: in mix_unit's form (an
// even 128-block's unit for the table's MMAs, an odd one's for decode_f16's), the odd block's biased exponent
// of s into xexp[r][u / 16]. x holds e4m3 codes times a power of two (the activation quantization's
// output), so x / s is exact in fp16.
template <bool kMix = false>
__device__ __forceinline__ void stage_unit(char* xsm, int* xexp, const Args& a, const Layout& L, int r, int src,
                                           int u) {
  uint4 v = *reinterpret_cast<const uint4*>(a.x + src * a.stride_x + u * 8);
  int sexp;
  const bool odd = kMix && mix_unit(v, u, sexp);
  store_unit(xsm, L, r, u, v);
  if (odd && !(u & 15)) xexp[r * (L.rowpitch / 256) + u / 16] = sexp;
}

// x rows of pairs c0 .. c0 + np - 1 into row slots 0 .. np - 1, by the 256 threads of a CTA (half)
// (kMix: odd blocks in fp16 with their exponents in xexp; every lane of a warp runs the same
// iterations, a row's units being a multiple of 64)
template <bool kMix = false>
__device__ __forceinline__ void stage_x(char* xsm, const Args& a, const Layout& L, int start, int c0, int np,
                                        int* xexp = nullptr) {
  const int units = a.K / 8;  // 16-byte units of a row
  for (int i = threadIdx.x & (kThreads - 1); i < np * units; i += kThreads) {
    const int p = i / units;
    const int pair = a.pair_ptr[start + c0 + p];
    stage_unit<kMix>(xsm, xexp, a, L, p, a.down ? pair : pair / a.topk, i % units);
  }
}

// A warp's sums over its 16 rows for the pass's pairs (pair p of the pass in row slot xrow[p] of
// the staged x): total[v] = half 0 + half 1 of the lane's rows g / g + 8 and pairs 0 / 1 (v = 0:
// (g, 0), 1: (g, 1), 2: (g + 8, 0), 3: (g + 8, 1)), each half's sum over the 4 owners as
// (o0 + o1) + (o2 + o3) first. The ring must be filled. The x loaders: lane (g, t) with
// g = 4p + t for the pass's pair p. table: the decode table; xsm: the staged x.
template <typename S, bool kMix = false>
__device__ __forceinline__ void warp_sums(S& st, const char* table, const char* xsm, const Layout& L, int np,
                                          const int (&xrow)[2], float (&total)[4], const int* xexp = nullptr) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, p = g >> 2;
  const bool active = (g & 3) == t && p < np;
  const int xr = p ? xrow[1] : xrow[0];  // (no local-memory indexing)
  const char* xl = xsm + xr * L.rowpitch + t * kGroupPitch;
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, lo[4];
  // (kMix: x's block exponents, [row][K / 128], of the row of the pair whose columns the lane holds,
  // t / 2, not of the pair whose x it loads; a lane of an absent pair takes row 0's: finite scales
  // for its zero sums)
  const int xe_row = t >> 1 && np > 1 ? xrow[1] : xrow[0];
  pass<S, kMix>(st, table, lane * 4, xl, t, active, acc, lo, kMix ? xexp + xe_row * (L.rowpitch / 256) : nullptr);
  // lane t: owners 2(t & 1), 2(t & 1) + 1 of pair t / 2, rows g (v = 0) and g + 8 (v = 1)
  float tv[2];
#pragma unroll
  for (int v = 0; v < 2; ++v) {
    float a = acc[2 * v] + acc[2 * v + 1], l = lo[2 * v] + lo[2 * v + 1];
    a += __shfl_xor_sync(0xffffffffu, a, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    tv[v] = l + a;
  }
  const int q = lane & ~3;  // lanes q, q + 1 hold pair 0's totals, q + 2, q + 3 pair 1's
  total[0] = __shfl_sync(0xffffffffu, tv[0], q);
  total[1] = __shfl_sync(0xffffffffu, tv[0], q + 2);
  total[2] = __shfl_sync(0xffffffffu, tv[1], q);
  total[3] = __shfl_sync(0xffffffffu, tv[1], q + 2);
}

// Passes of 2 kSets pairs (moe_down_lut4: kSets = 2, 4 pairs a pass). An expert's item streams its
// rows once for every 2 of its pairs in warp_sums; the loop is bound by its own instructions, so
// each further pass costs about what the first did (at 64 rows 1.43 passes per expert read under
// the synthetic gates' routing, docs/PERFORMANCE.md, 2026-12-06 from 23:36). Here each decoded A
// fragment feeds one MMA per pair set, set k with its own x into its own sums: per pair the MMAs,
// scales, adds and the final butterfly of step_sums / pass / warp_sums, in the same order, so a
// pair's bits do not depend on its set or on the pass width. (The 1-set functions above stay as
// they are: templating them on kSets changed the registers and schedule of every experts kernel.)
// Without the mixed decode (down's).
// An m16n8k16 A fragment by the table: bytes 2j, 2j + 1 of word wa (row g) and of wb (row g + 8), as the
// operands step_sums gives its MMAs.
__device__ __forceinline__ void a_frag(const char* table, int j, uint32_t wa, uint32_t wb, uint32_t lane_off,
                                       uint32_t (&f)[4]) {
  if (j & 1) {
    f[0] = lut<2>(table, wa, lane_off), f[1] = lut<2>(table, wb, lane_off);
    f[2] = lut<3>(table, wa, lane_off), f[3] = lut<3>(table, wb, lane_off);
  } else {
    f[0] = lut<0>(table, wa, lane_off), f[1] = lut<0>(table, wb, lane_off);
    f[2] = lut<1>(table, wa, lane_off), f[3] = lut<1>(table, wb, lane_off);
  }
}

template <int kSets>
__device__ __forceinline__ void step_sums_sets(const char* table, uint32_t lane_off, const char* const (&xe)[kSets],
                                               const char* const (&xo)[kSets], const bool (&active)[kSets],
                                               const uint4& a0, const uint4& a1, const uint4& b0, const uint4& b1,
                                               uint2 fa, uint2 fb, int sha, int shb, float (&acc)[kSets][4]) {
  float c0[kSets][4], c1[kSets][4];
#pragma unroll
  for (int k = 0; k < kSets; ++k)
#pragma unroll
    for (int v = 0; v < 4; ++v) c0[k][v] = c1[k][v] = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    uint2 x0[kSets], x1[kSets];  // (an inactive lane's x is zero; not carried from step to step)
#pragma unroll
    for (int k = 0; k < kSets; ++k) {
      const char* xs = j & 1 ? xo[k] : xe[k];
      x0[k] = active[k] ? *reinterpret_cast<const uint2*>(xs + j * 8) : make_uint2(0u, 0u);
      x1[k] = active[k] ? *reinterpret_cast<const uint2*>(xs + 4 * kGroupPitch + j * 8) : make_uint2(0u, 0u);
    }
    // the A fragments of groups t (c0) and t + 4 (c1), each fed to every set's MMA
    uint32_t e[4], o[4];
    a_frag(table, j, word(a0, j >> 1), word(b0, j >> 1), lane_off, e);
#pragma unroll
    for (int k = 0; k < kSets; ++k) mma(c0[k], e[0], e[1], e[2], e[3], x0[k].x, x0[k].y);
    a_frag(table, j, word(a1, j >> 1), word(b1, j >> 1), lane_off, o);
#pragma unroll
    for (int k = 0; k < kSets; ++k) mma(c1[k], o[0], o[1], o[2], o[3], x1[k].x, x1[k].y);
  }
  const float sa0 = scale_f((fa.x >> sha) & 0xFF), sa1 = scale_f((fa.y >> sha) & 0xFF);
  const float sb0 = scale_f((fb.x >> sha) & 0xFF), sb1 = scale_f((fb.y >> sha) & 0xFF);
  const float ta0 = scale_f((fa.x >> shb) & 0xFF), ta1 = scale_f((fa.y >> shb) & 0xFF);
  const float tb0 = scale_f((fb.x >> shb) & 0xFF), tb1 = scale_f((fb.y >> shb) & 0xFF);
#pragma unroll
  for (int k = 0; k < kSets; ++k) {
    acc[k][0] = fmaf(c0[k][0], sa0, acc[k][0]);
    acc[k][1] = fmaf(c0[k][1], ta0, acc[k][1]);
    acc[k][2] = fmaf(c0[k][2], sb0, acc[k][2]);
    acc[k][3] = fmaf(c0[k][3], tb0, acc[k][3]);
    acc[k][0] = fmaf(c1[k][0], sa1, acc[k][0]);
    acc[k][1] = fmaf(c1[k][1], ta1, acc[k][1]);
    acc[k][2] = fmaf(c1[k][2], sb1, acc[k][2]);
    acc[k][3] = fmaf(c1[k][3], tb1, acc[k][3]);
  }
}

// warp_sums over 2 kSets pairs (pair p of the pass in row slot xrow[p]): total[4k + v] = warp_sums'
// total[v] of set k (pairs 2k, 2k + 1). pass()'s loop, one x pointer, flag and sums per set. The sums
// of K half 0 wait in shared memory (losm: kSets float4 per thread of the CTA) instead of registers:
// held there, down's 4-pair build spilled to local memory.
template <typename S, int kSets>
__device__ __forceinline__ void warp_sums_sets(S& st, const char* table, const char* xsm, const Layout& L, int np,
                                               const int (&xrow)[2 * kSets], float (&total)[4 * kSets],
                                               float4* losm) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, p = g >> 2;
  const int sha = 16 * (t & 1), shb = sha + 8, sw = t & 2 ? 8 : 0;  // (pass())
  const char* xl[kSets];
  bool active[kSets];
  float acc[kSets][4];
#pragma unroll
  for (int k = 0; k < kSets; ++k) {
    active[k] = (g & 3) == t && 2 * k + p < np;
    xl[k] = xsm + (p ? xrow[2 * k + 1] : xrow[2 * k]) * L.rowpitch + t * kGroupPitch;
#pragma unroll
    for (int v = 0; v < 4; ++v) acc[k][v] = 0.f;
  }
  for (int s0 = 0; s0 < st.steps; s0 += S::kDepth) {
#pragma unroll
    for (int i = 0; i < S::kDepth; ++i) {
      const int s = s0 + i;
      if (s >= st.steps) break;
      if (2 * s == st.steps) {
#pragma unroll
        for (int k = 0; k < kSets; ++k) {
          losm[k * kThreads + threadIdx.x] = make_float4(acc[k][0], acc[k][1], acc[k][2], acc[k][3]);
#pragma unroll
          for (int v = 0; v < 4; ++v) acc[k][v] = 0.f;
        }
      }
      uint4 a0, a1, b0, b1;
      uint2 fa, fb;
      st.take(i, s, a0, a1, b0, b1, fa, fb);
      const char* xe[kSets];
      const char* xo[kSets];
#pragma unroll
      for (int k = 0; k < kSets; ++k) {
        xe[k] = xl[k] + s * 8 * kGroupPitch + sw;
        xo[k] = xl[k] + s * 8 * kGroupPitch - sw;
      }
      step_sums_sets<kSets>(table, lane * 4, xe, xo, active, a0, a1, b0, b1, fa, fb, sha, shb, acc);
      st.after(i, s);
    }
  }
  const int q = lane & ~3;
#pragma unroll
  for (int k = 0; k < kSets; ++k) {
    const float4 l4 = losm[k * kThreads + threadIdx.x];
    const float lo[4] = {l4.x, l4.y, l4.z, l4.w};
    float tv[2];
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      float a = acc[k][2 * v] + acc[k][2 * v + 1], l = lo[2 * v] + lo[2 * v + 1];
      a += __shfl_xor_sync(0xffffffffu, a, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      tv[v] = l + a;
    }
    total[4 * k + 0] = __shfl_sync(0xffffffffu, tv[0], q);
    total[4 * k + 1] = __shfl_sync(0xffffffffu, tv[0], q + 2);
    total[4 * k + 2] = __shfl_sync(0xffffffffu, tv[1], q);
    total[4 * k + 3] = __shfl_sync(0xffffffffu, tv[1], q + 2);
  }
}

// The weight stream of a warp's 16 rows of slot `slot`, row block `rb` (gate-up: channels rb * 8
// + g of w1 and of w3; down: rows rb * 16 + g and + 8 of w2); cnt: the slot's pairs, 0 for an
// expert absent from a sparse table. (A RingStream's slots are the caller's to set.)
template <typename S = Stream>
__device__ __forceinline__ S warp_stream(const Args& a, int slot, int rb, int& r0, int& r1, int& cnt, int& start) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int e = __ldcg(a.slot_e + slot);
  const long long* ent = a.tab + 4LL * e + (a.down ? 2 : 0);  // (w13, scale) or (w2, scale)
  const uint8_t* wbase = reinterpret_cast<const uint8_t*>(ent[0]);
  const uint8_t* sbase = reinterpret_cast<const uint8_t*>(ent[1]);
  cnt = a.sparse && wbase == nullptr ? 0 : __ldcg(a.slot_cnt + slot);
  start = __ldcg(a.slot_start + slot);
  r0 = a.down ? rb * 16 + g : rb * 8 + g;
  r1 = a.down ? r0 + 8 : r0 + a.w3_rows;
  S st;
  st.wa = wbase + r0 * a.stride_w + t * 16;
  st.wb = wbase + r1 * a.stride_w + t * 16;
  st.sa_p = sbase + r0 * a.stride_s;
  st.sb_p = sbase + r1 * a.stride_s;
  st.steps = a.K / 256;  // a row's 128-byte steps
  return st;
}

// The probe build (-DMOE_LUT_PROBE, benchmarks/kernels/moe_lut_probe.py; the runtime's build has none
// of it): thread 0 of each CTA stamps the phases of run() for its first item, globaltimer (ns) and
// its SM's clock64, for gate-up (kind 0) and down (kind 1); `dep` is a value the stamp waits for
// (an asm input), so a stamp after a load is taken once the load has returned. With
// -DMOE_LUT_NO_LOAD as well the weight streams load nothing (the streams' load() above): the loop's
// own rate, wrong values.
#ifdef MOE_LUT_PROBE
constexpr int kProbeCtas = 320, kProbeMarks = 10;
__device__ unsigned long long moe_lut_probe_buf[2][kProbeCtas][kProbeMarks][2];
__device__ __forceinline__ void probe(int kind, int mark, int dep) {
  if (threadIdx.x == 0 && blockIdx.x < kProbeCtas) {
    unsigned long long g, c;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g) : "r"(dep) : "memory");
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(c)::"memory");
    moe_lut_probe_buf[kind][blockIdx.x][mark][0] = g;
    moe_lut_probe_buf[kind][blockIdx.x][mark][1] = c;
  }
}
#define PROBE(kind, mark, dep) probe(kind, mark, dep)
#else
#define PROBE(kind, mark, dep)
#endif

// A barrier of the 256 threads that run() gives an item: the CTA, or with kHalves = 2 its half
// (named barriers 1 and 2; 0 is __syncthreads').
template <int kHalves>
__device__ __forceinline__ void item_sync() {
  if constexpr (kHalves == 1)
    __syncthreads();
  else
    asm volatile("bar.sync %0, %1;" ::"r"(1 + (threadIdx.x >> 8)), "n"(kThreads) : "memory");
}

// Runs every (slot, tile) item of this CTA; for each pass calls epi(item, c0, np, r0, r1, total) in
// every warp with total[v] = the full sums of the lane's rows r0 / r1 (half 0 + half 1), then
// post(item, c0, np) in every thread after item_sync.
// S = Stream: a CTA of 8 warps (kHalves = 1; 2 CTAs per SM, each with its own table).
// S = RingStream: a CTA of 16 warps in two halves of 8 (kHalves = 2) that take items apart, as two
// CTAs would, sharing one table; then the weights' steps in flight live in shared memory, not in
// registers: kRingDepth per warp instead of KPF (moe_gate_up_lut_ring; moe_lut.py's ring_rows).
// kMix: the mixed decode (decode_f16 for x's odd blocks), x's block exponents after the table.
template <typename S, int kHalves, bool kMix = false, int kSets = 1, typename Epi, typename Post>
__device__ __forceinline__ void run(const Args& a, int tiles, Epi epi, Post post) {
  extern __shared__ __align__(16) char smem[];
  const Layout L(a.K);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, blk = warp & (kWarps - 1), t = lane & 3;
  const int half = kHalves == 2 ? threadIdx.x >> 8 : 0;
  constexpr int kTable = kLutBytes + (kMix ? kExpBytes : 0);
  char* xsm = smem + kTable + half * L.bytes;
  const char* ring = smem + kTable + kHalves * L.bytes + warp * kRingDepth * 2048 + lane * 16;
  int* xexp = reinterpret_cast<int*>(smem + kLutBytes) + half * 2 * (a.K / 128);  // (kMix) [2 rows][K / 128]
  PROBE(a.down, 0, 0);
  prologue(smem);
  if constexpr (kHalves == 2) __syncthreads();  // (the table; with one half the first item_sync orders it)
  PROBE(a.down, 1, 0);
  // Under PDL gate-up waits here: x and the routing are its predecessor's (the router's) outputs;
  // then it releases its dependents (the activation quantization, which releases down at once).
  // down reads the routing and requests its first item's weights before it waits for aq (the
  // quantization's output): the routing was complete before gate-up's release, which came after
  // gate-up's own wait. (The routing is read past L1: .cg)
  bool waiting = a.down;
  if (!waiting) {
    pdl_wait();
    pdl_release();
  }
  const int items = __ldcg(a.nslot) * tiles;
  PROBE(a.down, 2, items);
  constexpr int kPass = 2 * kSets;  // pairs a pass
  int xrow[kPass];  // a pass's pairs in row slots 0 .. kPass - 1
#pragma unroll
  for (int p = 0; p < kPass; ++p) xrow[p] = p;
#ifdef MOE_LUT_PROBE
  int probed = 0;  // items of this CTA half
#endif
  // (half h of CTA b: items b + h G, b + (h + 2) G, ... of a grid of G CTAs, so that a launch of
  // fewer than 2 G items spreads over every SM first)
  for (int it = blockIdx.x + half * gridDim.x; it < items; it += gridDim.x * kHalves) {
    const int slot = it / tiles, tile = it % tiles;
    int r0, r1, cnt, start;
    S st = warp_stream<S>(a, slot, tile * kWarps + blk, r0, r1, cnt, start);
    if constexpr (S::kSlots) st.ring = ring;
#ifdef MOE_LUT_PROBE
    const bool first = probed++ == 0;
    if (first) PROBE(a.down, 3, cnt + start);
#endif
    bool filled = false;
    if (waiting) {  // down's first item: the ring filled, and the rest of its rows asked of L2
      // (also the rows of the CTA's next 1 or 3 items: no faster on one H200, docs/PERFORMANCE.md)
      if (cnt > 0) {
        st.fill();
        filled = true;
        for (int s = S::kDepth + t; s < st.steps; s += 4) {  // lane t: steps kDepth + t, + 4, ... of the quad's rows
          prefetch_l2(st.wa - t * 16 + s * 128);
          prefetch_l2(st.wb - t * 16 + s * 128);
        }
      }
      pdl_wait();
      pdl_release();
      PROBE(a.down, 4, 0);
      waiting = false;
    }
    for (int c0 = 0; c0 < cnt; c0 += kPass) {
      const int np = min(kPass, cnt - c0);
      item_sync<kHalves>();  // the previous pass's readers of x are done
      stage_x<kMix>(xsm, a, L, start, c0, np, xexp);
      item_sync<kHalves>();
#ifdef MOE_LUT_PROBE
      if (first && c0 == 0) PROBE(a.down, 5, 0);
#endif
      if (!filled) st.fill();
      filled = false;
      float total[2 * kPass];
      if constexpr (kSets == 1)
        warp_sums<S, kMix>(st, smem, xsm, L, np, xrow, total, xexp);
      else
        warp_sums_sets<S, kSets>(st, smem, xsm, L, np, xrow, total,
                                 reinterpret_cast<float4*>(xsm + kPass * L.rowpitch));  // (after x's rows)
#ifdef MOE_LUT_PROBE
      if (first && c0 == 0) PROBE(a.down, 6, __float_as_int(total[0]));
#endif
      epi(Item{start, cnt, tile}, c0, np, r0, r1, total);
      item_sync<kHalves>();
      post(Item{start, cnt, tile}, c0, np);
#ifdef MOE_LUT_PROBE
      if (first && c0 == 0) PROBE(a.down, 7, 0);
#endif
    }
  }
#ifdef MOE_LUT_PROBE
  PROBE(a.down, 8, 0);
  if (threadIdx.x == 0 && blockIdx.x < kProbeCtas) moe_lut_probe_buf[a.down][blockIdx.x][9][0] = probed;
#endif
}

// The spread schedule of gate-up, for launches in which every slot has at most 2 pairs (M <= 2:
// one pass per slot). run() gives a CTA whole items (slot, 8 row blocks): at one row the 6 slots'
// 192 items leave 72 of an H200's 132 SMs with one CTA and 60 with two, and the launch lasts as
// long as the SMs with two (31 us, against 21 us when no SM has two: docs/PERFORMANCE.md, fifteenth
// measurement). Here one CTA of kSpreadWarps warps per SM takes the launch's T = slots x blocks
// warp tasks (slot, 8 channels) in an even share: CTA c tasks [c T / G, (c + 1) T / G), its warp w
// tasks lo + w, lo + w + kSpreadWarps, ... So every SM streams about as many rows as any other,
// and a quarter of each SM's registers stays free for the side stream's launches (2 CTAs of 8
// warps per SM left none: the step at 1 row lost 0.18 ms). That quarter is still too small for
// the shared expert's w1/w3 program (128 threads x 168 registers), which then runs beside down
// instead of beside gate-up: at 1 row the step gains nothing, at 2 rows 2 % (moe_lut.py's
// SPREAD_ROWS). A warp's sums are run()'s (warp_sums, same order): the same bits. x's a.spread
// rows are staged once per CTA (row slots 0, 1). S = RingStream (moe_gate_up_lut_spread_ring): each
// warp's weights in kRingDepth slots of shared memory after x, as in run().
constexpr int kSpreadWarps = 12;

// (kMix: the mixed decode, x's block exponents after the table, as in run())
template <typename S, bool kMix = false, typename Epi>
__device__ __forceinline__ void run_spread(const Args& a, int blocks, Epi epi) {
  extern __shared__ __align__(16) char smem[];
  const Layout L(a.K);
  const int blk = threadIdx.x >> 5;
  constexpr int kTable = kLutBytes + (kMix ? kExpBytes : 0);
  char* xsm = smem + kTable;
  const char* ring = smem + kTable + L.bytes + blk * kRingDepth * 2048 + (threadIdx.x & 31) * 16;
  int* xexp = reinterpret_cast<int*>(smem + kLutBytes);  // (kMix) [2 rows][K / 128]
  prologue(smem);
  pdl_wait();  // (run's PDL order)
  pdl_release();
  const int T = __ldcg(a.nslot) * blocks;
  const int lo = (int)((long long)blockIdx.x * T / gridDim.x), hi = (int)((long long)(blockIdx.x + 1) * T / gridDim.x);
  const int units = a.K / 8;
  for (int i = threadIdx.x; i < a.spread * units; i += kSpreadWarps * 32)  // (warp-uniform: units % 64 == 0)
    stage_unit<kMix>(xsm, xexp, a, L, i / units, i / units, i % units);
  __syncthreads();
  for (int task = lo + blk; task < hi; task += kSpreadWarps) {
    int r0, r1, cnt, start;
    S st = warp_stream<S>(a, task / blocks, task % blocks, r0, r1, cnt, start);
    if (cnt == 0) continue;
    if constexpr (S::kSlots) st.ring = ring;
    st.fill();
    int xrow[2];
#pragma unroll
    for (int p = 0; p < 2; ++p) xrow[p] = p < cnt ? __ldcg(a.pair_ptr + start + p) / a.topk : 0;
    float total[4];
    warp_sums<S, kMix>(st, smem, xsm, L, cnt, xrow, total, xexp);
    epi(Item{start, cnt, 0}, 0, cnt, r0, r1, total);
  }
}

// r * silu(min(rnd(gv), limit)) * clamp(rnd(uv), +-limit) of a pair's gate and up sums (rnd: with round_out)
__device__ __forceinline__ float swiglu(float gv, float uv, float limit, int round_out, float r) {
  if (round_out) {
    gv = round_bf16(gv);
    uv = round_bf16(uv);
  }
  gv = fminf(gv, limit);
  uv = fminf(fmaxf(uv, -limit), limit);
  return __fmul_rn(__fmul_rn(__fdiv_rn(gv, __fadd_rn(1.f, expf(-gv))), uv), r);
}

// gate-up's body: kSpread picks run_spread's schedule (moe_gate_up_lut_spread) or run's, kRing
// the RingStream (moe_gate_up_lut_ring, moe_gate_up_lut_spread_ring).
// act[pair, i] = rnd(r * silu(min(rnd(w1 . x), limit)) * clamp(rnd(w3 . x), +-limit))  (bf16)
template <bool kSpread, bool kRing = false, bool kMix = false>  // (kMix: with kRing only)
__device__ __forceinline__ void gate_up(const Args& a, const float* rw, __nv_bfloat16* act, long long stride_a,
                                        float limit, int round_out) {
  const int t = threadIdx.x & 3;
  auto epi = [&](const Item& it, int c0, int np, int r0, int, const float (&total)[4]) {
    if (t < np) {  // lane t of the quad: pair c0 + t of channel r0
      const int pair = a.pair_ptr[it.start + c0 + t];
      // (no local-memory indexing)
      act[pair * stride_a + r0] =
          __float2bfloat16_rn(swiglu(t ? total[1] : total[0], t ? total[3] : total[2], limit, round_out, rw[pair]));
    }
  };
  if constexpr (kSpread && kRing)
    run_spread<RingStream, kMix>(a, a.w3_rows / 8, epi);
  else if constexpr (kSpread)
    run_spread<Stream>(a, a.w3_rows / 8, epi);
  else if constexpr (kRing)
    run<RingStream, 2, kMix>(a, a.w3_rows / (kWarps * 8), epi, [](const Item&, int, int) {});
  else
    run<Stream, 1>(a, a.w3_rows / (kWarps * 8), epi, [](const Item&, int, int) {});
}

// down's combine after a pass of np pairs (pairs c0 .. of the slot at start, every y of the pass issued: the
// barrier before it): each pair's row counts this (row, kTile-row tile); the last CTA to count a row's tile
// sums its topk pairs' y in slot order (fp32) into out, or with shared (bf16 [M, D]) rnd(that + shared) into
// out (bf16), and resets the counter. last: a shared int per pair of a pass.
template <int kTile, int kPass>
__device__ __forceinline__ void combine_pass(const Args& a, int start, int c0, int np, int tile, int tiles,
                                             const __nv_bfloat16* y, long long stride_y, void* out, long long stride_o,
                                             int* counters, const __nv_bfloat16* shared, long long stride_sh,
                                             int (&last)[kPass]) {
  const int topk = a.topk;
  if (threadIdx.x < np) {  // (a fence on each side of the count: the last CTA sees every y)
    const int row = a.pair_ptr[start + c0 + threadIdx.x] / topk;
    __threadfence();
    const int arrived = atomicAdd(counters + row * tiles + tile, 1);
    __threadfence();
    last[threadIdx.x] = arrived == topk - 1 ? row : -1;
  }
  __syncthreads();
  for (int p = 0; p < np; ++p) {
    const int row = last[p];
    if (row < 0) continue;
    if (threadIdx.x < kTile) {  // the row's topk pairs, slot order, fp32
      const int d = tile * kTile + threadIdx.x;
      const unsigned short* yp = reinterpret_cast<const unsigned short*>(y) + (long long)row * topk * stride_y + d;
      float tot = __uint_as_float((uint32_t)__ldcg(yp) << 16);
      for (int j = 1; j < topk; ++j) tot += __uint_as_float((uint32_t)__ldcg(yp + j * stride_y) << 16);
      if (shared) {
        tot += __bfloat162float(shared[row * stride_sh + d]);
        static_cast<__nv_bfloat16*>(out)[row * stride_o + d] = __float2bfloat16_rn(tot);
      } else {
        static_cast<float*>(out)[row * stride_o + d] = tot;
      }
    }
    if (threadIdx.x == 0) counters[row * tiles + tile] = 0;
  }
}

// y[pair, d] = rnd(w2 . aq[pair]); with combine, the last CTA to finish a (row, 128-row tile) of
// all its topk pairs sums them in slot order into out (fp32), then resets the counter; with
// shared (bf16 [M, D], the shared expert's output) out is bf16 and receives rnd(sum + shared).
// (A spread schedule for down, one warp's task per 16 rows and the combine by the last warp, was
// 1.5-3 us slower at 1-8 experts of one row: docs/PERFORMANCE.md, fifteenth measurement.)
// (down through the RingStream, in CTA halves, was 12-27 % slower per call at 1-64 rows on one H200
// while gate-up gained: docs/PERFORMANCE.md, twenty-second measurement. down's warp tasks after the
// spread gate-up's in the same launch, the activation quantized by each CTA once its slots' gate-up
// tasks were counted done, were 0-10 % faster alone at 1 row but 9-17 % slower in the step, the
// shared expert's launch waiting for SMs: twenty-third measurement, the code at bce6479.)
// kSets = 2 (moe_down_lut4): passes of 4 pairs (warp_sums_sets).
template <int kSets = 1>
__device__ __forceinline__ void down(const Args& a, __nv_bfloat16* y, long long stride_y, void* out,
                                     long long stride_o, int* counters, int D, int combine,
                                     const __nv_bfloat16* shared, long long stride_sh) {
  __shared__ int last[2 * kSets];
  constexpr int kTile = kWarps * 16;  // output rows of an item
  const int t = threadIdx.x & 3, tiles = D / kTile;
  run<Stream, 1, false, kSets>(a, tiles, [&](const Item& it, int c0, int np, int r0, int r1,
                                             const float (&total)[4 * kSets]) {
#pragma unroll
    for (int k = 0; k < kSets; ++k) {
      const int p = 2 * k + (t & 1);
      if (p < np) {  // lane t: row r0 (t < 2) or r1, pair c0 + 2k + t % 2
        const int pair = a.pair_ptr[it.start + c0 + p];
        const float* tk = total + 4 * k;
        const float v = t == 0 ? tk[0] : t == 1 ? tk[1] : t == 2 ? tk[2] : tk[3];
        y[pair * stride_y + (t < 2 ? r0 : r1)] = __float2bfloat16_rn(v);
      }
    }
  }, [&](const Item& it, int c0, int np) {
    if (combine) combine_pass<kTile>(a, it.start, c0, np, it.tile, tiles, y, stride_y, out, stride_o, counters, shared,
                                     stride_sh, last);
  });
}

// ---- gate-up, group-major (moe_gate_up_gm; moe_lut.py's GATE_UP_GM) ----
// The kernels above give each lane of a quad its own MXFP4 group (its 16-byte load), so an MMA's k16
// holds 4 groups and its B must be block-diagonal: 4 of its 8 columns per pair, 2 pairs per MMA, and
// an expert with more pairs streams and decodes its rows once for every 2 of them (down4: 4, at twice
// the MMAs). Here the weights pass through shared memory (cp.async, as RingStream) and come back by
// ldmatrix, which hands lane (g, t) word t of a 16-byte row: with a slot's 16-byte units laid out as
// rows (weight row, group), the 4 lanes of a quad hold the same group of the same row, so an MMA's k16
// is one group's 16 elements and its 8 columns are 8 pairs, each with its own x: a pass takes up to
// kGmPairs pairs at the instructions of one (the decode, the MMAs), where the pair-major kernels need
// a pass per 2. The price: a group's sum ends after 2 MMAs, so its scale is applied per group (4 fmaf
// and 2 scale bytes a group, 32 + 16 a step, against 8 + 8).
// Order of sums, per (pair, channel of w1 or w3), fixed whatever the batch: per group the 32 products in
// two chained MMAs (elements 8t .. 8t + 3 of the quad's lanes t, then 8t + 4 .. 8t + 7; fp32), times
// the group's scale into an fp32 sum over each K half in group order, then half 0 + half 1 (down's w2: one sum
// over the whole K). A column never meets another pair's values: batch invariant. Not the pair-major kernels'
// order, so not their bits: a step takes this kernel for every gate-up launch or for none (down likewise). Why
// two sums: 1-row launches (moe_gate_up_gm_few) give a task's halves to two warps, whose chains are half as
// long, and every other launch must add the same two sums.
// Work: one CTA of kGmWarps warps per SM; a warp's task is 8 channels of a slot (MMA rows g: w1, g + 8:
// w3) over the whole K, its pairs in passes of kGmPairs, x staged for the CTA (gate_up_gm's two schedules).
constexpr int kGmWarps = 16, kGmThreads = 32 * kGmWarps;
constexpr int kGmPairs = 8;   // pairs a pass: an MMA's 8 columns
constexpr int kGmDepth = 3;   // a warp's 2 KB ring slots (4 do not fit beside 8 rows of x at K = 4096)
// down's (K = I = 2048: 4 fit, 224.5 KB): 8 KB of a warp's w2 in flight, not 6. The same bits; on one H100 the step
// -0.91 % at 1 row, within -0.48 / +0.15 % at 2-64 (docs/PERFORMANCE.md, 2026-12-07 from 10:16, item 5)
constexpr int kGmDownDepth = 4;
constexpr int kGmPad = 64;    // bytes after each staged row of x: pair g's row 4 bank groups from g - 1's

// 16-byte unit of (MMA row r, group G of the step) in a 2 KB slot: row r's 8 groups in its own 128 B, the
// group XOR r % 8, so that ldmatrix's 8 rows of one group hit 8 distinct bank groups. Copies: the 8 lanes of a
// quarter warp take one row's 128 bytes of the step, one global line into one 128 B of the slot. ncu's counts
// (H100, 2026-12-07) fit a cp.async costing a shared-memory wavefront per (global line, 128 B of shared memory)
// pair its lanes touch, whatever the banks: the first layout here (a group's 8 rows in one 128 B, copied as
// RingStream's lanes copy) took 32 a copy, 8 times the ideal, and the kernel 1.6x the ring's time at 16 rows.
__device__ __forceinline__ int gm_unit(int r, int G) { return r * 8 + (G ^ (r & 7)); }

// ldmatrix.x4 at a shared-memory address
__device__ __forceinline__ void ldsm_x4(uint32_t p, uint32_t (&d)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(p));
}

// d = A . B (a zero C), bf16 operands
__device__ __forceinline__ void mma_z(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                      uint32_t b1) {
  d[0] = d[1] = d[2] = d[3] = 0.f;
  mma(d, a0, a1, a2, a3, b0, b1);
}

// A barrier of a warp pair (run_gm's kPairs): an mbarrier in shared memory of `count` threads a phase (named
// barriers number 16 a CTA, less the CTA's own: 15 pairs at most; 32-warp CTAs have 16)
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// every thread of the pair arrives, then waits for the phase of parity `phase` to complete (release / acquire:
// the pair's shared-memory writes before it are seen after it); phase flips for the next
__device__ __forceinline__ void pair_sync(uint32_t bar, uint32_t& phase) {
  asm volatile(
      "{\n"
      ".reg .b64 st;\n"
      ".reg .pred done;\n"
      "mbarrier.arrive.shared::cta.b64 st, [%0];\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(phase)
      : "memory");
  phase ^= 1;
}

// A warp's ring of kDepth slots over its 16 MMA rows. Lane l copies, per step, group l % 8 of rows l / 8,
// 4 + l / 8 (w1), 8 + l / 8 and 12 + l / 8 (w3) into their units; it reads back by 4 ldmatrix.x4 (q = 0 .. 3:
// groups 2q and 2q + 1, matrices (rows 0-7, 2q), (8-15, 2q), (0-7, 2q + 1), (8-15, 2q + 1)), lane l giving row
// l % 8 of matrix l / 8. The scale bytes stay in registers (8 a row a step, lane (g, t)'s rows g and g + 8, as
// RingStream's).
template <int kDepth>
struct GmRing {
  // this lane's copy rows at its group: l / 8 of w1 (wa) and w3 (wb), 4 + l / 8 (wa4, wb4)
  const uint8_t *wa, *wa4, *wb, *wb4, *sa_p, *sb_p;
  int steps;
  const char *put, *put4;  // the warp's slot 0 at this lane's units of rows l / 8 and 4 + l / 8 (w3's: 1 KB on)
  uint32_t get[4];         // the warp's slot 0 at this lane's ldmatrix unit for q (a shared-memory address)
  uint2 sa[kDepth], sb[kDepth];

  __device__ __forceinline__ void load(int i, int n) {
    const int off = i * 2048;
    cp_async16(put + off, wa + n * 128);
    cp_async16(put4 + off, wa4 + n * 128);
    cp_async16(put + off + 1024, wb + n * 128);
    cp_async16(put4 + off + 1024, wb4 + n * 128);
    sa[i] = __ldg(reinterpret_cast<const uint2*>(sa_p + n * 8));
    sb[i] = __ldg(reinterpret_cast<const uint2*>(sb_p + n * 8));
  }

  __device__ __forceinline__ void fill() {
#pragma unroll
    for (int i = 0; i < kDepth; ++i) {
      if (i < steps) load(i, i);
      cp_async_commit();
    }
  }

  // step s's words (slot i): w[G][0] row g's word t of group G, w[G][1] row g + 8's. Unlike RingStream's
  // lanes, a lane reads units other lanes copied: each waits for its own copies, then the warp's barrier
  // makes all of them visible to all (the refill after the step cannot overtake these reads: it follows
  // the MMAs that consume them).
  __device__ __forceinline__ void take(int i, uint32_t (&w)[8][2], uint2& fa, uint2& fb) {
    asm volatile("cp.async.wait_group %0;" ::"n"(kDepth - 1) : "memory");
    __syncwarp();
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t d[4];
      ldsm_x4(get[q] + i * 2048, d);
      w[2 * q][0] = d[0], w[2 * q][1] = d[1], w[2 * q + 1][0] = d[2], w[2 * q + 1][1] = d[3];
    }
    fa = sa[i], fb = sb[i];
  }

  __device__ __forceinline__ void after(int i, int s) {
    if (s + kDepth < steps) load(i, s + kDepth);
    cp_async_commit();
  }
};

// byte G (0 .. 7) of f (a step's 8 scale bytes of a row)
__device__ __forceinline__ int byte_of(uint2 f, int G) { return ((G < 4 ? f.x : f.y) >> (8 * (G & 3))) & 0xFF; }

// A warp's sums over its 16 rows for a pass (lane (g, t) brings column g's x: xl, at its 8t-th element of
// group 0): total[0 / 1] row g (w1) for columns 2t / 2t + 1, total[2 / 3] row g + 8 (w3); kTwo: as two
// sums, over the ring's first st.steps / 2 steps and over the rest, added at the end (gate-up's order over
// its whole K), else one. The ring is filled here.
// Only a lane whose column holds a pair (active) loads x: the others' B registers keep what they hold (a
// column never meets another, and those are not read), so at 1 row a warp's x load is 4 lanes' 64 bytes, one
// shared-memory wavefront, not 4.
template <int kDepth, bool kTwo>
__device__ __forceinline__ void warp_sums_gm(GmRing<kDepth>& st, const char* table, const char* xl, bool active,
                                             float (&total)[4]) {
  const uint32_t lane_off = (threadIdx.x & 31) * 4;
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, first[4];
  uint4 xv = make_uint4(0u, 0u, 0u, 0u);
  st.fill();
  for (int s0 = 0; s0 < st.steps; s0 += kDepth) {
#pragma unroll
    for (int i = 0; i < kDepth; ++i) {
      const int s = s0 + i;
      if (s >= st.steps) break;
      if (kTwo && s == st.steps / 2) {
#pragma unroll
        for (int v = 0; v < 4; ++v) first[v] = acc[v], acc[v] = 0.f;
      }
      uint32_t w[8][2];
      uint2 fa, fb;
      st.take(i, w, fa, fb);
#pragma unroll
      for (int G = 0; G < 8; ++G) {
        if (active) xv = *reinterpret_cast<const uint4*>(xl + (s * 8 + G) * 64);
        float c[4];
        mma_z(c, lut<0>(table, w[G][0], lane_off), lut<0>(table, w[G][1], lane_off), lut<1>(table, w[G][0], lane_off),
              lut<1>(table, w[G][1], lane_off), xv.x, xv.y);
        mma(c, lut<2>(table, w[G][0], lane_off), lut<2>(table, w[G][1], lane_off), lut<3>(table, w[G][0], lane_off),
            lut<3>(table, w[G][1], lane_off), xv.z, xv.w);
        const float ra = scale_f(byte_of(fa, G)), rb = scale_f(byte_of(fb, G));
        acc[0] = fmaf(c[0], ra, acc[0]);
        acc[1] = fmaf(c[1], ra, acc[1]);
        acc[2] = fmaf(c[2], rb, acc[2]);
        acc[3] = fmaf(c[3], rb, acc[3]);
      }
      st.after(i, s);
    }
  }
#pragma unroll
  for (int v = 0; v < 4; ++v) total[v] = kTwo ? first[v] + acc[v] : acc[v];
}

// The group-major body (gate-up's and down's): a warp's task is 16 MMA rows of a slot's weights (gate-up: 8
// channels of w1, rows g, and the same of w3, rows g + 8; down: 16 rows of w2) over the whole K, its pairs in
// passes of kGmPairs. Two schedules, the same per-warp work (so the same bits): kSpread (gate-up's launches of
// a.spread <= kXRows rows: every row of x staged once, in row slot m for row m): one CTA per SM takes the
// launch's T = slots x blocks warp tasks in an even share, CTA c tasks [c T / G, (c + 1) T / G), its warp w
// tasks lo + w, lo + w + kWarps, ... (run_spread's deal: at 1 row 1536 tasks, where items of 128 channels
// would be 96 on 132 SMs), a lane finding its pair's row slot from the routing; else items (slot, kWarps
// tasks) in turn, the item's pairs in passes of kGmPairs whose x rows (gate-up: the pairs' rows of x; down:
// the pairs' own rows of aq) are staged for the pass (slot p for the pass's pair p). epi(start, c0, np, r0,
// r1, total): the lane's outputs of a task (warp_sums_gm's total: rows r0, r1, columns = pairs c0 + 2t,
// c0 + 2t + 1); with kPost, post(start, c0, np, tile) after each item pass, every output of it issued.
// kTwo: a task's sums in two chains, one a K half (gate-up's order, warp_sums_gm); kPairs (kSpread, kTwo): a CTA
// takes kWarps / 2 tasks at a time (lo + m, lo + m + kWarps / 2, ...), warps 2m and 2m + 1 the halves of task
// m, and 2m adds 2m + 1's sums to its own through 2m + 1's first ring slot (free by then) between two barriers
// of the pair (pair_sync): each warp streams half the rows' bytes, so at 1 row, where a launch has about one
// task a warp, a task's chain is half as long. Passes of at most kXRows pairs (the rows of x a CTA stages).
// kDepth: a warp's ring slots (a pair's sums do not depend on them: the same bits whatever the depth). (4 slots
// for gate-up at 1-2 rows, in passes of 2 pairs with 2 rows of x staged, gave the same bits and +0.16 / +0.58 %
// at 1 / 2 rows on one H100: docs/PERFORMANCE.md, 2026-12-07 from 12:20; the code at f75b03e.)
// (Filling a warp's ring before x is staged, and down's first ring before its PDL wait with the rest of its rows
// asked of L2, as the pair-major down does, was 0.4 % faster at 1 row and 1.3-4.7 % slower at 2-64 rows on one
// H100: docs/PERFORMANCE.md, 2026-12-07 from 10:16, item 4; the code at 1418cde.)
// kEarly (items, down): a CTA's first item's routing is read before the PDL wait, as run's down reads it (run says
// why that is safe: only aq is the predecessor's), so that its chain of dependent loads (nslot, then the slot's
// expert, start and count, then the table entry) overlaps the activation quantization.
template <bool kSpread, bool kPost, int kDepth, bool kTwo, int kWarps = kGmWarps, int kXRows = kGmPairs,
          bool kPairs = false, bool kEarly = false, typename Epi, typename Post>
__device__ __forceinline__ void run_gm(const Args& a, int blocks, Epi epi, Post post) {
  static_assert(!kPairs || (kSpread && kTwo && kWarps % 2 == 0 && kWarps <= 32), "warp pairs: halves of tasks");
  static_assert(!kEarly || !kSpread, "the early routing: the items schedule");
  __shared__ __align__(8) unsigned long long pair_bar[kPairs ? kWarps / 2 : 1];
  constexpr int kTasks = kPairs ? kWarps / 2 : kWarps;  // a CTA's tasks at a time
  constexpr int kPass = kXRows < kGmPairs ? kXRows : kGmPairs;  // pairs a pass
  extern __shared__ __align__(16) char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int pitch = 2 * a.K + kGmPad, units = a.K / 8;
  // a task's rows: block blk's 8 (down: 16) from blk * rstep, the second 8 `second` rows after the first
  const int rstep = a.down ? 16 : 8, second = a.down ? 8 : a.w3_rows;
  char* xsm = smem + kLutBytes;
  char* slots = xsm + kXRows * pitch + warp * kDepth * 2048;
  // unit u of x row src into row slot r
  auto stage = [&](int r, int src, int u) {
    *reinterpret_cast<uint4*>(xsm + r * pitch + u * 16) =
        *reinterpret_cast<const uint4*>(a.x + src * a.stride_x + u * 8);
  };
  // this lane's ldmatrix unit for q: row l % 8 (+ 8 for odd l / 8) of group 2q + l / 16
  const int lr = (lane & 7) + ((lane >> 3) & 1) * 8;
  // this lane's copies: group l % 8 of rows l / 8 (+ 4, + 8, + 12)
  const int cr = lane >> 3, cg = lane & 7;
  prologue(smem);
  if constexpr (!kEarly) {
    pdl_wait();  // (run's PDL order; down: aq is the activation quantization's output)
    pdl_release();
  }
  // a warp's task of those at a time, its steps: kPairs a K half (warp 2m + h: task m, half h), else the whole K
  const int me = kPairs ? warp >> 1 : warp, half = kPairs ? (warp & 1) : 0;
  const int steps = kPairs ? a.K / 512 : a.K / 256, s0 = half * steps;
  const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(pair_bar + (kPairs ? me : 0)));
  uint32_t phase = 0;
  if (kPairs && threadIdx.x % 64 == 0) mbar_init(bar, 64);  // (before the CTA's first barrier below)
  // expert e's table entry: w13's address and scales' (gate-up) or w2's (down)
  auto entry = [&](int e) { return a.tab + 4LL * e + (a.down ? 2 : 0); };
  // warp task (a slot's weights wbase and their scales sbase, block blk), pairs c0 .. c0 + np - 1 of the slot, lane
  // g's x in row slot xr
  auto task = [&](const uint8_t* wbase, const uint8_t* sbase, int blk, int start, int c0, int np, int xr) {
    const int r0 = blk * rstep + g, r1 = r0 + second;
    GmRing<kDepth> st;
    st.wa = wbase + (blk * rstep + cr) * a.stride_w + cg * 16 + s0 * 128;
    st.wb = st.wa + second * a.stride_w;
    st.wa4 = st.wa + 4 * a.stride_w;
    st.wb4 = st.wb + 4 * a.stride_w;
    st.sa_p = sbase + r0 * a.stride_s + s0 * 8;
    st.sb_p = sbase + r1 * a.stride_s + s0 * 8;
    st.steps = steps;
    st.put = slots + 16 * gm_unit(cr, cg);
    st.put4 = slots + 16 * gm_unit(cr + 4, cg);
#pragma unroll
    for (int q = 0; q < 4; ++q)
      st.get[q] = static_cast<uint32_t>(__cvta_generic_to_shared(slots + 16 * gm_unit(lr, 2 * q + (lane >> 4))));
    float total[4];
    warp_sums_gm<kDepth, kTwo && !kPairs>(st, smem, xsm + xr * pitch + t * 16 + s0 * 512, g < np, total);
    if constexpr (kPairs) {  // half 1's sums to half 0 (lane by lane, through half 1's slot 0)
      float4* xch = reinterpret_cast<float4*>(slots + (half ? 0 : kDepth * 2048)) + lane;
      if (half) *xch = make_float4(total[0], total[1], total[2], total[3]);
      pair_sync(bar, phase);
      if (!half) {
        const float4 hi = *xch;
        total[0] += hi.x, total[1] += hi.y, total[2] += hi.z, total[3] += hi.w;
      }
      pair_sync(bar, phase);  // (read before half 1's next ring fill)
      if (half) return;
    }
    epi(start, c0, np, r0, r1, total);
  };
  if constexpr (kSpread) {
    // A warp's first task's routing (route) is loaded before x is staged, so that its two dependent loads overlap
    // the staging's; with kPairs the deal spreads the routing buffers' a.slots slots (at 1 row every one is
    // taken), a task of a slot past nslot doing nothing, so that the deal waits for no load. (ncu, one H100,
    // 2026-12-07 from 15:13, moe_gate_up_gm_few at 1 row: 42 % of the stall samples fell before a warp's first
    // step, on that chain; 27 % with this, the launch alone 25.6 against 27.4 us.)
    const int ns = __ldcg(a.nslot), T = (kPairs ? a.slots : ns) * blocks;
    const int lo = (int)((long long)blockIdx.x * T / gridDim.x);
    const int hi = (int)((long long)(blockIdx.x + 1) * T / gridDim.x);
    struct Route {
      const uint8_t *w, *s;
      int start, cnt, xr;  // the slot's first pair and pairs (0: none to do), lane g's row of x
    };
    auto route = [&](int k) {
      const int slot = k / blocks, e = __ldcg(a.slot_e + slot), cnt = __ldcg(a.slot_cnt + slot);
      Route r{nullptr, nullptr, __ldcg(a.slot_start + slot), 0, 0};
      if (slot < ns) {
        const long long* ent = entry(e);
        r.w = reinterpret_cast<const uint8_t*>(ent[0]);
        r.s = reinterpret_cast<const uint8_t*>(ent[1]);
        r.cnt = a.sparse && r.w == nullptr ? 0 : cnt;
        // (one pass: a slot holds at most one pair of a row; past its pairs, pair 0's row, which is not loaded)
        r.xr = a.pair_ptr[r.start + (g < min(kPass, r.cnt) ? g : 0)] / a.topk;
      }
      return r;
    };
    int k = lo + me;
    Route r = k < hi ? route(k) : Route{};
    for (int i = threadIdx.x; i < a.spread * units; i += 32 * kWarps) stage(i / units, i / units, i % units);
    __syncthreads();  // (x, and the table)
    while (k < hi) {
      for (int c0 = 0; c0 < r.cnt; c0 += kPass)
        task(r.w, r.s, k % blocks, r.start, c0, min(kPass, r.cnt - c0), r.xr);
      k += kTasks;
      if (k < hi) r = route(k);
    }
  } else {
    const int tiles = blocks / kTasks, items = __ldcg(a.nslot) * tiles;
    // an item's slot: its first pair, its table entry and its pairs (0 for an expert absent from a sparse table)
    struct Slot {
      int start;
      const long long* ent;
      int cnt;
    };
    auto slot_of = [&](int it) {
      const int slot = it / tiles, start = __ldcg(a.slot_start + slot);
      const long long* ent = entry(__ldcg(a.slot_e + slot));
      return Slot{start, ent, a.sparse && ent[0] == 0 ? 0 : __ldcg(a.slot_cnt + slot)};
    };
    const Slot first = kEarly && blockIdx.x < items ? slot_of(blockIdx.x) : Slot{};
    if constexpr (kEarly) {
      pdl_wait();
      pdl_release();
    }
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
      const int tile = it % tiles;
      const Slot cur = kEarly && it == blockIdx.x ? first : slot_of(it);
      const int start = cur.start, cnt = cur.cnt;
      for (int c0 = 0; c0 < cnt; c0 += kPass) {
        const int np = min(kPass, cnt - c0);
        __syncthreads();  // the previous pass's readers of x are done (the first: the table is written)
        for (int i = threadIdx.x; i < np * units; i += 32 * kWarps) {
          const int pair = a.pair_ptr[start + c0 + i / units];
          stage(i / units, a.down ? pair : pair / a.topk, i % units);
        }
        __syncthreads();
        // (past the pass's pairs: pair 0's row slot, an address warp_sums_gm does not load)
        task(reinterpret_cast<const uint8_t*>(cur.ent[0]), reinterpret_cast<const uint8_t*>(cur.ent[1]),
             tile * kTasks + me, start, c0, np, g < np ? g : 0);
        if constexpr (kPost) {
          __syncthreads();  // every output of the pass issued
          post(start, c0, np, tile);
        }
      }
    }
  }
}

// Launches of 1-2 rows (moe_lut.py's GM_FEW_ROWS): one CTA of kGmFewWarps warps per SM, kGmFewWarps / 2 tasks at
// a time, their K halves on warp pairs, kGmFewRows rows of x staged. Why 24 warps: at 1 row a launch has 1536
// tasks, 12 a CTA on 128 SMs; 16-warp CTAs would need 192 SMs for one round of half tasks. It costs registers (at
// most 80 a thread, none spilled: nvcc 13.0, sm_90a; at 32 warps, 64, it spills) and shared memory (224.1 KB at
// D = 4096). (down in the same form, 32 warps of 2 ring slots, items of 16 tasks: the launch alone 19.3-19.4
// against 19.0-19.1 us at 1 row, the step +0.5-0.8 % on one H100: docs/PERFORMANCE.md, 2026-12-07 from 15:13; the
// code at 93a587b.)
constexpr int kGmFewWarps = 24, kGmFewRows = 2;

// gate-up's group-major kernels: act as gate_up's (blocks of 8 channels of w1 and w3); kFew: a task's halves on
// warp pairs of kGmFewWarps-warp CTAs, else kGmWarps warps, each a whole task
template <bool kSpread, bool kFew = false>
__device__ __forceinline__ void gate_up_gm(const Args& a, const float* rw, __nv_bfloat16* act, long long stride_a,
                                           float limit, int round_out) {
  const int t = threadIdx.x & 3;
  constexpr int kW = kFew ? kGmFewWarps : kGmWarps, kR = kFew ? kGmFewRows : kGmPairs;
  run_gm<kSpread, false, kGmDepth, true, kW, kR, kFew>(a, a.w3_rows / 8, [&](int start, int c0, int np, int r0, int,
                                                                             const float (&total)[4]) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {  // lane t: pairs c0 + 2t, c0 + 2t + 1 of channel r0
      const int p = 2 * t + u;
      if (p < np) {
        const int pair = a.pair_ptr[start + c0 + p];
        act[pair * stride_a + r0] = __float2bfloat16_rn(swiglu(u ? total[1] : total[0], u ? total[3] : total[2],
                                                               limit, round_out, rw[pair]));
      }
    }
  }, [](int, int, int, int) {});
}

// down's group-major kernel: y and the combine as down's, items of kGmWarps x 16 rows of w2 (combine_pass
// per (row, 256-row tile): counters [M, D / 256] of down's [M, D / 128]); kEarly: run_gm's
template <bool kEarly = false>
__device__ __forceinline__ void down_gm(const Args& a, __nv_bfloat16* y, long long stride_y, void* out,
                                        long long stride_o, int* counters, int D, int combine,
                                        const __nv_bfloat16* shared, long long stride_sh) {
  __shared__ int last[kGmPairs];
  constexpr int kTile = kGmWarps * 16;  // output rows of an item
  const int t = threadIdx.x & 3, tiles = D / kTile;
  run_gm<false, true, kGmDownDepth, false, kGmWarps, kGmPairs, false, kEarly>(
      a, D / 16, [&](int start, int c0, int np, int r0, int r1, const float (&total)[4]) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {  // lane t: pairs c0 + 2t, c0 + 2t + 1 of rows r0, r1
      const int p = 2 * t + u;
      if (p < np) {
        const int pair = a.pair_ptr[start + c0 + p];
        y[pair * stride_y + r0] = __float2bfloat16_rn(total[u]);
        y[pair * stride_y + r1] = __float2bfloat16_rn(total[2 + u]);
      }
    }
  }, [&](int start, int c0, int np, int tile) {
    if (combine) combine_pass<kTile>(a, start, c0, np, tile, tiles, y, stride_y, out, stride_o, counters, shared,
                                     stride_sh, last);
  });
}

}  // namespace

// The launches (moe_lut.py): grid <= 2 CTAs per SM, 256 threads, 64 KB + Layout(K).bytes of
// dynamic shared memory; moe_gate_up_lut_spread (launches of M = 1 or 2 rows, `rows` = M): one CTA
// of kSpreadWarps warps per SM, at most 128 registers a thread (a quarter of the SM's left free);
// moe_gate_up_lut_ring: one CTA of 512 threads per SM (two halves), 64 KB + 2 Layout(K).bytes +
// 16 warps' kRingDepth 2 KB slots; moe_gate_up_lut_spread_ring: the spread's CTA, 64 KB +
// Layout(K).bytes + kSpreadWarps warps' slots.
#define GATE_UP_PARAMS                                                                                              \
  const __nv_bfloat16* xq, long long stride_q, const long long* tab, const float* rw, const int* pair_ptr,        \
      const int* slot_e, const int* slot_start, const int* slot_cnt, const int* nslot, __nv_bfloat16* act,          \
      long long stride_a, int D, int I, long long stride_w, long long stride_s, float limit, int round_out, int topk, \
      int sparse
#define GATE_UP_ARGS(...) /* (rows[, slots]) */                                                                   \
  Args{xq, stride_q, tab, pair_ptr, slot_e, slot_start, slot_cnt, nslot, D, I, topk, sparse, 0, stride_w, stride_s, \
       __VA_ARGS__}, rw, act, stride_a, limit, round_out

extern "C" __global__ void __launch_bounds__(kThreads, 2) moe_gate_up_lut(GATE_UP_PARAMS) {
  gate_up<false>(GATE_UP_ARGS(0));
}

extern "C" __global__ void __maxnreg__(128) moe_gate_up_lut_spread(GATE_UP_PARAMS, int rows) {
  gate_up<true>(GATE_UP_ARGS(rows));
}

extern "C" __global__ void __launch_bounds__(2 * kThreads, 1) moe_gate_up_lut_ring(GATE_UP_PARAMS) {
  gate_up<false, true>(GATE_UP_ARGS(0));
}

extern "C" __global__ void __maxnreg__(128) moe_gate_up_lut_spread_ring(GATE_UP_PARAMS, int rows) {
  gate_up<true, true>(GATE_UP_ARGS(rows));
}

#define DOWN_PARAMS                                                                                                \
  const __nv_bfloat16 *aq, long long stride_q, const long long *tab, const int *pair_ptr, const int *slot_e,        \
      const int *slot_start, const int *slot_cnt, const int *nslot, __nv_bfloat16 *y, long long stride_y, void *out, \
      long long stride_o, int *counters, int D, int I, long long stride_w, long long stride_s, int topk, int sparse,  \
      int combine, const __nv_bfloat16 *shared, long long stride_sh
#define DOWN_ARGS                                                                                                  \
  Args{aq, stride_q, tab, pair_ptr, slot_e, slot_start, slot_cnt, nslot, I, 0, topk, sparse, 1, stride_w, stride_s, 0}, \
      y, stride_y, out, stride_o, counters, D, combine, shared, stride_sh

extern "C" __global__ void __launch_bounds__(kThreads, 2) moe_down_lut(DOWN_PARAMS) { down(DOWN_ARGS); }

// down in passes of 4 pairs (moe_lut.py's DOWN4_MIN_ROWS): an expert with 3-4 pairs streams its rows once, not
// twice. After the table 4 rows of x and the K half 0 sums: 64 KB + 8 I + 8 KB of dynamic shared memory.
// (Not in the probe build, whose stamps it has no registers for.)
#ifndef MOE_LUT_PROBE
extern "C" __global__ void __launch_bounds__(kThreads, 2) moe_down_lut4(DOWN_PARAMS) { down<2>(DOWN_ARGS); }
#endif

// The ring gate-up with the mixed decode (moe_lut.py's RING_MIX): kExpBytes (x's block exponents)
// after the table in its dynamic shared memory, 225 KB at D = 4096.
extern "C" __global__ void __launch_bounds__(2 * kThreads, 1) moe_gate_up_lut_ring_mix(GATE_UP_PARAMS) {
  gate_up<false, true, true>(GATE_UP_ARGS(0));
}

// The spread gate-up with the ring's slots and the mixed decode (moe_lut.py's SPREAD_RING_MIX): 177 KB
// at D = 4096.
extern "C" __global__ void __maxnreg__(128) moe_gate_up_lut_spread_ring_mix(GATE_UP_PARAMS, int rows) {
  gate_up<true, true, true>(GATE_UP_ARGS(rows));
}

// The group-major gate-up (moe_lut.py's GATE_UP_GM): one CTA of kGmThreads per SM, 64 KB (the table) +
// kGmPairs rows of x (2 D + kGmPad bytes each) + kGmWarps x kGmDepth 2 KB slots of dynamic shared
// memory (224.5 KB at D = 4096). (Not in the probe build.)
#ifndef MOE_LUT_PROBE
extern "C" __global__ void __launch_bounds__(kGmThreads, 1) moe_gate_up_gm(GATE_UP_PARAMS) {
  gate_up_gm<false>(GATE_UP_ARGS(0));
}

// The same, warp tasks dealt out evenly over launches of `rows` <= kGmPairs rows (moe_lut.py's GM_SPREAD_ROWS).
extern "C" __global__ void __launch_bounds__(kGmThreads, 1) moe_gate_up_gm_spread(GATE_UP_PARAMS, int rows) {
  gate_up_gm<true>(GATE_UP_ARGS(rows));
}

// The same, warp tasks dealt out evenly, their K halves on warp pairs, over launches of `rows` <= kGmFewRows rows
// (moe_lut.py's GM_FEW_ROWS): one CTA of kGmFewWarps warps per SM, 64 KB + kGmFewRows rows of x + the warps'
// kGmDepth 2 KB slots (224.1 KB at D = 4096); slots: the routing buffers' slot count.
extern "C" __global__ void __launch_bounds__(32 * kGmFewWarps, 1) moe_gate_up_gm_few(GATE_UP_PARAMS, int rows,
                                                                                      int slots) {
  gate_up_gm<true, true>(GATE_UP_ARGS(rows, slots));
}

// down group-major (moe_lut.py's DOWN_GM): one CTA of kGmThreads per SM, 64 KB + kGmPairs rows of aq (2 I +
// kGmPad bytes each) + the warps' kGmDownDepth slots (224.5 KB at I = 2048).
extern "C" __global__ void __launch_bounds__(kGmThreads, 1) moe_down_gm(DOWN_PARAMS) { down_gm(DOWN_ARGS); }

// The same with its first item's routing read before the PDL wait (moe_lut.py's DOWN_GM_EARLY).
extern "C" __global__ void __launch_bounds__(kGmThreads, 1) moe_down_gm_early(DOWN_PARAMS) {
  down_gm<true>(DOWN_ARGS);
}

#endif

#ifdef MOE_LUT_PROBE
// the probe build's stamps into dst (u64 [2, kProbeCtas, kProbeMarks, 2]), then zeroed
extern "C" __global__ void moe_lut_probe_read(unsigned long long* dst) {
  unsigned long long* src = &moe_lut_probe_buf[0][0][0][0];
  constexpr int n = 2 * kProbeCtas * kProbeMarks * 2;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    dst[i] = src[i];
    src[i] = 0;
  }
}
#endif
