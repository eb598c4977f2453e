"""FP8 block-scaled linear for decode (small M): y = fp8q(x, 128) @ dequant(w)^T.

Semantics (`linear_fp8_ref`): the activation is fp8-quantized per block of 128 channels along K
with power-of-two scales (`formats.fp8_act_sim`; a ragged last block is quantized on its own
amax), multiplied exactly against the e4m3 weight with its E8M0 128x128 block scales, summed in
fp32 and rounded once to `out_dtype`. This is the official `Linear` on FP8 weights.

The kernel streams the weight once. Each program owns BLOCK_N output channels x BLOCK_M rows
and a contiguous slice of K (split-K); it quantizes its slice of x itself (per-128 amax, pow2
scale from exponent bits, e4m3 round by a cast), so no separate quantization pass exists.
Split-K partials go to an fp32 workspace; the last program of a tile (an arrival counter, no
atomics on data) sums them in split order 0..S-1 and writes the output, so results do not
depend on scheduling: same input, same bits.

Epilogues (constexpr flags of the one kernel body; the main loop and the split-K combine are shared):
- plain (`linear_fp8`): acc rounded once to out_dtype.
- gated (`linear_fp8_swiglu`, the shared expert's w1/w3): w13 = cat(w1, w3) rows [2I, K]; each
  program owns the same BLOCK_N rows of w1 and of w3 (two accumulators over one quantized x), so
  out = rnd(swiglu(rnd(x @ w1^T), rnd(x @ w3^T))) is formed after the (ordered) split-K combine,
  exactly `ops.swiglu(linear_fp8(x, w1), linear_fp8(x, w3), limit).to(out_dtype)`.
- residual (`linear_fp8(..., residual=y)`): out = rnd(y + rnd(acc)), exactly
  `(y.float() + linear_fp8(x, w, s, out_dtype=out_dtype).float()).to(out_dtype)`.
Here rnd rounds to out_dtype (nothing for fp32). On the GPU the swiglu uses libdevice expf and
an IEEE division, the operations torch's fp32 silu compiles to.

Modes (pinned per shape by `pick_config`, never autotuned at run time):
- "f16" (the default): one 128-block of K per step; the weight's e4m3 bytes and the activation's
  e4m3 codes both enter the tensor cores as fp16 (every e4m3 value is exact in fp16, and e4m3 ->
  fp16x2 is one instruction per two elements), fp32 accumulation; each block's fp32 dot is then
  multiplied by its activation scale times its weight scale (powers of two: exact) and added to
  the accumulator. Without activation quantization (wo_a) the block's bf16 activation enters as
  fp16 after a power-of-two scale that puts its amax in [2^14, 2^15) (`f16_pow2_scale`): exact
  for every element above amax * 2^-31, and the rounding of smaller ones (<= amax * 2^-39) sits
  ~15 binades below the fp32 sum's own rounding. Why: these GEMVs are bound by
  instruction issue, not by HBM. The loop of "dot16" spends ~435 instructions per thread per 8 KB
  step (the e4m3 -> bf16 conversion goes through fp32; the scales are multiplied into the
  operand), "f16" ~290, ~200 with x_codes (SASS of Triton 3.6, BLOCK_N 64:
  benchmarks/kernels/sass_loop.py); measured on one H200 at M = 1 it takes 20-26 % less time
  than "dot16" on every V4-Flash shape (benchmarks/kernels/linear_variants.py, table below).
- "dot16": tensor cores on bf16 operands (e4m3 weights and quantized activations are exact in
  bf16), activation and weight scales folded into the activation operand (exact), one dot per
  BLOCK_K with fp32 accumulation. Not picked any more (wo_a took it until 2026-11-30, 20.9 us
  per call at batch 1 on one H200); kept as the comparison the tests and benchmarks use.
Both use fp32 operands under the interpreter. M is padded to a 16-row tile: the MMA work is free
next to the weight bytes. The two modes differ from the ref (and from each other) in the order of
fp32 sums only.
Measured on one H200 and dropped: an fp8 x fp8 dot (Hopper's fp8 MMA accumulates with fewer
bits than fp32: several bf16 steps off the ref; measured again on 2026-11-30 as e4m3 x e4m3 wgmma
per 128-block, the official kernel's arithmetic: 4-22 % faster alone at 1 row, but the step only
1 % faster at 1 row and 11 % slower at 16, for a relative error of 3-9e-4 against ~1e-5), a
CUDA-core fp32 GEMV for M <= 4 (never faster than dot16), one K step per program with many
programs (slower than a pipelined K loop), 128-row tiles in "f16" (fewer instructions per byte,
but slower: half the programs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from megastep.checkpoint import formats
from megastep.kernels.rope_norm import fix_bits, rms_scale, round_to, sumsq_row
from megastep.model import ops
from megastep.kernels.common import (
    e8m0_to_f32,
    f16_pow2_scale,
    fp8_block_scales,
    fp8_pow2_scale,
    fp8_round,
    l2_prefetch_rows,
    launch_opts,
    next_pow2,
    on_interpreter,
    pdl_enter,
    pdl_release,
    prefetch_lines,
    round_bf16,
    store_fp8_codes,
    workspace,
)

BLOCK = 128
_MODES = {"dot16": 2, "f16": 3}


@dataclass(frozen=True)
class LinearFp8Config:
    mode: str  # "f16" or "dot16" (module doc)
    block_n: int  # output channels per program; divides 128
    block_m: int  # rows per program (16, 32, 64; M is padded)
    block_k: int  # K per loop step: 128, 256 or 512
    split_k: int  # programs along K, reduced in fixed order
    num_warps: int = 4
    num_stages: int = 3
    # ptxas's register cap per thread (0: its own choice). The same instructions, so the same bits;
    # a lower cap fits more programs on an SM (4-warp programs at 110 registers: 4 per SM).
    maxnreg: int = 0

    def check(self) -> None:
        assert self.mode in _MODES, self.mode
        assert self.maxnreg == 0 or 32 <= self.maxnreg <= 255, self.maxnreg
        assert self.block_n in (16, 32, 64, 128), self.block_n
        assert self.block_k in (128, 256, 512), self.block_k
        assert self.split_k >= 1
        assert self.block_m in (16, 32, 64), self.block_m
        assert self.mode != "f16" or self.block_k == 128, "f16 steps one 128-block at a time"


# Pinned configurations for the V4-Flash decode shapes where the rule below is not the best
# measured one, keyed by (N, K, M bucket). The rule's measurements on one H200
# (benchmarks/kernels/linear_variants.py, CUDA-graph replay, weights rotated past L2,
# 2026-11-29), µs per call at M = 1 / 64, "f16" rule against the earlier "dot16" rule:
#   x group (wq_a + wkv) 1536x4096    6.4 / 16.5   against  8.0 / 17.2
#   qr group (wq_b + idx) 40960x1024  18.1 / 47.7  against 22.9 / 58.8
#   wo_b 4096x8192                    16.2 / 38.6  against 22.1 / 42.6
#   shared w2 4096x2048                6.8 / 15.2  against  8.6 / 16.6
#   wo_a 8 x 1024x4096 (bf16 x)       15.7 / 35.7  against 21.1 / 33.1   (2026-11-30)
# (BLOCK_N 128, 6 stages, or twice the split were slower at every shape; on 2026-11-30 also
# BLOCK_N 32 and 16, twice the programs at 3 or 2 stages, and 256-wide steps with both 128-blocks'
# dots formed before either is added: docs/PERFORMANCE.md, ninth measurement.)
# Pinned: wo_b (N 4096, K 8192) in 8 K-splits and wo_a (8 groups, N 8192, K 4096) in 4, twice the
# rule's. Alone that was no faster (above), but in the step, where they are placed plainly since the
# seventeenth measurement: 30 V4-Flash layers on one H200, p50 ms A/B against the rule (eighteenth
# measurement): 1 row 4.694 / 4.666 against 4.723 / 4.724, 2 rows 5.797 / 5.800 against 5.867 /
# 5.865, 4 rows 7.817 / 7.814 against 7.927 / 7.929, 16 rows 18.309 / 18.277 against 18.376 /
# 18.343, but 64 rows 52.29 / 52.41 against 52.11 / 51.88. The split sets the sums, so every row
# tile takes it (a row's bits must not depend on its batch): 64 rows pay 0.4 ms for the rest.
_PINNED: dict[tuple[int, int, int], LinearFp8Config] = {
    **{(4096, 8192, mb): LinearFp8Config("f16", 64, mb, 128, 8) for mb in (16, 32, 64)},
    **{(8192, 4096, mb): LinearFp8Config("f16", 64, mb, 128, 4) for mb in (16, 32, 64)},
}


def _m_bucket(M: int) -> int:
    """16, 32 or 64: the row tile; more than 64 rows (a prefill chunk) take several 64-row tiles,
    each streaming the weight again (mostly from L2): correct, not tuned."""
    return 16 if M <= 16 else min(next_pow2(M), 64)


def _auto_split(tiles: int, K: int, block_k: int, target: int = 264) -> int:
    """Largest power-of-two split-K with tiles * split <= target programs (two waves of the
    132 SMs) and at least one BLOCK_K step per split."""
    kb = -(-K // BLOCK)
    split = 1
    while tiles * split * 2 <= target and (kb // (split * 2)) * BLOCK >= block_k:
        split *= 2
    return split


def pick_config(M: int, N: int, K: int, quantize_act: bool = True) -> LinearFp8Config:
    """The one configuration the wrapper uses for this shape (deterministic, no autotuning).
    Every M bucket takes the same mode, K step and split (only the row tile differs), so a
    row's sums do not depend on the batch. With or without the activation quantization the
    mode is "f16" (module doc)."""
    del quantize_act
    mb = _m_bucket(M)
    cfg = _PINNED.get((N, K, mb))
    if cfg is not None:
        return cfg
    bn = 64
    tiles = -(-N // bn)
    split = _auto_split(tiles, K, 128)
    return LinearFp8Config("f16", bn, mb, 128, split, num_warps=4, num_stages=3)


# Gated (w13 = cat(w1, w3)) configurations keyed by (I, K, M bucket). Rule: "f16", BLOCK_N 64 (a
# program streams 2 x 64 weight rows), 128-wide K steps, 3 stages, split-K to ~two waves.
# Measured on one H200 (benchmarks/kernels/linear_variants.py, 2026-11-29), V4-Flash shared expert
# I 2048, K 4096 (16 MB), µs per call at M = 1 / 64: the rule 11.8 / 34.2; "dot16" with 4 stages
# (the earlier rule) 15.9 / 37.8; 4 stages 13.2; BLOCK_N 128 15.1 / 50.8; split 16 17.0 / 52.1.
# Until the nineteenth measurement the shared expert's w1/w3 at 1-16 rows ran in 2-warp programs
# (sixteenth measurement: 2 rows 6.15-6.16 ms against 6.25-6.31 in the step; 1, 4 and 16 rows
# unchanged). That changed the sums. With 2 warps Triton runs the dot on mma.sync (its MMAv2 path,
# kWidth 4 for the e4m3 operand), whose k16 steps take two of each lane's four consecutive columns:
# interleaved sets such as {0,1,4,5,...,28,29}. 4 warps run wgmma over contiguous [16j, 16j + 16)
# (Triton 3.6 PTX). A k16 step's result depends on its set of products (docs/PERFORMANCE.md,
# nineteenth measurement), so a row's w1/w3 bits depended on whether its batch had more than 16
# rows. Pinned since the twentieth measurement: 2-warp programs with 16-row tiles at every batch (more
# than 16 rows take several tiles, each streaming w13 again, mostly from L2), so every row gets the
# same sums. 30 V4-Flash layers on one H200, p50 ms A/B against the rule (4 warps): 1 row 4.637 / 4.645
# against 4.612 / 4.633, 2 rows 5.784 / 5.759 against 5.822 / 5.841, 16 rows 18.06 / 18.02 against
# 18.62 / 18.66, 64 rows 52.78 / 52.78 against 52.71 / 52.69. (2 warps with 64-row tiles at 64 rows:
# 60.7 ms.) At 1-16 rows the 2-warp program fits beside the routed experts' gate-up.
_PINNED_SWIGLU: dict[tuple[int, int, int], LinearFp8Config] = {
    (2048, 4096, mb): LinearFp8Config("f16", 64, 16, 128, 8, num_warps=2) for mb in (16, 32, 64)}


def pick_config_swiglu(M: int, I: int, K: int) -> LinearFp8Config:
    """The configuration `linear_fp8_swiglu` uses for x [M, K] and w13 [2I, K] (shape only)."""
    mb = _m_bucket(M)
    cfg = _PINNED_SWIGLU.get((I, K, mb))
    if cfg is not None:
        return cfg
    return LinearFp8Config("f16", 64, mb, 128, _auto_split(-(-I // 64), K, 128), num_warps=4, num_stages=3)


@triton.jit
def _swiglu(g, u, limit, CLAMP: tl.constexpr, INTERPRET: tl.constexpr):
    """ops.swiglu in fp32: silu(min(g, limit)) * clamp(u, -limit, limit), silu = g / (1 + exp(-g))
    as torch computes it (libdevice expf and an IEEE division on the GPU: the same operations)."""
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    if INTERPRET:  # the interpreter has no libdevice: numpy's exp
        e = tl.exp(-g)
    else:
        e = libdevice.exp(-g)
    return tl.div_rn(g, 1.0 + e) * u


@triton.jit
def _epilogue(acc, acc3, res_ptrs, mask, limit, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
              GATED: tl.constexpr, CLAMP: tl.constexpr, HAS_RES: tl.constexpr):
    """The fp32 sum(s) of a tile -> the output values (exact in the output dtype)."""
    if OUT_BF16:  # the linear's own output rounding
        acc = round_bf16(acc, INTERPRET)
    if GATED:
        if OUT_BF16:
            acc3 = round_bf16(acc3, INTERPRET)
        acc = _swiglu(acc, acc3, limit, CLAMP, INTERPRET)
    if HAS_RES:
        acc = tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32) + acc
    if (GATED or HAS_RES) and OUT_BF16:
        acc = round_bf16(acc, INTERPRET)
    return acc


@triton.jit
def _code_dot(w, q, INTERPRET: tl.constexpr):
    """e4m3 weight tile [N, 128] times activation codes [M, 128] (e4m3, or fp16 for wo_a) -> fp32 [N, M]: fp16
    operands on tensor cores (every e4m3 value is exact in fp16, whose conversion is one
    instruction per two elements; fp32 accumulation), fp32 operands under the interpreter."""
    if INTERPRET:
        return tl.dot(w.to(tl.float32), tl.trans(q.to(tl.float32)))
    return tl.dot(w.to(tl.float16), tl.trans(q.to(tl.float16)))


@triton.jit
def _norm_tail(out_ptr, stride_om, nw_ptr, qr_ptr, qc_ptr, qs_ptr, cnt2_ptr, stride_qr, stride_qc, stride_qs, eps,
               pid_m, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OUT_BF16: tl.constexpr,
               INTERPRET: tl.constexpr, NORM_COLS: tl.constexpr, NORM_BLOCK: tl.constexpr, NORM_FIX: tl.constexpr):
    """`linear_fp8(norm_tail=)`: run by each program that wrote a tile of out's first NORM_COLS
    columns. The last of the row tile's NORM_COLS / BLOCK_N such programs (an arrival counter per
    row tile, reset by it) reads those columns of its rows back, one row after the other, and writes
    rope_norm.rms_norm's output and fp8 codes of them, with rms_norm's own helpers: its bits, whatever
    the layout (the sum of squares is exact). (Rows normed 2 or 4 at a time as one block were
    measured on one H100 on 2026-12-05 and lost at 1-4 rows: docs/PERFORMANCE.md, thirty-first
    measurement; read them at c74879f.)"""
    tl.debug_barrier()  # every thread's stores of the tile are issued before the release below
    done = tl.atomic_add(cnt2_ptr + pid_m, 1, sem="acq_rel", scope="gpu")
    if done == NORM_COLS // BLOCK_N - 1:
        tl.debug_barrier()
        offs = tl.arange(0, NORM_BLOCK)
        m = offs < NORM_COLS
        w = tl.load(nw_ptr + offs, mask=m, other=0.0)
        n = tl.full([], NORM_COLS, tl.int32)
        row0 = pid_m * BLOCK_M
        for i in range(tl.minimum(BLOCK_M, M - row0)):
            r = (row0 + i).to(tl.int64)
            x = tl.load(out_ptr + r * stride_om + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
            y = round_to(w * (x * rms_scale(sumsq_row(x, NORM_FIX), n, eps, INTERPRET)), OUT_BF16, INTERPRET)
            tl.store(qr_ptr + r * stride_qr + offs, y.to(qr_ptr.dtype.element_ty), mask=m)
            store_fp8_codes(y, offs, m, NORM_COLS, qc_ptr + r * stride_qc, qs_ptr + r * stride_qs, NORM_BLOCK,
                            INTERPRET)
        tl.store(cnt2_ptr + pid_m, 0)


@triton.jit
def _linear_fp8_kernel(
    x_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, cnt_ptr, res_ptr, xc_ptr, xs_ptr,
    nw_ptr, qr_ptr, qc_ptr, qs_ptr, cnt2_ptr,
    M, N, K, K_PER_SPLIT, limit, eps,
    stride_xm, stride_wn, stride_wsn, stride_om, stride_rm, stride_cm, stride_sm, stride_os,
    stride_qr, stride_qc, stride_qs,
    MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr, QUANT_ACT: tl.constexpr,
    GROUP_N: tl.constexpr, GATED: tl.constexpr, CLAMP: tl.constexpr, HAS_RES: tl.constexpr, CODES: tl.constexpr,
    PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr, SPLITS_OUT: tl.constexpr, NORM_COLS: tl.constexpr,
    NORM_BLOCK: tl.constexpr, NORM_FIX: tl.constexpr,
):
    # SPLITS_OUT: out is fp32 [SPLIT_K, M, N] (split stride stride_os): each split's partial, unsummed
    # NORM_COLS > 0 (`norm_tail`): the rows' first NORM_COLS outputs RMS-normalized into qr/qc/qs (_norm_tail)
    # GATED: N is I (output channels); w3's rows (and scale rows) start N rows below w1's
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    if PREFETCH_LINES:  # (PDL) the first weight lines, while the previous kernel drains
        l2_prefetch_rows(w_ptr, pid_n * BLOCK_N, N, stride_wn, pid_k, K_PER_SPLIT, K, BLOCK_N, PREFETCH_LINES)
        if GATED:
            l2_prefetch_rows(w_ptr + N * stride_wn, pid_n * BLOCK_N, N, stride_wn, pid_k, K_PER_SPLIT, K, BLOCK_N,
                             PREFETCH_LINES)
    pdl_enter(PDL)
    n_tiles = tl.cdiv(N, BLOCK_N)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_kk = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    # BLOCK_N divides 128: the whole tile shares one row of weight scales
    ws_row = ws_ptr + ((pid_n * BLOCK_N) // 128) * stride_wsn
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc3 = acc
    if GATED:
        ws3_row = ws_row + (N // 128) * stride_wsn
        w3_rows = w_rows + N * stride_wn
        acc3 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # grouped (wo_a): output rows [g*GROUP_N, (g+1)*GROUP_N) read input columns [g*K, (g+1)*K)
    x_rows = x_ptr + ((pid_n * BLOCK_N) // GROUP_N) * K + offs_m[:, None] * stride_xm
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + offs_kk
        k_mask = offs_k < K
        w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)
        if MODE == 3:  # "f16": one 128-block per step, its codes on tensor cores, scales after
            if CODES:  # quantized where x was made (x_codes): the same codes and scales, loaded
                q = tl.load(xc_ptr + offs_m[:, None] * stride_cm + offs_k[None, :],
                            mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                s = tl.load(xs_ptr + offs_m * stride_sm + k0 // 128, mask=m_mask, other=0.0)
            else:
                xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
                if QUANT_ACT:
                    s, inv = fp8_pow2_scale(tl.max(tl.abs(xt), axis=1))  # [BLOCK_M]
                    q = fp8_round(xt, inv[:, None], INTERPRET)
                else:  # wo_a: the bf16 activation itself, scaled into fp16's range (module doc)
                    s, inv = f16_pow2_scale(tl.max(tl.abs(xt), axis=1))
                    q = (xt * inv[:, None]).to(tl.float16)
            acc += _code_dot(w, q, INTERPRET) * (s * e8m0_to_f32(tl.load(ws_row + k0 // 128)))[None, :]
            if GATED:  # the same codes against w3's rows (their own weight scale)
                w3 = tl.load(w3_rows + offs_k[None, :], mask=w_mask, other=0.0)
                acc3 += _code_dot(w3, q, INTERPRET) * (s * e8m0_to_f32(tl.load(ws3_row + k0 // 128)))[None, :]
        else:  # "dot16": scales folded into the (exact) bf16 activation operand
            sw = e8m0_to_f32(tl.load(ws_row + offs_k // 128, mask=k_mask, other=127))  # [BLOCK_K]
            xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            if QUANT_ACT:
                s, inv = fp8_block_scales(tl.abs(xt), offs_kk, 128, BLOCK_K // 128)
                xq = fp8_round(xt, inv, INTERPRET).to(tl.float32) * s
            else:  # wo_a: a bf16 activation against the dequantized weight (power-of-two scale: exact)
                xq = xt
            xe = xq * sw[None, :]
            if INTERPRET:
                acc += tl.dot(w.to(tl.float32), tl.trans(xe))
            else:
                acc += tl.dot(w.to(tl.bfloat16), tl.trans(xe.to(tl.bfloat16)))
            if GATED:  # the same quantized x against w3's rows (their own weight scales)
                w3 = tl.load(w3_rows + offs_k[None, :], mask=w_mask, other=0.0)
                xe3 = xq * e8m0_to_f32(tl.load(ws3_row + offs_k // 128, mask=k_mask, other=127))[None, :]
                if INTERPRET:
                    acc3 += tl.dot(w3.to(tl.float32), tl.trans(xe3))
                else:
                    acc3 += tl.dot(w3.to(tl.bfloat16), tl.trans(xe3.to(tl.bfloat16)))
    pdl_release(PDL)  # every weight byte of this program is read

    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    res_ptrs = res_ptr + offs_m[None, :] * stride_rm + offs_n[:, None]
    out_mask = n_mask[:, None] & m_mask[None, :]
    if SPLITS_OUT:  # the partial as it enters the split sum (linear_fp8_splits)
        tl.store(out_ptrs + pid_k * stride_os, acc, mask=out_mask)
    elif SPLIT_K == 1:
        acc = _epilogue(acc, acc3, res_ptrs, out_mask, limit, OUT_BF16, INTERPRET, GATED, CLAMP, HAS_RES)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        if NORM_COLS > 0:
            if pid_n * BLOCK_N < NORM_COLS:
                _norm_tail(out_ptr, stride_om, nw_ptr, qr_ptr, qc_ptr, qs_ptr, cnt2_ptr, stride_qr, stride_qc,
                           stride_qs, eps, pid_m, M, BLOCK_M, BLOCK_N, OUT_BF16, INTERPRET, NORM_COLS, NORM_BLOCK,
                           NORM_FIX)
    else:
        tile = pid_m * n_tiles + pid_n
        tile_elems = BLOCK_N * BLOCK_M
        split_stride = tl.num_programs(0) * tl.num_programs(2) * tile_elems
        p_off = tile * tile_elems + tl.arange(0, BLOCK_M)[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        tl.store(part_ptr + pid_k * split_stride + p_off, acc, mask=out_mask)
        if GATED:  # w3's partials after all of w1's
            tl.store(part_ptr + (SPLIT_K + pid_k) * split_stride + p_off, acc3, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is issued before the release below
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # last program of this tile: fixed-order sum
            tl.debug_barrier()
            tot = tl.load(part_ptr + p_off, mask=out_mask, other=0.0, cache_modifier=".cg")
            for sk in tl.static_range(1, SPLIT_K):
                tot += tl.load(part_ptr + sk * split_stride + p_off, mask=out_mask, other=0.0,
                               cache_modifier=".cg")
            tot3 = tot
            if GATED:
                tot3 = tl.load(part_ptr + SPLIT_K * split_stride + p_off, mask=out_mask, other=0.0,
                               cache_modifier=".cg")
                for sk in tl.static_range(1, SPLIT_K):
                    tot3 += tl.load(part_ptr + (SPLIT_K + sk) * split_stride + p_off, mask=out_mask, other=0.0,
                                    cache_modifier=".cg")
            tot = _epilogue(tot, tot3, res_ptrs, out_mask, limit, OUT_BF16, INTERPRET, GATED, CLAMP, HAS_RES)
            tl.store(out_ptrs, tot.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.store(cnt_ptr + tile, 0)
            if NORM_COLS > 0:
                if pid_n * BLOCK_N < NORM_COLS:
                    _norm_tail(out_ptr, stride_om, nw_ptr, qr_ptr, qc_ptr, qs_ptr, cnt2_ptr, stride_qr, stride_qc,
                               stride_qs, eps, pid_m, M, BLOCK_M, BLOCK_N, OUT_BF16, INTERPRET, NORM_COLS, NORM_BLOCK,
                               NORM_FIX)


def _k_per_split(K: int, cfg: LinearFp8Config) -> int:
    """The K columns each split-K program sums (a multiple of the K step; the last may be short)."""
    kb = -(-K // BLOCK)
    split = min(cfg.split_k, kb)
    k_per_split = -(-kb // split) * BLOCK
    return -(-k_per_split // cfg.block_k) * cfg.block_k


def _launch(x, w, w_scale, out, cfg, quantize_act, groups, gated, limit, residual, x_codes, split_cols=None,
            tail=None):
    """Grid, split and workspace for x [M, K] -> out [M, N] (N = I when gated), or with split_cols
    (the columns per split) out [S, M, N] fp32, the S split-K partials. tail: (nw, eps, qr, (qc, qs))
    of `linear_fp8(norm_tail=)`, its outputs allocated."""
    M, N = out.shape[-2:]
    K = w.shape[1]
    splits_out = split_cols is not None
    k_per_split = split_cols if splits_out else _k_per_split(K, cfg)
    split = -(-K // k_per_split)
    grid = (-(-N // cfg.block_n), split, -(-M // cfg.block_m))
    tiles = grid[0] * grid[2]
    if splits_out:
        assert out.shape[0] == split and out.dtype == torch.float32, (out.shape, split)
        part = cnt = out  # unused
    elif split > 1:
        part = workspace(x.device, "partials", (2 if gated else 1) * split * tiles * cfg.block_n * cfg.block_m,
                         torch.float32)
        cnt = workspace(x.device, "counters", tiles, torch.int32)
    else:
        part = cnt = out  # unused
    res = out if residual is None else residual  # unused without a residual
    codes = x_codes is not None and cfg.mode == "f16"  # "dot16" quantizes x itself (the same values)
    xc, xs = x_codes if codes else (out, out)
    if tail is not None:
        nw, eps, qr, (qc, qs) = tail
        cnt2 = workspace(x.device, "counters_norm", grid[2], torch.int32)
    else:  # unused
        nw, eps, qr, qc, qs, cnt2 = out, 0.0, out, out, out, out
    norm_cols = nw.shape[0] if tail is not None else 0
    opts = launch_opts(x, grid, w.numel() * w.element_size())
    _linear_fp8_kernel[grid](
        x, w, w_scale.view(torch.uint8), out, part, cnt, res, xc, xs, nw, qr, qc, qs, cnt2,
        M, N, K, k_per_split, float(limit), float(eps),
        x.stride(0), w.stride(0), w_scale.stride(0), out.stride(-2), res.stride(0), xc.stride(0), xs.stride(0),
        out.stride(0) if splits_out else 0, qr.stride(0), qc.stride(0), qs.stride(0),
        MODE=_MODES[cfg.mode], BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
        SPLIT_K=split, OUT_BF16=out.dtype == torch.bfloat16, INTERPRET=on_interpreter(x), QUANT_ACT=quantize_act,
        GROUP_N=N // groups, GATED=gated, CLAMP=limit > 0, HAS_RES=residual is not None, CODES=codes,
        PREFETCH_LINES=prefetch_lines(opts, k_per_split * w.element_size()), SPLITS_OUT=splits_out,
        NORM_COLS=norm_cols, NORM_BLOCK=max(128, next_pow2(norm_cols)), NORM_FIX=fix_bits(max(norm_cols, 1)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}), **opts,
    )
    return out


def _check_codes(x, x_codes):
    """x_codes = (e4m3 [M, K], fp32 scales [M, ceil(K/128)]): x's activation quantization made
    by its producer (`formats.fp8_act_quant`'s layout); the caller vouches that they are x's."""
    if x_codes is None:
        return
    c, sc = x_codes
    M, K = x.shape
    assert c.shape == (M, K) and c.dtype == torch.float8_e4m3fn and c.stride(1) == 1, (c.shape, c.dtype)
    assert sc.shape == (M, -(-K // BLOCK)) and sc.dtype == torch.float32 and sc.stride(1) == 1, (sc.shape, sc.dtype)
    assert c.device == sc.device == x.device


def _check_operands(x, w, w_scale, out_dtype):
    assert x.dim() == 2 and w.dim() == 2, (x.shape, w.shape)
    assert x.dtype in (torch.bfloat16, torch.float32), x.dtype
    assert w.dtype == torch.float8_e4m3fn, w.dtype
    assert out_dtype in (torch.bfloat16, torch.float32), out_dtype
    N, K = w.shape
    assert w_scale.shape == (-(-N // BLOCK), -(-K // BLOCK)), (w_scale.shape, N, K)
    assert w_scale.dtype in (torch.float8_e8m0fnu, torch.uint8), w_scale.dtype
    assert x.stride(1) == 1 and w.stride(1) == 1 and w_scale.stride(1) == 1
    assert x.device == w.device == w_scale.device


def linear_fp8(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block: int = BLOCK,
    out_dtype: torch.dtype = torch.bfloat16,
    config: LinearFp8Config | None = None,
    quantize_act: bool = True,
    groups: int = 1,
    residual: torch.Tensor | None = None,
    x_codes: tuple[torch.Tensor, torch.Tensor] | None = None,
    norm_tail: tuple[torch.Tensor, float] | None = None,
):
    """x [M, K] bf16/fp32, w e4m3 [N, K], w_scale e8m0 [ceil(N/128), ceil(K/128)] -> [M, N].
    quantize_act=False skips the activation quantization (the official wo_a: a plain weight).
    groups=G (wo_a's grouped projection, one launch): x is [M, G*K] and output rows
    [g*N/G, (g+1)*N/G) take input columns [g*K, (g+1)*K); N/G must be a multiple of 128.
    residual y [M, N] fp32 (or bf16): returns rnd(y + rnd(x @ w^T)) with rnd the rounding to
    out_dtype, i.e. exactly `(y.float() + linear_fp8(x, w, w_scale, out_dtype=out_dtype).float())
    .to(out_dtype)` (the shared expert's w2 plus the routed sum), in the same launch.
    x_codes = (e4m3 [M, K], fp32 scales [M, ceil(K/128)]), exactly `formats.fp8_act_quant(x, 128)`
    as the kernel that made x writes it beside x (rms_norm with codes=True): the "f16"
    loop then loads them instead of quantizing x in every program. Same bits either way.
    norm_tail = (nw fp32 [C], eps), C <= N a multiple of the configuration's BLOCK_N: also returns
    rope_norm.rms_norm(y[:, :C], nw, eps, codes=True) of the output y, bit for bit, made in the same
    launch by the last program to write those columns of a row tile (the x group's wq_a columns and the
    q norm, without the norm's launch between wq_a and wq_b): (y, (normed, (codes, scales)))."""
    assert block == BLOCK, "V4 FP8 weights use 128x128 blocks"
    _check_operands(x, w, w_scale, out_dtype)
    x_codes = x_codes if quantize_act else None  # wo_a reads x itself
    _check_codes(x, x_codes)
    assert x.shape[1] == groups * w.shape[1], (x.shape, w.shape, groups)
    assert groups == 1 or (w.shape[0] % groups == 0 and (w.shape[0] // groups) % BLOCK == 0), (w.shape, groups)
    M = x.shape[0]
    N, K = w.shape
    if residual is not None:
        assert residual.shape == (M, N) and residual.stride(1) == 1, (residual.shape, M, N)
        assert residual.dtype in (torch.float32, torch.bfloat16) and residual.device == x.device, residual.dtype
    cfg = config or pick_config(M, N, K, quantize_act)
    cfg.check()
    out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    tail = None
    if norm_tail is not None:
        nw, eps = norm_tail
        C = nw.shape[0]
        assert nw.dim() == 1 and 0 < C <= N and C % cfg.block_n == 0 and C <= 16384, (nw.shape, N, cfg.block_n)
        assert nw.dtype == torch.float32 and nw.is_contiguous() and nw.device == x.device, nw.dtype
        assert residual is None, "norm_tail normalizes the linear's own output"
        normed = torch.empty(M, C, dtype=out_dtype, device=x.device)
        codes = (torch.empty(M, C, dtype=torch.float8_e4m3fn, device=x.device),
                 torch.empty(M, -(-C // BLOCK), dtype=torch.float32, device=x.device))
        tail = (nw, float(eps), normed, codes)
    if M == 0 or N == 0:
        return out if tail is None else (out, (tail[2], tail[3]))
    _launch(x, w, w_scale, out, cfg, quantize_act, groups, False, 0.0, residual, x_codes, tail=tail)
    return out if tail is None else (out, (tail[2], tail[3]))


def linear_fp8_swiglu(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    swiglu_limit: float,
    out_dtype: torch.dtype = torch.bfloat16,
    config: LinearFp8Config | None = None,
    x_codes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [M, K] bf16/fp32, w13 e4m3 [2I, K] = cat(w1, w3) rows, w13_scale = cat of their e8m0
    scales [2I/128, ceil(K/128)]; I a multiple of 128 -> [M, I]:
    rnd(swiglu(rnd(x @ w1^T), rnd(x @ w3^T), swiglu_limit)) with rnd the rounding to out_dtype,
    exactly `ops.swiglu(linear_fp8(x, w1, s1, out_dtype=od), linear_fp8(x, w3, s3, out_dtype=od),
    limit).to(od)` (swiglu in fp32; limit <= 0: no clamp). x_codes: as in `linear_fp8`."""
    _check_operands(x, w13, w13_scale, out_dtype)
    _check_codes(x, x_codes)
    M, K = x.shape
    two_i = w13.shape[0]
    assert w13.shape[1] == K and two_i % (2 * BLOCK) == 0, (x.shape, w13.shape)
    I = two_i // 2
    cfg = config or pick_config_swiglu(M, I, K)
    cfg.check()
    out = torch.empty(M, I, dtype=out_dtype, device=x.device)
    if M == 0:
        return out
    return _launch(x, w13, w13_scale, out, cfg, True, 1, True, float(swiglu_limit), None, x_codes)


def split_cols(K: int, config: LinearFp8Config) -> int:
    """The K columns one split-K program of `config` sums on a weight of K columns: a weight cut
    along K at multiples of this gives its split partials to different launches (linear_fp8_splits)."""
    return _k_per_split(K, config)


def linear_fp8_splits(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, config: LinearFp8Config, cols: int,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """The split-K partials of `linear_fp8`, unsummed: x [M, K], w e4m3 [N, K] -> fp32 [S, M, N]
    (or into `out`, a view of that shape with unit stride along N), S = K / cols, partial s = the
    fp32 sum over columns [s*cols, (s+1)*cols) as a program of `config` forms it before the ordered
    sum. So when w is a column block of a wider weight whose launch takes `config`, and cols is
    that launch's `split_cols` (tensor parallelism: each rank holds K/W columns of wo_b), the
    ranks' partials, concatenated and summed in order 0..S-1 and rounded (split_combine), give the
    full launch's bits. K must be whole splits."""
    _check_operands(x, w, w_scale, torch.float32)
    M, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K, (x.shape, w.shape)
    config.check()
    assert cols > 0 and cols % config.block_k == 0 and K % cols == 0, f"K {K} is not whole splits of {cols} columns"
    S = K // cols
    if out is None:
        out = torch.empty(S, M, N, dtype=torch.float32, device=x.device)
    assert out.shape == (S, M, N) and out.dtype == torch.float32 and out.stride(2) == 1, (out.shape, out.stride())
    if M and N:
        _launch(x, w, w_scale, out, config, True, 1, False, 0.0, None, None, split_cols=cols)
    return out

def linear_fp8_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    block: int = BLOCK,
    out_dtype: torch.dtype = torch.bfloat16,
    config: LinearFp8Config | None = None,
    quantize_act: bool = True,
    groups: int = 1,
    residual: torch.Tensor | None = None,
    x_codes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The exact semantics: fp32 dequantized weight times fp32 quantized activation."""
    del config, x_codes  # by contract x's own quantization
    xq = formats.fp8_act_sim(x.float(), block) if quantize_act else x.float()
    wd = formats.dequantize_fp8_weight(w, w_scale, block)
    if groups == 1:
        y = (xq @ wd.T).to(out_dtype)
    else:
        M, (N, K) = x.shape[0], w.shape
        y = torch.einsum("mgk,gnk->mgn", xq.view(M, groups, K), wd.view(groups, N // groups, K)).reshape(M, N).to(out_dtype)
    return y if residual is None else (residual.float() + y.float()).to(out_dtype)


def linear_fp8_swiglu_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    swiglu_limit: float,
    out_dtype: torch.dtype = torch.bfloat16,
    config: LinearFp8Config | None = None,
    x_codes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Two linears and `ops.swiglu`."""
    del config, x_codes
    I = w13.shape[0] // 2
    g = linear_fp8_ref(x, w13[:I], w13_scale[:I // BLOCK], out_dtype=out_dtype)
    u = linear_fp8_ref(x, w13[I:], w13_scale[I // BLOCK:], out_dtype=out_dtype)
    return ops.swiglu(g, u, swiglu_limit).to(out_dtype)


def linear_fp8_splits_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, config: LinearFp8Config,
                          cols: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of `linear_fp8_splits`: each split's columns through `linear_fp8_ref` in fp32
    (the same exact products; the sum order inside a split may differ)."""
    del config
    K, c = x.shape[1], cols
    assert c > 0 and K % c == 0, f"K {K} is not whole splits of {c} columns"
    parts = torch.stack([linear_fp8_ref(x[:, k:k + c], w[:, k:k + c], w_scale[:, k // BLOCK:(k + c) // BLOCK],
                                        out_dtype=torch.float32) for k in range(0, K, c)])
    if out is None:
        return parts
    out.copy_(parts)
    return out
