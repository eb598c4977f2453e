"""Routed MXFP4 experts for decode: sum over the top-k slots of SwiGLU experts.

Semantics (`moe_experts_mxfp4_ref`), those of the official `Expert` on FP4 weights, for each row m
and slot j with expert e = topk_ids[m, j] and routing weight r = topk_weights[m, j]
(rnd(.) rounds to x.dtype, as every official Linear rounds its output; a no-op for fp32 x):

    q  = fp8_act_sim(x[m], 128)
    g  = min(rnd(w1[e] . q), limit)             u = clamp(rnd(w3[e] . q), -limit, limit)
    a  = rnd(r * (silu(g) * u))                 routing weight before w2 (official order)
    y_j = rnd(w2[e] . fp8_act_sim(a, 128))
    out[m] = (((y_0 + y_1) + y_2) + ...)        fp32, fixed slot order

(the reference decode sums the same bf16 y_j in ascending expert id; either fixed order is
deterministic and they differ by fp32 rounding only.)

Layout: per expert w13 int8 [2I, D/2] (rows 0..I-1 = w1, I..2I-1 = w3), w13_scale e8m0 [2I, D/32],
w2 int8 [D, I/2], w2_scale e8m0 [D, I/32]; low nibble = even element, one E8M0 scale per 32 along K.
The kernels find each expert through an `ExpertTable`: an int64 [E, 4] tensor of the four base
addresses of every expert, so the experts may live anywhere the GPU can address (stacked [E, ...]
tensors at load, `stack_experts`; separate HBM slots; pinned host memory read "zero-copy" through
its device-visible address). Row strides are common to all experts of a table.
`moe_experts_mxfp4` takes the stacked tensors and builds (once, cached) their table.

Three launches (four above FUSED_ACT_QUANT_MAX_PAIRS pairs), all with static grids (CUDA-graph friendly, no host sync):
1. `_moe_prep_kernel` (kernels/moe_route.py): groups the M*k (row, slot) pairs by expert (pairs sorted by expert then
   pair index; one "slot" per distinct expert: id, first pair, count) and, in other programs of
   the same launch, quantizes x (fp8_act_sim per 128) once for all experts.
2. `_moe_gate_up_kernel`: programs (I tile, slot group) loop over their distinct experts and read
   each expert's w1/w3 rows, dequantizing MXFP4 in registers (never to memory); then clamp,
   SwiGLU and the routing weight; then fp8_act_sim(a, 128): a 128-block of a pair's activation
   spans several I tiles, and the last of their programs to store its tile (an arrival counter
   per (pair, block), reset by it; no atomics on data) quantizes the block. Above
   FUSED_ACT_QUANT_MAX_PAIRS pairs (or with I tiles that do not divide 128),
   `_moe_act_quant_kernel` does it per pair in a launch of its own, with the same operations (the
   same bits, tested).
3. `_moe_down_kernel`: the same for w2; writes per-pair outputs, and the last program to finish
   a (row, D tile) (arrival counter; no atomics on data) sums the row's k slots in slot order.
The quantized activations are stored as bf16 (exact). Except for mode "dot_scaled" each 32-group
is permuted to (16 even, 16 odd) elements, the order in which the packed bytes deliver their low
and high nibbles; "dot_scaled" keeps the natural order that `tl.dot_scaled` unpacks to.

Modes (`MoeConfig.mode`; `pick_config` returns DEFAULT_MODE):
- "fma": CUDA-core GEMV. Per 32-group sums of e2m1 * q (fp16 bit trick, fp32 FMAs) times the
  group's E8M0 scale, pairs of one expert handled BLOCK_P at a time (re-reading the weight tile).
- "dot": tensor cores. Each weight tile [rows, BLOCK_K] is decoded once to bf16 with the group
  scale folded in (exact: e2m1 * 2^(s-127) is a bf16 value), then multiplied against the
  activations of up to 16 pairs of the expert at once (one weight read for all its pairs; M=1
  wastes 15/16 of an MMA, which costs nothing next to the decode). Two dots per step: low
  nibbles against the 16 "even" activation columns of each group, high nibbles against the odd.
- "dot_asm": "dot" with the decode in inline PTX on packed registers: 2 bytes -> 4 bf16 in 13
  instructions (prmt/shift/lop3 place sign and exponent/mantissa bits, giving e2m1 * 2^-126 with
  code 1 on the bf16 subnormal 2^-127; two bf16x2 multiplies by 2^126 and 2^(s-127) finish it);
  the Triton decode is ~2x as many per-element ops. Same values as "dot", so the same bits.
  Under the interpreter it decodes as "dot".
- "lut" (CUDA C++, kernels/moe_lut.py; a CUDA device with nvcc, bf16 x, D and I multiples of
  512): the gate-up and down launches as hand-written kernels. A byte of weight is decoded by a
  shared-memory table lookup (one prmt + one shared load, exact bf16 pairs); mma.sync on register
  operands with a block-diagonal B, so each lane's MXFP4 group sum comes out alone and takes its
  own E8M0 scale (acc += C * 2^(s-127)); natural-order x; the activation quantization in its own
  launch. Sums: per group in one MMA chain, then per lane in group order, a quad butterfly, the two
  K halves: fixed whatever the batch. On one H200, 30 V4-Flash layers (docs/PERFORMANCE.md, tenth
  measurement): routed experts 56.3 / 145.0 / 462.3 / 1449 us per layer at 1 / 4 / 16 / 64 rows
  against "dot_asm"'s 56.6 / 232 / 782 / 1647. `FastDecoder` takes it by default where it runs.
- "dot_scaled": Triton's `tl.dot_scaled` (e2m1 weights, bf16 activations; on sm_90 Triton
  upcasts to bf16 itself). Under the interpreter (whose dot_scaled passes bf16 through fp16)
  it decodes as "dot", with natural-order activations.
Measured on one H200 (V4-Flash shapes, benchmarks/kernels/moe_variants.py, 2026-11-29), µs per call
at M = 1 / 64: "fma" 80 / 3757; "dot_asm" 64.3 / 1855 (pick_config's tiles; 73 / 1853 with the
earlier 4-byte decode; 65.5 / 1810 with 4 stages; 126 / 3286 with 8 warps), 79 / 1844 with
num_stages 1; "dot" 95 / 2322 and "dot_scaled" 174 / 5064 (num_stages 1). Cold experts read from
pinned host memory through the table at M = 1 (output bit-identical to the all-device table):
the dot modes add ~43-47 GB/s of cold bytes over the all-device time, "fma" ~23 GB/s.
End to end (30 V4-Flash layers, context 4K, graph replay, one H200, 2026-11-29): "dot_asm" 9.12 /
14.47 / 29.22 / 63.38 ms per step at 1 / 4 / 16 / 64 rows against "fma" 9.16 / 15.27 / 36.92 /
128.4, hence the default.
Numerics: every mode multiplies the same exact values (e2m1 * 2^a times e4m3 * 2^b) and sums in
fp32; they differ from the ref and from each other in the order of fp32 sums only. Each row's
order is fixed by (mode, block_k) and the weight shapes, never by M or the routing of other rows:
a dot's columns (pairs) are independent and always 16 wide, an "fma" pair block keeps pairs apart.
So results are deterministic and batch invariant as long as the caller pins the mode and block_k
(pick_config does, for every M). Supported E8M0 scale bytes: 2..240 (2^-125..2^113) in every
mode; bytes outside give wrong values and are not detected per call (`check_scales` at load).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
import triton  # noqa: F401
import triton.language as tl

from megastep.checkpoint import formats
from megastep.kernels.expert_table import (  # noqa: F401  (re-exported: the experts' API in one place)
    SCALE_MAX,
    SCALE_MIN,
    ExpertTable,
    _expert_ptr,
    check_scales,
    stack_experts,
    stacked_table,
)
from megastep.kernels.moe_route import ACT_BLOCK, Routing, _moe_act_quant_kernel, moe_route  # noqa: F401  (re-exported)
from megastep.kernels.moe_route import quant_blocks_store
from megastep.kernels import moe_lut as _lut
from megastep.kernels.common import (
    launch_opts,
    mxfp4_decode,
    mxfp4_decode_unscaled,
    next_pow2,
    on_interpreter,
    pdl_enter,
    round_bf16,
    workspace,
)

MODES = {"fma": 0, "dot": 1, "dot_asm": 2, "dot_scaled": 3}  # the Triton kernels' modes
CUDA_MODES = ("lut",)  # CUDA C++ kernels (kernels/moe_lut.py): on a CUDA device only
ALL_MODES = tuple(MODES) + CUDA_MODES
DEFAULT_MODE = "dot_asm"  # the mode pick_config returns: measured end to end, see below
# the activation quantization inside the gate-up launch (module doc) for calls of at most this many
# (row, slot) pairs; 0: always its own launch. The same bits either way, so the choice may follow
# the batch. Above it a gate-up program would wait on an atomic per 4 pairs of every expert it
# handles, serially; below it each program handles one or a few experts. Measured on one H200
# at 1 row (30 V4-Flash layers, docs/PERFORMANCE.md, ninth measurement): routed experts 59.0 ->
# 56.3 us per layer (the separate launch took 2.8); 4 and 16 rows not measured apart.
FUSED_ACT_QUANT_MAX_PAIRS = 96
_QUANT_ROWS = tl.constexpr(4)  # pairs per step of that quantization (few registers next to the main loop)


@dataclass(frozen=True)
class MoeConfig:
    block_i: int  # w1 rows (and as many w3 rows) per gate-up program
    block_d: int  # w2 rows per down program
    block_p: int  # pairs of one expert handled together ("fma": 1, 2, 4; dot modes: 16; more pairs loop)
    block_k: int  # K elements per loop step (128, 256 or 512)
    groups_up: int  # slot groups in the gate-up grid (programs per I tile)
    groups_down: int  # slot groups in the down grid
    num_warps: int = 4
    num_stages: int = 3
    mode: str = "fma"  # see module doc

    def check(self) -> None:
        assert self.mode in ALL_MODES, self.mode
        assert self.block_k in (128, 256, 512), self.block_k
        assert self.block_p in ((1, 2, 4) if self.mode == "fma" else (16,)), (self.mode, self.block_p)
        for b in (self.block_i, self.block_d):
            assert b in (16, 32, 64, 128), b
        assert self.groups_up >= 1 and self.groups_down >= 1


def pick_config(M: int, topk: int, E: int, D: int, I: int, mode: str | None = None) -> MoeConfig:
    """The one configuration the wrapper uses for this shape (deterministic, no autotuning).
    Only the slot groups depend on M (they choose which program handles which expert, never a
    value), so a row's result does not depend on the batch.

    "fma": with random routing an expert gets about M*k/E pairs, so each program handles one pair
    at a time (more pairs of one expert loop, re-reading the expert's tile from L2). Small tiles
    and many programs (8 per SM) won on one H200 at V4-Flash shapes: 83 µs at M=1 against 109 µs
    for 32x64 tiles and 4 per SM (benchmarks/kernels/bench_kernels.py --lite).
    Dot modes: 64-row weight tiles (w1 32 + w3 32; w2 64), the smallest tile a Hopper warpgroup
    MMA takes, 128 K per step, Triton's 3-stage pipelining. "dot_asm" on one H200 (Triton 3.6,
    benchmarks/kernels/moe_variants.py, 2026-11-29): 72.7 / 1853 µs at M = 1 / 64 against 79.1 /
    1844 without pipelining (num_stages 1), 96 / 2187 with 256 K per step, 95 / 2014 with 128-row
    tiles and 8 warps; "fma" 80.0 / 3757."""
    mode = mode or DEFAULT_MODE
    slots = min(M * topk, E)
    if mode == "lut":  # the CUDA kernels' items (channels of I, rows of D); they size their own grids
        return MoeConfig(_lut.ITEM_CHANNELS, _lut.ITEM_ROWS, 16, 128, 1, 1, mode=mode)
    if mode == "fma":
        bi, bd, bp, bk, ns, per_sm = 16, 32, 1, 128, 3, 8
    else:
        bi, bd, bp, bk, ns, per_sm = 32, 64, 16, 128, 3, 4
    target = per_sm * 132  # programs per launch
    g_up = max(1, min(slots, target // max(1, -(-I // bi))))
    g_down = max(1, min(slots, target // max(1, -(-D // bd))))
    return MoeConfig(bi, bd, bp, bk, g_up, g_down, num_warps=4, num_stages=ns, mode=mode)


# ---- "fma": CUDA-core group sums ----------------------------------------------------------------
@triton.jit
def _expert_tile_step(w_rows, s_rows, row_mask, q_ptr, k0, K, stride_q, pair_ptr, c0, cnt, TOPK_DIV, acc,
                      NG: tl.constexpr, BLOCK_P: tl.constexpr):
    """One BLOCK_K step of acc[n, group, pair] += sum over the group's 32 elements of
    MXFP4 weight (rows w_rows) times the quantized activation (rows of q_ptr, permuted layout)."""
    grp = k0 // 32 + tl.arange(0, NG)
    g_mask = grp * 32 < K
    ar_j = tl.arange(0, 16)
    wm = row_mask[:, None, None] & g_mask[None, :, None]
    b = tl.load(w_rows + grp[None, :, None] * 16 + ar_j[None, None, :], mask=wm, other=0)
    sc = tl.load(s_rows + grp[None, :], mask=row_mask[:, None] & g_mask[None, :], other=0)
    we, wo = mxfp4_decode_unscaled(b)
    f = ((sc.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)  # 2^(scale - 127) * 2^14
    ar_p = tl.arange(0, BLOCK_P)
    for r in tl.static_range(BLOCK_P):
        ok = (c0 + r) < cnt
        pr = tl.load(pair_ptr + c0 + r, mask=ok, other=0) // TOPK_DIV
        qp = q_ptr + pr * stride_q + grp[:, None] * 32 + ar_j[None, :]
        qe = tl.load(qp, mask=g_mask[:, None], other=0.0).to(tl.float32)
        qo = tl.load(qp + 16, mask=g_mask[:, None], other=0.0).to(tl.float32)
        part = tl.sum(we * qe[None, :, :] + wo * qo[None, :, :], axis=2) * f  # [N, NG]
        sel = ar_p[None, None, :] == tl.where(ok, r, -1)
        acc = tl.where(sel, acc + part[:, :, None], acc)
    return acc


# ---- dot modes: decode a weight tile to bf16, multiply on tensor cores ---------------------------
# Inline PTX for "dot_asm", 2 packed bytes at a time ($2, a 16-bit register: the pair of bytes
# that one thread holds of the MMA operand's layout, consecutive along K; $3, $4 their scales as
# bf16x2 patterns 2^(s-127) in both halves) -> the low nibbles ($0) and the high nibbles ($1) as
# bf16x2. With byte b in the high byte of a 16-bit half (prmt), the low nibble's sign (bit 11)
# moves to bit 15 (<< 4) and its exponent/mantissa bits (8..10) to bits 6..8 (>> 2); the other
# source bits of the two shifted copies are zero where the mask keeps them, so one lop3
# ((a | b) & m) assembles the half. The high nibble needs its low neighbour cleared first. The
# pattern is bf16 e2m1 * 2^-126 (code 1 = the subnormal 2^-127, zero stays zero); x 2^126 and
# x 2^(s-127) are exact (fma with -0 keeps the sign of zero).
# Two bytes, not four: the operand layout gives each thread its bytes in pairs (16-bit shared
# memory loads), and a 4-byte asm operand made Triton repack them with 7 byte permutes per 4
# bytes (SASS of Triton 3.6: 402 -> 346 instructions per K step of a gate-up program; 71.5 ->
# 64.3 µs per V4-Flash MoE call at M = 1 on one H200, same bits).
_DECODE_ASM = tl.constexpr("""
{
.reg .b32 u, t, v, f, m, c, z, w, zero;
mov.b32 m, 0x81C081C0;
mov.b32 c, 0x7E807E80;
mov.b32 z, 0x80008000;
mov.b32 zero, 0;
cvt.u32.u16 w, $2;
prmt.b32 u, w, zero, 0x1404;
prmt.b32 f, $3, $4, 0x7610;
shl.b32 t, u, 4;
shr.b32 v, u, 2;
lop3.b32 t, t, v, m, 0xA8;
fma.rn.bf16x2 t, t, c, z;
fma.rn.bf16x2 $0, t, f, z;
and.b32 t, u, 0xF000F000;
shr.b32 v, t, 6;
lop3.b32 t, t, v, m, 0xA8;
fma.rn.bf16x2 t, t, c, z;
fma.rn.bf16x2 $1, t, f, z;
}
""")


@triton.jit
def _decode_bf16(b, sc, MODE: tl.constexpr, INTERPRET: tl.constexpr):
    """Packed bytes b [R, NG, 16] (uint8) and their group scales sc [R, NG] (uint8) -> (even,
    odd) exact MXFP4 values [R, NG, 16]: bf16 on the GPU, fp32 under the interpreter."""
    if MODE == 2 and not INTERPRET:
        fb = (sc.to(tl.int32) << 7) * 0x10001  # bf16 bits of 2^(s-127), in both halves
        ev, od = tl.inline_asm_elementwise(_DECODE_ASM, "=r,=r,h,r,r", [b, fb[:, :, None]],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
    else:
        ev, od = mxfp4_decode(b, sc[:, :, None])  # fp32 e2m1 * 2^(s-127), exact for s <= 240
        if not INTERPRET:
            ev = ev.to(tl.bfloat16)
            od = od.to(tl.bfloat16)
    return ev, od


@triton.jit
def _dot_rows(w_rows, s_rows, row_mask, q_ptr, stride_q, prow, p_ok, K,
              R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, MODE: tl.constexpr,
              INTERPRET: tl.constexpr):
    """acc [R, BLOCK_P] fp32: weight rows (pointers w_rows [R, 1], scale rows s_rows [R, 1]) times
    the quantized activation rows prow [BLOCK_P] of q_ptr (columns with p_ok False read zeros),
    over K, one BLOCK_K step after the other, fp32 accumulation."""
    NG: tl.constexpr = BLOCK_K // 32
    KH: tl.constexpr = BLOCK_K // 2
    ar_g = tl.arange(0, NG)
    c = tl.arange(0, KH)  # byte of the step: group c // 16, byte c % 16
    acc = tl.zeros([R, BLOCK_P], dtype=tl.float32)
    # The scales are loaded one step ahead (the compiler's pipelining skips such narrow loads, and
    # an un-prefetched load would expose a memory latency in every step). The weight bytes are
    # not: a loop-carried uint8 tensor takes a register per byte and byte shuffles to repack.
    sc_next = tl.load(s_rows + ar_g[None, :], mask=row_mask[:, None] & (ar_g * 32 < K)[None, :], other=0)
    for k0 in range(0, K, BLOCK_K):
        sc = sc_next  # [R, NG]
        gn = k0 // 32 + NG + ar_g
        sc_next = tl.load(s_rows + gn[None, :], mask=row_mask[:, None] & (gn * 32 < K)[None, :], other=0)
        c_ok = (k0 // 32 + c // 16) * 32 < K  # per group (K % 32 == 0): constant over 16 bytes, keeps loads wide
        b = tl.load(w_rows + (k0 // 2 + c)[None, :], mask=row_mask[:, None] & c_ok[None, :], other=0)  # [R, KH]
        if MODE == 3 and not INTERPRET:  # tl.dot_scaled on natural-order activations
            k = k0 + tl.arange(0, BLOCK_K)
            xq = tl.load(q_ptr + prow[None, :] * stride_q + k[:, None], mask=p_ok[None, :] & (k < K)[:, None], other=0.0)
            acc = tl.dot_scaled(b, sc, "e2m1", xq, None, "bf16", acc)
        else:
            ev, od = _decode_bf16(tl.reshape(b, [R, NG, 16]), sc, MODE, INTERPRET)  # [R, NG, 16]: a scale per group
            ev = tl.reshape(ev, [R, KH])
            od = tl.reshape(od, [R, KH])
            if MODE == 3:  # interpreter: natural order (element 2c is even, 2c + 1 odd)
                ke = k0 + (c // 16) * 32 + (c % 16) * 2
                ko = ke + 1
            else:  # permuted: a group's 16 even elements, then its 16 odd ones
                ke = k0 + (c // 16) * 32 + c % 16
                ko = ke + 16
            qm = p_ok[None, :] & (ke < K)[:, None]
            qe = tl.load(q_ptr + prow[None, :] * stride_q + ke[:, None], mask=qm, other=0.0)  # [KH, BLOCK_P]
            qo = tl.load(q_ptr + prow[None, :] * stride_q + ko[:, None], mask=qm, other=0.0)
            if INTERPRET:  # the interpreter's bf16 dot is wrong; fp32 operands hold the same values
                acc = tl.dot(ev, qe.to(tl.float32), acc)
                acc = tl.dot(od, qo.to(tl.float32), acc)
            else:
                acc = tl.dot(ev, qe, acc)
                acc = tl.dot(od, qo, acc)
    return acc


# ---- 2. gate-up: w1, w3, SwiGLU, routing weight ---------------------------------------------
@triton.jit
def _swiglu_store(g, u, pairs, p_mask, rw_ptr, act_ptr, stride_am, offs_i, i_mask, limit,
                  ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """g, u [BLOCK_I, BLOCK_P] fp32 sums -> act[pair, i] = rnd(r * silu(min(g, lim)) * clamp(u))."""
    if ROUND_BF16:  # the official w1/w3 Linear outputs are bf16
        g = round_bf16(g, INTERPRET)
        u = round_bf16(u, INTERPRET)
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    a = g / (1.0 + tl.exp(-g)) * u
    a = a * tl.load(rw_ptr + pairs, mask=p_mask, other=0.0)[None, :]
    if ROUND_BF16:
        a = round_bf16(a, INTERPRET)
    tl.store(act_ptr + pairs[None, :] * stride_am + offs_i[:, None], a.to(act_ptr.dtype.element_ty),
             mask=i_mask[:, None] & p_mask[None, :])


@triton.jit
def _quant_act_block(act_ptr, aq_ptr, pairs, rows_ok, qb, I, stride_am, stride_aq, INTERPRET: tl.constexpr,
                     PERM: tl.constexpr):
    """fp8_act_sim of the 128-block qb of act's rows `pairs` (where rows_ok) into aq, permuted per
    32-group like `moe_route.quant_row_perm` (its code: the same bits). act is read past L1 (.cg):
    other programs just wrote parts of it."""
    k = qb * 128 + tl.arange(0, 128)
    m = rows_ok[:, None] & (k < I)[None, :]
    v = tl.load(act_ptr + pairs[:, None] * stride_am + k[None, :], mask=m, other=0.0, cache_modifier=".cg")
    quant_blocks_store(v.to(tl.float32), k[None, :], aq_ptr + pairs[:, None] * stride_aq, m, INTERPRET, PERM)


@triton.jit
def _moe_gate_up_kernel(
    xq_ptr, tab_ptr, rw_ptr, pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr, act_ptr,
    aq_ptr, qcnt_ptr,
    D, I, stride_qm, stride_wn, stride_sn, stride_am, stride_aq, limit, G,
    TOPK: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr, MODE: tl.constexpr, ALIGN: tl.constexpr,
    SPARSE: tl.constexpr, QUANT: tl.constexpr, NQ: tl.constexpr, PERM: tl.constexpr, PDL: tl.constexpr,
):
    # QUANT: the activation quantization too: of the programs whose I tiles make up a 128-block of
    # a pair's activation, the last to store its tile (an arrival counter per (pair, block), reset
    # by it) quantizes the block (no separate launch)
    pdl_enter(PDL)
    NG: tl.constexpr = BLOCK_K // 32
    pid_i = tl.program_id(0)
    grp = tl.program_id(1)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = offs_i < I
    ar_p = tl.arange(0, BLOCK_P)
    # dot modes: one tile of 2 * BLOCK_I rows, w1 rows then the same w3 rows
    ar_r = tl.arange(0, 2 * BLOCK_I)
    rows = pid_i * BLOCK_I + ar_r % BLOCK_I + (ar_r // BLOCK_I) * I
    r_mask = pid_i * BLOCK_I + ar_r % BLOCK_I < I
    n_slots = tl.load(nslot_ptr)
    for s in range(grp, n_slots, G):
        e = tl.load(slot_e_ptr + s)
        start = tl.load(slot_start_ptr + s)
        cnt = tl.load(slot_cnt_ptr + s)
        w_base = _expert_ptr(tab_ptr, e, 0, ALIGN)
        s_base = _expert_ptr(tab_ptr, e, 1, ALIGN)
        if SPARSE:  # an expert held by another rank (address 0): nothing to compute here
            cnt = tl.where(tl.load(tab_ptr + e.to(tl.int64) * 4) == 0, 0, cnt)
        for c0 in range(0, cnt, BLOCK_P):
            p_mask = c0 + ar_p < cnt
            pairs = tl.load(pair_ptr + start + c0 + ar_p, mask=p_mask, other=0)
            if MODE == 0:
                w1_rows = w_base + offs_i[:, None, None] * stride_wn
                w3_rows = w1_rows + I * stride_wn
                s1_rows = s_base + offs_i[:, None] * stride_sn
                s3_rows = s1_rows + I * stride_sn
                acc_g = tl.zeros([BLOCK_I, NG, BLOCK_P], dtype=tl.float32)
                acc_u = tl.zeros([BLOCK_I, NG, BLOCK_P], dtype=tl.float32)
                for k0 in range(0, D, BLOCK_K):
                    acc_g = _expert_tile_step(w1_rows, s1_rows, i_mask, xq_ptr, k0, D, stride_qm, pair_ptr + start, c0,
                                              cnt, TOPK, acc_g, NG, BLOCK_P)
                    acc_u = _expert_tile_step(w3_rows, s3_rows, i_mask, xq_ptr, k0, D, stride_qm, pair_ptr + start, c0,
                                              cnt, TOPK, acc_u, NG, BLOCK_P)
                g = tl.sum(acc_g, axis=1)  # [BLOCK_I, BLOCK_P]
                u = tl.sum(acc_u, axis=1)
            else:
                acc = _dot_rows(w_base + rows[:, None] * stride_wn, s_base + rows[:, None] * stride_sn, r_mask,
                                xq_ptr, stride_qm, pairs // TOPK, p_mask, D, 2 * BLOCK_I, BLOCK_K, BLOCK_P, MODE,
                                INTERPRET)
                g, u = tl.split(tl.permute(tl.reshape(acc, [2, BLOCK_I, BLOCK_P]), [1, 2, 0]))
            _swiglu_store(g, u, pairs, p_mask, rw_ptr, act_ptr, stride_am, offs_i, i_mask, limit, ROUND_BF16, INTERPRET)
            if QUANT:
                qb = (pid_i * BLOCK_I) // 128
                tiles_in_block = tl.cdiv(tl.minimum(128, I - qb * 128), BLOCK_I)
                tl.debug_barrier()  # every thread's act is issued before the releases below
                # QUANT_ROWS pairs at a time: a [QUANT_ROWS, 128] tile, few registers next to the main loop's
                for q0 in tl.static_range(0, BLOCK_P, _QUANT_ROWS):
                    if c0 + q0 < cnt:  # (a step with no pair of the chunk left issues nothing)
                        qj = q0 + tl.arange(0, _QUANT_ROWS)  # this chunk's pairs only (BLOCK_P may be < _QUANT_ROWS)
                        qr = c0 + qj
                        qm = (qj < BLOCK_P) & (qr < cnt)
                        qp = tl.load(pair_ptr + start + qr, mask=qm, other=0)
                        arrived = tl.atomic_add(qcnt_ptr + qp * NQ + qb, 1, mask=qm, sem="acq_rel", scope="gpu")
                        last = qm & (arrived == tiles_in_block - 1)
                        tl.debug_barrier()
                        _quant_act_block(act_ptr, aq_ptr, qp, last, qb, I, stride_am, stride_aq, INTERPRET, PERM)
                        tl.store(qcnt_ptr + qp * NQ + qb, 0, mask=last)


# ---- 3. down: w2, then the fixed-order sum over slots ---------------------------------------
@triton.jit
def _moe_down_kernel(
    aq_ptr, tab_ptr, pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr,
    y_ptr, out_ptr, cnt_ptr, sh_ptr,
    D, I, stride_am, stride_wn, stride_sn, stride_ym, stride_om, stride_shm, G,
    TOPK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr, MODE: tl.constexpr, ALIGN: tl.constexpr,
    SPARSE: tl.constexpr, COMBINE: tl.constexpr, SHARED: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    NG: tl.constexpr = BLOCK_K // 32
    pid_d = tl.program_id(0)
    grp = tl.program_id(1)
    n_d_tiles = tl.num_programs(0)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    ar_p = tl.arange(0, BLOCK_P)
    n_slots = tl.load(nslot_ptr)
    for s in range(grp, n_slots, G):
        e = tl.load(slot_e_ptr + s)
        start = tl.load(slot_start_ptr + s)
        cnt = tl.load(slot_cnt_ptr + s)
        w_rows = _expert_ptr(tab_ptr, e, 2, ALIGN) + offs_d[:, None] * stride_wn
        s_rows = _expert_ptr(tab_ptr, e, 3, ALIGN) + offs_d[:, None] * stride_sn
        if SPARSE:  # absent expert: its pairs' y rows stay as the caller zeroed them
            cnt = tl.where(tl.load(tab_ptr + e.to(tl.int64) * 4) == 0, 0, cnt)
        for c0 in range(0, cnt, BLOCK_P):
            p_mask = c0 + ar_p < cnt
            pairs = tl.load(pair_ptr + start + c0 + ar_p, mask=p_mask, other=0)
            if MODE == 0:
                acc = tl.zeros([BLOCK_D, NG, BLOCK_P], dtype=tl.float32)
                for k0 in range(0, I, BLOCK_K):  # activation rows are indexed by pair (divisor 1)
                    acc = _expert_tile_step(w_rows[:, :, None], s_rows, d_mask, aq_ptr, k0, I, stride_am, pair_ptr + start,
                                            c0, cnt, 1, acc, NG, BLOCK_P)
                y = tl.sum(acc, axis=1)  # [BLOCK_D, BLOCK_P]
            else:
                y = _dot_rows(w_rows, s_rows, d_mask, aq_ptr, stride_am, pairs, p_mask, I, BLOCK_D, BLOCK_K, BLOCK_P,
                              MODE, INTERPRET)
            if ROUND_BF16:  # the official w2 Linear output is bf16
                y = round_bf16(y, INTERPRET)
            tl.store(y_ptr + pairs[None, :] * stride_ym + offs_d[:, None], y.to(y_ptr.dtype.element_ty),
                     mask=d_mask[:, None] & p_mask[None, :])
            if COMBINE:  # the last of a row's TOPK pairs to finish this D tile sums the row in slot order
                rows = pairs // TOPK
                tl.debug_barrier()  # every thread's y is issued before the release below
                arrived = tl.atomic_add(cnt_ptr + rows * n_d_tiles + pid_d, 1, mask=p_mask, sem="acq_rel", scope="gpu")
                last = p_mask & (arrived == TOPK - 1)
                tl.debug_barrier()
                lm = d_mask[:, None] & last[None, :]
                yrow = y_ptr + (rows * TOPK)[None, :] * stride_ym + offs_d[:, None]
                tot = tl.load(yrow, mask=lm, other=0.0, cache_modifier=".cg").to(tl.float32)
                for t in tl.static_range(1, TOPK):
                    tot += tl.load(yrow + t * stride_ym, mask=lm, other=0.0, cache_modifier=".cg").to(tl.float32)
                if SHARED:  # + the shared expert's output, then one rounding to out's dtype
                    tot += tl.load(sh_ptr + rows[None, :] * stride_shm + offs_d[:, None], mask=lm, other=0.0).to(tl.float32)
                    if out_ptr.dtype.element_ty == tl.bfloat16:
                        tot = round_bf16(tot, INTERPRET)
                tl.store(out_ptr + rows[None, :] * stride_om + offs_d[:, None], tot.to(out_ptr.dtype.element_ty), mask=lm)
                tl.store(cnt_ptr + rows * n_d_tiles + pid_d, 0, mask=last)


def moe_experts_table(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    table: ExpertTable,
    swiglu_limit: float = 10.0,
    config: MoeConfig | None = None,
    return_pairs: bool = False,
    pairs_out: torch.Tensor | None = None,
    routing: Routing | None = None,
    shared: torch.Tensor | Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """x [M, D] bf16 (or fp32), topk_ids [M, k] int32, topk_weights [M, k] fp32, the experts'
    address table -> [M, D] fp32 sum of the routed experts (module doc).

    shared: the shared expert's output s [M, D] (bf16 or fp32), or a zero-argument function that
    returns it, called just before the last launch (a caller may join another stream there). The
    combine adds it and rounds once: returns (routed + s.float()).to(s.dtype), exactly what adding
    s to this function's fp32 result would give, without the extra launch.

    routing: topk_ids' pairs grouped by expert and x quantized (`moe_route`'s result, e.g. made
    in the router's launch by `router.route_group`); None: this call makes them (one launch more).

    return_pairs=True returns instead the per-pair outputs y [M, k, D] in x's dtype (rnd(w2 . a)
    of each (row, slot)), unsummed: zero for the pairs of experts absent from a sparse table
    (expert parallelism: the ranks' pair outputs are combined bit-exactly, then summed in slot
    order as the summing kernel does: `sum_pairs`). A sparse table needs return_pairs.
    pairs_out (with return_pairs): a contiguous [>= M*k, D] buffer in x's dtype that receives y
    instead of a fresh zeroed one; the pairs of absent experts are left untouched there (the
    peer-to-peer combine reads each pair from its owner only, kernels/pair_combine.py)."""
    assert x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float32) and x.stride(1) == 1, (x.shape, x.dtype)
    M, D = x.shape
    E, I = table.E, table.I
    k = topk_ids.shape[1]
    assert D == table.D and table.device == x.device, (D, table.D, table.device, x.device)
    assert topk_ids.shape == (M, k) and topk_weights.shape == (M, k), (topk_ids.shape, topk_weights.shape)
    assert topk_ids.dtype in (torch.int32, torch.int64) and topk_weights.dtype == torch.float32
    if table.sparse and not return_pairs:
        raise ValueError("a table with absent experts (expert parallelism) needs return_pairs=True")
    if shared is not None and return_pairs:
        raise ValueError("shared is added by the combine: not with return_pairs=True")
    if pairs_out is not None:
        assert return_pairs and pairs_out.dtype == x.dtype and pairs_out.is_contiguous(), (pairs_out.dtype, x.dtype)
        assert pairs_out.shape[-1] == D and pairs_out.numel() >= M * k * D, (pairs_out.shape, M, k, D)
    cfg = config or pick_config(M, k, E, D, I)
    cfg.check()
    lut = cfg.mode == "lut"
    if lut and not _lut.supported(x.device, x.dtype, D, I):
        raise ValueError(f"experts mode 'lut' needs a CUDA device, nvcc, bf16 x and D, I multiples of 512 "
                         f"(got {x.device.type}, {x.dtype}, D {D}, I {I})")
    if M == 0:
        if return_pairs:
            return torch.zeros(M, k, D, dtype=x.dtype, device=x.device)
        return torch.empty(M, D, dtype=torch.float32 if shared is None else x.dtype, device=x.device)
    P = M * k
    interp = on_interpreter(x)
    rnd = x.dtype == torch.bfloat16
    perm = permutes(cfg.mode)
    if routing is None:
        routing = moe_route(topk_ids, E, x, permute=perm)
    assert routing.permuted == perm and routing.xq is not None and routing.pairs.numel() == P, "routing of another call"
    pairs, slot_e, slot_start, slot_cnt, nslots, xq, _ = routing
    rw = topk_weights.reshape(-1).contiguous()
    # with absent experts their pairs are never written: zeros (y: the combine's contract; act:
    # its quantization reads them)
    act = (torch.zeros if table.sparse else torch.empty)(P, I, dtype=x.dtype, device=x.device)
    aq = torch.empty(P, I, dtype=torch.bfloat16, device=x.device)
    if pairs_out is not None:
        y = pairs_out.view(-1, D)[:P]
    else:
        y = (torch.zeros if return_pairs else torch.empty)(P, D, dtype=x.dtype, device=x.device)
    S = min(P, E)
    g_up, g_down = min(cfg.groups_up, S), min(cfg.groups_down, S)
    sw13, ss13, sw2, ss2 = table.strides
    common = {} if lut else dict(  # the Triton kernels' arguments
        TOPK=k, BLOCK_P=cfg.block_p, BLOCK_K=cfg.block_k, ROUND_BF16=rnd, INTERPRET=interp, MODE=MODES[cfg.mode],
        ALIGN=table.align, SPARSE=table.sparse, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    nq = -(-I // ACT_BLOCK)
    # (I tiles inside 128-blocks; "lut" quantizes in the separate launch)
    fuse = not lut and P <= FUSED_ACT_QUANT_MAX_PAIRS and 128 % cfg.block_i == 0
    qcnt = workspace(x.device, "counters_moe_act", P * nq, torch.int32) if fuse else aq
    grid = (-(-I // cfg.block_i), g_up)
    if lut:
        _lut.gate_up(xq, table.addr, rw, pairs, slot_e, slot_start, slot_cnt, nslots, act, D, I, (sw13, ss13),
                     swiglu_limit, k, rnd, table.sparse)
    else:
        _moe_gate_up_kernel[grid](
            xq, table.addr, rw, pairs, slot_e, slot_start, slot_cnt, nslots, act, aq, qcnt,
            D, I, xq.stride(0), sw13, ss13, act.stride(0), aq.stride(0), float(swiglu_limit), g_up,
            BLOCK_I=cfg.block_i, QUANT=fuse, NQ=nq, PERM=perm, **common, **launch_opts(x, grid),
        )
    if not fuse:
        grid = (P,)
        _moe_act_quant_kernel[grid](act, aq, I, act.stride(0), aq.stride(0), NB=next_pow2(nq),
                                    INTERPRET=interp, PERM=perm, num_warps=4, **launch_opts(act, grid))
    n_d_tiles = -(-D // cfg.block_d)
    cnt = workspace(x.device, "counters_moe", M * n_d_tiles, torch.int32)
    grid = (n_d_tiles, g_down)
    sh = _shared_operand(shared, M, D, x.device)
    out = torch.empty(M, D, dtype=torch.float32 if sh is None else sh.dtype, device=x.device)
    if lut:
        _lut.down(aq, table.addr, pairs, slot_e, slot_start, slot_cnt, nslots, y, out, cnt, D, I, (sw2, ss2), k,
                  table.sparse, not return_pairs, shared=sh)
        return y.view(M, k, D) if return_pairs else out
    _moe_down_kernel[grid](
        aq, table.addr, pairs, slot_e, slot_start, slot_cnt, nslots, y, out, cnt, out if sh is None else sh,
        D, I, aq.stride(0), sw2, ss2, y.stride(0), out.stride(0), 0 if sh is None else sh.stride(0), g_down,
        BLOCK_D=cfg.block_d, COMBINE=not return_pairs, SHARED=sh is not None, **common, **launch_opts(x, grid),
    )
    return y.view(M, k, D) if return_pairs else out


def _shared_operand(shared, M: int, D: int, device: torch.device) -> torch.Tensor | None:
    """moe_experts_table's `shared` (a tensor, or the function that returns it: called now)."""
    sh = shared() if callable(shared) else shared
    if sh is not None:
        assert sh.shape == (M, D) and sh.dtype in (torch.bfloat16, torch.float32) and sh.stride(1) == 1, (
            sh.shape, sh.dtype)
        assert sh.device == device, (sh.device, device)
    return sh


