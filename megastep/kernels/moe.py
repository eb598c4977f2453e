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

Layout: experts stacked once at load (`stack_experts`): w13 int8 [E, 2I, D/2] (rows 0..I-1 = w1,
I..2I-1 = w3), w13_scale e8m0 [E, 2I, D/32], w2 int8 [E, D, I/2], w2_scale e8m0 [E, D, I/32];
low nibble = even element, one E8M0 scale per 32 along K.

Four launches, all with static grids (CUDA-graph friendly, no host sync):
1. `_moe_prep_kernel`: groups the M*k (row, slot) pairs by expert (pairs sorted by expert then
   pair index; one "slot" per distinct expert: id, first pair, count) and, in other programs of
   the same launch, quantizes x (fp8_act_sim per 128) once for all experts.
2. `_moe_gate_up_kernel`: programs (I tile, slot group) loop over their distinct experts and read
   each expert's w1/w3 rows once per pair block, dequantizing MXFP4 in registers (never to
   memory): per 32-group sums of e2m1 * x, times the group's E8M0 scale; then clamp, SwiGLU and
   the routing weight.
3. `_moe_act_quant_kernel`: fp8_act_sim(a, 128) per pair (a 128-block spans several I tiles).
4. `_moe_down_kernel`: the same for w2; writes per-pair outputs, and the last program to finish
   a (row, D tile) (arrival counter; no atomics on data) sums the row's k slots in slot order.
The quantized activations are stored as bf16 (exact), each 32-group permuted to (16 even, 16 odd)
elements, the order in which the packed bytes deliver their low and high nibbles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton  # noqa: F401
import triton.language as tl

from megastep.checkpoint import formats
from megastep.kernels.common import (
    fp8_pow2_scale,
    fp8_round,
    mxfp4_decode_unscaled,
    next_pow2,
    on_interpreter,
    round_bf16,
    workspace,
)

ACT_BLOCK = 128


@dataclass(frozen=True)
class MoeConfig:
    block_i: int  # w1 rows (and as many w3 rows) per gate-up program
    block_d: int  # w2 rows per down program
    block_p: int  # pairs of one expert handled together (1, 2, 4; more pairs loop)
    block_k: int  # K elements per loop step (128, 256 or 512)
    groups_up: int  # slot groups in the gate-up grid (programs per I tile)
    groups_down: int  # slot groups in the down grid
    num_warps: int = 4
    num_stages: int = 3

    def check(self) -> None:
        assert self.block_k in (128, 256, 512), self.block_k
        assert self.block_p in (1, 2, 4), self.block_p
        for b in (self.block_i, self.block_d):
            assert b in (16, 32, 64, 128), b
        assert self.groups_up >= 1 and self.groups_down >= 1


