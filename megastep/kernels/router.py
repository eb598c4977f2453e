"""MoE routing for decode in one launch (instead of softplus, sqrt, add, topk, sort, gather, sum,
divide, multiply: ~10 torch ops).

Semantics (`route_ref`: FastDecoder._moe's routing + ops.route_weights), per row:
  scores = sqrt(softplus(logits))                (fp32; softplus as torch: x > 20 -> x, else log1p(exp(x)))
  idx    = topk(scores + bias, k)                (bias only selects), or the given hash rows
           (tid2eid[token]), then sorted ascending (the reference's summation order)
  w      = scores[idx] / sum(scores[idx]) * scaling

Kernel: one program per row (E = 256 scores in registers): k rounds of argmax over the not yet
chosen experts, each taking the lowest index among equal maxima; the chosen set is read out in
ascending order through a prefix count (no sort). Hash rows are sorted by counting ranks (ties
kept in input order). The weight sum runs over the k chosen scores in ascending expert order.

What differs from torch:
- ties in top-k: the lowest expert id wins here; torch.topk's choice among equal values is
  unspecified.
- the order of the k-term weight sum (torch's reduction order is its own; one fp32 ulp at most).
- exp/log1p are libdevice's on the GPU (__nv_expf, __nv_log1pf, compiled without flush-to-zero:
  what torch's CUDA softplus calls, expected bit-identical, subnormals included); on the
  interpreter float64 rounded to fp32 (torch-CPU's SLEEF functions are within an ulp).
Logits must be finite. Deterministic and batch invariant (rows independent), static grid (B,).

`route_group` also does the experts kernels' first launch (`moe_route`: the (row, slot) pairs
grouped by expert, x quantized for them) in the same launch, for up to MAX_GROUPED_PAIRS pairs:
the last routing program to arrive groups them. At batch 1 that is one launch fewer on the
router -> experts chain of every MoE layer. Its results are integers and exact bf16 values,
equal to the two launches' whichever made them, so a step may take either path by batch size.

`gate_route_group` also computes the gate GEMV in that launch (up to one row tile, 16 rows): its
programs are `dense.linear_bf16`'s for the gate's shape (`dense.bf16_tile`: the same sums, so the
same logits bits), and the program that completes the last column tile routes every row at once
(`route_rows`: route_row's operations per row, the same bits) and groups the pairs. One launch for
gate + routing + grouping + x quantization.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megastep.kernels import dense as _dense
from megastep.kernels import moe_route as _mr
from megastep.kernels import rope_norm as _rn
from megastep.kernels.common import (l2_prefetch_rows, launch_opts, next_pow2, on_interpreter, pdl_enter, pdl_release,
                                     prefetch_lines, workspace)
from megastep.checkpoint import formats
from megastep.model import ops


@triton.jit
def route_row(logit_ptr, bias_ptr, rows_ptr, idx_ptr, w_ptr, b, E, stride_lb, stride_rb, stride_ib, stride_wb,
              scaling, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr,
              HASH: tl.constexpr, INTERPRET: tl.constexpr):
    """Row b's experts (ascending) and weights (module doc): `route_rows` on that one row."""
    route_rows(logit_ptr + b * stride_lb, bias_ptr, rows_ptr + b * stride_rb, idx_ptr + b * stride_ib,
               w_ptr + b * stride_wb, 1, E, 0, 0, 0, 0, scaling, 1, EP, K, KP, HAS_BIAS, HASH, INTERPRET)


