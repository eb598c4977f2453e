// Routed MXFP4 experts on the CPU (issue 4, Recipe B): one or several experts of one layer for a
// few rows, straight from the checkpoint bytes, with the semantics of `moe_experts_mxfp4_ref`:
//
//   q = fp8_act_sim(x, 128)            g = rnd(w1 . q), u = rnd(w3 . q)      (rnd = to bf16, RNE)
//   a = rnd(r * (silu(min(g, lim)) * clamp(u, -lim, lim)))
//   y = rnd(w2 . fp8_act_sim(a, 128))  one output row per (row, slot)
//
// No torch headers (a JIT build takes ~2 s, not ~40 s): plain C entry points called through ctypes,
// which also releases the GIL, so a Python worker thread can run the sidecar next to the GPU step.
//
// ISA paths, picked at run time (one portable -O3 build serves every x86-64 CPU; the SIMD kernels
// are compiled with per-function target attributes and chosen with __builtin_cpu_supports):
//   3 avx512bf16: two 32-groups per step: bytes -> words (vpmovzxbw), low / high nibbles index a
//                 32-entry bf16 table (vpermw) whose halves carry the two groups' E8M0 scales (an
//                 integer add to the exponent field: exact); vdpbf16ps against the bf16
//                 activations (fp8_act_sim values are exact in bf16), stored per 64-element span
//                 as (32 even, 32 odd). A block of rows with any scale outside [40, 240] (a scaled
//                 weight or a product could leave the normal range, which vdpbf16ps flushes), or
//                 K % 64 != 0, takes the avx512 path instead.
//   2 avx512:     nibbles -> fp32 with vpermps from the table times 2^(s-127), fp32 FMAs against
//                 activations stored per 32-group as (16 even, 16 odd).
//   1 avx2:       the same with 8-wide vpermps on the magnitudes plus the sign bit (fallback).
//   0 scalar:     portable C++, per-group partial sums times the scale (fallback).
// AMX (on the GPU host) is not used yet: at M <= 8 the bf16 dot products are not the limit.
// Tasks are blocks of 32 output rows; a kernel call handles R rows at once (independent decode
// chains), K in chunks that keep the activations in L1, and prefetches the next call's rows.
//
// All paths accumulate in fp32 and differ from each other and from torch only in the order of the
// fp32 sums. Determinism: each output is summed by one thread, per SIMD lane in K order then in a
// fixed lane order; tasks, chunks and R never change what a sum contains, so the bits are the
// same for any thread count and for a row alone or among others (batch invariance).
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include <immintrin.h>
#include <omp.h>

