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

Three launches, all with static grids (CUDA-graph friendly, no host sync):
1. `_moe_route_kernel` (one program): groups the M*k (row, slot) pairs by expert: pairs sorted by
   expert then pair index, one "slot" per distinct expert (id, first pair, count), and the count.
2. `_moe_gate_up_kernel`: programs (I tile, slot group) loop over their distinct experts; each
   reads its expert's w1/w3 rows once for all pairs routed to it, dequantizes MXFP4 in registers
   (never to memory), fuses the fp8 activation quantization, SwiGLU, clamp, routing weight.
3. `_moe_down_kernel`: same for w2 with the activation quantized per 128 along I; writes per-pair
   outputs, and the last program to finish a (row, D tile) (arrival counter; no atomics on data)
   sums the row's k slots in slot order into `out`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from megastep.checkpoint import formats
from megastep.kernels.common import (
    fp8_block_scales,
    fp8_round,
    mxfp4_decode,
    next_pow2,
    on_interpreter,
    round_bf16,
    workspace,
)

ACT_BLOCK = 128
_MODES = {"fma": 0, "dot16": 2}


@dataclass(frozen=True)
class MoeConfig:
    mode: str  # "fma" (CUDA cores, a few pairs per expert) | "dot16" (tensor cores, bf16 operands)
    block_i: int  # w1/w3 rows (each) per gate-up program
    block_d: int  # w2 rows per down program
    block_p: int  # pairs of one expert handled together (fma: 1, 2, 4; dot16: 16, 32, 64)
    block_k: int  # K elements per loop step, a multiple of 128
    groups_up: int  # slot groups in the gate-up grid (programs per I tile)
    groups_down: int  # slot groups in the down grid
    num_warps: int = 4
    num_stages: int = 3

    def check(self) -> None:
        assert self.mode in _MODES, self.mode
        assert self.block_k in (128, 256, 512), self.block_k
        if self.mode == "fma":
            assert self.block_p in (1, 2, 4), self.block_p
        else:
            assert self.block_p in (16, 32, 64), self.block_p
        for b in (self.block_i, self.block_d):
            assert b in (16, 32, 64, 128), b
        assert self.groups_up >= 1 and self.groups_down >= 1


