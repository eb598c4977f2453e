"""Sparse attention for decode with one shared KV head (K = V) and attention sinks.

Two entry points share one kernel body:
- `sparse_attention_decode(q, kv, valid, sink, scale)`: KV rows given as one tensor [B, N, d] with a
  mask [B, N] (benchmarks, tests).
- `sparse_attention_pools(q, window, slots, pos, sink, scale, rope, comp=, idx=, idx_ok=, ratio=)`:
  the decode step's attention, reading the per-sequence pools in place (no gathers, no cats) and
  undoing the RoPE of the output in its final store. Its entries, per row b, in this order:
    window[slots[b], j] for j in 0..W-1,                valid iff j <= pos[b] (the ring's filled slots);
    ratio > 0, idx given (CSA): comp[slots[b], idx[b, t]] for t in 0..k-1, valid iff idx_ok[b, t];
    ratio > 0, no idx (HCA):    comp[slots[b], j] for j in 0..n-1, valid iff j < (pos[b] + 1) // ratio;
  (comp [S, n+1, d]: its last row is the compressors' discard row, never read). Then
  o = ops.sparse_attention(q, entries, sink, scale, valid), rounded to bf16, and the inverse RoPE of
  o's last rd dims at pos[b] (ops.apply_rope(o, inv_freq, pos, inverse=True): fp32 rotation of the
  bf16 o, rounded to bf16 again). `sparse_attention_pools_ref` is that, written with torch's
  gathers and cats as model/fast.py used to.

Semantics (`sparse_attention_decode_ref` = `ops.sparse_attention`, MODEL_SPEC §3), per row b and
head h, in fp32: s_j = (q_h . kv_j) * scale over the valid entries j; m = max_j s_j;
o_h = sum_j e^(s_j - m) kv_j / (sum_j e^(s_j - m) + e^(sink_h - m)), rounded to bf16.
Masked entries weigh exactly 0 whatever their rows hold: finite data in `sparse_attention_decode`'s
kv; anything, NaN included, in the pools, whose masked rows the kernel does not read (the pools'
unused rows, the discard row, the rows behind invalid top-k ids; the refs need finite data there).

Kernel (flash-decoding): grid (H / BLOCK_H, S, B). Program (hb, s, b) takes BLOCK_H heads of row
b and the entries [s*CHUNK, (s+1)*CHUNK) of its list; it loads each BLOCK_N x d tile of KV once
(each entry's row through its own pointer: window ring row, compressed row, or top-k row) and uses
it for all its heads, both as K (scores) and as V (weighted sum), keeping a running max, sum and
fp32 accumulator. The head-block programs of one KV chunk are neighbouring program ids, so the
KV comes from HBM once and from L2 after that. With S > 1 the chunk results go to fp32 partials
and the last program of (b, hb) to arrive (an int32 arrival counter, reset by that program; no
atomics on data) combines them in chunk order 0..S-1. S depends on the number of entries N (W + n
or W + k) only, never on B or the positions, so a row's result does not depend on the batch
(batch invariant); the order is fixed (deterministic). HCA programs stop at the row's last visible
entry (the chunks past it only publish an empty partial).
Value split (`AttnConfig.dv_split` = V > 1): grid (H / BLOCK_H * V, S, B). The V programs of a (row,
head block, chunk) each compute the chunk's scores over all d (the same values in each) and the
weighted sum of their own d / V columns, with their own partials, (m, l) copy, arrival counter and
combine: the same sums per column, so the same bits (tested), over more and lighter programs.

Precision: scores are tensor-core dots of bf16 q and kv (exact products, fp32 accumulation). The
weights p (fp32) are split into PV_PIECES bf16 pieces p = p1 + p2 (+ p3) + r, each piece exact in
bf16 and multiplied exactly against the bf16 kv with fp32 accumulation: two pieces leave
|r| <= 2^-17 |p|, below the fp32 summation noise of the sum over entries, at twice the
tensor-core work of a bf16 P. Under the Triton interpreter the same pieces are multiplied as fp32
operands (its bf16 dot is wrong), so the CPU tests check exactly the GPU's arithmetic.
What differs from the reference: fp32 summation orders, the online-softmax rescaling across
tiles and chunks, and dividing the weighted sum by the denominator instead of each weight.
A row with no valid entry gives 0 (the reference gives NaN there).
The inverse RoPE is ops'. The kernel is compiled without FMA contraction and with libdevice's
subnormals (rope_norm.TORCH_MATH), so each product of the rotation is rounded as in torch; cos/sin
come from libdevice on the GPU (the interpreter: float64 rounded to fp32, an ulp off torch-CPU in
a few % of the angles) or, bit-exact anywhere, from a `rope_norm.rope_table`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from megastep.kernels.common import (launch_opts, next_pow2, on_interpreter, pdl_enter, pdl_release, round_bf16,
                                     workspace)
from megastep.kernels.rope_norm import TORCH_MATH, _rope_arg, rope_pairs
from megastep.model import ops

_COUNTERS = 1 << 14  # arrival counters kept per device (B x head blocks)

# where a program's KV entries come from (the kernel's SRC)
_DENSE, _SWA, _HCA, _CSA = 0, 1, 2, 3


@dataclass(frozen=True)
class AttnConfig:
    block_h: int  # heads per program
    block_n: int  # KV entries per loop step
    chunk: int  # KV entries per program (a multiple of block_n); S = cdiv(N, chunk)
    pv_pieces: int = 2  # bf16 pieces of the softmax weights in the weighted sum
    num_warps: int = 8
    num_stages: int = 2
    # the combine of S > 1 chunks (one program per (row, head block)): chunk partials loaded per
    # step (up to S) and output columns per slab (up to d). Same sums in the same order whatever
    # the values (chunk order, per column): they only set how many loads are in flight at once.
    combine_group: int = 4
    combine_cols: int = 128
    # programs per (row, head block, chunk) that split the value columns: each computes the chunk's
    # scores over all d (the same values in each) and the weighted sum of d / dv_split columns
    # only, with its own partials, arrival counter and combine. More programs, each with a
    # smaller accumulator and a shorter combine.
    dv_split: int = 1
    # ptxas's register cap per thread (0: its own choice): the same instructions, so the same bits.
    # For a tuner or a benchmark: no pin sets it. (The step's CSA plan of one row takes 114 registers
    # under Triton 3.6, two 8-warp programs per SM, so its 160 programs run in one wave:
    # benchmarks/kernels/occupancy.py.)
    maxnreg: int = 0

    def check(self) -> None:
        assert self.block_h in (16, 32, 64), self
        assert self.dv_split in (1, 2, 4, 8), self
        assert self.maxnreg == 0 or 32 <= self.maxnreg <= 255, self
        assert self.block_n in (16, 32, 64), self
        assert self.chunk >= self.block_n and self.chunk % self.block_n == 0, self
        assert self.pv_pieces in (2, 3), self  # one bf16 piece misses the ref by bf16 steps
        assert self.combine_group >= 1 and self.combine_cols in (32, 64, 128, 256, 512), self


# Measured configurations by (H, N, d), consulted first by pick_config: winners of
# benchmarks/kernels/tune_attention.py on one H200 (each candidate checked against
# sparse_attention_pools_ref, timed at B = 1 and B = 64, scored by its share of the two decode
# steps), then chosen with the few-rows plans below in the step. Keys are exact: a shape not
# listed takes the rule below. Never keyed by B (batch invariance). Re-swept 2026-12-04 on the
# kernel of that day, V4-Flash at context 4K, us per call at B = 1 / 64, and with the value columns
# split over 4 programs (dv_split 4, the same bits) at B = 1 (docs/data/tune-attention-m27-c3-2026-12-04.log):
#   CSA (N = 128 + 512): h16 n32 c64 w8 30.7 / 230.3 (pinned since 2026-11-29) | h16 n32 c32 w4
#                        31.7 / 216.7, v4 15.7: the step at 2 / 4 rows 3-4 % slower, 1 row even |
#                        the sweep's winner h16 n64 c64 w8 22.4 / 214.2 (no v4: 1 row would lose it)
#   HCA (N = 128 + 33):  h16 n32 c64 w4 13.0 / 42.8, v4 10.7 (pinned, the sweep's winner) | until
#                        then h16 n32 c64 w8 13.2 / 47.1
#   window (N = 128):    h16 n32 c32 w4 9.5 / 39.9, v4 6.5 (pinned) | until then h16 n32 c32 w8
#                        10.3 / 38.5 | the sweep's winner h16 n32 c128 w4 s3 9.7 / 14.4
# The step with HCA's and the window's (30 layers, p50 ms A/B against the pins before: docs/PERFORMANCE.md,
# twenty-seventh measurement): 1 row 4.470 / 4.450 against 4.530 / 4.489, 64 rows 48.02 / 47.97
# against 48.13 / 48.31, 2-16 rows within 0.3 %. (The sweep of 2026-11-29, on that day's kernel:
# docs/data/tune-2026-11-29-b.log; sixth measurement.)
_PINNED: dict[tuple[int, int, int], AttnConfig] = {
    (64, 128, 512): AttnConfig(block_h=16, block_n=32, chunk=32, pv_pieces=2, num_warps=4, num_stages=2, combine_group=4, combine_cols=128),
    (64, 161, 512): AttnConfig(block_h=16, block_n=32, chunk=64, pv_pieces=2, num_warps=4, num_stages=2, combine_group=4, combine_cols=128),
    (64, 640, 512): AttnConfig(block_h=16, block_n=32, chunk=64, pv_pieces=2, num_warps=8, num_stages=2, combine_group=4, combine_cols=128),
}


# Launch settings for steps of few rows, by (H, N, d): (at most this many rows, config). Each
# differs from the shape's `pick_config` only in settings that change no bits (`same_bits`), so a
# row's result still does not depend on the batch. The value columns split over 4 programs at one
# row, for every kind since 2026-12-04 (the sweep above); CSA's since 2026-11-29
# (benchmarks/kernels/attn_few_rows.py at 1 / 2 / 4 rows: 25.3 / 39.0 / 59.0 us against 30.1 / 32.0 /
# 44.3, so one row only). HCA's and the window's over 8 since 2026-12-05: the 30-layer step at 1 row
# -0.32 / -0.34 % (p50 of 3 rounds, 4.446 / 4.461 ms against 4.460 / 4.476, in two calls: `arms2`
# and `one` of benchmarks/h200_checks.sh, docs/PERFORMANCE.md twenty-eighth measurement; with
# INDEXER_FIRST on one H100, `pins`: -0.16 % at 1 row).
_FEW_ROWS_DV_SPLIT = {(64, 128, 512): 8, (64, 161, 512): 8}  # the rest: 4
_PINNED_FEW_ROWS: dict[tuple[int, int, int], tuple[int, AttnConfig]] = {
    key: (1, replace(c, dv_split=_FEW_ROWS_DV_SPLIT.get(key, 4))) for key, c in _PINNED.items()
}
_BIT_NEUTRAL = ("num_stages", "combine_group", "combine_cols", "dv_split", "maxnreg")


def same_bits(a: AttnConfig, b: AttnConfig) -> bool:
    """Whether two configurations give the same bits: they differ at most in how the work is
    spread (pipeline stages, the combine's loads in flight, the value-column split, the register
    cap), never in the sums (heads per program, entries per step and per chunk, weight pieces)
    nor in the warps: on the H200, 4 warps instead of 8 moved 2 of 8 x 64 x 512 CSA outputs by
    one bf16 step (the other settings gave equal bits at 4, 8 and 16 rows)."""
    return all(getattr(a, f) == getattr(b, f) for f in AttnConfig.__dataclass_fields__ if f not in _BIT_NEUTRAL)


def pick_config(H: int, N: int, d: int, rows: int | None = None) -> AttnConfig:
    """The configuration for (heads, entries, head dim) and a step of `rows` rows. Its sums never
    depend on the rows: a measured entry of `_PINNED` when there is one; otherwise the rule:
    chunks are sized so that the fp32 partials (H x d x 4 bytes per chunk) are no larger than the
    KV bytes they summarize (chunk x d x 2) from 128 entries on, while B = 1 still gets several
    programs (the rule is not measured on the device). For few rows, `_PINNED_FEW_ROWS` may
    spread that same computation differently (the same bits)."""
    pinned = _PINNED.get((H, N, d))
    few = _PINNED_FEW_ROWS.get((H, N, d))
    # only while it keeps the pinned configuration's sums (a re-tune may pin another one)
    if few is not None and rows is not None and rows <= few[0] and pinned is not None and same_bits(few[1], pinned):
        return few[1]
    if pinned is not None:
        return pinned
    del d
    bh = 16 if H <= 16 else 32
    chunk = 64 if N <= 256 else 128 if N <= 1024 else 256
    return AttnConfig(bh, 32, chunk, pv_pieces=2, num_warps=8, num_stages=2)


@triton.jit
def _entry_rows(offs_n, n_in, b, pos_w, age_lim, nvis, win_row, comp_row, idx_ptr, ok_ptr, W,
                stride_wr, stride_cr, stride_ib, stride_kb, SRC: tl.constexpr, ROWS16: tl.constexpr):
    """The KV row pointers [BLOCK_N] of the entries offs_n, their validity and the mask to load
    them with (`_load_rows`). From the pools, masked rows are not read (0 instead); dense kv rows
    are loaded whatever the mask says (no load waits for another there: the faster form when every
    row is finite anyway). pos_w = pos % W and age_lim = min(pos, WA - 1), int32 (the kernel's).
    ROWS16: every KV row starts on a 16-byte boundary (checked by the launcher). Triton 3.9's
    alignment analysis loses that through the select between window and compressed rows and then
    loads the tile 2 bytes per instruction: 3646 instead of 1099 SASS instructions per thread per
    KV step at the CSA pin, with spills (sass_loop.py attention). Triton 3.6 (the device's) keeps
    it: the same SASS with or without the hint, and the same time on one H200 (2026-11-30)."""
    if SRC == 0:  # dense: row b of kv, validity from the mask; the rows load alongside the mask
        ok = n_in & (tl.load(ok_ptr + b * stride_kb + offs_n, mask=n_in, other=0) != 0)
        rows = comp_row + offs_n.to(tl.int64) * stride_cr
        ld = n_in
    else:
        in_win = offs_n < W
        # ring slot j holds the latest position q = j (mod W) written so far; the row at pos sees q
        # in [pos - WA + 1, pos]. With W = WA that is j <= pos; a ring longer than the window (a
        # multi-token block wrote up to W - WA positions ahead) keeps the block's earlier rows' keys.
        # age = (pos - j) mod W from pos % W, without a division per entry (a 64-bit one was a
        # ~100-instruction call, ten of them per step of 32 entries)
        age = pos_w - offs_n
        age = tl.where(age < 0, age + W, age)
        ok = n_in & in_win & (age <= age_lim)
        rows = win_row + offs_n.to(tl.int64) * stride_wr
        if SRC != 1:
            t = offs_n - W
            in_c = n_in & (t >= 0)
            if SRC == 2:  # HCA: every visible entry
                ok_c = in_c & (t < nvis)
                e = t.to(tl.int64)
            else:  # CSA: the top-k entries
                ok_c = in_c & (tl.load(ok_ptr + b * stride_kb + t, mask=in_c, other=0) != 0)
                e = tl.load(idx_ptr + b * stride_ib + t, mask=in_c, other=0).to(tl.int64)  # beside the mask
            ok = ok | ok_c
            rows = tl.where(in_win, rows, comp_row + e * stride_cr)
            if ROWS16:
                rows = tl.multiple_of(rows, 16)
        ld = ok  # masked rows: never read
    return rows, ok, ld


@triton.jit
def _load_rows(rows, ld, offs_c):
    """Columns offs_c of the KV rows (`_entry_rows`) [BLOCK_N, C]; 0 where ld is False."""
    return tl.load(rows[:, None] + offs_c[None, :], mask=ld[:, None], other=0.0)


@triton.jit
def _store_out(out_row, offs_h, h_mask, o, c0, pos, rope_ptr, stride_oh, BLOCK_H: tl.constexpr, C: tl.constexpr,
               NOPE_P: tl.constexpr, ROPE_P: tl.constexpr, TABLE: tl.constexpr, INTERPRET: tl.constexpr):
    """Store the fp32 output columns [c0, c0 + C) of BLOCK_H heads rounded to bf16; with ROPE_P > 0
    first undo the RoPE of channel pairs NOPE_P.. at pos (ops.apply_rope(.., inverse=True): in fp32
    from the bf16 values, rounded to bf16 again)."""
    o = round_bf16(o, INTERPRET)
    if ROPE_P > 0:
        e, od = tl.split(tl.reshape(o, [BLOCK_H, C // 2, 2]))
        p = c0 // 2 + tl.arange(0, C // 2)[None, :]  # channel pair index
        e, od = rope_pairs(e, od, p, pos, rope_ptr, NOPE_P, ROPE_P, TABLE, INTERPRET, INVERSE=True)
        # the pass-through pairs are bf16 already: rounding them again changes nothing
        o = tl.reshape(tl.join(round_bf16(e, INTERPRET), round_bf16(od, INTERPRET)), [BLOCK_H, C])
    offs_c = c0 + tl.arange(0, C)
    tl.store(out_row + offs_h[:, None] * stride_oh + offs_c[None, :], o.to(out_row.dtype.element_ty),
             mask=h_mask[:, None])


@triton.jit
def _sparse_attn_kernel(
    q_ptr, win_ptr, comp_ptr, idx_ptr, ok_ptr, slot_ptr, pos_ptr, rope_ptr, sink_ptr, out_ptr,
    pacc_ptr, pml_ptr, cnt_ptr,
    H, W, WA, N, ratio, scale,
    stride_qb, stride_qh, stride_ws, stride_wr, stride_cs, stride_cr, stride_ib, stride_kb, stride_ob, stride_oh,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, PIECES: tl.constexpr, INTERPRET: tl.constexpr,
    DC: tl.constexpr, GROUP: tl.constexpr, SRC: tl.constexpr,
    NOPE_P: tl.constexpr, ROPE_P: tl.constexpr, TABLE: tl.constexpr, DSPLIT: tl.constexpr, ROWS16: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    DV: tl.constexpr = D // DSPLIT  # value columns of this program
    # fastest: the (head block, value slab) programs of one KV chunk run side by side
    tile0 = tl.program_id(0)  # = hb * DSPLIT + dv: (row, head block, value slab) has its own partials
    hb = tile0 // DSPLIT
    dv = tile0 % DSPLIT
    s = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    n_t0 = tl.num_programs(0)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_d = tl.arange(0, D)
    offs_v = dv * DV + tl.arange(0, DV)
    n_lo = s * CHUNK
    n_hi = tl.minimum(n_lo + CHUNK, N)
    if SRC == 0:
        pos = b * 0
        pos_w = 0
        age_lim = 0
        nvis = 0
        comp_row = comp_ptr + b * stride_cs
        win_row = comp_row
    else:
        pos = tl.load(pos_ptr + b).to(tl.int64)
        pos_w = (pos % W).to(tl.int32)  # once per program: the window entries' ages follow from it
        age_lim = tl.minimum(pos, WA - 1).to(tl.int32)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        win_row = win_ptr + slot * stride_ws
        comp_row = comp_ptr + slot * stride_cs
        nvis = 0
        if SRC == 2:
            nvis = (pos + 1) // ratio
            n_hi = tl.minimum(n_hi, W + nvis)  # nothing visible past there
    q = tl.load(q_ptr + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :], mask=h_mask[:, None], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, DV], dtype=tl.float32)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        rows, ok, ld = _entry_rows(offs_n, offs_n < n_hi, b, pos_w, age_lim, nvis, win_row, comp_row, idx_ptr,
                                   ok_ptr, W, stride_wr, stride_cr, stride_ib, stride_kb, SRC, ROWS16)
        kv = _load_rows(rows, ld, offs_d)
        if DSPLIT == 1:
            vv = kv
        else:  # this program's value columns: the same lines again (from L1 / L2)
            vv = _load_rows(rows, ld, offs_v)
        if INTERPRET:
            kv = kv.to(tl.float32)
            vv = vv.to(tl.float32)
        sc = tl.dot(q, tl.trans(kv)) * scale  # [BLOCK_H, BLOCK_N]
        sc = tl.where(ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet: weights 0, not NaN
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(sc - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        r = p
        for i in tl.static_range(PIECES):
            piece = round_bf16(r, INTERPRET)  # fp32 holding the nearest bf16
            if INTERPRET:
                acc = acc + tl.dot(piece, vv)
            else:
                acc = tl.dot(piece.to(tl.bfloat16), vv, acc)
            if i < PIECES - 1:
                r = r - piece  # exact
        m_i = m_new
    pdl_release(PDL)  # the KV loop is done: only the output (or the chunk combine) is left

    sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0)
    out_row = out_ptr + b * stride_ob
    if SPLIT == 1:
        m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
        o = acc / (l_i + tl.exp(sink - m_use))[:, None]
        _store_out(out_row, offs_h, h_mask, o, dv * DV, pos, rope_ptr, stride_oh, BLOCK_H, DV, NOPE_P, ROPE_P, TABLE,
                   INTERPRET)
    else:
        # partials: acc [B, SPLIT, H, D] (each value slab its columns), (m, l) [B, DSPLIT, SPLIT, 2, H]
        # (each value slab its own copy, equal to the others: its combine reads only what the
        # programs behind its own arrival counter wrote)
        pa_row = pacc_ptr + (b * SPLIT) * H * D
        pml_row = pml_ptr + ((b * DSPLIT + dv) * SPLIT) * 2 * H
        tl.store(pa_row + (s * H + offs_h)[:, None] * D + offs_v[None, :], acc, mask=h_mask[:, None])
        tl.store(pml_row + s * 2 * H + offs_h, m_i, mask=h_mask)
        tl.store(pml_row + s * 2 * H + H + offs_h, l_i, mask=h_mask)
        tl.debug_barrier()  # every thread's partial is issued before the release below
        tile = b * n_t0 + tile0
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:  # last chunk program of (b, hb, dv): combine in chunk order
            tl.debug_barrier()
            ss = tl.arange(0, SPLIT_P2)
            ml_mask = (ss < SPLIT)[:, None] & h_mask[None, :]
            m_all = tl.load(pml_row + ss[:, None] * 2 * H + offs_h[None, :], mask=ml_mask, other=float("-inf"),
                            cache_modifier=".cg")
            l_all = tl.load(pml_row + ss[:, None] * 2 * H + H + offs_h[None, :], mask=ml_mask, other=0.0,
                            cache_modifier=".cg")
            m = tl.max(m_all, axis=0)
            m_use = tl.where(m == float("-inf"), 0.0, m)
            a_all = tl.exp(m_all - m_use[None, :])  # [SPLIT_P2, BLOCK_H] chunk weights, 0 past SPLIT
            den = tl.sum(l_all * a_all, axis=0) + tl.exp(sink - m_use)
            # the weighted sum over chunks in order, by DC-wide column slabs, GROUP chunks in flight
            for d0 in range(dv * DV, dv * DV + DV, DC):
                offs_c = d0 + tl.arange(0, DC)
                acc_c = tl.zeros([BLOCK_H, DC], dtype=tl.float32)
                for g in range(0, SPLIT, GROUP):
                    for i in tl.static_range(GROUP):
                        a_s = tl.sum(tl.where(ss[:, None] == g + i, a_all, 0.0), axis=0)
                        rows = tl.zeros([BLOCK_H], dtype=tl.int32) + (g + i)
                        v = tl.load(pa_row + ((g + i) * H + offs_h)[:, None] * D + offs_c[None, :],
                                    mask=(h_mask & (rows < SPLIT))[:, None], other=0.0, cache_modifier=".cg")
                        acc_c = acc_c + v * a_s[:, None]
                _store_out(out_row, offs_h, h_mask, acc_c / den[:, None], d0, pos, rope_ptr, stride_oh, BLOCK_H, DC,
                           NOPE_P, ROPE_P, TABLE, INTERPRET)
            tl.store(cnt_ptr + tile, 0)


def _launch(src: int, q, H: int, N: int, cfg: AttnConfig | None, sink, scale, *, win, comp, idx, ok, slots, pos,
            rope, W: int, ratio: int, strides: tuple[int, ...], nope_p: int, rope_p: int, table: bool,
            WA: int | None = None, heads_like: int | None = None) -> torch.Tensor:
    B, _, d = q.shape
    cfg = cfg or pick_config(heads_like or H, N, d, B)
    cfg.check()
    out = torch.empty(B, H, d, dtype=q.dtype, device=q.device)
    if B == 0 or H == 0:
        return out
    split = max(1, -(-N // cfg.chunk))
    n_hb = -(-H // cfg.block_h)
    dsplit = cfg.dv_split
    assert d % dsplit == 0 and d // dsplit >= 16, (d, dsplit)
    if split > 1:
        pacc = torch.empty(B * split * H * d, dtype=torch.float32, device=q.device)
        pml = torch.empty(B * dsplit * split * 2 * H, dtype=torch.float32, device=q.device)
        cnt = workspace(q.device, "counters_attn", max(B * n_hb * dsplit, _COUNTERS), torch.int32)
    else:
        pacc = pml = cnt = out  # unused
    grid = (n_hb * dsplit, split, B)
    opts = launch_opts(q, grid)
    row_starts = (win.data_ptr(), comp.data_ptr(), *(st * win.element_size() for st in strides[:4]))
    _sparse_attn_kernel[grid](
        q, win, comp, idx, ok, slots, pos, rope, sink, out, pacc, pml, cnt,
        H, W, W if WA is None else WA, N, ratio, float(scale),
        q.stride(0), q.stride(1), *strides, out.stride(0), out.stride(1),
        D=d, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, CHUNK=cfg.chunk, SPLIT=split, SPLIT_P2=next_pow2(split),
        PIECES=cfg.pv_pieces, INTERPRET=on_interpreter(q), DC=min(d // dsplit, cfg.combine_cols),
        GROUP=min(cfg.combine_group, split), SRC=src,
        NOPE_P=nope_p, ROPE_P=rope_p, TABLE=table, DSPLIT=dsplit, ROWS16=all(a % 16 == 0 for a in row_starts),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **TORCH_MATH,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and not on_interpreter(q) else {}), **opts,
    )
    return out


def _check_q(q: torch.Tensor, sink: torch.Tensor) -> None:
    assert q.dim() == 3 and q.dtype == torch.bfloat16 and q.stride(2) == 1, (q.shape, q.dtype, q.stride())
    H, d = q.shape[1:]
    assert sink.shape == (H,) and sink.dtype == torch.float32 and sink.is_contiguous(), (sink.shape, sink.dtype)
    assert d >= 16 and d & (d - 1) == 0, "head_dim must be a power of two"
    assert q.device == sink.device


def sparse_attention_decode(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                            scale: float, config: AttnConfig | None = None) -> torch.Tensor:
    """q [B, H, d] bf16, kv [B, N, d] bf16 (K = V), valid [B, N] bool, sink [H] f32 -> [B, H, d] bf16."""
    assert q.dim() == 3 and kv.dim() == 3 and valid.dim() == 2, (q.shape, kv.shape, valid.shape)
    _check_q(q, sink)
    B, H, d = q.shape
    N = kv.shape[1]
    assert kv.shape == (B, N, d) and valid.shape == (B, N), (q.shape, kv.shape, valid.shape)
    assert kv.dtype == torch.bfloat16 and valid.dtype == torch.bool, (kv.dtype, valid.dtype)
    assert kv.stride(2) == 1 and valid.stride(1) == 1
    assert q.device == kv.device == valid.device
    v8 = valid.view(torch.uint8)
    return _launch(_DENSE, q, H, N, config, sink, scale, win=kv, comp=kv, idx=v8, ok=v8, slots=v8, pos=v8, rope=sink,
                   W=0, ratio=1, strides=(0, 0, kv.stride(0), kv.stride(1), 0, valid.stride(0)),
                   nope_p=0, rope_p=0, table=False)


def sparse_attention_pools(q: torch.Tensor, window: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                           sink: torch.Tensor, scale: float, rope: torch.Tensor, *, comp: torch.Tensor | None = None,
                           idx: torch.Tensor | None = None, idx_ok: torch.Tensor | None = None, ratio: int = 0,
                           window_size: int | None = None, config: AttnConfig | None = None,
                           heads_like: int | None = None) -> torch.Tensor:
    """The decode step's attention over the pools, with the inverse RoPE of the output.

    q [B, H, d] bf16 (RoPE'd), window [S, W, d] bf16 (the SWA ring pool), slots / pos [B] int64
    (state slot, position), sink [H] f32, rope = inv_freq [rd/2] f32 or a table [P, rd] from
    `rope_table` (P > max position). ratio 0: the window only (comp, idx, idx_ok None). ratio > 0:
    also comp [S, n+1, d] bf16 (compressed entries; row n is the discard row, never read); with
    idx [B, k] int64/int32 and idx_ok [B, k] bool (CSA: the top-k entry ids, in [0, n) where
    idx_ok) the selected entries, without (HCA) the (pos+1)//ratio visible ones. -> [B, H, d] bf16.
    window_size: the model's sliding window (default: the ring's length W); a ring longer than
    the window serves multi-token blocks (ring slot j holds the latest position = j mod W, and
    positions pos - window_size + 1 .. pos are seen). heads_like: without `config`, the
    configuration of a launch with this many heads: a tensor-parallel rank's heads take the full
    launch's, so each head gets its bits there (a program's heads are independent rows of its
    products, so a head block that H leaves part empty gives its heads the same bits). Exactly
    `sparse_attention_pools_ref` up to fp32 summation order (module doc)."""
    _check_q(q, sink)
    B, H, d = q.shape
    assert window.dim() == 3 and window.shape[2] == d and window.dtype == q.dtype and window.stride(2) == 1, (
        window.shape, window.dtype)
    W = window.shape[1]
    WA = W if window_size is None else int(window_size)
    assert 1 <= WA <= W, (WA, W)
    assert slots.shape == (B,) and pos.shape == (B,) and slots.dtype == pos.dtype == torch.int64, (slots.shape, pos.shape)
    assert slots.is_contiguous() and pos.is_contiguous()
    rp, table = _rope_arg(rope, d)
    dev = q.device
    assert window.device == slots.device == pos.device == rope.device == dev
    if ratio == 0:
        assert comp is None and idx is None and idx_ok is None, "ratio 0 attends the window only"
        src, M, comp, cs = _SWA, 0, window, (0, 0)
    else:
        assert ratio > 0 and comp is not None, ratio
        assert comp.dim() == 3 and comp.shape[2] == d and comp.dtype == q.dtype and comp.stride(2) == 1, (
            comp.shape, comp.dtype)
        assert comp.shape[0] == window.shape[0] and comp.device == dev, (comp.shape, window.shape)
        cs = (comp.stride(0), comp.stride(1))
        if idx is None:
            assert idx_ok is None
            src, M = _HCA, comp.shape[1] - 1
        else:
            src, M = _CSA, idx.shape[1]
            assert idx.shape == (B, M) and idx.dtype in (torch.int64, torch.int32) and idx.stride(1) == 1, (
                idx.shape, idx.dtype)
            assert idx_ok is not None and idx_ok.shape == (B, M) and idx_ok.dtype == torch.bool, idx_ok
            assert idx_ok.stride(1) == 1 and idx.device == idx_ok.device == dev
    if src != _CSA:
        idx = idx_ok = slots  # unused
    ok8 = idx_ok.view(torch.uint8) if idx_ok.dtype == torch.bool else idx_ok
    return _launch(src, q, H, W + M, config, sink, scale, win=window, comp=comp, idx=idx, ok=ok8, slots=slots,
                   pos=pos, rope=rope, W=W, ratio=max(ratio, 1),
                   strides=(window.stride(0), window.stride(1), *cs, idx.stride(0), idx_ok.stride(0)),
                   nope_p=d // 2 - rp, rope_p=rp, table=table, WA=WA, heads_like=heads_like)


# ---- references ---------------------------------------------------------------------------------
def sparse_attention_decode_ref(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                                scale: float, config: AttnConfig | None = None) -> torch.Tensor:
    """`ops.sparse_attention` itself."""
    del config
    return ops.sparse_attention(q, kv, sink, scale, valid)


def inverse_rope_ref(x: torch.Tensor, rope: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """ops.apply_rope(x, inv_freq, pos, inverse=True), cos/sin from the table when `rope` is one."""
    if rope.dim() == 1:
        return ops.apply_rope(x, rope, pos, inverse=True)
    rd = rope.shape[1]
    shape = (-1, *([1] * (x.dim() - 2)), rd // 2)
    cos, sin = rope[pos, : rd // 2].view(shape), -rope[pos, rd // 2:].view(shape)
    r = x[..., -rd:].float().unflatten(-1, (-1, 2))
    a, b = r[..., 0], r[..., 1]
    rot = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rot.to(x.dtype)], dim=-1)


def sparse_attention_pools_ref(q, window, slots, pos, sink, scale, rope, *, comp=None, idx=None, idx_ok=None,
                               ratio=0, window_size=None, config=None, heads_like=None):
    """What model/fast.py computed with torch: gather the entries, cat, attend, undo the RoPE."""
    del config, heads_like
    W, d = window.shape[1], window.shape[2]
    WA = W if window_size is None else window_size
    kvs = [window[slots]]
    age = (pos[:, None] - torch.arange(W, device=q.device)[None]) % W  # pos - (position in ring slot j)
    valid = [age <= pos.clamp(max=WA - 1)[:, None]]
    if ratio:
        n = comp.shape[1] - 1
        ent = comp[slots, :n]
        if idx is not None:
            kvs.append(ent.gather(1, idx.long()[..., None].expand(-1, -1, d)))
            valid.append(idx_ok)
        else:
            kvs.append(ent)
            valid.append(torch.arange(n, device=q.device)[None] < ((pos + 1) // ratio)[:, None])
    o = ops.sparse_attention(q, torch.cat(kvs, 1), sink, scale, torch.cat(valid, 1))
    return inverse_rope_ref(o, rope, pos)
