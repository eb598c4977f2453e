"""mHC (manifold hyper-connections) for decode: the stream mixes, Sinkhorn, collapse + RMSNorm,
and the stream update, as three small kernels instead of ~150 torch ops per call.

Semantics (`*_ref`, built from `model/ops.py`, MODEL_SPEC §3):
- `mhc_pre`:  (x, post, comb) = ops.hc_pre(h, fn, scale, base); x = ops.rms_norm(x, norm_w).
- `mhc_head`: z = ops.rms_norm(ops.hc_head(h, fn, scale, base), norm_w) (no Sinkhorn).
- `mhc_post`: ops.hc_post(y, h, post, comb).

Kernels:
1. `_hc_mix_partial_kernel`, grid (S, cdiv(B, BLOCK_M)): program s takes the flat slice
   [s*KC, (s+1)*KC) of flat(h) (hc*D long), reads that slice of fn once and applies it to
   BLOCK_M rows, writing per row the partial mixes and the partial sum of squares to an fp32
   buffer [S, B, MIXP]. The 1.5 MB fp32 fn of V4-Flash is thus streamed once by S = 64 programs
   (one program per row would make one SM read all of it: ~10 us at B = 1). Rows past B (the
   last tile; all but one at B = 1) are skipped.
2. `_hc_finish_kernel`, grid (B, 2) (mhc_pre with `sinkhorn_apart`; else (B, 1)): program (b, 0)
   collapses row b over the streams, rounds to bf16 and applies the RMSNorm; program (b, 1)
   computes post and runs the Sinkhorn on the hc x hc tile in registers (or, `sinkhorn_scalar`
   with hc = 4, on 16 scalars that every thread holds: no shuffles). The two are independent
   (each sums the S partials it needs), so at B = 1 the 20 Sinkhorn rounds no longer sit in
   front of the collapse. With `sinkhorn_stream` the Sinkhorn program is a launch of its own on
   that stream (forked after the collapse launch), so the next launch on the caller's stream waits
   for the collapse only: its output (post, comb) is needed by the next stream update, a
   sublayer later, not by the sublayer's input x. With block_d >= D (the pinned V4 case) the collapse program
   keeps the whole row in registers: h, the norm weight and the partials are all loaded first, so
   the program makes one round trip to memory, and the bf16 row is never stored and re-read. With
   block_d < D it walks the row in chunks and re-reads the stored unnormalized row (large D).
3. `_hc_post_kernel`, grid (B, cdiv(D, BLOCK_D)): elementwise over D.
`mhc_post_pre` (a sublayer's post followed by the next one's pre, as the step runs them) folds 3
into 1: each mixes program first makes its slice of the updated streams from the previous ones
(the post kernel's arithmetic, products rounded on their own, `_mul_rn`), stores it for the finish
and the next post, and mixes it: one launch per sublayer fewer, the same bits.

Rounding points follow ops exactly: every product is rounded before it is summed (the finish and
post kernels are compiled with enable_fp_fusion=False, so no FMA contraction), sums over streams
run j = 0..hc-1 in order like torch's reduction over a non-inner dim (and the 4-long row and
column sums of Sinkhorn too), the collapsed x is rounded to bf16 before the norm and the norm
output again. What differs from torch: the fp32 summation order of the hc*D-long mixes dot
products (inside a mixes program the order, and any FMA contraction, follows Triton's layout for
(KC, num_warps)) and of the sums of squares, and the exp/sigmoid/sqrt implementations (a few fp32
ulps).

Fixed trees in the finish: the S partials of a row (each column alike) and the RMSNorm's sum of
squares over the row are summed by one pairwise tree (elements 2i and 2i+1 at every level,
`_tree_rows` / `_tree_1d`), written as reshapes and sums over axes of two: a sum of two values
does not depend on the order, so the result does not depend on how Triton lays the tile out over
threads and warps (a plain tl.sum's order does). A block_d chunk is an aligned subtree of the
row's tree, and zero padding adds exact zeros, so the chunked and the one-pass collapse give the
same bits. Hence the outputs depend on (kc, num_warps) only (the mixes kernel's sums), never on
block_m, block_d, finish_warps, sinkhorn_apart, sinkhorn_scalar or post_block_d; tests/kernels/test_mhc.py and
benchmarks/kernels/tune_mhc.py check this. (These two trees replaced tl.sum reductions on
2026-11-29: the fp32 order of those two sums, and so the last bits of the outputs, changed once
against the earlier kernel; every per-element operation is as before.)

Batch invariance: a row's result never depends on B (fixed S, fixed BLOCK_M with independent
rows, the finish's programs per row); no atomics, no host syncs, outputs from torch.empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megastep.config import ModelConfig
from megastep.kernels.common import launch_opts, next_pow2, on_interpreter, pdl_enter, round_bf16
from megastep.kernels.moe import sum_pairs
from megastep.kernels.split_combine import sum_splits_ref
from megastep.model import ops


@dataclass(frozen=True)
class MhcConfig:
    kc: int = 256  # flat(h) elements per mixes program (power of two)
    block_m: int = 8  # rows per mixes program
    block_d: int = 4096  # D chunk of the collapse program (>= D: the whole row in registers, one pass)
    post_block_d: int = 512  # D chunk of an hc_post program
    num_warps: int = 4  # mixes and hc_post kernels
    finish_warps: int = 4  # finish kernel
    sinkhorn_apart: bool = True  # the finish's Sinkhorn in its own program, beside the collapse
    # hc = 4: the 20 Sinkhorn rounds on 16 scalars that every thread holds (no cross-thread sums;
    # the same operations on the same values: the same bits), not on a [4, 4] tile spread over
    # the program's warps. Pinned for V4-Flash below (measured on one H200).
    sinkhorn_scalar: bool = False

    def check(self) -> None:
        for v in (self.kc, self.block_m, self.block_d, self.post_block_d, self.num_warps, self.finish_warps):
            assert v >= 1 and v & (v - 1) == 0, self
        assert self.kc >= 16 and self.block_d >= 16 and self.post_block_d >= 16, self


# Pinned per (hc, D); other shapes use the same rule. V4-Flash's, from
# benchmarks/kernels/tune_mhc.py on one H200 (2026-11-30, docs/PERFORMANCE.md eleventh measurement):
# the Sinkhorn on scalars and 256-wide hc_post chunks, mhc_pre + mhc_post 8.7 / 21.7 us at B = 1 / 64
# against 9.1 / 22.4 for the rule (the same bits: every candidate was checked against it). The
# collapse's finish_warps measured again with the Sinkhorn in a launch of its own (nineteenth
# measurement, 30 layers p50 ms A/B at 1 row): 4 warps 4.643 / 4.610, 8 warps 4.638 / 4.663,
# 16 warps 5.094 / 5.135; at 2-16 rows 8 was no faster either. 4 stays.
_PINNED: dict[tuple[int, int], MhcConfig] = {
    (4, 4096): MhcConfig(kc=256, block_m=8, block_d=4096, post_block_d=256, num_warps=4, finish_warps=4,
                         sinkhorn_apart=True, sinkhorn_scalar=True),
}


def pick_config(hc: int, D: int) -> MhcConfig:
    """The one configuration the wrappers use for this shape (never depends on B)."""
    cfg = _PINNED.get((hc, D))
    if cfg is not None:
        return cfg
    return MhcConfig(256, 8, min(4096, max(16, next_pow2(D))), min(512, max(16, next_pow2(D))), 4, 4, True)


@triton.jit
def _mul_rn(a, b, INTERPRET: tl.constexpr):
    """a * b rounded on its own (never contracted into an FMA with a following add), in a kernel
    compiled with FP fusion on: hc_post's products, bit for bit as `_hc_post_kernel` (compiled
    without fusion: mul.rn.f32) makes them. Not libdevice's mul_rn, which flushes subnormals."""
    if INTERPRET:  # numpy rounds every operation
        return a * b
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _sublayer_out(y_ptr, y2_ptr, row, d, mask, stride_yb, stride_y2b, stride_ys, Y2: tl.constexpr,
                  YS: tl.constexpr, INTERPRET: tl.constexpr):
    """The sublayer output y at (row, d) as fp32; with Y2, rnd(y + y2) (y fp32, y2 bf16: the bits
    of linear_fp8's residual epilogue rnd(y + rnd(acc)), its second addend computed apart). YS > 0:
    y holds YS parts (part stride stride_ys) summed here in fp32 in part order: the split-K partials
    of the sublayer's last linear, then rounded to bf16 (that linear's own combine), or the routed
    experts' per-slot outputs, then (with Y2) rnd(sum + y2) (the experts' combine with the shared
    expert's output)."""
    y = tl.load(y_ptr + row * stride_yb + d, mask=mask, other=0.0).to(tl.float32)
    if YS > 0:
        for sk in tl.static_range(1, YS):
            y += tl.load(y_ptr + sk * stride_ys + row * stride_yb + d, mask=mask, other=0.0).to(tl.float32)
        if not Y2:
            y = round_bf16(y, INTERPRET)
    if Y2:
        y = round_bf16(y + tl.load(y2_ptr + row * stride_y2b + d, mask=mask, other=0.0).to(tl.float32), INTERPRET)
    return y