namespace {

constexpr int kMaxRows = 8;     // rows (pairs) per kernel pass; more pairs of one expert loop
constexpr int kActBlock = 128;  // activation quantization block
constexpr int kScaleLo = 40, kScaleHi = 240;  // E8M0 range of the bf16 path (see header)

const float kE2M1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                         -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

inline float bits_f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t f_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch's .to(bfloat16)
  uint32_t u = f_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_to_f32(uint16_t h) { return bits_f((uint32_t)h << 16); }
inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// E8M0 byte -> 2^(byte - 127) as fp32 (as formats.e8m0_to_float: 0 -> 2^-127, 255 -> inf).
struct Pow2Table {
  float v[256];
  Pow2Table() { for (int i = 0; i < 256; ++i) v[i] = std::ldexp(1.0f, i - 127); }
};
const Pow2Table kE8M0;
inline float e8m0(uint8_t s) { return kE8M0.v[s]; }

// e4m3fn round to nearest even of |v| <= 448: normal values keep 3 mantissa bits; below 2^-6 the
// grid is multiples of 2^-9, reached by adding 1.5 * 2^14 (fp32 ulp 2^-9 on both sides).
inline float round_e4m3(float v) {
  v = std::fmin(std::fmax(v, -448.f), 448.f);
  float a = std::fabs(v), r;
  if (a < 0.015625f) {
    r = (a + 24576.f) - 24576.f;  // not folded: no -ffast-math
  } else {
    uint32_t u = f_bits(a);
    r = bits_f((u + 0x7ffffu + ((u >> 20) & 1u)) & 0xfff00000u);
  }
  return std::copysign(r, v);
}

// fp8_act_sim over n values (one row), blocks of 128 (a ragged last block on its own amax).
void act_quant_row(const float* x, int64_t n, float* q) {
  for (int64_t b0 = 0; b0 < n; b0 += kActBlock) {
    const int64_t b1 = b0 + kActBlock < n ? b0 + kActBlock : n;
    float amax = 0.f;
    for (int64_t i = b0; i < b1; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    int e;
    const float m = std::frexp(std::fmax(amax, 1e-4f) / 448.0f, &e);  // as formats.pow2_scale
    const float s = std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
    for (int64_t i = b0; i < b1; ++i) q[i] = round_e4m3(x[i] / s) * s;
  }
}

// Activations of the rows of one pass, in the layouts the ISA paths read.
struct Acts {
  int64_t K = 0;
  std::vector<float> nat;    // [P, K] natural order (scalar path)
  std::vector<float> perm;   // [P, K] per 32-group: 16 even, then 16 odd elements (avx2, avx512)
  std::vector<uint16_t> bf;  // [P, K] bf16 bits, per 64-span: 32 even, then 32 odd elements (avx512bf16)
  void resize(int P, int64_t k) {  // grows only: buffers are reused call after call
    K = k;
    if ((int64_t)nat.size() < P * k) { nat.resize(P * k); perm.resize(P * k); bf.resize(P * k); }
  }
  void finish_row(int p, int isa) {  // derive the ISA layout of row p from nat
    const float* src = nat.data() + p * K;
    if (isa == 3 && K % 64 == 0) {
      uint16_t* dst = bf.data() + p * K;
      for (int64_t g = 0; g < K; g += 64)
        for (int j = 0; j < 32; ++j) {  // fp8_act_sim values are exact in bf16
          dst[g + j] = f32_to_bf16(src[g + 2 * j]);
          dst[g + 32 + j] = f32_to_bf16(src[g + 2 * j + 1]);
        }
    }
    if (isa >= 1) {
      float* dst = perm.data() + p * K;
      for (int64_t g = 0; g < K; g += 32)
        for (int j = 0; j < 16; ++j) { dst[g + j] = src[g + 2 * j]; dst[g + 16 + j] = src[g + 2 * j + 1]; }
    }
  }
};

// ---- the row kernels ---------------------------------------------------------------------------
// A SIMD kernel adds groups [g0, g1) of R weight rows (row r at W + r * rb, its scales at
// S + r * G) times M activation rows (row m at act + m * K, in the path's layout) into per-lane
// fp32 accumulators acc[(r * M + m) * lanes + lane], carried across K chunks: each lane sums its
// elements in K order whatever the chunking, so results do not depend on chunk, R or M.

// Portable: per-group partial sums times the scale (also the reference for the others' layout).
template <int M>
void row_scalar(const uint8_t* W, const uint8_t* S, int64_t K, const float* act, float* sums) {
  const int64_t G = K / 32;
  for (int m = 0; m < M; ++m) {
    const float* a = act + m * K;
    float acc = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* b = W + g * 16;
      float part = 0.f;
      for (int j = 0; j < 16; ++j) {
        part += kE2M1[b[j] & 15] * a[g * 32 + 2 * j];
        part += kE2M1[b[j] >> 4] * a[g * 32 + 2 * j + 1];
      }
      acc += part * e8m0(S[g]);
    }
    sums[m] = acc;
  }
}

#define MS_AVX2 __attribute__((target("avx2,fma")))
#define MS_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))
#define MS_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")))

// AVX2: 8 bytes -> 8 even + 8 odd fp32 values: vpermps on the 8 magnitudes times 2^(s-127), the
// sign bit moved to bit 31 and xor-ed in. Activations per 32-group: 16 even, then 16 odd.
template <int M, int R>
MS_AVX2 void rows_avx2(const uint8_t* W, int64_t rb, const uint8_t* S, int64_t G, int64_t g0, int64_t g1,
                       const float* act, int64_t K, float* accp) {
  const __m256 mag = _mm256_loadu_ps(kE2M1);
  const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_loadu_ps(accp + (r * M + m) * 8);
  for (int64_t g = g0; g < g1; ++g) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 tb = _mm256_mul_ps(mag, _mm256_set1_ps(e8m0(S[r * G + g])));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(W + r * rb + g * 16 + h * 8)));
        const __m256 we = _mm256_xor_ps(_mm256_permutevar8x32_ps(tb, d),
                                        _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 28), sign)));
        const __m256 wo = _mm256_xor_ps(_mm256_permutevar8x32_ps(tb, _mm256_srli_epi32(d, 4)),
                                        _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 24), sign)));
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const float* a = act + m * K + g * 32 + h * 8;
          acc[r][m] = _mm256_fmadd_ps(we, _mm256_loadu_ps(a), acc[r][m]);
          acc[r][m] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(a + 16), acc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) _mm256_storeu_ps(accp + (r * M + m) * 8, acc[r][m]);
}