@triton.jit
def route_rows(logit_ptr, bias_ptr, rows_ptr, idx_ptr, w_ptr, B, E, stride_lb, stride_rb, stride_ib, stride_wb,
               scaling, BP: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
               HAS_BIAS: tl.constexpr, HASH: tl.constexpr, INTERPRET: tl.constexpr):
    """Experts (ascending) and weights of rows 0..B-1 (B <= BP) in one program (module doc): k
    rounds of argmax over the not yet chosen experts, the lowest index among equal maxima; the
    chosen set read out in ascending order through a prefix count; hash rows sorted by counting
    ranks; the weight sum over the k chosen scores in ascending expert order. Every reduction runs
    over one row's own experts and is exact (max, min, integer sums, sums with one nonzero term),
    so a row's bits do not depend on the rows beside it. Logits are read past L1 (.cg): other
    programs of the launch may just have written them."""
    r = tl.arange(0, BP)
    rm = r < B
    e = tl.arange(0, EP)
    em = e < E
    x = tl.load(logit_ptr + r[:, None].to(tl.int64) * stride_lb + e[None, :], mask=rm[:, None] & em[None, :],
                other=0.0, cache_modifier=".cg")
    s = tl.sqrt_rn(tl.where(x > 20.0, x, _rn.t_log1p(_rn.t_exp(x, INTERPRET), INTERPRET)))
    s = tl.where(em[None, :], s, 0.0)
    kk = tl.arange(0, KP)
    idx = tl.zeros([BP, KP], dtype=tl.int32)
    if HASH:
        v = tl.load(rows_ptr + r[:, None].to(tl.int64) * stride_rb + kk[None, :], mask=rm[:, None] & (kk < K)[None, :],
                    other=EP).to(tl.int32)  # padding sorts last
        vi = v[:, :, None]
        vj = v[:, None, :]
        before = (vi < vj) | ((vi == vj) & (kk[:, None] < kk[None, :])[None, :, :])
        rank = tl.sum(before.to(tl.int32), axis=1)  # [BP, KP]: ascending position of v[:, j]
        for t in tl.static_range(K):
            idx = tl.where(kk[None, :] == t, tl.sum(tl.where(rank == t, v, 0), axis=1)[:, None], idx)
    else:
        key = s
        if HAS_BIAS:
            key = s + tl.load(bias_ptr + e, mask=em, other=0.0)[None, :]
        key = tl.where(em[None, :], key, float("-inf"))
        chosen = (e[None, :] < 0) & rm[:, None]
        for _ in tl.static_range(K):
            m = tl.max(tl.where(chosen, float("-inf"), key), axis=1)
            j = tl.min(tl.where(~chosen & (key == m[:, None]), e[None, :], EP), axis=1)  # lowest index among the maxima
            chosen = chosen | (e[None, :] == j[:, None])
        rank = tl.cumsum(chosen.to(tl.int32), axis=1) - 1
        for t in tl.static_range(K):
            idx = tl.where(kk[None, :] == t, tl.sum(tl.where(chosen & (rank == t), e[None, :], 0), axis=1)[:, None], idx)
    wk = tl.zeros([BP, KP], dtype=tl.float32)
    total = tl.zeros([BP], dtype=tl.float32)
    for t in tl.static_range(K):
        it = tl.sum(tl.where(kk[None, :] == t, idx, 0), axis=1)
        wt = tl.sum(tl.where(e[None, :] == it[:, None], s, 0.0), axis=1)  # exact: one nonzero term
        wk = tl.where(kk[None, :] == t, wt[:, None], wk)
        if t == 0:
            total = wt
        else:
            total = total + wt
    total = tl.where(rm, total, 1.0)  # rows past B: stored nowhere, but no 0 / 0
    w = tl.div_rn(wk, total[:, None]) * scaling
    km = rm[:, None] & (kk < K)[None, :]
    tl.store(idx_ptr + r[:, None].to(tl.int64) * stride_ib + kk[None, :], idx, mask=km)
    tl.store(w_ptr + r[:, None].to(tl.int64) * stride_wb + kk[None, :], w, mask=km)