@triton.jit
def _post_slice(y_ptr, y2_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, row, j, d, mask, stride_yb, stride_y2b, stride_ys,
                stride_hb, stride_hj, stride_ob, stride_oj, HC: tl.constexpr, Y2: tl.constexpr, YS: tl.constexpr,
                INTERPRET: tl.constexpr):
    """hc_post for the elements (stream j, channel d) of one row (vectors; `_hc_post_kernel`'s
    arithmetic and rounding), stored to out; returns them as fp32 (exact bf16 values)."""
    y = _sublayer_out(y_ptr, y2_ptr, row, d, mask, stride_yb, stride_y2b, stride_ys, Y2, YS, INTERPRET)
    cb = comb_ptr + row * HC * HC
    h_row = h_ptr + row * stride_hb + d
    acc = _mul_rn(tl.load(cb + j, mask=mask, other=0.0), tl.load(h_row, mask=mask, other=0.0).to(tl.float32), INTERPRET)
    for i in tl.static_range(1, HC):
        hi = tl.load(h_row + i * stride_hj, mask=mask, other=0.0).to(tl.float32)
        acc = acc + _mul_rn(tl.load(cb + i * HC + j, mask=mask, other=0.0), hi, INTERPRET)
    o = _mul_rn(tl.load(post_ptr + row * HC + j, mask=mask, other=0.0), y, INTERPRET) + acc
    o = round_bf16(o, INTERPRET)
    tl.store(out_ptr + row * stride_ob + j * stride_oj + d, o.to(out_ptr.dtype.element_ty), mask=mask)
    return o