// AVX-512 fp32: 16 bytes -> 16 even + 16 odd values with vpermps (index = low 4 bits) on the table
// times 2^(s-127). Same activation layout as AVX2.
template <int M, int R>
MS_AVX512 void rows_avx512(const uint8_t* W, int64_t rb, const uint8_t* S, int64_t G, int64_t g0, int64_t g1,
                           const float* act, int64_t K, float* accp) {
  const __m512 tbl = _mm512_loadu_ps(kE2M1);
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_loadu_ps(accp + (r * M + m) * 16);
  for (int64_t g = g0; g < g1; ++g) {
    __m512 we[R], wo[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm_prefetch((const char*)(W + (r + R) * rb + g * 16), _MM_HINT_T0);  // the next call's rows
      const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(W + r * rb + g * 16)));
      const __m512 tb = _mm512_mul_ps(tbl, _mm512_set1_ps(e8m0(S[r * G + g])));
      we[r] = _mm512_permutexvar_ps(d, tb);
      wo[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), tb);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 a = _mm512_loadu_ps(act + m * K + g * 32);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(we[r], a, acc[r][m]);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 a = _mm512_loadu_ps(act + m * K + g * 32 + 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(wo[r], a, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(accp + (r * M + m) * 16, acc[r][m]);
}

// bf16 of the 16 e2m1 values, twice: entries 0..15 serve the first group of a 64-element span,
// 16..31 the second, each shifted by its own E8M0 exponent.
const uint16_t kE2M1Bf16x2[32] = {
    0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
    0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0,
    0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
    0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0};

// E8M0 byte -> its exponent offset in a bf16 word, in both halves of a dword (a dword broadcast
// from memory is a plain load).
inline int32_t bf16_exp_offset(uint8_t s) {
  const uint32_t o = (uint32_t)((((int)s - 127) << 7) & 0xffff);
  return (int32_t)(o | (o << 16));
}

// AVX-512 BF16: 32 bytes (two 32-groups) per step. vpmovzxbw gives word j = byte j; the low
// nibbles (even elements) index entries 0..15 / 16..31 of the table by group, the high nibbles
// (odd elements) likewise; the table's nonzero entries carry the group's scale as an exponent add
// (exact). vdpbf16ps multiplies them with the activations stored as (32 even, 32 odd) per span.
template <int M, int R>
MS_AVX512BF16 void rows_avx512bf16(const uint8_t* W, int64_t rb, const uint8_t* S, int64_t G, int64_t g0,
                                   int64_t g1, const uint16_t* act, int64_t K, float* accp) {
  const int64_t ng = g1 - g0;
  thread_local std::vector<int32_t> offs;
  if ((int64_t)offs.size() < R * ng) offs.resize(R * ng);
  for (int r = 0; r < R; ++r)
    for (int64_t g = 0; g < ng; ++g) offs[r * ng + g] = bf16_exp_offset(S[r * G + g0 + g]);
  const int32_t* off = offs.data() - g0;  // off[r * ng + g] for g in [g0, g1)
  const __m512i tbl = _mm512_loadu_si512(kE2M1Bf16x2);
  const __m512i lo4 = _mm512_set1_epi16(0x000f);
  const __m512i upper = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
  const __mmask32 nz0 = 0x0000fefeu, nz1 = 0xfefe0000u;  // entries +-0 carry no exponent
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_loadu_ps(accp + (r * M + m) * 16);
  for (int64_t g = g0; g < g1; g += 2) {
    __m512bh we[R], wo[R];  // decode all R rows first: R independent decode chains in flight
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm_prefetch((const char*)(W + (r + R) * rb + g * 16), _MM_HINT_T0);  // the next call's rows
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(W + r * rb + g * 16)));
      const __m512i ie = _mm512_ternarylogic_epi32(w, lo4, upper, 0xea);  // (w & 15) | upper
      const __m512i io = _mm512_or_si512(_mm512_srli_epi16(w, 4), upper);
      __m512i tb = _mm512_mask_add_epi16(tbl, nz0, tbl, _mm512_set1_epi32(off[r * ng + g]));
      tb = _mm512_mask_add_epi16(tb, nz1, tb, _mm512_set1_epi32(off[r * ng + g + 1]));
      we[r] = (__m512bh)_mm512_permutexvar_epi16(ie, tb);
      wo[r] = (__m512bh)_mm512_permutexvar_epi16(io, tb);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512bh a = (__m512bh)_mm512_loadu_si512(act + m * K + g * 32);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], we[r], a);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512bh a = (__m512bh)_mm512_loadu_si512(act + m * K + g * 32 + 32);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wo[r], a);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(accp + (r * M + m) * 16, acc[r][m]);
}

