"""Two FP8 linears in one launch, the second reading the first's output (the attention's wo_a,
then wo_b): u = A(x), y = B(u).

Shapes and dtypes: x [M, G * KA] bf16, wa e4m3 [NA, KA] with its E8M0 scales (groups G as
`linear_fp8`'s: output rows [g NA/G, (g+1) NA/G) read x's columns [g KA, (g+1) KA); wo_a), wb e4m3
[NB, NA] -> y [M, NB] bf16; u [M, NA] bf16 is written on the way (returned too).

Semantics (`linear_fp8_pair_ref`): exactly `linear_fp8(linear_fp8(x, wa, ...), wb, ...)`, each with
the configuration `linear_fp8` picks for its weight alone. Every program of either half runs the
program of that launch (`linear_fp8._linear_tile`, the same code), so each output element is the
same sum in the same order: the same bits (tested on the interpreter and on the GPU).

Why one launch: at one row each of wo_a and wo_b (33.5 MB at V4-Flash) streams in ~15 us, of
which the launch's ramp and tail (the first programs' DRAM latency, the last programs' split-K
sums) are several: the second launch's ramp waits for the first's tail. Here B's programs start
where A's end and wait only for the part of u they read.

Order without deadlock: a program takes a ticket (an atomic counter) when it starts; tickets
0 .. A-1 run A's programs (tile-major, each tile's K splits together, so u's columns complete in
order), the rest B's (split-major: B's split s reads u's columns [s KPS_B, (s+1) KPS_B)). A's
program that stores a tile of u (the last of its K splits) counts it in ready[m tile, B split];
B's program spins on that count (acquire) until every tile of its columns is stored, then reads
them past L1. A program waits only for tickets taken before its own, i.e. for programs already
running, so the launch completes whatever the order in which its CTAs are placed. The last program
to finish sets the tickets and counts back to zero for the next launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megastep.kernels import linear_fp8 as _lin
from megastep.kernels.common import launch_opts, next_pow2, on_interpreter, pdl_enter, workspace


@triton.jit
def _linear_pair_kernel(
    x_ptr, wa_ptr, wsa_ptr, u_ptr, parta_ptr, cnta_ptr,
    wb_ptr, wsb_ptr, y_ptr, partb_ptr, cntb_ptr, sync_ptr,
    M, NA, KA, KPS_A, NB, KPS_B,
    stride_xm, stride_wan, stride_wsan, stride_um, stride_wbn, stride_wsbn, stride_ym,
    MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_A: tl.constexpr, SPLIT_B: tl.constexpr, GROUP_NA: tl.constexpr, QUANT_A: tl.constexpr,
    QUANT_B: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr, READY: tl.constexpr,
):
    # sync_ptr: [0] tickets taken, [1] programs finished, [2 ..] ready[m tile, B split]
    pdl_enter(PDL)
    tiles_a = tl.cdiv(NA, BLOCK_N)
    tiles_b = tl.cdiv(NB, BLOCK_N)
    m_tiles = tl.cdiv(M, BLOCK_M)
    progs_a = tiles_a * SPLIT_A * m_tiles
    total = progs_a + tiles_b * SPLIT_B * m_tiles
    ready = sync_ptr + 2
    t = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    if t < progs_a:
        pid_k = t % SPLIT_A
        pid_n = (t // SPLIT_A) % tiles_a
        pid_m = t // (SPLIT_A * tiles_a)
        stored = _lin._linear_tile(
            pid_n, pid_k, pid_m, tiles_a, m_tiles, x_ptr, wa_ptr, wsa_ptr, u_ptr, parta_ptr, cnta_ptr, u_ptr, x_ptr,
            x_ptr, M, NA, KA, KPS_A, 0.0, stride_xm, stride_wan, stride_wsan, stride_um, 0, 0, 0, 0,
            MODE, BLOCK_N, BLOCK_M, BLOCK_K, SPLIT_A, True, INTERPRET, QUANT_A, GROUP_NA, False, False, False, False,
            PDL, False, "")
        if stored:  # this tile of u is in memory: count it for the B split that reads it
            tl.debug_barrier()
            tl.atomic_add(ready + pid_m * SPLIT_B + (pid_n * BLOCK_N) // KPS_B, 1, sem="release", scope="gpu")
    else:
        tb = t - progs_a
        pid_n = tb % tiles_b
        pid_k = (tb // tiles_b) % SPLIT_B
        pid_m = tb // (tiles_b * SPLIT_B)
        flag = ready + pid_m * SPLIT_B + pid_k
        need = KPS_B // BLOCK_N
        seen = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        while seen < need:
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        _lin._linear_tile(
            pid_n, pid_k, pid_m, tiles_b, m_tiles, u_ptr, wb_ptr, wsb_ptr, y_ptr, partb_ptr, cntb_ptr, y_ptr, u_ptr,
            u_ptr, M, NB, NA, KPS_B, 0.0, stride_um, stride_wbn, stride_wsbn, stride_ym, 0, 0, 0, 0,
            MODE, BLOCK_N, BLOCK_M, BLOCK_K, SPLIT_B, True, INTERPRET, QUANT_B, NB, False, False, False, False,
            PDL, False, ".cg")
    tl.debug_barrier()
    done = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == total - 1:  # every program has finished: zero the counts for the next launch
        tl.store(sync_ptr, 0)
        tl.store(sync_ptr + 1, 0)
        r = tl.arange(0, READY)
        tl.store(ready + r, tl.zeros([READY], dtype=tl.int32), mask=r < m_tiles * SPLIT_B)


def pair_configs(M: int, NA: int, KA: int, NB: int, quantize_a: bool, quantize_b: bool):
    """(A's, B's) configurations, `linear_fp8`'s picks for each weight alone, or None when one
    launch cannot run both: their programs must share the loop's tiles, warps and stages (only
    the K split may differ), and B's K splits must be whole tiles of u."""
    ca = _lin.pick_config(M, NA, KA, quantize_a)
    cb = _lin.pick_config(M, NB, NA, quantize_b)
    same = all(getattr(ca, f) == getattr(cb, f) for f in ("mode", "block_n", "block_m", "block_k", "num_warps",
                                                           "num_stages"))
    kps_b = _lin._k_per_split(NA, cb)
    if not same or ca.mode != "f16" or kps_b % cb.block_n or NA % kps_b:
        return None
    return ca, cb