def pick_config(M: int, topk: int, E: int, D: int, I: int) -> MoeConfig:
    """The one configuration the wrapper uses for this shape (deterministic, no autotuning).

    With random routing an expert gets about M*k/E pairs, so each program handles one pair at a
    time (more pairs of one expert loop, re-reading the expert's tile from L2). Small tiles and
    many programs (8 per SM) won on one H200 at V4-Flash shapes: 83 µs at M=1 against 109 µs for
    32x64 tiles and 4 per SM (benchmarks/kernels/bench_kernels.py --lite)."""
    slots = min(M * topk, E)
    bi, bd = 16, 32
    target = 8 * 132  # programs per launch
    g_up = max(1, min(slots, target // max(1, -(-I // bi))))
    g_down = max(1, min(slots, target // max(1, -(-D // bd))))
    return MoeConfig(bi, bd, 1, 128, g_up, g_down, num_warps=4, num_stages=3)


# ---- activation quantization into the layout the expert kernels read ------------------------
@triton.jit
def _quant_row_perm(src_ptr, dst_ptr, K, NB: tl.constexpr, INTERPRET: tl.constexpr):
    """fp8_act_sim(row, 128) of one row of K values -> dst (bf16: the values are e4m3 * 2^k,
    exact), permuted so that each 32-group holds its 16 even elements, then its 16 odd ones:
    the order in which the MXFP4 bytes deliver their low and high nibbles."""
    k = tl.arange(0, NB)[:, None] * 128 + tl.arange(0, 128)[None, :]
    m = k < K
    v = tl.load(src_ptr + k, mask=m, other=0.0).to(tl.float32)
    s, inv = fp8_pow2_scale(tl.max(tl.abs(v), axis=1))
    q = fp8_round(v, inv[:, None], INTERPRET).to(tl.float32) * s[:, None]
    kp = (k // 32) * 32 + (k % 2) * 16 + (k % 32) // 2
    tl.store(dst_ptr + kp, q.to(tl.bfloat16), mask=m)


@triton.jit
def _moe_act_quant_kernel(src_ptr, dst_ptr, K, stride_s, stride_d, NB: tl.constexpr, INTERPRET: tl.constexpr):
    r = tl.program_id(0)
    _quant_row_perm(src_ptr + r * stride_s, dst_ptr + r * stride_d, K, NB, INTERPRET)


# ---- 1. routing (group pairs by expert) + quantization of x ---------------------------------
@triton.jit
def _moe_prep_kernel(
    ids_ptr, P, x_ptr, xq_ptr, D, stride_xm, stride_qm,
    pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr,
    N_ROUTE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr, E_PAD: tl.constexpr,
    NB: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid >= N_ROUTE:  # one program per row of x
        m = pid - N_ROUTE
        _quant_row_perm(x_ptr + m * stride_xm, xq_ptr + m * stride_qm, D, NB, INTERPRET)
    else:  # BLOCK_R pairs per program, each compared with all P pairs
        BIG: tl.constexpr = 1 << 30
        offs_r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        r_mask = offs_r < P
        idr = tl.load(ids_ptr + offs_r, mask=r_mask, other=BIG)
        ar_e = tl.arange(0, E_PAD)
        present = tl.zeros([E_PAD], dtype=tl.int32)  # experts with at least one pair
        rank = tl.zeros([BLOCK_R], dtype=tl.int32)  # position in (expert, pair) order
        dup_before = tl.zeros([BLOCK_R], dtype=tl.int32)  # earlier pairs with the same expert
        count = tl.zeros([BLOCK_R], dtype=tl.int32)  # pairs with the same expert
        for q0 in range(0, P, BLOCK_Q):
            offs_q = q0 + tl.arange(0, BLOCK_Q)
            q_mask = offs_q < P
            idq = tl.load(ids_ptr + offs_q, mask=q_mask, other=BIG)
            present = tl.maximum(present, tl.max((ar_e[:, None] == idq[None, :]).to(tl.int32), axis=1))
            eq = (idr[:, None] == idq[None, :]) & q_mask[None, :]
            lt = (idq[None, :] < idr[:, None]) & q_mask[None, :]
            before = offs_q[None, :] < offs_r[:, None]
            rank += tl.sum((lt | (eq & before)).to(tl.int32), axis=1)
            dup_before += tl.sum((eq & before).to(tl.int32), axis=1)
            count += tl.sum(eq.to(tl.int32), axis=1)
        slot = tl.sum(((ar_e[None, :] < idr[:, None]) & (present[None, :] > 0)).to(tl.int32), axis=1)
        first = (dup_before == 0) & r_mask
        tl.store(pair_ptr + rank, offs_r, mask=r_mask)
        tl.store(slot_e_ptr + slot, idr, mask=first)
        tl.store(slot_start_ptr + slot, rank, mask=first)
        tl.store(slot_cnt_ptr + slot, count, mask=first)
        if pid == 0:
            tl.store(nslot_ptr, tl.sum(present, axis=0))


_ROUTE_BLOCK = 32


def moe_route(topk_ids: torch.Tensor, E: int, x: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """topk_ids [M, k] -> (pairs [P], slot_expert [S], slot_start [S], slot_count [S], nslots [1],
    xq) with P = M*k, S = min(P, E): pairs sorted by (expert, pair index) and one slot per
    distinct expert (only the first nslots slots are meaningful). When x [M, D] is given, the same
    launch writes xq [M, D] = fp8_act_sim(x, 128) in bf16, permuted per 32-group (even, odd)."""
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    P = ids.numel()
    S = min(P, E)
    dev = ids.device
    pairs = torch.empty(P, dtype=torch.int32, device=dev)
    slot_e = torch.empty(S, dtype=torch.int32, device=dev)
    slot_start = torch.empty(S, dtype=torch.int32, device=dev)
    slot_cnt = torch.empty(S, dtype=torch.int32, device=dev)
    nslots = torch.empty(1, dtype=torch.int32, device=dev)
    n_route = -(-P // _ROUTE_BLOCK)
    if x is not None:
        M, D = x.shape
        xq = torch.empty(M, D, dtype=torch.bfloat16, device=dev)
        args = (x, xq, D, x.stride(0), xq.stride(0))
    else:
        M, D, xq = 0, 128, None
        args = (ids, ids, 0, 0, 0)
    e_pad = next_pow2(max(E, 2))
    _moe_prep_kernel[(n_route + M,)](
        ids, P, *args, pairs, slot_e, slot_start, slot_cnt, nslots,
        N_ROUTE=n_route, BLOCK_R=_ROUTE_BLOCK, BLOCK_Q=max(2, min(64, 8192 // e_pad)), E_PAD=e_pad,
        NB=next_pow2(-(-D // ACT_BLOCK)), INTERPRET=on_interpreter(ids), num_warps=4,
    )
    return pairs, slot_e, slot_start, slot_cnt, nslots, xq


# ---- shared piece of the two expert kernels ---------------------------------------------------
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


# ---- 2. gate-up: w1, w3, SwiGLU, routing weight ---------------------------------------------
@triton.jit
def _moe_gate_up_kernel(
    xq_ptr, w_ptr, ws_ptr, rw_ptr, pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr, act_ptr,
    D, I, stride_qm, stride_we, stride_wn, stride_se, stride_sn, stride_am, limit, G,
    TOPK: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr,
):
    NG: tl.constexpr = BLOCK_K // 32
    pid_i = tl.program_id(0)
    grp = tl.program_id(1)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = offs_i < I
    ar_p = tl.arange(0, BLOCK_P)
    n_slots = tl.load(nslot_ptr)
    for s in range(grp, n_slots, G):
        e = tl.load(slot_e_ptr + s).to(tl.int64)
        start = tl.load(slot_start_ptr + s)
        cnt = tl.load(slot_cnt_ptr + s)
        w1_rows = w_ptr + e * stride_we + offs_i[:, None, None] * stride_wn
        w3_rows = w1_rows + I * stride_wn
        s1_rows = ws_ptr + e * stride_se + offs_i[:, None] * stride_sn
        s3_rows = s1_rows + I * stride_sn
        for c0 in range(0, cnt, BLOCK_P):
            acc_g = tl.zeros([BLOCK_I, NG, BLOCK_P], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_I, NG, BLOCK_P], dtype=tl.float32)
            for k0 in range(0, D, BLOCK_K):
                acc_g = _expert_tile_step(w1_rows, s1_rows, i_mask, xq_ptr, k0, D, stride_qm, pair_ptr + start, c0, cnt,
                                          TOPK, acc_g, NG, BLOCK_P)
                acc_u = _expert_tile_step(w3_rows, s3_rows, i_mask, xq_ptr, k0, D, stride_qm, pair_ptr + start, c0, cnt,
                                          TOPK, acc_u, NG, BLOCK_P)
            g = tl.sum(acc_g, axis=1)  # [BLOCK_I, BLOCK_P]
            u = tl.sum(acc_u, axis=1)
            if ROUND_BF16:  # the official w1/w3 Linear outputs are bf16
                g = round_bf16(g, INTERPRET)
                u = round_bf16(u, INTERPRET)
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            a = g / (1.0 + tl.exp(-g)) * u
            p_mask = c0 + ar_p < cnt
            pairs = tl.load(pair_ptr + start + c0 + ar_p, mask=p_mask, other=0)
            a = a * tl.load(rw_ptr + pairs, mask=p_mask, other=0.0)[None, :]
            if ROUND_BF16:
                a = round_bf16(a, INTERPRET)
            tl.store(act_ptr + pairs[None, :] * stride_am + offs_i[:, None], a.to(act_ptr.dtype.element_ty),
                     mask=i_mask[:, None] & p_mask[None, :])


# ---- 3. down: w2, then the fixed-order sum over slots ---------------------------------------
@triton.jit
def _moe_down_kernel(
    aq_ptr, w_ptr, ws_ptr, pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr,
    y_ptr, out_ptr, cnt_ptr,
    D, I, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ym, stride_om, G,
    TOPK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr,
):
    NG: tl.constexpr = BLOCK_K // 32
    pid_d = tl.program_id(0)
    grp = tl.program_id(1)
    n_d_tiles = tl.num_programs(0)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    ar_p = tl.arange(0, BLOCK_P)
    n_slots = tl.load(nslot_ptr)
    for s in range(grp, n_slots, G):
        e = tl.load(slot_e_ptr + s).to(tl.int64)
        start = tl.load(slot_start_ptr + s)
        cnt = tl.load(slot_cnt_ptr + s)
        w_rows = w_ptr + e * stride_we + offs_d[:, None, None] * stride_wn
        s_rows = ws_ptr + e * stride_se + offs_d[:, None] * stride_sn
        for c0 in range(0, cnt, BLOCK_P):
            acc = tl.zeros([BLOCK_D, NG, BLOCK_P], dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):  # activation rows are indexed by pair (divisor 1)
                acc = _expert_tile_step(w_rows, s_rows, d_mask, aq_ptr, k0, I, stride_am, pair_ptr + start, c0, cnt,
                                        1, acc, NG, BLOCK_P)
            y = tl.sum(acc, axis=1)  # [BLOCK_D, BLOCK_P]
            if ROUND_BF16:  # the official w2 Linear output is bf16
                y = round_bf16(y, INTERPRET)
            p_mask = c0 + ar_p < cnt
            pairs = tl.load(pair_ptr + start + c0 + ar_p, mask=p_mask, other=0)
            tl.store(y_ptr + pairs[None, :] * stride_ym + offs_d[:, None], y.to(y_ptr.dtype.element_ty),
                     mask=d_mask[:, None] & p_mask[None, :])
            # the last of a row's TOPK pairs to finish this D tile sums the row in slot order
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
            tl.store(out_ptr + rows[None, :] * stride_om + offs_d[:, None], tot, mask=lm)
            tl.store(cnt_ptr + rows * n_d_tiles + pid_d, 0, mask=last)


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
    experts (see module doc) -> [M, D] fp32 sum of the routed experts."""
    assert x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float32) and x.stride(1) == 1, (x.shape, x.dtype)
    M, D = x.shape
    E, two_i, dh = w13.shape
    I = two_i // 2
    k = topk_ids.shape[1]
    assert topk_ids.shape == (M, k) and topk_weights.shape == (M, k), (topk_ids.shape, topk_weights.shape)
    assert topk_ids.dtype in (torch.int32, torch.int64) and topk_weights.dtype == torch.float32
    assert w13.dtype == torch.int8 and w2.dtype == torch.int8, (w13.dtype, w2.dtype)
    assert two_i == 2 * I and dh * 2 == D and D % 32 == 0 and I % 32 == 0, (w13.shape, D)
    assert w13_scale.shape == (E, 2 * I, D // 32), w13_scale.shape
    assert w2.shape == (E, D, I // 2) and w2_scale.shape == (E, D, I // 32), (w2.shape, w2_scale.shape)
    assert w13_scale.dtype in (torch.float8_e8m0fnu, torch.uint8) and w2_scale.dtype == w13_scale.dtype
    for t in (w13, w13_scale, w2, w2_scale):
        assert t.stride(2) == 1 and t.device == x.device
    cfg = config or pick_config(M, k, E, D, I)
    cfg.check()
    out = torch.empty(M, D, dtype=torch.float32, device=x.device)
    if M == 0:
        return out
    P = M * k
    interp = on_interpreter(x)
    rnd = x.dtype == torch.bfloat16
    pairs, slot_e, slot_start, slot_cnt, nslots, xq = moe_route(topk_ids, E, x)
    rw = topk_weights.reshape(-1).contiguous()
    act = torch.empty(P, I, dtype=x.dtype, device=x.device)
    aq = torch.empty(P, I, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(P, D, dtype=x.dtype, device=x.device)
    S = min(P, E)
    g_up, g_down = min(cfg.groups_up, S), min(cfg.groups_down, S)
    w13u, s13u, w2u, s2u = (t.view(torch.uint8) for t in (w13, w13_scale, w2, w2_scale))
    common = dict(TOPK=k, BLOCK_P=cfg.block_p, BLOCK_K=cfg.block_k, ROUND_BF16=rnd, INTERPRET=interp,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _moe_gate_up_kernel[(-(-I // cfg.block_i), g_up)](
        xq, w13u, s13u, rw, pairs, slot_e, slot_start, slot_cnt, nslots, act,
        D, I, xq.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), act.stride(0),
        float(swiglu_limit), g_up, BLOCK_I=cfg.block_i, **common,
    )
    _moe_act_quant_kernel[(P,)](act, aq, I, act.stride(0), aq.stride(0), NB=next_pow2(-(-I // ACT_BLOCK)),
                                INTERPRET=interp, num_warps=4)
    n_d_tiles = -(-D // cfg.block_d)
    cnt = workspace(x.device, "counters_moe", M * n_d_tiles, torch.int32)
    _moe_down_kernel[(n_d_tiles, g_down)](
        aq, w2u, s2u, pairs, slot_e, slot_start, slot_cnt, nslots, y, out, cnt,
        D, I, aq.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), y.stride(0), out.stride(0),
        g_down, BLOCK_D=cfg.block_d, **common,
    )
    return out


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
) -> torch.Tensor:
    """The exact semantics in fp32 with formats.py dequantization (see module doc)."""
    del config
    dt = x.dtype
    M, D = x.shape
    k = topk_ids.shape[1]
    I = w13.shape[1] // 2
    lim = float(swiglu_limit)
    q = formats.fp8_act_sim(x.float(), ACT_BLOCK)
    y = torch.zeros(M, k, D, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        w13d = formats.dequantize_mxfp4_weight(w13[e], w13_scale[e])
        w2d = formats.dequantize_mxfp4_weight(w2[e], w2_scale[e])
        h = q[rows] @ w13d.T
        g = h[:, :I].to(dt).float().clamp(max=lim)
        u = h[:, I:].to(dt).float().clamp(-lim, lim)
        a = (topk_weights[rows, slots, None].float() * (F.silu(g) * u)).to(dt).float()
        a = formats.fp8_act_sim(a, ACT_BLOCK)
        y[rows, slots] = (a @ w2d.T).to(dt).float()
    out = y[:, 0].clone()
    for j in range(1, k):
        out += y[:, j]
    return out


def stack_experts(weights: dict[str, torch.Tensor], layer_prefix: str, E: int) -> dict[str, torch.Tensor]:
    """Official per-expert tensors `{layer_prefix}.ffn.experts.{e}.w{1,2,3}.{weight,scale}` ->
    {"w13", "w13_scale", "w2", "w2_scale"} stacked as `moe_experts_mxfp4` takes them (done once
    at load). `layer_prefix` is e.g. "layers.3"."""
    p = layer_prefix.rstrip(".") + ".ffn.experts."

    def raw(e: int, name: str) -> torch.Tensor:  # E8M0 as its bytes: cat/stack need not know it
        v = weights[f"{p}{e}.{name}"]
        return v.view(torch.uint8) if v.dtype == torch.float8_e8m0fnu else v

    def like(stacked: torch.Tensor, name: str) -> torch.Tensor:
        return stacked.view(weights[f"{p}0.{name}"].dtype)

    return {
        "w13": torch.stack([torch.cat([raw(e, "w1.weight"), raw(e, "w3.weight")], 0) for e in range(E)]),
        "w13_scale": like(torch.stack([torch.cat([raw(e, "w1.scale"), raw(e, "w3.scale")], 0) for e in range(E)]), "w1.scale"),
        "w2": torch.stack([raw(e, "w2.weight") for e in range(E)]),
        "w2_scale": like(torch.stack([raw(e, "w2.scale") for e in range(E)]), "w2.scale"),
    }