bool scales_in_bf16_range(const uint8_t* S, int64_t n) {
  uint8_t lo = 255, hi = 0;
  for (int64_t i = 0; i < n; ++i) { lo = S[i] < lo ? S[i] : lo; hi = S[i] > hi ? S[i] : hi; }
  return lo >= kScaleLo && hi <= kScaleHi;
}

// Where a row pass writes: fp32 [M, ld] or bf16 (rounded) through per-row pointers.
struct Out {
  float* f = nullptr;
  int64_t ld = 0;
  uint16_t* const* b = nullptr;
  void put(int m, int64_t n, float v) const {
    if (b) b[m][n] = f32_to_bf16(v); else f[m * ld + n] = v;
  }
};

inline float reduce_lanes(float* l, int n) {  // fixed pairwise order
  for (; n > 1; n /= 2)
    for (int i = 0; i < n / 2; ++i) l[i] += l[i + n / 2];
  return l[0];
}

// Weight rows per kernel call: enough independent decode chains and R * M accumulators in flight.
// Measured on the bf16 path (Zen 5): 1 -> 8, 2-3 -> 4, 4-7 -> 3, 8 -> 2 rows per call.
constexpr int rows_per_step(int M) { return M == 1 ? 8 : M <= 3 ? 4 : M <= 7 ? 3 : 2; }
constexpr int rows_per_step_avx2(int M) { return M <= 2 ? 4 : M <= 4 ? 2 : 1; }  // 16 ymm registers
constexpr int kBlockRows = 32;  // output rows per task
// K chunk (in 32-groups, even): M rows of activations (bf16: 2 bytes each) stay within ~16 KB of L1
// while a task's rows pass over them.
constexpr int64_t chunk_groups(int M) { return ((8192 / M) / 64) * 2; }