def pick_config(M: int, topk: int, E: int, D: int, I: int) -> MoeConfig:
    """The one configuration the wrapper uses for this shape (deterministic, no autotuning)."""
    slots = min(M * topk, E)
    # with random routing an expert gets ~M*k/E pairs: tensor cores only pay when that is large
    mode, bp = ("fma", 1) if M * topk <= 2 * E else ("dot16", 16)
    bi, bd = 32, 64
    target = 4 * 132  # programs per launch
    g_up = max(1, min(slots, target // max(1, -(-I // bi))))
    g_down = max(1, min(slots, target // max(1, -(-D // bd))))
    return MoeConfig(mode, bi, bd, bp, 256, g_up, g_down, num_warps=4, num_stages=3)


# ---- 1. routing: group pairs by expert ------------------------------------------------------
@triton.jit
def _moe_route_kernel(
    ids_ptr, P, pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr,
    BLOCK_P: tl.constexpr, CHUNK: tl.constexpr,
):
    offs_p = tl.arange(0, BLOCK_P)
    p_mask = offs_p < P
    BIG: tl.constexpr = 1 << 30
    idp = tl.load(ids_ptr + offs_p, mask=p_mask, other=BIG)
    rank = tl.zeros([BLOCK_P], dtype=tl.int32)  # position in (expert, pair) order
    dup_before = tl.zeros([BLOCK_P], dtype=tl.int32)  # earlier pairs with the same expert
    count = tl.zeros([BLOCK_P], dtype=tl.int32)  # pairs with the same expert
    slot = tl.zeros([BLOCK_P], dtype=tl.int32)  # distinct experts with a smaller id
    for q0 in tl.static_range(0, BLOCK_P, CHUNK):
        offs_q = q0 + tl.arange(0, CHUNK)
        q_mask = offs_q < P
        idq = tl.load(ids_ptr + offs_q, mask=q_mask, other=BIG)
        eq = (idp[:, None] == idq[None, :]) & q_mask[None, :]
        lt = (idq[None, :] < idp[:, None]) & q_mask[None, :]
        q_before_p = offs_q[None, :] < offs_p[:, None]
        rank += tl.sum((lt | (eq & q_before_p)).to(tl.int32), axis=1)
        dup_before += tl.sum((eq & q_before_p).to(tl.int32), axis=1)
        count += tl.sum(eq.to(tl.int32), axis=1)
        # q is the first pair of its expert when no valid p < q has the same id
        q_first = tl.sum((eq & (offs_p[:, None] < offs_q[None, :]) & p_mask[:, None]).to(tl.int32), axis=0) == 0
        slot += tl.sum((lt & q_first[None, :]).to(tl.int32), axis=1)
    first = (dup_before == 0) & p_mask
    tl.store(pair_ptr + rank, offs_p, mask=p_mask)
    tl.store(slot_e_ptr + slot, idp, mask=first)
    tl.store(slot_start_ptr + slot, rank, mask=first)
    tl.store(slot_cnt_ptr + slot, count, mask=first)
    tl.store(nslot_ptr, tl.sum(first.to(tl.int32), axis=0))


def moe_route(topk_ids: torch.Tensor, E: int) -> tuple[torch.Tensor, ...]:
    """topk_ids [M, k] -> (pairs [P], slot_expert [S], slot_start [S], slot_count [S], nslots [1])
    with P = M*k, S = min(P, E); only the first nslots slots are meaningful."""
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
    bp = next_pow2(max(P, 2))
    chunk = max(1, min(bp, 8192 // bp))
    _moe_route_kernel[(1,)](ids, P, pairs, slot_e, slot_start, slot_cnt, nslots, BLOCK_P=bp, CHUNK=chunk, num_warps=8)
    return pairs, slot_e, slot_start, slot_cnt, nslots


# ---- shared pieces of the two expert kernels --------------------------------------------------
@triton.jit
def _quant_even_odd(ve, vo, offs_h, NSUB: tl.constexpr, INTERPRET: tl.constexpr):
    """Even/odd halves [R, BLOCK_K/2] of activation rows -> their fp8_act_sim values (fp32);
    byte column h holds elements 2h and 2h+1, 64 columns per 128-element block."""
    s, inv = fp8_block_scales(tl.maximum(tl.abs(ve), tl.abs(vo)), offs_h, 64, NSUB)
    qe = fp8_round(ve, inv, INTERPRET).to(tl.float32) * s
    qo = fp8_round(vo, inv, INTERPRET).to(tl.float32) * s
    return qe, qo


@triton.jit
def _dot_pair(we, wo, qe, qo, INTERPRET: tl.constexpr):
    """[N, H] x [R, H] (even and odd halves) -> [N, R] with fp32 accumulation; every operand
    value is exact in bf16 (e2m1 * 2^k and e4m3 * 2^k)."""
    if INTERPRET:
        return tl.dot(we, tl.trans(qe)) + tl.dot(wo, tl.trans(qo))
    else:
        d = tl.dot(we.to(tl.bfloat16), tl.trans(qe.to(tl.bfloat16)))
        return tl.dot(wo.to(tl.bfloat16), tl.trans(qo.to(tl.bfloat16)), d)


@triton.jit
def _pick(v, offs, r):
    """v[r] of a small 1-D tensor, as a scalar."""
    return tl.sum(tl.where(offs == r, v, 0), axis=0)


# ---- 2. gate-up: w1, w3, SwiGLU, routing weight ---------------------------------------------
@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, ws_ptr, rw_ptr, pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr, act_ptr,
    D, I, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_am, limit, G,
    TOPK: tl.constexpr, MODE: tl.constexpr, BLOCK_I: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_i = tl.program_id(0)
    grp = tl.program_id(1)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = offs_i < I
    offs_h = tl.arange(0, BLOCK_K // 2)
    offs_p = tl.arange(0, BLOCK_P)
    n_slots = tl.load(nslot_ptr)
    for s in range(grp, n_slots, G):
        e = tl.load(slot_e_ptr + s).to(tl.int64)
        start = tl.load(slot_start_ptr + s)
        cnt = tl.load(slot_cnt_ptr + s)
        w1_rows = w_ptr + e * stride_we + offs_i[:, None] * stride_wn
        w3_rows = w1_rows + I * stride_wn
        s1_rows = ws_ptr + e * stride_se + offs_i[:, None] * stride_sn
        s3_rows = s1_rows + I * stride_sn
        for c0 in range(0, cnt, BLOCK_P):
            p_mask = c0 + offs_p < cnt
            pairs = tl.load(pair_ptr + start + c0 + offs_p, mask=p_mask, other=0)
            rows = pairs // TOPK
            acc_g = tl.zeros([BLOCK_I, BLOCK_P], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_I, BLOCK_P], dtype=tl.float32)
            for k0 in range(0, D, BLOCK_K):
                offs_b = k0 // 2 + offs_h  # byte column: elements 2b, 2b+1
                b_mask = offs_b * 2 < D
                wm = i_mask[:, None] & b_mask[None, :]
                w1e, w1o = mxfp4_decode(tl.load(w1_rows + offs_b[None, :], mask=wm, other=0),
                                        tl.load(s1_rows + offs_b[None, :] // 16, mask=wm, other=0))
                w3e, w3o = mxfp4_decode(tl.load(w3_rows + offs_b[None, :], mask=wm, other=0),
                                        tl.load(s3_rows + offs_b[None, :] // 16, mask=wm, other=0))
                if MODE == 0:
                    for r in tl.static_range(BLOCK_P):
                        row = tl.zeros([1, BLOCK_K // 2], dtype=tl.int32) + _pick(rows, offs_p, r)
                        ok = (tl.zeros([1, BLOCK_K // 2], dtype=tl.int32) + (c0 + r)) < cnt
                        xp = x_ptr + row * stride_xm + 2 * offs_b[None, :]
                        xm = b_mask[None, :] & ok
                        qe, qo = _quant_even_odd(tl.load(xp, mask=xm, other=0.0).to(tl.float32),
                                                 tl.load(xp + 1, mask=xm, other=0.0).to(tl.float32),
                                                 offs_h, BLOCK_K // 128, INTERPRET)
                        col = tl.arange(0, BLOCK_P)[None, :] == r
                        acc_g = tl.where(col, acc_g + tl.sum(w1e * qe + w1o * qo, axis=1)[:, None], acc_g)
                        acc_u = tl.where(col, acc_u + tl.sum(w3e * qe + w3o * qo, axis=1)[:, None], acc_u)
                else:
                    xp = x_ptr + rows[:, None] * stride_xm + 2 * offs_b[None, :]
                    xm = p_mask[:, None] & b_mask[None, :]
                    qe, qo = _quant_even_odd(tl.load(xp, mask=xm, other=0.0).to(tl.float32),
                                             tl.load(xp + 1, mask=xm, other=0.0).to(tl.float32),
                                             offs_h, BLOCK_K // 128, INTERPRET)
                    acc_g += _dot_pair(w1e, w1o, qe, qo, INTERPRET)
                    acc_u += _dot_pair(w3e, w3o, qe, qo, INTERPRET)
            if ROUND_BF16:  # the official w1/w3 Linear outputs are bf16
                acc_g = round_bf16(acc_g, INTERPRET)
                acc_u = round_bf16(acc_u, INTERPRET)
            g = tl.minimum(acc_g, limit)
            u = tl.minimum(tl.maximum(acc_u, -limit), limit)
            a = g / (1.0 + tl.exp(-g)) * u
            a = a * tl.load(rw_ptr + pairs, mask=p_mask, other=0.0)[None, :]
            if ROUND_BF16:
                a = round_bf16(a, INTERPRET)
            tl.store(act_ptr + pairs[None, :] * stride_am + offs_i[:, None], a.to(act_ptr.dtype.element_ty),
                     mask=i_mask[:, None] & p_mask[None, :])


# ---- 3. down: w2, then the fixed-order sum over slots ---------------------------------------
@triton.jit
def _moe_down_kernel(
    act_ptr, w_ptr, ws_ptr, pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr,
    y_ptr, out_ptr, cnt_ptr,
    D, I, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ym, stride_om, G,
    TOPK: tl.constexpr, MODE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, ROUND_BF16: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_d = tl.program_id(0)
    grp = tl.program_id(1)
    n_d_tiles = tl.num_programs(0)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    offs_h = tl.arange(0, BLOCK_K // 2)
    offs_p = tl.arange(0, BLOCK_P)
    n_slots = tl.load(nslot_ptr)
    for s in range(grp, n_slots, G):
        e = tl.load(slot_e_ptr + s).to(tl.int64)
        start = tl.load(slot_start_ptr + s)
        cnt = tl.load(slot_cnt_ptr + s)
        w_rows = w_ptr + e * stride_we + offs_d[:, None] * stride_wn
        s_rows = ws_ptr + e * stride_se + offs_d[:, None] * stride_sn
        for c0 in range(0, cnt, BLOCK_P):
            p_mask = c0 + offs_p < cnt
            pairs = tl.load(pair_ptr + start + c0 + offs_p, mask=p_mask, other=0)
            acc = tl.zeros([BLOCK_D, BLOCK_P], dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                offs_b = k0 // 2 + offs_h
                b_mask = offs_b * 2 < I
                wm = d_mask[:, None] & b_mask[None, :]
                we, wo = mxfp4_decode(tl.load(w_rows + offs_b[None, :], mask=wm, other=0),
                                      tl.load(s_rows + offs_b[None, :] // 16, mask=wm, other=0))
                if MODE == 0:
                    for r in tl.static_range(BLOCK_P):
                        pr = tl.zeros([1, BLOCK_K // 2], dtype=tl.int32) + _pick(pairs, offs_p, r)
                        ok = (tl.zeros([1, BLOCK_K // 2], dtype=tl.int32) + (c0 + r)) < cnt
                        ap = act_ptr + pr * stride_am + 2 * offs_b[None, :]
                        am = b_mask[None, :] & ok
                        qe, qo = _quant_even_odd(tl.load(ap, mask=am, other=0.0).to(tl.float32),
                                                 tl.load(ap + 1, mask=am, other=0.0).to(tl.float32),
                                                 offs_h, BLOCK_K // 128, INTERPRET)
                        col = tl.arange(0, BLOCK_P)[None, :] == r
                        acc = tl.where(col, acc + tl.sum(we * qe + wo * qo, axis=1)[:, None], acc)
                else:
                    ap = act_ptr + pairs[:, None] * stride_am + 2 * offs_b[None, :]
                    am = p_mask[:, None] & b_mask[None, :]
                    qe, qo = _quant_even_odd(tl.load(ap, mask=am, other=0.0).to(tl.float32),
                                             tl.load(ap + 1, mask=am, other=0.0).to(tl.float32),
                                             offs_h, BLOCK_K // 128, INTERPRET)
                    acc += _dot_pair(we, wo, qe, qo, INTERPRET)
            if ROUND_BF16:  # the official w2 Linear output is bf16
                acc = round_bf16(acc, INTERPRET)
            ymask = d_mask[:, None] & p_mask[None, :]
            tl.store(y_ptr + pairs[None, :] * stride_ym + offs_d[:, None], acc.to(y_ptr.dtype.element_ty), mask=ymask)
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
    round_bf16_ = x.dtype == torch.bfloat16
    pairs, slot_e, slot_start, slot_cnt, nslots = moe_route(topk_ids, E)
    rw = topk_weights.reshape(-1).contiguous()
    act = torch.empty(P, I, dtype=x.dtype, device=x.device)
    y = torch.empty(P, D, dtype=x.dtype, device=x.device)
    S = min(P, E)
    g_up, g_down = min(cfg.groups_up, S), min(cfg.groups_down, S)
    w13u, s13u, w2u, s2u = (t.view(torch.uint8) for t in (w13, w13_scale, w2, w2_scale))
    common = dict(TOPK=k, MODE=_MODES[cfg.mode], BLOCK_P=cfg.block_p, BLOCK_K=cfg.block_k,
                  ROUND_BF16=round_bf16_, INTERPRET=interp, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _moe_gate_up_kernel[(-(-I // cfg.block_i), g_up)](
        x, w13u, s13u, rw, pairs, slot_e, slot_start, slot_cnt, nslots, act,
        D, I, x.stride(0), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), act.stride(0),
        float(swiglu_limit), g_up, BLOCK_I=cfg.block_i, **common,
    )
    n_d_tiles = -(-D // cfg.block_d)
    cnt = workspace(x.device, "counters_moe", M * n_d_tiles, torch.int32)
    _moe_down_kernel[(n_d_tiles, g_down)](
        act, w2u, s2u, pairs, slot_e, slot_start, slot_cnt, nslots, y, out, cnt,
        D, I, act.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), y.stride(0), out.stride(0),
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