@triton.jit
def _hc_mix_partial_kernel(
    h_ptr, fn_ptr, part_ptr, y_ptr, y2_ptr, post_ptr, comb_ptr, hout_ptr,
    B, D, K, stride_hb, stride_hj, stride_fn, stride_yb, stride_y2b, stride_ys, stride_ob, stride_oj,
    MIX: tl.constexpr, MIXP: tl.constexpr, KC: tl.constexpr, BLOCK_M: tl.constexpr, HC: tl.constexpr,
    UPDATE: tl.constexpr, Y2: tl.constexpr, YS: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    s = tl.program_id(0)
    mt = tl.program_id(1)
    offs_k = s * KC + tl.arange(0, KC)  # index into flat(h) = h[j, d] at j * D + d
    k_mask = offs_k < K
    j = offs_k // D
    h_off = j * stride_hj + (offs_k - j * D)
    cols = tl.arange(0, MIXP)
    # a weight: loaded before the wait (with PDL), while the previous kernel drains
    fn = tl.load(fn_ptr + cols[:, None] * stride_fn + offs_k[None, :],
                 mask=(cols < MIX)[:, None] & k_mask[None, :], other=0.0)
    pdl_enter(PDL)
    for r in tl.static_range(BLOCK_M):
        if mt * BLOCK_M + r < B:  # rows past B (a partial last tile, B = 1): skip their reductions
            # row index as a tensor: the interpreter mishandles a scalar boolean in a mask
            row = tl.zeros([KC], dtype=tl.int32) + (mt * BLOCK_M + r)
            if UPDATE:  # h is the previous h: this slice of the updated streams, made and stored here
                x = _post_slice(y_ptr, y2_ptr, h_ptr, post_ptr, comb_ptr, hout_ptr, row.to(tl.int64), j,
                                offs_k - j * D, k_mask & (row < B), stride_yb, stride_y2b, stride_ys, stride_hb,
                                stride_hj, stride_ob, stride_oj, HC, Y2, YS, INTERPRET)
            else:
                x = tl.load(h_ptr + row.to(tl.int64) * stride_hb + h_off, mask=k_mask & (row < B),
                            other=0.0).to(tl.float32)
            part = tl.sum(fn * x[None, :], axis=1)  # [MIXP], zero past MIX
            part = tl.where(cols == MIX, tl.sum(x * x, axis=0), part)
            prow = tl.zeros([MIXP], dtype=tl.int32) + (mt * BLOCK_M + r)
            tl.store(part_ptr + (s * B + prow).to(tl.int64) * MIXP + cols, part, mask=prow < B)


@triton.jit
def _take(v, idx, i, AXIS: tl.constexpr):
    """The slice of v where idx == i along AXIS (idx: v's index along AXIS), exactly: the other
    terms of the sum are -0.0, which leaves every value as it is (-0.0 too) and which the compiler
    folds away where idx is known per register (an axis held in registers). -0.0 comes from its
    bits: Triton 3.6 turns a -0.0 literal into +0.0."""
    neg0 = tl.full(v.shape, -2147483648, tl.int32).to(tl.float32, bitcast=True)
    return tl.sum(tl.where(idx == i, v, neg0), axis=AXIS)


@triton.jit
def _tree_rows(x, N: tl.constexpr, M: tl.constexpr):
    """x [N, M] (N a power of two) -> [M]: the sum over rows as a fixed pairwise tree, rows 2i and
    2i+1 at every level. Each step adds exactly two values (a + b == b + a), so the result does
    not depend on how x is laid out over threads and warps; a tl.sum over N does."""
    for i in tl.static_range(24):
        if (N >> i) > 2:
            x = tl.sum(tl.reshape(x, (N >> (i + 1), 2, M)), axis=1)
    return tl.sum(x, axis=0)  # the last two rows (or the only one)


@triton.jit
def _tree_1d(x, N: tl.constexpr):
    """x [N] (N a power of two) -> scalar: `_tree_rows`' tree, elements 2i and 2i+1 at every level.
    Aligned power-of-two blocks are subtrees, so a row can be summed block by block (then the
    block sums by the same tree) with the same result, and zero padding changes nothing."""
    for i in tl.static_range(24):
        if (N >> i) > 2:
            x = tl.sum(tl.reshape(x, (N >> (i + 1), 2)), axis=1)
    return tl.sum(x, axis=0)


@triton.jit
def _load_partials(prow, s_ok, COL: tl.constexpr, M: tl.constexpr):
    """The S partials of columns [COL, COL + M) of a row: [SP, M], zero rows past S."""
    return tl.load(prow[:, None] + COL + tl.arange(0, M)[None, :], mask=s_ok[:, None], other=0.0)


@triton.jit
def _load_mix_sq(prow, s_ok, COL: tl.constexpr, HC: tl.constexpr, MIX: tl.constexpr):
    """The S partials of columns [COL, COL + HC) of a row and, HC times over, of its sum of
    squares (column MIX): [SP, 2 HC], zero rows past S."""
    t = tl.arange(0, 2 * HC)
    col = tl.where(t < HC, COL + t, MIX)
    return tl.load(prow[:, None] + col[None, :], mask=s_ok[:, None], other=0.0)


@triton.jit
def _mix_rs(part, K, norm_eps, HC: tl.constexpr, SP: tl.constexpr):
    """From `_load_mix_sq`'s tile: (the HC mixes [HC], rsqrt(mean(flat(h)^2) + eps) [HC], the
    same value HC times: a vector keeps it where the mixes are, with no cross-warp reduction)."""
    v = tl.reshape(_tree_rows(part, SP, 2 * HC), (2, HC))
    r = tl.arange(0, 2)[:, None]
    sq = _take(v, r, 1, 0)
    return _take(v, r, 0, 0), tl.div_rn(1.0, tl.sqrt_rn(sq / K + norm_eps))


@triton.jit
def _rows4(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, eps):
    """Each row of the 4 x 4 matrix (rows a, b, c, d) over (its in-order sum + eps); with the
    arguments and results transposed, each column."""
    ra = ((a0 + a1) + a2) + a3 + eps
    rb = ((b0 + b1) + b2) + b3 + eps
    rc = ((c0 + c1) + c2) + c3 + eps
    rd = ((d0 + d1) + d2) + d3 + eps
    return (a0 / ra, a1 / ra, a2 / ra, a3 / ra, b0 / rb, b1 / rb, b2 / rb, b3 / rb,
            c0 / rc, c1 / rc, c2 / rc, c3 / rc, d0 / rd, d1 / rd, d2 / rd, d3 / rd)


@triton.jit
def _softmax_row4(p, eps):
    """softmax over the row of 4 at p, plus eps: the tile path's operations (max, exp of the
    difference, the in-order sum, one division per element) on scalars."""
    x0 = tl.load(p)
    x1 = tl.load(p + 1)
    x2 = tl.load(p + 2)
    x3 = tl.load(p + 3)
    m = tl.maximum(tl.maximum(tl.maximum(x0, x1), x2), x3)
    e0 = tl.exp(x0 - m)
    e1 = tl.exp(x1 - m)
    e2 = tl.exp(x2 - m)
    e3 = tl.exp(x3 - m)
    r = ((e0 + e1) + e2) + e3
    return e0 / r + eps, e1 / r + eps, e2 / r + eps, e3 / r + eps


@triton.jit
def _sinkhorn4(comb_row, iters, eps):
    """Sinkhorn of the 4 x 4 matrix at comb_row (row-major fp32), in place: a row softmax + eps,
    a column normalization, then iters - 1 rounds of row and column normalization (+ eps in each
    denominator), on 16 scalars that every thread holds: `sinkhorn_mixes`' operations in
    `_sinkhorn_row`'s order, so its bits, with no sum across threads or warps."""
    a0, a1, a2, a3 = _softmax_row4(comb_row, eps)
    b0, b1, b2, b3 = _softmax_row4(comb_row + 4, eps)
    c0, c1, c2, c3 = _softmax_row4(comb_row + 8, eps)
    d0, d1, d2, d3 = _softmax_row4(comb_row + 12, eps)
    a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2, a3, b3, c3, d3 = _rows4(  # the columns
        a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2, a3, b3, c3, d3, eps)
    for _ in range(iters - 1):
        a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3 = _rows4(
            a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, eps)
        a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2, a3, b3, c3, d3 = _rows4(  # the columns
            a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2, a3, b3, c3, d3, eps)
    tl.debug_barrier()  # every thread has read the matrix before any thread overwrites it
    tl.store(comb_row + 0, a0)
    tl.store(comb_row + 1, a1)
    tl.store(comb_row + 2, a2)
    tl.store(comb_row + 3, a3)
    tl.store(comb_row + 4, b0)
    tl.store(comb_row + 5, b1)
    tl.store(comb_row + 6, b2)
    tl.store(comb_row + 7, b3)
    tl.store(comb_row + 8, c0)
    tl.store(comb_row + 9, c1)
    tl.store(comb_row + 10, c2)
    tl.store(comb_row + 11, c3)
    tl.store(comb_row + 12, d0)
    tl.store(comb_row + 13, d1)
    tl.store(comb_row + 14, d2)
    tl.store(comb_row + 15, d3)


@triton.jit
def _sinkhorn_row(prow, s_ok, scale_ptr, base_ptr, post_row, comb_row, K, iters, hc_eps, norm_eps,
                  HC: tl.constexpr, MIX: tl.constexpr, SP: tl.constexpr, SCALAR: tl.constexpr):
    """post = 2 sigmoid(post mixes), comb = Sinkhorn(comb mixes) of one row, stored."""
    jj = tl.arange(0, HC)
    # every load first: nothing waits for another round trip
    post_part = _load_mix_sq(prow, s_ok, HC, HC, MIX)
    c_part = _load_partials(prow, s_ok, 2 * HC, HC * HC)
    ci = jj[:, None] * HC + jj[None, :]  # [HC, HC] index of comb[j, k]
    scale1 = tl.load(scale_ptr + 1)
    scale2 = tl.load(scale_ptr + 2)
    post_base = tl.load(base_ptr + HC + jj)
    c_base = tl.load(base_ptr + 2 * HC + ci)
    post_mix, rs = _mix_rs(post_part, K, norm_eps, HC, SP)
    post_mix = post_mix * rs
    post = 2.0 * tl.sigmoid(post_mix * scale1 + post_base)
    tl.store(post_row + jj, post)
    c_mix = tl.reshape(_tree_rows(c_part, SP, HC * HC), (HC, HC)) * rs[None, :]
    c = c_mix * scale2 + c_base
    if SCALAR:  # HC == 4: the tile's 16 values to every thread, once, through the output row
        tl.store(comb_row + ci, c)
        tl.debug_barrier()
        _sinkhorn4(comb_row, iters, hc_eps)
        return
    rows = tl.broadcast_to(jj[:, None], (HC, HC))
    colsi = tl.broadcast_to(jj[None, :], (HC, HC))
    # softmax over k, then column normalization; sums sequential in index order like torch
    e = tl.exp(c - tl.max(c, axis=1)[:, None])
    rsum = _take(e, colsi, 0, 1)
    for i in tl.static_range(1, HC):
        rsum = rsum + _take(e, colsi, i, 1)
    c = e / rsum[:, None] + hc_eps
    csum = _take(c, rows, 0, 0)
    for i in tl.static_range(1, HC):
        csum = csum + _take(c, rows, i, 0)
    c = c / (csum[None, :] + hc_eps)
    for _ in range(iters - 1):
        rsum = _take(c, colsi, 0, 1)
        for i in tl.static_range(1, HC):
            rsum = rsum + _take(c, colsi, i, 1)
        c = c / (rsum[:, None] + hc_eps)
        csum = _take(c, rows, 0, 0)
        for i in tl.static_range(1, HC):
            csum = csum + _take(c, rows, i, 0)
        c = c / (csum[None, :] + hc_eps)
    tl.store(comb_row + ci, c)


@triton.jit
def _collapse_row(prow, s_ok, h_row, x_row, w_ptr, scale_ptr, base_ptr, D, K, hc_eps, norm_eps, stride_hj,
                  HC: tl.constexpr, MIX: tl.constexpr, SP: tl.constexpr, BLOCK_D: tl.constexpr,
                  NCHP: tl.constexpr, INTERPRET: tl.constexpr):
    """x = rms_norm(bf16(sum_j pre_j h_j)) of one row, stored. NCHP == 1 (BLOCK_D >= D): the whole
    row in registers, its h and norm weight loaded before anything else (their latency hides
    behind the partial sums); else BLOCK_D chunks, the unnormalized row stored and re-read."""
    jj = tl.arange(0, HC)
    pre_part = _load_mix_sq(prow, s_ok, 0, HC, MIX)
    scale0 = tl.load(scale_ptr)
    pre_base = tl.load(base_ptr + jj)
    if NCHP == 1:
        offs = tl.arange(0, BLOCK_D)
        m = offs < D
        hv = tl.load(h_row + jj[:, None] * stride_hj + offs[None, :], mask=m[None, :], other=0.0)  # [HC, BLOCK_D]
        wv = tl.load(w_ptr + offs, mask=m, other=0.0)
    pre_mix, rs = _mix_rs(pre_part, K, norm_eps, HC, SP)
    pre_mix = pre_mix * rs
    pre = tl.sigmoid(pre_mix * scale0 + pre_base) + hc_eps  # [HC]
    # x = sum_j pre_j h_j (in order), bf16 round; the sum of squares by `_tree_1d` over the row
    if NCHP == 1:
        prod = pre[:, None] * hv.to(tl.float32)  # [HC, BLOCK_D]: pre_j h_j, the streams in registers
        acc = _take(prod, jj[:, None], 0, 0)
        for j in tl.static_range(1, HC):
            acc = acc + _take(prod, jj[:, None], j, 0)
        xr = round_bf16(acc, INTERPRET)
        rn = tl.div_rn(1.0, tl.sqrt_rn(_tree_1d(xr * xr, BLOCK_D) / D + norm_eps))
        y = wv * (xr * rn)
        tl.store(x_row + offs, round_bf16(y, INTERPRET).to(x_row.dtype.element_ty), mask=m)
    else:
        cidx = tl.arange(0, NCHP)
        csq = tl.zeros([NCHP], dtype=tl.float32)  # per-chunk sums of squares (subtrees of the row's tree)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            m = offs < D
            acc = _take(pre, jj, 0, 0) * tl.load(h_row + offs, mask=m, other=0.0).to(tl.float32)
            for j in tl.static_range(1, HC):
                acc = acc + _take(pre, jj, j, 0) * tl.load(h_row + j * stride_hj + offs, mask=m, other=0.0).to(tl.float32)
            xr = round_bf16(acc, INTERPRET)
            csq = tl.where(cidx == d0 // BLOCK_D, _tree_1d(xr * xr, BLOCK_D), csq)
            tl.store(x_row + offs, xr.to(x_row.dtype.element_ty), mask=m)
        rn = tl.div_rn(1.0, tl.sqrt_rn(_tree_1d(csq, NCHP) / D + norm_eps))
        tl.debug_barrier()  # the unnormalized row is re-read below by other threads of this program
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            m = offs < D
            xr = tl.load(x_row + offs, mask=m, other=0.0).to(tl.float32)
            y = tl.load(w_ptr + offs, mask=m, other=0.0) * (xr * rn)
            tl.store(x_row + offs, round_bf16(y, INTERPRET).to(x_row.dtype.element_ty), mask=m)


@triton.jit
def _hc_finish_kernel(
    part_ptr, h_ptr, scale_ptr, base_ptr, w_ptr, x_ptr, post_ptr, comb_ptr,
    B, D, K, S, iters, hc_eps, norm_eps,
    stride_hb, stride_hj, stride_xb,
    HC: tl.constexpr, MIX: tl.constexpr, MIXP: tl.constexpr, SP: tl.constexpr,
    BLOCK_D: tl.constexpr, NCHP: tl.constexpr, SINKHORN: tl.constexpr, APART: tl.constexpr,
    SCALAR: tl.constexpr, ROLE0: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    # program (b, 0): collapse + RMSNorm of row b; with SINKHORN the post and comb mixes too, done
    # by program (b, 1) when APART (the two run side by side), else before the collapse. ROLE0 = 1
    # (APART, grid (B, 1)): this launch runs the Sinkhorn programs only, the collapse has its own
    pdl_enter(PDL)
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    sidx = tl.arange(0, SP)
    s_ok = sidx < S
    prow = part_ptr + (sidx.to(tl.int64) * B + b) * MIXP  # [SP] row starts of this row's partials
    h_row = h_ptr + b64 * stride_hb
    x_row = x_ptr + b64 * stride_xb
    if SINKHORN:
        if APART:
            if tl.program_id(1) + ROLE0 == 0:
                _collapse_row(prow, s_ok, h_row, x_row, w_ptr, scale_ptr, base_ptr, D, K, hc_eps, norm_eps,
                              stride_hj, HC, MIX, SP, BLOCK_D, NCHP, INTERPRET)
            else:
                _sinkhorn_row(prow, s_ok, scale_ptr, base_ptr, post_ptr + b64 * HC, comb_ptr + b64 * HC * HC,
                              K, iters, hc_eps, norm_eps, HC, MIX, SP, SCALAR)
        else:
            _sinkhorn_row(prow, s_ok, scale_ptr, base_ptr, post_ptr + b64 * HC, comb_ptr + b64 * HC * HC,
                          K, iters, hc_eps, norm_eps, HC, MIX, SP, SCALAR)
            _collapse_row(prow, s_ok, h_row, x_row, w_ptr, scale_ptr, base_ptr, D, K, hc_eps, norm_eps,
                          stride_hj, HC, MIX, SP, BLOCK_D, NCHP, INTERPRET)
    else:
        _collapse_row(prow, s_ok, h_row, x_row, w_ptr, scale_ptr, base_ptr, D, K, hc_eps, norm_eps,
                      stride_hj, HC, MIX, SP, BLOCK_D, NCHP, INTERPRET)


@triton.jit
def _hc_post_kernel(
    y_ptr, y2_ptr, h_ptr, post_ptr, comb_ptr, out_ptr,
    D, stride_yb, stride_y2b, stride_ys, stride_hb, stride_hj, stride_ob, stride_oj,
    HC: tl.constexpr, BLOCK_D: tl.constexpr, Y2: tl.constexpr, YS: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = offs < D
    y = _sublayer_out(y_ptr, y2_ptr, b, offs, m, stride_yb, stride_y2b, stride_ys, Y2, YS, INTERPRET)
    cb = comb_ptr + b * HC * HC
    for k in tl.static_range(HC):
        acc = tl.load(cb + k) * tl.load(h_ptr + b * stride_hb + offs, mask=m, other=0.0).to(tl.float32)
        for j in tl.static_range(1, HC):
            hj = tl.load(h_ptr + b * stride_hb + j * stride_hj + offs, mask=m, other=0.0).to(tl.float32)
            acc = acc + tl.load(cb + j * HC + k) * hj
        o = tl.load(post_ptr + b * HC + k) * y + acc
        tl.store(out_ptr + b * stride_ob + k * stride_oj + offs, round_bf16(o, INTERPRET).to(out_ptr.dtype.element_ty),
                 mask=m)


def _check_h(h: torch.Tensor, hc: int) -> tuple[int, int]:
    assert h.dim() == 3 and h.shape[1] == hc, (h.shape, hc)
    assert h.dtype == torch.bfloat16, h.dtype
    assert h.stride(2) == 1, "channels of h must be contiguous"
    return h.shape[0], h.shape[2]


def _check_update(y, h, post, comb, y2=None):
    """The inputs of hc_post (y, h, post, comb, and y2: see mhc_post); returns (B, D)."""
    hc = h.shape[1]
    B, D = _check_h(h, hc)
    if y.dim() == 3:  # parts (see mhc_post)
        assert y.shape[1:] == (B, D) and y.shape[0] >= 1 and y.stride(2) == 1, (y.shape, h.shape)
        assert y.dtype == (torch.float32 if y2 is None else torch.bfloat16), (y.dtype, y2 is None)
    else:
        assert y.shape == (B, D) and y.stride(1) == 1, (y.shape, h.shape)
        assert y.dtype in (torch.bfloat16, torch.float32), y.dtype
    if y2 is not None:
        assert y.dtype == (torch.bfloat16 if y.dim() == 3 else torch.float32) and y2.dtype == torch.bfloat16, (
            y.dtype, y2.dtype)
        assert y2.shape == (B, D) and y2.stride(1) == 1 and y2.device == y.device, (y2.shape, y2.stride())
    assert post.shape == (B, hc) and post.dtype == torch.float32 and post.is_contiguous()
    assert comb.shape == (B, hc, hc) and comb.dtype == torch.float32 and comb.is_contiguous()
    assert y.device == h.device == post.device == comb.device
    return B, D


def _y2_operand(y: torch.Tensor, y2: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The kernels' (y2 pointer, y2 row stride): y2, or y and 0 without it (Y2 off: never read)."""
    return (y, 0) if y2 is None else (y2, y2.stride(0))


def _y_operand(y: torch.Tensor) -> tuple[int, int, int]:
    """The kernels' (YS, y row stride, y part stride): for parts [S, B, D] (split-K partials, or the
    experts' pairs as a transposed view) their count and strides, else 0 and y's row stride."""
    return (y.shape[0], y.stride(1), y.stride(0)) if y.dim() == 3 else (0, y.stride(0), 0)


# `sinkhorn_stream` value: the Sinkhorn's own launch on the caller's current stream (the CPU tests)
CURRENT_STREAM = "current"


def _collapse(h, fn, scale, base, norm_w, hc, iters, hc_eps, norm_eps, sinkhorn, config, update=None,
              sinkhorn_stream=None):
    """The mixes and finish launches -> (x, post, comb, the streams collapsed). With update =
    (y, post, comb, y2) the mixes launch first makes the updated streams h' = hc_post(y, h, post,
    comb) (y2: see mhc_post), stores them and collapses those (returned last); else h itself.
    sinkhorn_stream: None, the Sinkhorn in the finish launch; a CUDA stream, its own launch on that
    stream, forked after the collapse launch (it needs only the mixes' partials; a fork right after
    the mixes was slower at 2-16 rows: docs/PERFORMANCE.md, twentieth measurement), and the
    caller's stream must wait for that stream before it reads post or comb; CURRENT_STREAM, its own
    launch after the collapse on the current stream."""
    B, D = _check_h(h, hc)
    mix = (2 + hc) * hc if sinkhorn else hc
    K = hc * D
    assert fn.shape == (mix, K) and fn.dtype == torch.float32 and fn.stride(1) == 1, (fn.shape, fn.dtype)
    assert base.shape == (mix,) and base.dtype == torch.float32 and base.is_contiguous()
    assert scale.dtype == torch.float32 and scale.numel() == (3 if sinkhorn else 1) and scale.is_contiguous()
    assert norm_w.shape == (D,) and norm_w.dtype == torch.float32 and norm_w.is_contiguous()
    assert iters >= 1
    assert h.device == fn.device == base.device == scale.device == norm_w.device
    cfg = config or pick_config(hc, D)
    cfg.check()
    dev = h.device
    x = torch.empty(B, D, dtype=h.dtype, device=dev)
    post = torch.empty(B, hc, dtype=torch.float32, device=dev)
    comb = torch.empty(B, hc, hc, dtype=torch.float32, device=dev)
    hout = h  # the streams collapsed: h, or (update) the new ones the mixes launch writes
    if update is not None:
        _check_update(update[0], h, *update[1:])
        hout = torch.empty(B, hc, D, dtype=h.dtype, device=dev)
    if B == 0:
        return x, post, comb, hout
    S = -(-K // cfg.kc)
    mixp = next_pow2(mix + 1)
    part = torch.empty(S, B, mixp, dtype=torch.float32, device=dev)
    interp = on_interpreter(h)
    y, post_in, comb_in, y2 = update if update is not None else (h, h, h, None)  # unused without update
    grid = (S, -(-B // cfg.block_m))
    y2_ptr, y2_stride = _y2_operand(y, y2)
    ys, y_stride, ys_stride = _y_operand(y) if update is not None else (0, y.stride(0), 0)
    _hc_mix_partial_kernel[grid](
        h, fn, part, y, y2_ptr, post_in, comb_in, hout, B, D, K, h.stride(0), h.stride(1),
        fn.stride(0), y_stride, y2_stride, ys_stride, hout.stride(0), hout.stride(1),
        MIX=mix, MIXP=mixp, KC=cfg.kc, BLOCK_M=cfg.block_m, HC=hc, UPDATE=update is not None, Y2=y2 is not None,
        YS=ys, INTERPRET=interp,
        num_warps=cfg.num_warps, **launch_opts(h, grid),
    )
    h = hout
    block_d = min(cfg.block_d, max(16, next_pow2(D)))
    own = sinkhorn and sinkhorn_stream is not None  # the Sinkhorn programs in a launch of their own
    apart = own or (sinkhorn and cfg.sinkhorn_apart)

    def finish(grid: tuple[int, int], role0: int) -> None:
        _hc_finish_kernel[grid](
            part, h, scale, base, norm_w, x, post, comb,
            B, D, K, S, iters, hc_eps, norm_eps,
            h.stride(0), h.stride(1), x.stride(0),
            HC=hc, MIX=mix, MIXP=mixp, SP=next_pow2(S), BLOCK_D=block_d, NCHP=next_pow2(-(-D // block_d)),
            SINKHORN=sinkhorn, APART=apart, SCALAR=cfg.sinkhorn_scalar and hc == 4, ROLE0=role0, INTERPRET=interp,
            num_warps=cfg.finish_warps, enable_fp_fusion=False,
            **launch_opts(h, grid),
        )

    finish((B, 1 if own or not apart else 2), 0)
    if own and isinstance(sinkhorn_stream, str):
        assert sinkhorn_stream == CURRENT_STREAM, sinkhorn_stream
        finish((B, 1), 1)
    elif own:
        sinkhorn_stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(sinkhorn_stream):
            finish((B, 1), 1)
        part.record_stream(sinkhorn_stream)  # read there after this function has let it go
    return x, post, comb, h


def mhc_pre(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_w: torch.Tensor,
            hc: int, iters: int, hc_eps: float, norm_eps: float, config: MhcConfig | None = None,
            sinkhorn_stream=None):
    """h [B, hc, D] bf16, fn [(2+hc)*hc, hc*D] f32, scale [3], base [(2+hc)*hc], norm_w [D] f32
    -> (x [B, D] bf16 (collapsed and normed), post [B, hc] f32, comb [B, hc, hc] f32).
    sinkhorn_stream: where post and comb are made (`_collapse`); the same bits wherever."""
    return _collapse(h, fn, scale, base, norm_w, hc, iters, hc_eps, norm_eps, True, config,
                     sinkhorn_stream=sinkhorn_stream)[:3]


def mhc_post_pre(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                 scale: torch.Tensor, base: torch.Tensor, norm_w: torch.Tensor, hc: int, iters: int, hc_eps: float,
                 norm_eps: float, config: MhcConfig | None = None, y2: torch.Tensor | None = None,
                 sinkhorn_stream=None):
    """`mhc_post` then `mhc_pre` of the next sublayer with one launch fewer: the mixes launch makes the
    updated streams itself (the post kernel's arithmetic, rounded product by product) and stores
    them. -> (h' [B, hc, D] bf16, x, post', comb'), the bits of the two calls (y2: as mhc_post's;
    sinkhorn_stream: as mhc_pre's)."""
    x, post2, comb2, h2 = _collapse(h, fn, scale, base, norm_w, hc, iters, hc_eps, norm_eps, True, config,
                                    update=(y, post, comb, y2), sinkhorn_stream=sinkhorn_stream)
    return h2, x, post2, comb2


def mhc_head(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_w: torch.Tensor,
             hc_eps: float, norm_eps: float, config: MhcConfig | None = None) -> torch.Tensor:
    """h [B, hc, D] bf16, fn [hc, hc*D] f32, scale [1], base [hc] -> z [B, D] bf16 (collapsed, normed)."""
    return _collapse(h, fn, scale, base, norm_w, h.shape[1], 1, hc_eps, norm_eps, False, config)[0]


def mhc_post(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             config: MhcConfig | None = None, y2: torch.Tensor | None = None) -> torch.Tensor:
    """y [B, D] bf16 (or f32), h [B, hc, D] bf16, post [B, hc] f32, comb [B, hc, hc] f32 -> [B, hc, D]
    bf16. y2 [B, D] bf16 with y f32: the sublayer output is rnd(y + y2), rounded here (a residual
    sum whose second addend another stream computed: FastDecoder's shared_w2 "mhc"). y [S, B, D] f32
    (no y2): the split-K partials of the sublayer's last linear (`linear_fp8_splits` of a bf16 linear),
    summed here in split order 0..S-1 and rounded to bf16, the bits of that linear's own combine, so
    the linear's launch ends without its arrival count and last program (FastDecoder's WO_B_PARTS_ROWS).
    y [k, B, D] bf16 with y2: the routed experts' per-slot outputs (`moe_experts_table(return_pairs=True)`
    transposed, a view), summed in slot order in fp32 (`moe.sum_pairs`), then rnd(sum + y2): the experts'
    combine without its launch's arrival counts (MOE_PAIRS_ROWS)."""
    hc = h.shape[1]
    B, D = _check_update(y, h, post, comb, y2)
    cfg = config or pick_config(hc, D)
    cfg.check()
    out = torch.empty(B, hc, D, dtype=h.dtype, device=h.device)
    if B == 0:
        return out
    bd = min(cfg.post_block_d, max(16, next_pow2(D)))
    grid = (B, -(-D // bd))
    y2_ptr, y2_stride = _y2_operand(y, y2)
    ys, y_stride, ys_stride = _y_operand(y)
    _hc_post_kernel[grid](
        y, y2_ptr, h, post, comb, out, D, y_stride, y2_stride, ys_stride, h.stride(0), h.stride(1), out.stride(0),
        out.stride(1),
        HC=hc, BLOCK_D=bd, Y2=y2 is not None, YS=ys, INTERPRET=on_interpreter(h), num_warps=cfg.num_warps,
        enable_fp_fusion=False,
        **launch_opts(h, grid),
    )
    return out


# ---- references (model/ops.py itself) -----------------------------------------------------
def _cfg(hc: int, iters: int, hc_eps: float, norm_eps: float):
    return ModelConfig().replace(hc_mult=hc, hc_sinkhorn_iters=iters, hc_eps=hc_eps, rms_norm_eps=norm_eps)


def mhc_pre_ref(h, fn, scale, base, norm_w, hc, iters, hc_eps, norm_eps, config=None, sinkhorn_stream=None):
    del config, sinkhorn_stream
    x, post, comb = ops.hc_pre(h, fn, scale, base, _cfg(hc, iters, hc_eps, norm_eps))
    return ops.rms_norm(x, norm_w, norm_eps), post, comb


def mhc_head_ref(h, fn, scale, base, norm_w, hc_eps, norm_eps, config=None):
    del config
    return ops.rms_norm(ops.hc_head(h, fn, scale, base, _cfg(h.shape[1], 1, hc_eps, norm_eps)), norm_w, norm_eps)


def mhc_post_ref(y, h, post, comb, config=None, y2=None):
    del config
    if y.dim() == 3:  # wo_b's partials summed and rounded, or the experts' pairs (a [k, B, D] view) summed
        y = sum_splits_ref(y) if y2 is None else sum_pairs(y.transpose(0, 1))
    if y2 is not None:
        y = (y.float() + y2.float()).to(torch.bfloat16)
    return ops.hc_post(y, h, post, comb)


def mhc_post_pre_ref(y, h, post, comb, fn, scale, base, norm_w, hc, iters, hc_eps, norm_eps, config=None, y2=None,
                     sinkhorn_stream=None):
    del config, sinkhorn_stream
    h2 = mhc_post_ref(y, h, post, comb, y2=y2)
    return (h2, *mhc_pre_ref(h2, fn, scale, base, norm_w, hc, iters, hc_eps, norm_eps))