template <int M, int R>
void call_rows(int path, const uint8_t* W, int64_t rb, const uint8_t* S, int64_t G, int64_t g0, int64_t g1,
               const Acts& A, int64_t K, float* acc) {
  if (path == 3) rows_avx512bf16<M, R>(W, rb, S, G, g0, g1, A.bf.data(), K, acc);
  else if (path == 2) rows_avx512<M, R>(W, rb, S, G, g0, g1, A.perm.data(), K, acc);
  else rows_avx2<M, R>(W, rb, S, G, g0, g1, A.perm.data(), K, acc);
}

// Rows [n0, n0 + nrows) in calls of R rows, K in chunks, into acc.
template <int M, int R>
void sweep(int path, const uint8_t* W, const uint8_t* S, int64_t n0, int64_t nrows, int64_t K, const Acts& A,
           float* acc, int lanes) {
  const int64_t G = K / 32, rb = K / 2, gc = chunk_groups(M);
  for (int64_t g0 = 0; g0 < G; g0 += gc) {
    const int64_t g1 = g0 + gc < G ? g0 + gc : G;
    int64_t r = 0;
    for (; r + R <= nrows; r += R)
      call_rows<M, R>(path, W + (n0 + r) * rb, rb, S + (n0 + r) * G, G, g0, g1, A, K, acc + r * M * lanes);
    for (; r < nrows; ++r)
      call_rows<M, 1>(path, W + (n0 + r) * rb, rb, S + (n0 + r) * G, G, g0, g1, A, K, acc + r * M * lanes);
  }
}

// Output rows [n0, n0 + nrows) of out[m, n] = W[n] . act[m].
template <int M>
void gemv_block(int isa, const uint8_t* W, const uint8_t* S, int64_t n0, int64_t nrows, int64_t K, const Acts& A,
                const Out& out) {
  const int64_t G = K / 32, rb = K / 2;
  if (isa == 0) {
    for (int64_t n = n0; n < n0 + nrows; ++n) {
      float sums[M];
      row_scalar<M>(W + n * rb, S + n * G, K, A.nat.data(), sums);
      for (int m = 0; m < M; ++m) out.put(m, n, sums[m]);
    }
    return;
  }
  for (int64_t i = 0; i < nrows * G; i += 64)  // the next block's scales (read first, by the check)
    _mm_prefetch((const char*)(S + (n0 + nrows) * G + i), _MM_HINT_T0);
  int path = isa;  // the bf16 path needs pairs of groups and scales in its range
  if (path == 3 && (K % 64 || !scales_in_bf16_range(S + n0 * G, nrows * G))) path = 2;
  const int lanes = path == 1 ? 8 : 16;
  alignas(64) float acc[kBlockRows * M * 16];
  std::memset(acc, 0, sizeof(float) * nrows * M * lanes);
  if (path == 1) sweep<M, rows_per_step_avx2(M)>(path, W, S, n0, nrows, K, A, acc, lanes);
  else sweep<M, rows_per_step(M)>(path, W, S, n0, nrows, K, A, acc, lanes);
  for (int64_t r = 0; r < nrows; ++r)
    for (int m = 0; m < M; ++m) out.put(m, n0 + r, reduce_lanes(acc + (r * M + m) * lanes, lanes));
}

// out[m, n] = W[n] . act[m] for n in [0, N): fixed blocks of rows split over the team (call
// inside a parallel region; the blocks, not the thread count, define what each sum contains).
template <int M>
void gemv_team(int isa, const uint8_t* W, const uint8_t* S, int64_t N, int64_t K, const Acts& A, const Out& out) {
  const int64_t nb = (N + kBlockRows - 1) / kBlockRows;
#pragma omp for schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t n0 = b * kBlockRows;
    gemv_block<M>(isa, W, S, n0, n0 + kBlockRows <= N ? kBlockRows : N - n0, K, A, out);
  }
}

