"""RMSNorm + RoPE + activation simulations of the attention inputs, one launch each instead of
the ~20-40 small torch ops per call of model/fast.py.

Semantics (`*_ref`, built from model/ops.py, MODEL_SPEC §3):
- `rms_norm(x, w, eps)`                         = ops.rms_norm(x, w, eps)              (q_norm on wq_a's output)
- `q_norm_rope(q, rope, pos, eps)`              = ops.apply_rope(ops.rms_norm(q, None, eps), inv_freq, pos)
- `kv_rope_sim_store(kv, w, rope, pos, window, slots, eps, nope)`
      kv = ops.kv_sim(ops.apply_rope(ops.rms_norm(kv, w, eps), inv_freq, pos), nope);
      window[slots[b], pos[b] % W] = kv[b]; returns kv
- `indexer_q(q, rope, pos)`                     = ops.index_sim(ops.apply_rope(q, inv_freq, pos))

`rope` is either the inverse frequencies [rd/2] (fp32; the kernel computes pos * inv_freq in fp32
and its cos/sin), or a table [P, rd] from `rope_table(inv_freq, P)`: cos in [:rd/2], sin in
[rd/2:], made by torch from the same fp32 angles as ops.apply_rope, so that RoPE is bit-exact by
construction on any device (P positions x rd x 4 bytes; the caller picks).

Rounding points are those of ops (every kernel is compiled with enable_fp_fusion=False, so each
product is rounded before it is added, as in torch's eager ops, and with enable_reflect_ftz=False,
so libdevice keeps subnormals as torch's CUDA build does; divisions are tl.div_rn, because
Triton's `/` is div.full.f32 / div.approx on the GPU, not IEEE): the norm in fp32, rounded to
the activation dtype (bf16 rounding only for bf16 tensors; fp32 tensors are accepted and never
rounded); RoPE on the rounded values, in fp32, rounded again; the fp8 e4m3 simulation per 64
nope channels and the fp4 e2m1 simulation per 32 channels after the Hadamard rotation with
power-of-two scales computed from the bits of amax (common.fp8_pow2_scale, `fp4_pow2_scale`
here): exact twins of formats.fp8_act_sim / fp4_act_sim, ties to even.

What differs from torch:
- fp32 summation order of the sum of squares (`rms_norm`'s is exact instead: the block comment
  above `fix_bits`; `rms_norm_exact_ref` is its twin) and, in `indexer_q`, of the 128-point
  Hadamard (log2(n) butterfly stages here, a matmul in torch). Each can move an fp32 result by an
  ulp and so, rarely, a bf16 rounding by one step, and through it an fp8/fp4 rounding by one grid
  step.
- transcendental functions. On the GPU they are libdevice's (__nv_cosf, __nv_sinf, __nv_rsqrtf,
  __nv_expf, __nv_log1pf): the CUDA math library functions that torch's CUDA kernels call
  (::cos, ::rsqrt, ...), expected bit-identical (to be confirmed by the gpu tests). Under the
  Triton interpreter (CPU tests) they are computed in float64 and rounded to fp32, against
  torch-CPU's SLEEF functions (<= 1 ulp): cos/sin then differ from torch in 2-4% of the RoPE
  angles by one fp32 ulp; the table path removes that difference.
Measured on the interpreter at the V4-Flash shapes (B = 64, positions up to 2^20, both RoPE
kinds, inverse frequencies): indexer_q 0 of 524288 output elements differ from the ref,
q_norm_rope 1 of 2097152 (one bf16 step), kv_rope_sim_store 0 of 32768; with the table, 0.

Layout: a row of d channels is loaded as its even and odd channels ([.., d/2] each), which are
exactly RoPE's interleaved pairs; the fp8/fp4 blocks are runs of pairs. One program per row
(per block of heads for the [B, H, d] inputs): no cross-program reduction, so a row's result
never depends on the batch; no atomics, no host syncs; grids depend on shapes only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from megastep.checkpoint import formats
from megastep.kernels.common import (
    fp8_pow2_scale,
    fp8_round,
    launch_opts,
    next_pow2,
    on_interpreter,
    pdl_enter,
    round_bf16,
    store_fp8_codes,
)
from megastep.model import ops

# Compile options of every kernel here: no FMA contraction (torch's eager ops round each product),
# and libdevice without flush-to-zero (torch's CUDA build keeps subnormals; Triton's default
# flushes them, which turns e.g. expf of a very negative number into 0 instead of a subnormal).
TORCH_MATH = dict(enable_fp_fusion=False, enable_reflect_ftz=False)

# simulation blocks in channel pairs (jit globals must be constexpr)
KV_SIM_PAIRS = tl.constexpr(ops.KV_SIM_BLOCK // 2)  # fp8 per 64 channels
INDEX_SIM_PAIRS = tl.constexpr(ops.INDEX_SIM_BLOCK // 2)  # fp4 per 32 channels


# ---- device math as torch computes it ---------------------------------------------------------
@triton.jit
def t_cos(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.cos(x.to(tl.float64)).to(tl.float32)
    else:
        return libdevice.cos(x)


@triton.jit
def t_sin(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.sin(x.to(tl.float64)).to(tl.float32)
    else:
        return libdevice.sin(x)


@triton.jit
def t_exp(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.exp(x.to(tl.float64)).to(tl.float32)
    else:
        return libdevice.exp(x)


@triton.jit
def t_log1p(x, INTERPRET: tl.constexpr):
    if INTERPRET:  # no log1p in the interpreter: log(1+u) * u / ((1+u) - 1) in float64 (Goldberg)
        u = x.to(tl.float64)
        w = 1.0 + u
        return tl.where(w == 1.0, u, tl.log(w) * u / (w - 1.0)).to(tl.float32)
    else:
        return libdevice.log1p(x)


@triton.jit
def t_rsqrt(x, INTERPRET: tl.constexpr):
    """torch.rsqrt: 1 / sqrt(x) correctly rounded twice on CPU, CUDA's rsqrtf on the GPU."""
    if INTERPRET:
        return tl.div_rn(1.0, tl.sqrt_rn(x))
    else:
        return libdevice.rsqrt(x)