@triton.jit
def _route_kernel(logit_ptr, bias_ptr, rows_ptr, idx_ptr, w_ptr, E, stride_lb, stride_rb, stride_ib, stride_wb,
                  scaling, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HASH: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    route_row(logit_ptr, bias_ptr, rows_ptr, idx_ptr, w_ptr, tl.program_id(0).to(tl.int64), E, stride_lb, stride_rb,
              stride_ib, stride_wb, scaling, EP, K, KP, HAS_BIAS, HASH, INTERPRET)


@triton.jit
def _route_group_kernel(logit_ptr, bias_ptr, rows_ptr, idx_ptr, w_ptr, E, stride_lb, stride_rb, scaling,
                        x_ptr, xq_ptr, D, stride_xm, stride_qm, cnt_ptr,
                        pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr, B,
                        EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr,
                        HASH: tl.constexpr, INTERPRET: tl.constexpr, NB: tl.constexpr, PERM: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr):
    # programs [0, B): route a row, then the last of them to arrive groups all B*K pairs;
    # programs [B, 2B): quantize a row of x for the experts kernels
    pdl_enter(PDL)
    pid = tl.program_id(0)
    if pid >= B:
        m = pid - B
        _mr.quant_row_perm(x_ptr + m * stride_xm, xq_ptr + m * stride_qm, D, NB, INTERPRET, PERM)
    else:
        route_row(logit_ptr, bias_ptr, rows_ptr, idx_ptr, w_ptr, pid.to(tl.int64), E, stride_lb, stride_rb, K, K,
                  scaling, EP, K, KP, HAS_BIAS, HASH, INTERPRET)
        pdl_release(PDL)  # only the grouping is left
        tl.debug_barrier()  # every thread's ids are issued before the release below
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == B - 1:  # the others' ids are visible (acquire); .cg loads read them past L1
            _mr.group_all_pairs(idx_ptr, B * K, pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr,
                                BLOCK_R, BLOCK_Q, E_PAD)
            tl.store(cnt_ptr, 0)  # ready for the next launch (and graph replay)


@triton.jit
def _gate_route_group_kernel(x_ptr, gw_ptr, logit_ptr, part_ptr, cnt_ptr, bias_ptr, rows_ptr, idx_ptr, w_ptr,
                             xq_ptr, pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr,
                             B, E, D, K_PER_SPLIT, stride_xm, stride_gw, stride_lb, stride_rb, stride_qm, scaling,
                             N_TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             SPLIT_K: tl.constexpr, BP: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                             KP: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr, INTERPRET: tl.constexpr,
                             NB: tl.constexpr, PERM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr,
                             E_PAD: tl.constexpr, PDL: tl.constexpr, PREFETCH_LINES: tl.constexpr):
    # programs [0, N_TILES * SPLIT_K): the gate GEMV, exactly linear_bf16's programs (one row tile:
    # B <= 16); the program that completes the last column tile (a second arrival counter) routes
    # every row and groups the pairs. Programs past them quantize a row of x for the experts.
    G: tl.constexpr = N_TILES * SPLIT_K
    pid = tl.program_id(0)
    pid_n = pid % N_TILES
    pid_k = pid // N_TILES
    if PREFETCH_LINES:  # (PDL) the gate's first weight lines, while the previous kernel drains
        if pid < G:
            l2_prefetch_rows(gw_ptr, pid_n * BLOCK_N, E, stride_gw, pid_k, K_PER_SPLIT, D, BLOCK_N, PREFETCH_LINES)
    pdl_enter(PDL)
    if pid >= G:
        m = pid - G
        _mr.quant_row_perm(x_ptr + m * stride_xm, xq_ptr + m * stride_qm, D, NB, INTERPRET, PERM)
    else:
        done = _dense.bf16_tile(x_ptr, gw_ptr, logit_ptr, part_ptr, cnt_ptr, B, E, D, K_PER_SPLIT, stride_xm,
                                stride_gw, stride_lb, 0, pid_n, pid_k, 1, N_TILES, BLOCK_N, _dense.BLOCK_M, BLOCK_K,
                                SPLIT_K, False, INTERPRET, PDL, 4)
        if done:
            tl.debug_barrier()  # every thread's logits are issued before the release below
            tiles_done = tl.atomic_add(cnt_ptr + N_TILES, 1, sem="acq_rel", scope="gpu")
            if tiles_done == N_TILES - 1:  # every logit is visible (acquire): route, then group
                route_rows(logit_ptr, bias_ptr, rows_ptr, idx_ptr, w_ptr, B, E, stride_lb, stride_rb, K, K,
                           scaling, BP, EP, K, KP, HAS_BIAS, HASH, INTERPRET)
                tl.debug_barrier()  # the ids are written before group_pairs reads them back
                _mr.group_all_pairs(idx_ptr, B * K, pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr,
                                    BLOCK_R, BLOCK_Q, E_PAD)
                tl.store(cnt_ptr + N_TILES, 0)  # ready for the next launch (and graph replay)


def _route_check(logits, bias, tid2eid_rows, k) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands' checks; the empty (idx, w) outputs."""
    assert logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1, (logits.shape, logits.dtype)
    B, E = logits.shape
    assert 1 <= k <= E and E <= 4096, (k, E)
    if bias is not None:
        assert bias.shape == (E,) and bias.dtype == torch.float32 and bias.is_contiguous() and bias.device == logits.device
    if tid2eid_rows is not None:
        assert tid2eid_rows.shape == (B, k) and tid2eid_rows.stride(1) == 1, tid2eid_rows.shape
        assert tid2eid_rows.dtype in (torch.int64, torch.int32) and tid2eid_rows.device == logits.device
    return (torch.empty(B, k, dtype=torch.int32, device=logits.device),
            torch.empty(B, k, dtype=torch.float32, device=logits.device))


def _route_meta(E, k, bias, tid2eid_rows, logits) -> dict:
    return dict(EP=max(16, next_pow2(E)), K=k, KP=max(2, next_pow2(k)), HAS_BIAS=bias is not None,
                HASH=tid2eid_rows is not None, INTERPRET=on_interpreter(logits))


def route(logits: torch.Tensor, bias: torch.Tensor | None, tid2eid_rows: torch.Tensor | None, k: int,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, E] f32 (the gate GEMV), bias [E] f32 (top-k layers) or None, tid2eid_rows [B, k]
    int (hash layers: tid2eid[tokens]) or None -> (idx [B, k] int32 ascending, weights [B, k] f32)."""
    B, E = logits.shape
    idx, w = _route_check(logits, bias, tid2eid_rows, k)
    if B == 0:
        return idx, w
    rows = tid2eid_rows if tid2eid_rows is not None else idx
    grid = (B,)
    _route_kernel[grid](
        logits, logits if bias is None else bias, rows, idx, w, E, logits.stride(0), rows.stride(0), idx.stride(0),
        w.stride(0), float(scaling), **_route_meta(E, k, bias, tid2eid_rows, logits), num_warps=4,
        **_rn.TORCH_MATH, **launch_opts(logits, grid),
    )
    return idx, w


MAX_GROUPED_PAIRS = 96  # route_group groups at most this many (row, slot) pairs in its last program


def route_group(logits: torch.Tensor, bias: torch.Tensor | None, tid2eid_rows: torch.Tensor | None, k: int,
                scaling: float, x: torch.Tensor, permute: bool = True) -> tuple[torch.Tensor, torch.Tensor, _mr.Routing]:
    """`route` and the experts' `moe_route` (pairs grouped by expert, x quantized) in one launch,
    for B*k <= MAX_GROUPED_PAIRS: the last routing program to arrive (an arrival counter, reset by
    it) groups every row's pairs; other programs quantize x's rows. Returns (idx, w, routing),
    equal to `route(...)` and `moe_route(idx, E, x, permute)` (integers and exact bf16 values:
    the same results, whichever launch made them)."""
    B, E = logits.shape
    idx, w = _route_check(logits, bias, tid2eid_rows, k)
    assert 1 <= B * k <= MAX_GROUPED_PAIRS, (B, k)
    assert x.dim() == 2 and x.shape[0] == B and x.stride(1) == 1 and x.device == logits.device, x.shape
    pairs, slot_e, slot_start, slot_cnt, nslots, xq = _mr.routing_buffers(B * k, E, x, logits.device)
    rows = tid2eid_rows if tid2eid_rows is not None else idx
    cnt = workspace(logits.device, "counters_route", 1, torch.int32)
    D = x.shape[1]
    grid = (2 * B,)
    _route_group_kernel[grid](
        logits, logits if bias is None else bias, rows, idx, w, E, logits.stride(0), rows.stride(0), float(scaling),
        x, xq, D, x.stride(0), xq.stride(0), cnt, pairs, slot_e, slot_start, slot_cnt, nslots, B,
        **_route_meta(E, k, bias, tid2eid_rows, logits), NB=next_pow2(-(-D // _mr.ACT_BLOCK)), PERM=permute,
        **_mr.group_block_sizes(E), num_warps=4, **_rn.TORCH_MATH, **launch_opts(logits, grid),
    )
    return idx, w, _mr.Routing(pairs, slot_e, slot_start, slot_cnt, nslots, xq, permute)


# FastDecoder takes gate_route_group for steps of at most this many rows. The launch itself takes
# up to one row tile of the gate GEMV (dense.BLOCK_M = 16 rows), but its routing then runs in one
# program for every row. Measured on one H200 (30 V4-Flash layers, 2026-11-29/30, together with
# the attention and experts changes of that run: docs/PERFORMANCE.md, ninth measurement): the
# router stage 13.1 us per layer in two launches -> 15.7 in one, the step 631 launches instead
# of 691 and faster at 1 and 4 rows; above 4 rows not measured.
MAX_GATE_ROWS = 4


def gate_route_group(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None,
                     tid2eid_rows: torch.Tensor | None, k: int, scaling: float,
                     permute: bool = True) -> tuple[torch.Tensor, torch.Tensor, _mr.Routing, torch.Tensor]:
    """The gate GEMV (`dense.linear_bf16(x, gate_w)`, fp32 logits) and `route_group` in one launch,
    for B <= dense.BLOCK_M rows and B*k <= MAX_GROUPED_PAIRS pairs: the gate's programs are
    linear_bf16's (its configuration for the gate's shape, the same sums: the same logits bits);
    the program that completes the last column tile routes every row (`route_rows`: route_row's
    bits) and groups the pairs; other programs quantize x. Returns (idx, w, routing, logits),
    equal to `linear_bf16` then `route_group`. x [B, D] bf16, gate_w [E, D] bf16."""
    B, D = x.shape
    E = gate_w.shape[0]
    assert x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(1) == 1, (x.shape, x.dtype)
    assert gate_w.shape == (E, D) and gate_w.dtype == torch.bfloat16 and gate_w.stride(1) == 1 and gate_w.device == x.device
    assert 1 <= B <= _dense.BLOCK_M and B * k <= MAX_GROUPED_PAIRS, (B, k)
    logits = torch.empty(B, E, dtype=torch.float32, device=x.device)
    idx, w = _route_check(logits, bias, tid2eid_rows, k)
    cfg = _dense.pick_config(E, D)  # linear_bf16's configuration and split, for the same sums
    split, k_per_split = _dense.split_plan(D, cfg)
    n_tiles = -(-E // cfg.block_n)
    part = torch.empty(split * n_tiles * cfg.block_n * _dense.BLOCK_M, dtype=torch.float32, device=x.device)
    cnt = workspace(x.device, "counters_gate_route", n_tiles + 1, torch.int32)
    pairs, slot_e, slot_start, slot_cnt, nslots, xq = _mr.routing_buffers(B * k, E, x, x.device)
    rows = tid2eid_rows if tid2eid_rows is not None else idx
    grid = (n_tiles * split + B,)
    opts = launch_opts(x, grid)
    _gate_route_group_kernel[grid](
        x, gate_w, logits, part, cnt, gate_w if bias is None else bias, rows, idx, w,
        xq, pairs, slot_e, slot_start, slot_cnt, nslots,
        B, E, D, k_per_split, x.stride(0), gate_w.stride(0), logits.stride(0), rows.stride(0), xq.stride(0),
        float(scaling), N_TILES=n_tiles, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
        BP=max(2, next_pow2(B)), **_route_meta(E, k, bias, tid2eid_rows, logits), NB=next_pow2(-(-D // _mr.ACT_BLOCK)),
        PERM=permute, **_mr.group_block_sizes(E), PREFETCH_LINES=prefetch_lines(opts, k_per_split * 2),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **_rn.TORCH_MATH, **opts,
    )
    return idx, w, _mr.Routing(pairs, slot_e, slot_start, slot_cnt, nslots, xq, permute), logits


def route_group_ref(logits, bias, tid2eid_rows, k, scaling, x, permute=True):
    """`route_ref`, then the pairs grouped by expert (stable sort of the flattened ids: pair order
    within an expert) and x quantized as the experts kernels read it (`moe_route`'s semantics)."""
    idx, w = route_ref(logits, bias, tid2eid_rows, k, scaling)
    flat = idx.flatten()
    experts, counts = torch.unique(flat, return_counts=True)
    S = min(flat.numel(), logits.shape[1])
    pad = torch.zeros(S - experts.numel(), dtype=torch.int32, device=idx.device)  # slots past nslots: unspecified
    i32 = lambda t: torch.cat([t.to(torch.int32), pad])  # noqa: E731
    xq = formats.fp8_act_sim(x.float(), _mr.ACT_BLOCK)
    if permute:  # each 32-group: its 16 even elements, then its 16 odd ones
        g = xq.unflatten(-1, (-1, 16, 2))
        xq = torch.cat([g[..., 0], g[..., 1]], dim=-1).flatten(-2)
    routing = _mr.Routing(torch.argsort(flat, stable=True).to(torch.int32), i32(experts),
                          i32(torch.cumsum(counts, 0) - counts), i32(counts),
                          torch.tensor([experts.numel()], dtype=torch.int32, device=idx.device),
                          xq.to(torch.bfloat16), permute)
    return idx, w, routing


def route_ref(logits, bias, tid2eid_rows, k, scaling):
    """FastDecoder._moe's routing (its code) -> (idx int32 ascending, weights f32)."""
    scores = torch.sqrt(torch.nn.functional.softplus(logits))
    if tid2eid_rows is not None:
        idx = tid2eid_rows.long()
    else:
        idx = (scores + bias if bias is not None else scores).topk(k, dim=-1).indices
    idx = idx.sort(-1).values  # ascending expert id: the reference's summation order
    w = ops.route_weights(scores, idx, scaling)
    return idx.to(torch.int32), w