void gemv(int M, int isa, const uint8_t* W, const uint8_t* S, int64_t N, int64_t K, const Acts& A, const Out& o) {
  switch (M) {
    case 1: gemv_team<1>(isa, W, S, N, K, A, o); break;
    case 2: gemv_team<2>(isa, W, S, N, K, A, o); break;
    case 3: gemv_team<3>(isa, W, S, N, K, A, o); break;
    case 4: gemv_team<4>(isa, W, S, N, K, A, o); break;
    case 5: gemv_team<5>(isa, W, S, N, K, A, o); break;
    case 6: gemv_team<6>(isa, W, S, N, K, A, o); break;
    case 7: gemv_team<7>(isa, W, S, N, K, A, o); break;
    default: gemv_team<8>(isa, W, S, N, K, A, o); break;
  }
}

bool isa_ok(int isa) {
  __builtin_cpu_init();
  if (isa == 0) return true;
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == 1) return avx2;
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("fma");
  if (isa == 2) return avx512;
  if (isa == 3) return avx512 && __builtin_cpu_supports("avx512bf16");
  return false;
}

}  // namespace

extern "C" {

// 1 when this CPU can run path `isa` (0 scalar, 1 avx2, 2 avx512, 3 avx512bf16).
int ms_cpu_isa_supported(int isa) { return isa_ok(isa) ? 1 : 0; }

// The best path of this CPU.
int ms_cpu_best_isa() { return isa_ok(3) ? 3 : isa_ok(2) ? 2 : isa_ok(1) ? 1 : 0; }

// Several experts of one layer. x [M, D] bf16 bits; ids [M, k] int32 (an id < 0 skips the slot,
// leaving y untouched); rw [M, k] fp32; stacked experts: w13 [E, 2I, D/2], w13s [E, 2I, D/32],
// w2 [E, D, I/2], w2s [E, D, I/32] (contiguous bytes); y [M, k, D] bf16 bits.
// Experts are visited in ascending id; each expert's pairs in (row, slot) order, 8 per pass.
// Returns 0, or -1 on a bad argument (unsupported isa, D or I not multiples of 32, bad id).
int ms_experts_forward(const uint16_t* x, int64_t M, int64_t D, int64_t I, int64_t k, const int32_t* ids,
                       const float* rw, int64_t E, const uint8_t* w13, const uint8_t* w13s, const uint8_t* w2,
                       const uint8_t* w2s, float limit, uint16_t* y, int isa, int nthreads) {
  if (!isa_ok(isa) || D % 32 || I % 32 || M < 0 || k < 1 || nthreads < 1) return -1;
  for (int64_t i = 0; i < M * k; ++i)
    if (ids[i] >= E) return -1;
  // passes: (expert, up to 8 pairs), experts ascending, pairs in index order
  struct Pass { int64_t e; int n; int64_t pair[kMaxRows]; };
  std::vector<Pass> passes;
  std::vector<char> used(E, 0);
  for (int64_t i = 0; i < M * k; ++i) if (ids[i] >= 0) used[ids[i]] = 1;
  for (int64_t e = 0; e < E; ++e) {
    if (!used[e]) continue;
    Pass p{e, 0, {}};
    for (int64_t i = 0; i < M * k; ++i) {
      if (ids[i] != e) continue;
      p.pair[p.n++] = i;
      if (p.n == kMaxRows) { passes.push_back(p); p.n = 0; }
    }
    if (p.n) passes.push_back(p);
  }
  if (passes.empty()) return 0;

  // Buffers of the calling thread, kept between calls (a fresh ~0.6 MB each call costs page faults).
  struct Work {
    std::vector<float> qx, h;
    Acts ax, aa;
  };
  thread_local Work work;
  int rows = 1;
  for (const Pass& p : passes) rows = p.n > rows ? p.n : rows;
  if ((int64_t)work.qx.size() < M * D) work.qx.resize(M * D);
  if ((int64_t)work.h.size() < rows * 2 * I) work.h.resize(rows * 2 * I);
  work.ax.resize(rows, D);  // one pass's x rows
  work.aa.resize(rows, I);  // and its quantized SwiGLU outputs
  std::vector<float>& qx = work.qx;  // fp8_act_sim(x), once per row for all experts
  std::vector<float>& h = work.h;    // w13 outputs
  Acts& ax = work.ax;
  Acts& aa = work.aa;
  const int64_t nblk_i = (I + kActBlock - 1) / kActBlock;
  uint16_t* yrow[kMaxRows];

#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> xf(D);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t i = 0; i < D; ++i) xf[i] = bf16_to_f32(x[m * D + i]);
      act_quant_row(xf.data(), D, qx.data() + m * D);
    }
    for (const Pass& p : passes) {
#pragma omp single
      {
        for (int j = 0; j < p.n; ++j) {
          std::memcpy(ax.nat.data() + j * D, qx.data() + (p.pair[j] / k) * D, D * sizeof(float));
          ax.finish_row(j, isa);
          yrow[j] = y + p.pair[j] * D;
        }
      }  // implicit barrier
      gemv(p.n, isa, w13 + p.e * 2 * I * (D / 2), w13s + p.e * 2 * I * (D / 32), 2 * I, D, ax,
           Out{h.data(), 2 * I, nullptr});
      // SwiGLU, routing weight and fp8_act_sim(a, 128): one task per (pair, 128-block of I)
#pragma omp for schedule(static)
      for (int64_t t = 0; t < p.n * nblk_i; ++t) {
        const int j = (int)(t / nblk_i);
        const int64_t i0 = (t % nblk_i) * kActBlock, i1 = i0 + kActBlock < I ? i0 + kActBlock : I;
        const float r = rw[p.pair[j]];
        float a[kActBlock];
        for (int64_t i = i0; i < i1; ++i) {
          const float g = std::fmin(round_bf16(h[j * 2 * I + i]), limit);
          const float u = std::fmin(std::fmax(round_bf16(h[j * 2 * I + I + i]), -limit), limit);
          const float silu = g / (1.0f + std::exp(-g));
          a[i - i0] = round_bf16(r * (silu * u));
        }
        act_quant_row(a, i1 - i0, aa.nat.data() + j * I + i0);
      }
#pragma omp single
      for (int j = 0; j < p.n; ++j) aa.finish_row(j, isa);
      gemv(p.n, isa, w2 + p.e * D * (I / 2), w2s + p.e * D * (I / 32), D, I, aa, Out{nullptr, 0, yrow});
    }
  }
  return 0;
}