def permutes(mode: str | None) -> bool:
    """Whether the experts kernel in `mode` (None: the default) reads x permuted per 32-group."""
    return (mode or DEFAULT_MODE) not in ("dot_scaled", "lut")


def sum_pairs(y: torch.Tensor) -> torch.Tensor:
    """Per-pair outputs y [M, k, D] -> fp32 [M, D]: ((y_0 + y_1) + y_2) + ... in slot order, the
    additions the summing kernel makes (so the same y give the same bits)."""
    out = y[:, 0].float()
    for j in range(1, y.shape[1]):
        out = out + y[:, j].float()
    return out


def moe_experts_mxfp4(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    swiglu_limit: float = 10.0,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """x [M, D] bf16 (or fp32), topk_ids [M, k] int32, topk_weights [M, k] fp32, stacked MXFP4
    experts (see module doc) -> [M, D] fp32 sum of the routed experts. The experts' address
    table is built once per (tensors, device) and cached (`stacked_table`)."""
    assert w13.dim() == 3 and x.dim() == 2 and w13.shape[2] * 2 == x.shape[1], (w13.shape, x.shape)
    for t in (w13, w13_scale, w2, w2_scale):
        assert t.device == x.device, (t.device, x.device)
    return moe_experts_table(x, topk_ids, topk_weights, stacked_table(w13, w13_scale, w2, w2_scale),
                             swiglu_limit=swiglu_limit, config=config)


def moe_experts_mxfp4_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    swiglu_limit: float = 10.0,
    config: MoeConfig | None = None,
    return_pairs: bool = False,
    expert_ids: Sequence[int] | None = None,
) -> torch.Tensor:
    """The exact semantics in fp32 with formats.py dequantization (see module doc).
    return_pairs / expert_ids: the twin of a sparse table (expert parallelism): the stacked
    tensors hold the experts `expert_ids` in that order, the pairs of other experts give zero,
    and the per-pair outputs [M, k, D] (x's dtype) come back unsummed (`sum_pairs` sums them)."""
    del config
    dt = x.dtype
    M, D = x.shape
    k = topk_ids.shape[1]
    I = w13.shape[1] // 2
    lim = float(swiglu_limit)
    q = formats.fp8_act_sim(x.float(), ACT_BLOCK)
    y = torch.zeros(M, k, D, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    local = {e: e for e in range(w13.shape[0])} if expert_ids is None else {e: i for i, e in enumerate(expert_ids)}
    for e in torch.unique(ids).tolist():
        if e not in local:
            continue
        rows, slots = (ids == e).nonzero(as_tuple=True)
        i = local[e]
        w13d = formats.dequantize_mxfp4_weight(w13[i], w13_scale[i])
        w2d = formats.dequantize_mxfp4_weight(w2[i], w2_scale[i])
        h = q[rows] @ w13d.T
        g = h[:, :I].to(dt).float().clamp(max=lim)
        u = h[:, I:].to(dt).float().clamp(-lim, lim)
        a = (topk_weights[rows, slots, None].float() * (F.silu(g) * u)).to(dt).float()
        a = formats.fp8_act_sim(a, ACT_BLOCK)
        y[rows, slots] = (a @ w2d.T).to(dt).float()
    if return_pairs:
        return y.to(dt)
    return sum_pairs(y)