def linear_fp8_pair(x: torch.Tensor, wa: torch.Tensor, sa: torch.Tensor, wb: torch.Tensor, sb: torch.Tensor,
                    groups: int = 1, quantize_a: bool = True, quantize_b: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, groups * KA] bf16, wa e4m3 [NA, KA] + sa, wb e4m3 [NB, NA] + sb -> (u [M, NA], y [M, NB])
    bf16, the bits of `linear_fp8_pair_ref`. Needs `pair_configs` (V4-Flash's wo_a / wo_b have it)."""
    _lin._check_operands(x, wa, sa, torch.bfloat16)
    _lin._check_operands(x, wb, sb, torch.bfloat16)
    M = x.shape[0]
    NA, KA = wa.shape
    NB = wb.shape[0]
    assert x.dtype == torch.bfloat16 and x.stride(1) == 1 and x.shape[1] == groups * KA, (x.shape, x.dtype, groups)
    assert wb.shape[1] == NA, (wa.shape, wb.shape)
    assert groups == 1 or (NA % groups == 0 and (NA // groups) % _lin.BLOCK == 0), (NA, groups)
    cfgs = pair_configs(M, NA, KA, NB, quantize_a, quantize_b)
    assert cfgs is not None, "these two linears cannot share a launch (pair_configs)"
    ca, cb = cfgs
    u = torch.empty(M, NA, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(M, NB, dtype=torch.bfloat16, device=x.device)
    if M == 0:
        return u, y
    kps_a, kps_b = _lin._k_per_split(KA, ca), _lin._k_per_split(NA, cb)
    split_a, split_b = -(-KA // kps_a), -(-NA // kps_b)
    m_tiles = -(-M // ca.block_m)
    tiles_a, tiles_b = -(-NA // ca.block_n), -(-NB // cb.block_n)
    elems = ca.block_n * ca.block_m
    dev = x.device
    part_a = workspace(dev, "partials", split_a * tiles_a * m_tiles * elems, torch.float32)
    cnt_a = workspace(dev, "counters", tiles_a * m_tiles, torch.int32)
    part_b = workspace(dev, "partials_pair", split_b * tiles_b * m_tiles * elems, torch.float32)
    cnt_b = workspace(dev, "counters_pair", tiles_b * m_tiles, torch.int32)
    sync = workspace(dev, "counters_pair_sync", 2 + m_tiles * split_b, torch.int32)
    grid = (tiles_a * split_a * m_tiles + tiles_b * split_b * m_tiles,)
    opts = launch_opts(x, grid, wa.numel() + wb.numel())
    _linear_pair_kernel[grid](
        x, wa, sa.view(torch.uint8), u, part_a, cnt_a, wb, sb.view(torch.uint8), y, part_b, cnt_b, sync,
        M, NA, KA, kps_a, NB, kps_b,
        x.stride(0), wa.stride(0), sa.stride(0), u.stride(0), wb.stride(0), sb.stride(0), y.stride(0),
        MODE=_lin._MODES[ca.mode], BLOCK_N=ca.block_n, BLOCK_M=ca.block_m, BLOCK_K=ca.block_k, SPLIT_A=split_a,
        SPLIT_B=split_b, GROUP_NA=NA // groups, QUANT_A=quantize_a, QUANT_B=quantize_b,
        INTERPRET=on_interpreter(x), READY=next_pow2(m_tiles * split_b), num_warps=ca.num_warps,
        num_stages=ca.num_stages, **opts)
    return u, y


def linear_fp8_pair_ref(x, wa, sa, wb, sb, groups=1, quantize_a=True, quantize_b=True):
    """The two linears one after the other (torch twins): (u, y)."""
    u = _lin.linear_fp8_ref(x, wa, sa, quantize_act=quantize_a, groups=groups)
    return u, _lin.linear_fp8_ref(u, wb, sb, quantize_act=quantize_b)
