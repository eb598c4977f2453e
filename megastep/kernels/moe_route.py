"""The routing step of the MXFP4 experts kernels (`kernels/moe.py`, launch 1 of 4) and the
activation quantization they read: the M*k (row, slot) pairs grouped by expert (sorted by expert
then pair index; one "slot" per distinct expert: id, first pair, count) and, in other programs of
the same launch, x quantized once for all experts (fp8_act_sim per 128 channels), stored as bf16
(exact) with each 32-group permuted to (16 even, 16 odd) elements, the order in which the packed
MXFP4 bytes deliver their low and high nibbles. Static grids, no host sync."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton  # noqa: F401
import triton.language as tl

from megastep.kernels.common import FP8_ACT_BLOCK as ACT_BLOCK
from megastep.kernels.common import fp8_pow2_scale, fp8_round, launch_opts, next_pow2, on_interpreter, pdl_enter


# ---- activation quantization into the layout the expert kernels read ------------------------
@triton.jit
def quant_row_perm(src_ptr, dst_ptr, K, NB: tl.constexpr, INTERPRET: tl.constexpr, PERM: tl.constexpr):
    """fp8_act_sim(row, 128) of one row of K values -> dst (bf16: the values are e4m3 * 2^k,
    exact). With PERM each 32-group holds its 16 even elements, then its 16 odd ones: the order
    in which the MXFP4 bytes deliver their low and high nibbles."""
    k = tl.arange(0, NB)[:, None] * 128 + tl.arange(0, 128)[None, :]
    m = k < K
    v = tl.load(src_ptr + k, mask=m, other=0.0).to(tl.float32)
    quant_blocks_store(v, k, dst_ptr, m, INTERPRET, PERM)


@triton.jit
def quant_blocks_store(v, k, dst, m, INTERPRET: tl.constexpr, PERM: tl.constexpr):
    """fp8_act_sim of the 128-blocks that are v's rows (fp32 [R, 128]; columns k, broadcastable
    to v) stored as bf16 at dst + k (dst broadcastable: a row pointer, or one per block), where
    m; with PERM each 32-group permuted (quant_row_perm)."""
    s, inv = fp8_pow2_scale(tl.max(tl.abs(v), axis=1))
    q = fp8_round(v, inv[:, None], INTERPRET).to(tl.float32) * s[:, None]
    if PERM:
        kp = (k // 32) * 32 + (k % 2) * 16 + (k % 32) // 2
    else:
        kp = k
    tl.store(dst + kp, q.to(tl.bfloat16), mask=m)


@triton.jit
def _moe_act_quant_kernel(src_ptr, dst_ptr, K, stride_s, stride_d, NB: tl.constexpr, INTERPRET: tl.constexpr,
                          PERM: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    r = tl.program_id(0)
    quant_row_perm(src_ptr + r * stride_s, dst_ptr + r * stride_d, K, NB, INTERPRET, PERM)


# ---- 1. routing (group pairs by expert) + quantization of x ---------------------------------
@triton.jit
def group_pairs(ids_ptr, P, blk, pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr,
                BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr, E_PAD: tl.constexpr):
    """Pairs [blk * BLOCK_R, (blk + 1) * BLOCK_R) of the P (row, slot) pairs, each compared with
    all P: its position in (expert, pair) order, and for the first pair of each expert that
    expert's slot (id, first position, count); block 0 also writes the number of slots. The ids
    are read past L1 (.cg): a caller may group ids other programs of its launch just wrote."""
    BIG: tl.constexpr = 1 << 30
    offs_r = blk * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < P
    idr = tl.load(ids_ptr + offs_r, mask=r_mask, other=BIG, cache_modifier=".cg")
    ar_e = tl.arange(0, E_PAD)
    present = tl.zeros([E_PAD], dtype=tl.int32)  # experts with at least one pair
    rank = tl.zeros([BLOCK_R], dtype=tl.int32)  # position in (expert, pair) order
    dup_before = tl.zeros([BLOCK_R], dtype=tl.int32)  # earlier pairs with the same expert
    count = tl.zeros([BLOCK_R], dtype=tl.int32)  # pairs with the same expert
    for q0 in range(0, P, BLOCK_Q):
        offs_q = q0 + tl.arange(0, BLOCK_Q)
        q_mask = offs_q < P
        idq = tl.load(ids_ptr + offs_q, mask=q_mask, other=BIG, cache_modifier=".cg")
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
    if blk == 0:
        tl.store(nslot_ptr, tl.sum(present, axis=0))


@triton.jit
def group_all_pairs(ids_ptr, P, pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr,
                    BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr, E_PAD: tl.constexpr):
    """`group_pairs` over all P pairs in one program, block after block."""
    for blk in range(0, tl.cdiv(P, BLOCK_R)):
        group_pairs(ids_ptr, P, blk, pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr,
                    BLOCK_R, BLOCK_Q, E_PAD)


@triton.jit
def _moe_prep_kernel(
    ids_ptr, P, x_ptr, xq_ptr, D, stride_xm, stride_qm,
    pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr,
    N_ROUTE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr, E_PAD: tl.constexpr,
    NB: tl.constexpr, INTERPRET: tl.constexpr, PERM: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    if pid >= N_ROUTE:  # one program per row of x
        m = pid - N_ROUTE
        quant_row_perm(x_ptr + m * stride_xm, xq_ptr + m * stride_qm, D, NB, INTERPRET, PERM)
    else:  # BLOCK_R pairs per program, each compared with all P pairs
        group_pairs(ids_ptr, P, pid, pair_ptr, slot_e_ptr, slot_start_ptr, slot_cnt_ptr, nslot_ptr,
                    BLOCK_R, BLOCK_Q, E_PAD)


_ROUTE_BLOCK = 32


class Routing(NamedTuple):
    """The (row, slot) pairs grouped by expert, as the experts kernels read them (module doc), and
    x quantized for them (bf16, permuted per 32-group when `permuted`)."""
    pairs: torch.Tensor  # [P] int32: pair indices in (expert, pair) order
    slot_expert: torch.Tensor  # [S] int32, S = min(P, E): the distinct experts ascending
    slot_start: torch.Tensor  # [S] int32: each one's first position in `pairs`
    slot_count: torch.Tensor  # [S] int32: its number of pairs
    nslots: torch.Tensor  # [1] int32: how many of the S slots are real
    xq: torch.Tensor | None  # [M, D] bf16
    permuted: bool


def routing_buffers(P: int, E: int, x: torch.Tensor | None, device) -> tuple[torch.Tensor, ...]:
    """Empty (pairs, slot_expert, slot_start, slot_count, nslots, xq) for P pairs over E experts."""
    S = min(P, E)
    i32 = dict(dtype=torch.int32, device=device)
    xq = None if x is None else torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    return (torch.empty(P, **i32), torch.empty(S, **i32), torch.empty(S, **i32), torch.empty(S, **i32),
            torch.empty(1, **i32), xq)


def group_block_sizes(E: int) -> dict:
    """group_pairs' tile sizes for E experts (the [BLOCK_R, BLOCK_Q] compare and [E_PAD, BLOCK_Q]
    presence tiles stay within 8K elements)."""
    e_pad = next_pow2(max(E, 2))
    return dict(BLOCK_R=_ROUTE_BLOCK, BLOCK_Q=max(2, min(64, 8192 // e_pad)), E_PAD=e_pad)


def moe_route(topk_ids: torch.Tensor, E: int, x: torch.Tensor | None = None, permute: bool = True) -> Routing:
    """topk_ids [M, k] -> the Routing of its P = M*k pairs: sorted by (expert, pair index), one
    slot per distinct expert (only the first nslots slots are meaningful). When x [M, D] is given,
    the same launch writes xq [M, D] = fp8_act_sim(x, 128) in bf16, permuted per 32-group (even,
    odd) unless permute=False."""
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32:
        ids = ids.to(torch.int32)
    P = ids.numel()
    pairs, slot_e, slot_start, slot_cnt, nslots, xq = routing_buffers(P, E, x, ids.device)
    n_route = -(-P // _ROUTE_BLOCK)
    if x is not None:
        M, D = x.shape
        args = (x, xq, D, x.stride(0), xq.stride(0))
    else:
        M, D = 0, 128
        args = (ids, ids, 0, 0, 0)
    grid = (n_route + M,)
    _moe_prep_kernel[grid](
        ids, P, *args, pairs, slot_e, slot_start, slot_cnt, nslots, N_ROUTE=n_route, **group_block_sizes(E),
        NB=next_pow2(-(-D // ACT_BLOCK)), INTERPRET=on_interpreter(ids), PERM=permute, num_warps=4, **launch_opts(ids, grid),
    )
    return Routing(pairs, slot_e, slot_start, slot_cnt, nslots, xq, permute)