// A CPU-sidecar job (issue 4, recipe B): the arguments of one ms_experts_forward call, fixed when a
// decode step is built (page-locked staging buffers and one layer's cold experts). The CUDA driver
// runs ms_sidecar_run as a host function when the stream reaches it (cuLaunchHostFunc, also inside
// a CUDA graph): y is zeroed first (the slots of the experts the GPU computes must read 0 in the
// combine), then the cold slots are written. status: the return code of the last run. The counters
// after it are for the benchmark's report (the engine never reads them): every run; the runs that
// had at least one slot of this job's experts, the distinct experts they read and their wall time
// (steady clock around zeroing y and the experts, on the running thread), the longest of them; and
// the wall time of the other runs, which only zero y. They are written by the one thread that runs
// the job and read once the GPU has finished.
struct MsSidecarJob {
  const uint16_t* x;
  int64_t M, D, I, k;
  const int32_t* ids;
  const float* rw;
  int64_t E;
  const uint8_t *w13, *w13s, *w2, *w2s;
  float limit;
  uint16_t* y;
  int isa;
  int nthreads;
  int status;
  int64_t runs, busy_runs, experts, busy_ns, max_ns, idle_ns;
};

int64_t ms_sidecar_job_size() { return sizeof(MsSidecarJob); }  // the ctypes mirror checks its layout