# ---- rms_norm's sum of squares, exact ------------------------------------------------------------
# rms_norm sums its squares as whole multiples of one unit per row, in fp64 where each partial sum is
# an exact integer: the sum does not depend on the order of the additions, so any launch with any
# layout that reads a row (the x group's, `linear_fp8(norm_tail=)`, whose layout depends on its
# configuration) gets the bits of this kernel. The unit: 2^(e - fix), 2^e the
# power of two above the row's largest square and fix = `fix_bits(D)`, so D terms sum below 2^53.
# Squares below the unit are dropped: the sum is off by under D units, 2^-32 of it at D = 1024,
# below fp32's half ulp 2^-24. The one rounding is the final fp64 -> fp32 (`sumsq_exact_ref`).
def fix_bits(D: int) -> int:
    """The unit's bits for rows of D channels: D multiples below 2^fix sum below 2^53."""
    return 53 - max(1, (D - 1).bit_length())


@triton.jit
def pow2_f64(k):
    """2^k in fp64 (int k in [-1022, 1023]), exactly: from the exponent bits."""
    return ((k.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def sq_exponent(amax_sq):
    """e with amax_sq < 2^e for an fp32 amax_sq >= 0, from its exponent bits (0 and subnormals: -126)."""
    return (amax_sq.to(tl.int32, bitcast=True) >> 23) - 126


@triton.jit
def fixed_squares(x, up):
    """x^2 (fp32) in whole units 1/up, rounded down: an exact integer in fp64."""
    return tl.floor((x * x).to(tl.float64) * up)


@triton.jit
def sumsq_row(x, FIX: tl.constexpr):
    """The exact sum of squares of a row held whole (fp32 [BLOCK], zeros past its end) -> fp32."""
    e = sq_exponent(tl.max(x * x, axis=0))
    tot = tl.sum(fixed_squares(x, pow2_f64(FIX - e)), axis=0)
    return (tot * pow2_f64(e - FIX)).to(tl.float32)


@triton.jit
def rms_scale(ss, D, eps, INTERPRET: tl.constexpr):
    """1 / sqrt(mean square + eps) from the row's sum of squares."""
    return t_rsqrt(tl.div_rn(ss, D.to(tl.float32)) + eps, INTERPRET)


@triton.jit
def round_to(x, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """`.to(dtype)` of an fp32 value, kept in fp32: bf16 rounding, or nothing for fp32."""
    if OUT_BF16:
        return round_bf16(x, INTERPRET)
    else:
        return x


# ---- pieces on (even, odd) channel pairs [R, HALF] ---------------------------------------------
@triton.jit
def rope_pairs(e, o, p, pos, rope_ptr, NOPE_P: tl.constexpr, ROPE_P: tl.constexpr, TABLE: tl.constexpr,
               INTERPRET: tl.constexpr, INVERSE: tl.constexpr = False):
    """ops.apply_rope on pairs p >= NOPE_P (pair NOPE_P + i turns with frequency i) at the
    scalar position pos (int64); the other pairs pass through. No rounding here. INVERSE: the
    inverse rotation, computed as ops.apply_rope(.., inverse=True) does (sin negated)."""
    j = p - NOPE_P
    is_rope = j >= 0
    j = tl.where(is_rope, j, 0)
    if TABLE:
        c = tl.load(rope_ptr + pos * (2 * ROPE_P) + j)
        s = tl.load(rope_ptr + pos * (2 * ROPE_P) + ROPE_P + j)
    else:
        ang = pos.to(tl.float32) * tl.load(rope_ptr + j)
        c = t_cos(ang, INTERPRET)
        s = t_sin(ang, INTERPRET)
    if INVERSE:
        s = -s
    re = e * c - o * s
    ro = o * c + e * s
    return tl.where(is_rope, re, e), tl.where(is_rope, ro, o)


@triton.jit
def fp8_sim_pairs(e, o, p, NOPE_P: tl.constexpr, INTERPRET: tl.constexpr):
    """formats.fp8_act_sim(x[:, :2*NOPE_P], 64) on pairs: blocks of 32 pairs (the last one may
    be ragged), scale 2^ceil(log2(max(amax, 1e-4)/448)), e4m3 round to nearest even. Pairs past
    NOPE_P pass through."""
    a = tl.maximum(tl.abs(e), tl.abs(o))
    blk = p // KV_SIM_PAIRS
    nope = p < NOPE_P
    s_el = tl.zeros(a.shape, dtype=tl.float32)
    inv_el = tl.zeros(a.shape, dtype=tl.float32)
    for k in tl.static_range((NOPE_P + KV_SIM_PAIRS - 1) // KV_SIM_PAIRS):
        inb = nope & (blk == k)
        s, inv = fp8_pow2_scale(tl.max(tl.where(inb, a, 0.0), axis=1))
        s_el = tl.where(inb, s[:, None], s_el)
        inv_el = tl.where(inb, inv[:, None], inv_el)
    qe = fp8_round(e, inv_el, INTERPRET).to(tl.float32) * s_el
    qo = fp8_round(o, inv_el, INTERPRET).to(tl.float32) * s_el
    return tl.where(nope, qe, e), tl.where(nope, qo, o)


@triton.jit
def fp4_pow2_scale(amax):
    """amax (fp32) -> (s, 1/s), s = 2^ceil(log2(max(amax, 6 * 2^-126) / 6)) from the bits:
    amax = 1.f * 2^e and 6 = 1.5 * 2^2, so s = 2^(e-2) when 1.f <= 1.5, else 2^(e-1). Equals
    formats.pow2_scale, which rounds amax/6 first: that quotient is never within an ulp of a
    power of two unless exactly one, so its rounding never crosses one."""
    amax = tl.maximum(amax, 8.816207631167156e-38)  # 6 * 2^-126
    bits = amax.to(tl.int32, bitcast=True)
    se = ((bits >> 23) & 0xFF) - 2 + ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)
    return (se << 23).to(tl.float32, bitcast=True), ((254 - se) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_round(x):
    """Nearest e2m1 value of fp32 x (formats.e2m1_codes: ties to even, saturating at 6); the
    sign comes from the sign bit, so -0.0 and small negatives give -0.0 as the table does."""
    a = tl.abs(x)
    half_steps = (a > 0.25).to(tl.float32) + (a >= 0.75).to(tl.float32) + (a > 1.25).to(tl.float32) + (
        a >= 1.75).to(tl.float32)
    v = half_steps * 0.5 + (a > 2.5).to(tl.float32) + (a >= 3.5).to(tl.float32) + (a > 5.0).to(tl.float32) * 2.0
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -v, v)


@triton.jit
def fp4_sim_pairs(e, o, p, HALF: tl.constexpr):
    """formats.fp4_act_sim(x, 32) on pairs: blocks of 16 pairs, E8M0-style power-of-two scale."""
    a = tl.maximum(tl.abs(e), tl.abs(o))
    blk = p // INDEX_SIM_PAIRS
    s_el = tl.zeros(a.shape, dtype=tl.float32)
    inv_el = tl.zeros(a.shape, dtype=tl.float32)
    for k in tl.static_range((HALF + INDEX_SIM_PAIRS - 1) // INDEX_SIM_PAIRS):
        inb = blk == k
        s, inv = fp4_pow2_scale(tl.max(tl.where(inb, a, 0.0), axis=1))
        s_el = tl.where(inb, s[:, None], s_el)
        inv_el = tl.where(inb, inv[:, None], inv_el)
    return e2m1_round(e * inv_el) * s_el, e2m1_round(o * inv_el) * s_el


@triton.jit
def _fwht_last(x, R: tl.constexpr, N: tl.constexpr, LOG: tl.constexpr):
    """Unnormalized Walsh-Hadamard transform (Sylvester order: x @ H) along the last axis of
    x [R, N]: LOG butterfly stages (a, b) -> (a + b, a - b) at strides 1, 2, 4, ..."""
    for s in tl.static_range(LOG):
        y = tl.permute(tl.reshape(x, [R, N // (2 << s), 2, 1 << s]), [0, 1, 3, 2])
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [R, N])
    return x


@triton.jit
def hadamard_pairs(e, o, R: tl.constexpr, HALF: tl.constexpr, LOG_HALF: tl.constexpr):
    """formats.hadamard_rotate before its rounding: (x @ H_n) * fp32(n^-0.5) with x given as
    pairs. The stride-1 stage combines the two channels of each pair; the later stages keep
    channel parity, so they are a HALF-point transform of the even and of the odd channels."""
    e, o = e + o, e - o
    if LOG_HALF > 0:
        e = _fwht_last(e, R, HALF, LOG_HALF)
        o = _fwht_last(o, R, HALF, LOG_HALF)
    scale = (2.0 * HALF) ** -0.5  # a Python float, used in fp32 as torch's scalar multiply does
    return e * scale, o * scale


# ---- kernels -------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, codes_ptr, scales_ptr, D, stride_xb, stride_ob, stride_cb, stride_sb, eps,
                     BLOCK_D: tl.constexpr, FIX: tl.constexpr, HAS_W: tl.constexpr, OUT_BF16: tl.constexpr,
                     CODES: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    x = tl.load(x_ptr + b * stride_xb + offs, mask=m, other=0.0).to(tl.float32)
    y = x * rms_scale(sumsq_row(x, FIX), D, eps, INTERPRET)
    if HAS_W:
        y = tl.load(w_ptr + offs, mask=m, other=0.0) * y
    y = round_to(y, OUT_BF16, INTERPRET)
    tl.store(out_ptr + b * stride_ob + offs, y.to(out_ptr.dtype.element_ty), mask=m)
    if CODES:  # the next linear's activation quantization, here where the row is in registers
        store_fp8_codes(y, offs, m, D, codes_ptr + b * stride_cb, scales_ptr + b * stride_sb, BLOCK_D, INTERPRET)


@triton.jit
def _q_norm_rope_kernel(q_ptr, rope_ptr, pos_ptr, out_ptr, H, stride_qb, stride_qh, stride_ob, stride_oh, eps,
                        HALF: tl.constexpr, NOPE_P: tl.constexpr, ROPE_P: tl.constexpr, BLOCK_H: tl.constexpr,
                        TABLE: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    hb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    hm = h < H
    p = tl.arange(0, HALF)[None, :]
    src = q_ptr + b * stride_qb + h * stride_qh + 2 * p
    e = tl.load(src, mask=hm, other=0.0).to(tl.float32)
    o = tl.load(src + 1, mask=hm, other=0.0).to(tl.float32)
    r = t_rsqrt(tl.div_rn(tl.sum(e * e + o * o, axis=1), 2.0 * HALF) + eps, INTERPRET)[:, None]
    e = round_to(e * r, OUT_BF16, INTERPRET)
    o = round_to(o * r, OUT_BF16, INTERPRET)
    e, o = rope_pairs(e, o, p, tl.load(pos_ptr + b), rope_ptr, NOPE_P, ROPE_P, TABLE, INTERPRET)
    dst = out_ptr + b * stride_ob + h * stride_oh + 2 * p
    ty = out_ptr.dtype.element_ty
    tl.store(dst, round_to(e, OUT_BF16, INTERPRET).to(ty), mask=hm)
    tl.store(dst + 1, round_to(o, OUT_BF16, INTERPRET).to(ty), mask=hm)


@triton.jit
def _kv_rope_sim_store_kernel(x_ptr, w_ptr, rope_ptr, pos_ptr, slot_ptr, out_ptr, win_ptr,
                              W, stride_xb, stride_ob, stride_ws, stride_wr, eps,
                              HALF: tl.constexpr, NOPE_P: tl.constexpr, ROPE_P: tl.constexpr,
                              TABLE: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, HALF)[None, :]
    e = tl.load(x_ptr + b * stride_xb + 2 * p).to(tl.float32)
    o = tl.load(x_ptr + b * stride_xb + 2 * p + 1).to(tl.float32)
    r = t_rsqrt(tl.div_rn(tl.sum(e * e + o * o, axis=1), 2.0 * HALF) + eps, INTERPRET)[:, None]
    e = round_to(tl.load(w_ptr + 2 * p) * (e * r), OUT_BF16, INTERPRET)
    o = round_to(tl.load(w_ptr + 2 * p + 1) * (o * r), OUT_BF16, INTERPRET)
    pos = tl.load(pos_ptr + b)
    e, o = rope_pairs(e, o, p, pos, rope_ptr, NOPE_P, ROPE_P, TABLE, INTERPRET)
    e = round_to(e, OUT_BF16, INTERPRET)
    o = round_to(o, OUT_BF16, INTERPRET)
    e, o = fp8_sim_pairs(e, o, p, NOPE_P, INTERPRET)  # e4m3 * 2^k: exact in bf16
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + b * stride_ob + 2 * p, e.to(ty))
    tl.store(out_ptr + b * stride_ob + 2 * p + 1, o.to(ty))
    dst = win_ptr + tl.load(slot_ptr + b) * stride_ws + (pos % W) * stride_wr + 2 * p
    tl.store(dst, e.to(win_ptr.dtype.element_ty))
    tl.store(dst + 1, o.to(win_ptr.dtype.element_ty))


@triton.jit
def _indexer_q_kernel(q_ptr, rope_ptr, pos_ptr, out_ptr, H, stride_qb, stride_qh, stride_ob, stride_oh,
                      HALF: tl.constexpr, LOG_HALF: tl.constexpr, NOPE_P: tl.constexpr, ROPE_P: tl.constexpr,
                      BLOCK_H: tl.constexpr, TABLE: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
                      PDL: tl.constexpr):
    pdl_enter(PDL)
    hb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    hm = h < H
    p = tl.arange(0, HALF)[None, :]
    src = q_ptr + b * stride_qb + h * stride_qh + 2 * p
    e = tl.load(src, mask=hm, other=0.0).to(tl.float32)
    o = tl.load(src + 1, mask=hm, other=0.0).to(tl.float32)
    e, o = rope_pairs(e, o, p, tl.load(pos_ptr + b), rope_ptr, NOPE_P, ROPE_P, TABLE, INTERPRET)
    e = round_to(e, OUT_BF16, INTERPRET)
    o = round_to(o, OUT_BF16, INTERPRET)
    e, o = hadamard_pairs(e, o, BLOCK_H, HALF, LOG_HALF)
    e = round_to(e, OUT_BF16, INTERPRET)
    o = round_to(o, OUT_BF16, INTERPRET)
    e, o = fp4_sim_pairs(e, o, p, HALF)
    dst = out_ptr + b * stride_ob + h * stride_oh + 2 * p
    ty = out_ptr.dtype.element_ty
    tl.store(dst, e.to(ty), mask=hm)
    tl.store(dst + 1, o.to(ty), mask=hm)


# ---- wrappers -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadsConfig:
    block_h: int  # heads per program (power of two)
    num_warps: int


# Pinned per (H, head dim); B never enters (no configuration changes a bit: GPU-tested). The
# indexer's q transform (64 x 128) in 16 programs per row, measured in the 30-layer step on one
# H200 (2026-11-30, the `heads` group of h200_checks.sh at d01987c, A/B, p50 ms at 1 / 2 / 4 rows):
# 4.711 / 5.869 / 7.901 against 16 heads per program's 4.767 / 5.950 / 7.967; 64 programs 4.721 /
# 5.889 / 7.927. q's norm + RoPE (64 x 512) in 64 programs beside it: 4.695 / 5.916 / 7.889,
# slower at 2 rows: not taken (docs/PERFORMANCE.md, eighteenth measurement).
_PINNED_HEADS: dict[tuple[int, int], HeadsConfig] = {(64, 512): HeadsConfig(4, 4), (64, 128): HeadsConfig(4, 4)}


def pick_heads_config(H: int, d: int) -> HeadsConfig:
    cfg = _PINNED_HEADS.get((H, d))
    if cfg is not None:
        return cfg
    return HeadsConfig(max(1, min(next_pow2(H), 2048 // d)), 4)


def rope_table(inv_freq: torch.Tensor, n_pos: int) -> torch.Tensor:
    """[n_pos, rd] fp32: cos | sin of pos * inv_freq, computed as ops.apply_rope computes them."""
    ang = torch.arange(n_pos, device=inv_freq.device).float().view(-1, 1) * inv_freq
    return torch.cat([ang.cos(), ang.sin()], -1).contiguous()


def _rope_arg(rope: torch.Tensor, d: int) -> tuple[int, bool]:
    """-> (rope pairs, is a table); checks the shape against the head dim d."""
    assert rope.dtype == torch.float32 and rope.is_contiguous(), (rope.dtype, rope.stride())
    if rope.dim() == 1:
        rp = rope.numel()
    else:
        assert rope.dim() == 2 and rope.shape[1] % 2 == 0, rope.shape
        rp = rope.shape[1] // 2
    assert 0 < 2 * rp <= d, (rope.shape, d)
    return rp, rope.dim() == 2


def _check_rows(x: torch.Tensor, pos: torch.Tensor) -> None:
    assert x.dtype in (torch.bfloat16, torch.float32), x.dtype
    assert x.stride(-1) == 1, "channels must be contiguous"
    assert pos.shape == (x.shape[0],) and pos.dtype == torch.int64, (pos.shape, pos.dtype)
    assert x.device == pos.device


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float, codes: bool = False):
    """x [B, D] bf16/f32, w [D] f32 or None -> [B, D] in x's dtype. codes=True also returns the
    output's fp8 activation quantization (e4m3 [B, D], fp32 scales [B, ceil(D/128)]: exactly
    `formats.fp8_act_quant`) for linear_fp8's x_codes: (out, (codes, scales))."""
    assert x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float32) and x.stride(1) == 1, (x.shape, x.dtype)
    B, D = x.shape
    assert D <= 16384, D
    if w is not None:
        assert w.shape == (D,) and w.dtype == torch.float32 and w.is_contiguous() and w.device == x.device
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    cq = torch.empty(B, D, dtype=torch.float8_e4m3fn, device=x.device) if codes else out
    cs = torch.empty(B, -(-D // 128), dtype=torch.float32, device=x.device) if codes else out
    if B > 0:
        bd = max(128 if codes else 16, next_pow2(D))
        grid = (B,)
        _rms_norm_kernel[grid](x, x if w is None else w, out, cq, cs, D, x.stride(0), out.stride(0), cq.stride(0),
                               cs.stride(0), float(eps), BLOCK_D=bd, FIX=fix_bits(D), HAS_W=w is not None,
                               OUT_BF16=x.dtype == torch.bfloat16, CODES=codes, INTERPRET=on_interpreter(x),
                               num_warps=4 if bd <= 2048 else 8, **TORCH_MATH, **launch_opts(x, grid))
    return (out, (cq, cs)) if codes else out


def q_norm_rope(q: torch.Tensor, rope: torch.Tensor, pos: torch.Tensor, eps: float,
                config: HeadsConfig | None = None) -> torch.Tensor:
    """q [B, H, hd] bf16/f32, rope = inv_freq [rd/2] or table [P, rd], pos [B] i64 -> [B, H, hd]."""
    assert q.dim() == 3, q.shape
    _check_rows(q, pos)
    B, H, d = q.shape
    assert d >= 2 and d & (d - 1) == 0, "head dim must be a power of two"
    rp, table = _rope_arg(rope, d)
    cfg = config or pick_heads_config(H, d)
    out = torch.empty(B, H, d, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    grid = (triton.cdiv(H, cfg.block_h), B)
    _q_norm_rope_kernel[grid](
        q, rope, pos, out, H, q.stride(0), q.stride(1), out.stride(0), out.stride(1), float(eps),
        HALF=d // 2, NOPE_P=d // 2 - rp, ROPE_P=rp, BLOCK_H=cfg.block_h, TABLE=table,
        OUT_BF16=q.dtype == torch.bfloat16, INTERPRET=on_interpreter(q), num_warps=cfg.num_warps,
        **TORCH_MATH, **launch_opts(q, grid))
    return out


def kv_rope_sim_store(kv: torch.Tensor, norm_w: torch.Tensor, rope: torch.Tensor, pos: torch.Tensor,
                      window: torch.Tensor, slots: torch.Tensor, eps: float, nope: int) -> torch.Tensor:
    """kv [B, hd] bf16/f32 (wkv's output), norm_w [hd] f32, rope = inv_freq [rd/2] or table,
    pos/slots [B] i64, window [S, W, hd] (the SWA ring pool) -> kv [B, hd]; also writes
    window[slots[b], pos[b] % W] = kv[b]. nope must be hd - rd."""
    assert kv.dim() == 2, kv.shape
    _check_rows(kv, pos)
    B, d = kv.shape
    assert d >= 2 and d & (d - 1) == 0, "head dim must be a power of two"
    rp, table = _rope_arg(rope, d)
    assert nope == d - 2 * rp, (nope, d, rp)
    assert norm_w.shape == (d,) and norm_w.dtype == torch.float32 and norm_w.is_contiguous()
    assert window.dim() == 3 and window.shape[2] == d and window.stride(2) == 1 and window.dtype == kv.dtype
    assert slots.shape == (B,) and slots.dtype == torch.int64
    assert kv.device == norm_w.device == rope.device == window.device == slots.device
    out = torch.empty(B, d, dtype=kv.dtype, device=kv.device)
    if B == 0:
        return out
    grid = (B,)
    _kv_rope_sim_store_kernel[grid](
        kv, norm_w, rope, pos, slots, out, window, window.shape[1], kv.stride(0), out.stride(0),
        window.stride(0), window.stride(1), float(eps),
        HALF=d // 2, NOPE_P=nope // 2, ROPE_P=rp, TABLE=table, OUT_BF16=kv.dtype == torch.bfloat16,
        INTERPRET=on_interpreter(kv), num_warps=4, **TORCH_MATH, **launch_opts(kv, grid))
    return out


def indexer_q(q: torch.Tensor, rope: torch.Tensor, pos: torch.Tensor, config: HeadsConfig | None = None) -> torch.Tensor:
    """q [B, Hi, di] bf16/f32 (wq_b_idx's output), rope = inv_freq or table, pos [B] i64 -> [B, Hi, di]."""
    assert q.dim() == 3, q.shape
    _check_rows(q, pos)
    B, H, d = q.shape
    assert d >= 2 and d & (d - 1) == 0, "head dim must be a power of two"
    rp, table = _rope_arg(rope, d)
    cfg = config or pick_heads_config(H, d)
    out = torch.empty(B, H, d, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    grid = (triton.cdiv(H, cfg.block_h), B)
    _indexer_q_kernel[grid](
        q, rope, pos, out, H, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        HALF=d // 2, LOG_HALF=(d // 2).bit_length() - 1, NOPE_P=d // 2 - rp, ROPE_P=rp, BLOCK_H=cfg.block_h,
        TABLE=table, OUT_BF16=q.dtype == torch.bfloat16, INTERPRET=on_interpreter(q), num_warps=cfg.num_warps,
        **TORCH_MATH, **launch_opts(q, grid))
    return out


# ---- references: the ops code, with the table form of RoPE ----------------------------------------
def apply_rope_ref(x: torch.Tensor, rope: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """ops.apply_rope (per-row positions), cos/sin from the table when `rope` is one."""
    if rope.dim() == 1:
        return ops.apply_rope(x, rope, pos)
    rd = rope.shape[1]
    shape = (-1, *([1] * (x.dim() - 2)), rd // 2)
    cos, sin = rope[pos, : rd // 2].view(shape), rope[pos, rd // 2:].view(shape)
    r = x[..., -rd:].float().unflatten(-1, (-1, 2))
    a, b = r[..., 0], r[..., 1]
    rot = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rot.to(x.dtype)], dim=-1)


def rms_norm_ref(x, w, eps):
    return ops.rms_norm(x, w, eps)


def _pow2_f64(k: torch.Tensor) -> torch.Tensor:
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def sumsq_exact_ref(x: torch.Tensor) -> torch.Tensor:
    """The kernels' sum of squares over the last dim (fp32), step by step (block comment above)."""
    xf = x.float()
    sq = xf * xf
    e = (sq.amax(-1).view(torch.int32) >> 23) - 126
    fix = fix_bits(x.shape[-1])
    tot = torch.floor(sq.double() * _pow2_f64(fix - e)[..., None]).sum(-1)
    return (tot * _pow2_f64(e - fix)).float()


def rms_norm_exact_ref(x, w, eps):
    """`rms_norm`'s arithmetic in torch: the exact sum of squares, torch.rsqrt (the interpreter's
    bits; the GPU's rsqrtf may differ by an ulp), w * (x * r), rounded to x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(sumsq_exact_ref(x) / x.shape[-1] + eps)[..., None]
    return (y if w is None else w * y).to(x.dtype)


def q_norm_rope_ref(q, rope, pos, eps, config=None):
    del config
    return apply_rope_ref(ops.rms_norm(q, None, eps), rope, pos)


def kv_rope_sim_store_ref(kv, norm_w, rope, pos, window, slots, eps, nope):
    kv = ops.kv_sim(apply_rope_ref(ops.rms_norm(kv, norm_w, eps), rope, pos), nope)
    window[slots, pos % window.shape[1]] = kv
    return kv


def indexer_q_ref(q, rope, pos, config=None):
    del config
    return ops.index_sim(apply_rope_ref(q, rope, pos))


def hadamard_ref(x: torch.Tensor) -> torch.Tensor:
    """formats.hadamard_rotate (kept here so the tests name what the kernel's butterflies match)."""
    return formats.hadamard_rotate(x)