void ms_sidecar_run(void* job) {
  MsSidecarJob* j = static_cast<MsSidecarJob*>(job);
  const auto t0 = std::chrono::steady_clock::now();
  std::memset(j->y, 0, sizeof(uint16_t) * j->M * j->k * j->D);
  j->status = ms_experts_forward(j->x, j->M, j->D, j->I, j->k, j->ids, j->rw, j->E, j->w13, j->w13s, j->w2, j->w2s,
                                 j->limit, j->y, j->isa, j->nthreads);
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  thread_local std::vector<char> seen;
  seen.assign(j->E, 0);
  int64_t n = 0;
  for (int64_t i = 0; i < j->M * j->k; ++i) {
    const int32_t e = j->ids[i];
    if (e >= 0 && e < j->E && !seen[e]) seen[e] = 1, ++n;
  }
  ++j->runs;
  if (n) {
    ++j->busy_runs;
    j->experts += n;
    j->busy_ns += ns;
    if (ns > j->max_ns) j->max_ns = ns;
  } else {
    j->idle_ns += ns;
  }
}

// The polling worker: recipe B without a host node per layer. A host node makes the GPU stream
// wait for a driver thread in every MoE sublayer with CPU experts, routed to or not (~0.12 ms a
// layer on the H200 host, docs/PERFORMANCE.md twenty-first measurement). Instead each job has a
// flag word in page-locked memory: the GPU stream writes 1 after copying the job's inputs
// (cuStreamWriteValue32, which orders after the copies), this thread runs the job and stores 2,
// the GPU stream waits for 2 (cuStreamWaitValue32) before copying y back and then writes 0. The
// thread scans every registered flag; it spins (pause) for kSpinFor after its last job, then sleeps
// kSleepUs between scans, so an idle engine does not hold a core. The spin is timed, not counted:
// with the zero-copy sidecar (kernels/sidecar_zero_copy.cu) only the layers whose rows chose a CPU
// expert post a job, ~4 a token at one row (one every ~1.6 ms), and a count of empty scans lasts
// only as long as the scans take, so the thread could nap between two jobs of one step and answer
// one 50 us late.
constexpr int kMaxPollJobs = 4096;
constexpr auto kSpinFor = std::chrono::milliseconds(20);  // a few steps
constexpr int kSleepUs = 50;

struct MsPoller {
  std::atomic<int> n{0};
  std::atomic<bool> stop{false};
  MsSidecarJob* jobs[kMaxPollJobs];
  volatile uint32_t* flags[kMaxPollJobs];
  std::thread worker;
};

static void ms_poller_loop(MsPoller* p) {
  auto last = std::chrono::steady_clock::now();  // of the last job (or the start)
  while (!p->stop.load(std::memory_order_relaxed)) {
    bool ran = false;
    const int n = p->n.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i) {
      if (*p->flags[i] != 1u) continue;
      std::atomic_thread_fence(std::memory_order_acquire);  // the inputs were written before the flag
      ms_sidecar_run(p->jobs[i]);
      std::atomic_thread_fence(std::memory_order_release);  // y before the flag
      *p->flags[i] = 2u;
      ran = true;
    }
    if (ran) {
      last = std::chrono::steady_clock::now();
    } else if (std::chrono::steady_clock::now() - last < kSpinFor) {
      _mm_pause();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(kSleepUs));
    }
  }
}

void* ms_poller_start() {
  MsPoller* p = new MsPoller();
  p->worker = std::thread(ms_poller_loop, p);
  return p;
}

// Registers a job and its flag word (0 until the GPU posts it). Returns 0, or -1 when full.
int ms_poller_add(void* poller, void* job, uint32_t* flag) {
  MsPoller* p = static_cast<MsPoller*>(poller);
  const int i = p->n.load(std::memory_order_relaxed);
  if (i >= kMaxPollJobs) return -1;
  p->jobs[i] = static_cast<MsSidecarJob*>(job);
  p->flags[i] = flag;
  p->n.store(i + 1, std::memory_order_release);  // the worker sees the entry complete
  return 0;
}

void ms_poller_stop(void* poller) {
  MsPoller* p = static_cast<MsPoller*>(poller);
  p->stop.store(true);
  p->worker.join();
  delete p;
}

}  // extern "C"
