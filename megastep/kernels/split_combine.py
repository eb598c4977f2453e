"""A linear's split-K partials summed in split order and rounded, one launch: locally (`sum_splits`)
or gathered from the ranks that computed them through peer-to-peer loads (`gather_sum_splits`).

Shapes: partials p [S, M, N] fp32 (`linear_fp8.linear_fp8_splits`); out [M, N] =
rnd(((p[0] + p[1]) + p[2]) + ... + p[S-1]) with rnd the rounding to out's dtype: the additions and
the rounding of `linear_fp8`'s ordered split-K sum and plain epilogue, so the same partials give
the full launch's bits.

Tensor parallelism (runtime/distributed.py, `PeerSplits`; the attention's heads split over the
ranks): rank r of W holds columns [r*K/W, (r+1)*K/W) of wo_b, computes the partials of splits
[r*S/W, (r+1)*S/W) into its own per-layer buffer [S/W, M, N] in symmetric memory, and this kernel
  1. signals and waits with every rank, the pair combine's barrier (pair_combine.arrive_and_wait);
  2. reads split s from rank s // (S/W) (local or over NVLink) and sums in order 0..S-1.
Every value arrives as its owner's bits, so each rank gets the 1-GPU output bit for bit. One buffer
per layer is safe for the reason the pair combine's is (its module doc): with at least two layers, a
rank writes layer L's buffer again only after a barrier that every peer reaches after its combine
of layer L.

`gather_cols` (the lm head's vocabulary split over the ranks, `PeerCols`): rank r computes logit
columns [r*V/W, (r+1)*V/W) into its buffer [M_max, V/W]; after the same barrier every rank copies
every rank's columns into the full [M, V]. Its one buffer is safe because a rank writes it again
only in the next step, after the MoE combine of that step's first layer, which every peer reaches
after its gather of this step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megastep.kernels.common import launch_opts, next_pow2, on_interpreter, pdl_enter, round_bf16
from megastep.kernels.pair_combine import arrive_and_wait, peer_load


@triton.jit
def _split_sum_kernel(p_ptr, table_ptr, out_ptr, flags_ptr, epoch_ptr, N, stride_s, stride_m, buf_off, flag_off, rank,
                      S: tl.constexpr, PER: tl.constexpr, W: tl.constexpr, PEER: tl.constexpr,
                      OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    if PEER:
        arrive_and_wait(flags_ptr, epoch_ptr, flag_off, rank, W)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(S):
        row = (s % PER) * stride_s + m.to(tl.int64) * stride_m
        if PEER:
            v = peer_load(table_ptr, s // PER, buf_off + row + offs, mask, p_ptr, False)
        else:
            v = tl.load(p_ptr + row + offs, mask=mask, other=0.0)
        if s == 0:
            acc = v
        else:
            acc = acc + v
    if OUT_BF16:
        acc = round_bf16(acc, INTERPRET)
    tl.store(out_ptr + m.to(tl.int64) * N + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Columns per program of the split sum (a power of two): it changes no bits, only how many programs
# share the latency of the S dependent loads (at 1 row and N 4096, 1024 gives 4 programs).
BLOCK_COLS = 1024


def _launch(p, table, out, flags, epoch, S, per, stride_s, stride_m, buf_off=0, flag_off=0, rank=0, world_size=1,
            peer=False):
    M, N = out.shape
    bn = min(BLOCK_COLS, next_pow2(N))
    grid = (M, triton.cdiv(N, bn))
    _split_sum_kernel[grid](
        p, table, out, flags, epoch, N, stride_s, stride_m, buf_off, flag_off, rank,
        S=S, PER=per, W=world_size, PEER=peer, OUT_BF16=out.dtype == torch.bfloat16, INTERPRET=on_interpreter(p),
        BLOCK_N=bn, num_warps=4, **launch_opts(p, grid))


def sum_splits(p: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Partials p [S, M, N] fp32 -> [M, N] out_dtype, summed in split order and rounded once."""
    assert p.dim() == 3 and p.dtype == torch.float32 and p.stride(2) == 1, (p.shape, p.dtype, p.stride())
    S, M, N = p.shape
    out = torch.empty(M, N, dtype=out_dtype, device=p.device)
    if M and N:  # the pointers the local sum does not read: p
        _launch(p, p, out, p, p, S, S, p.stride(0), p.stride(1))
    return out


def gather_sum_splits(p_like: torch.Tensor, table: torch.Tensor, flags: torch.Tensor, epoch: torch.Tensor, M: int,
                      *, buf_off: int, flag_off: int, rank: int, world_size: int,
                      out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[M, N] out_dtype: split s read from the buffer of rank s // (S/W) and summed in split order,
    after a barrier with every rank (module doc).

    p_like: this rank's buffer of one layer, fp32 [S/W, M_max, N] (gives S/W, the strides and N;
    rows 0..M-1 are read); table: int64 [W] every rank's buffer base address; flags: int64 [W]
    every rank's flags base address; epoch: int64 [1] this step's epoch; buf_off / flag_off:
    element offsets of this call's buffer and flags from the bases."""
    assert p_like.dim() == 3 and p_like.dtype == torch.float32 and p_like.stride(2) == 1, (p_like.shape, p_like.dtype)
    assert table.dtype == flags.dtype == epoch.dtype == torch.int64
    assert table.numel() == flags.numel() == world_size
    per, M_max, N = p_like.shape
    assert 0 <= M <= M_max, (M, M_max)
    out = torch.empty(M, N, dtype=out_dtype, device=p_like.device)
    if M:
        _launch(p_like, table, out, flags, epoch, per * world_size, per, p_like.stride(0), p_like.stride(1),
                buf_off, flag_off, rank, world_size, peer=True)
    return out


@triton.jit
def _gather_cols_kernel(table_ptr, out_ptr, flags_ptr, epoch_ptr, NL, stride_m, flag_off, rank, W: tl.constexpr,
                        BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    m = tl.program_id(0)
    owner = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < NL
    arrive_and_wait(flags_ptr, epoch_ptr, flag_off, rank, W)
    v = peer_load(table_ptr, owner, m.to(tl.int64) * stride_m + offs, mask, out_ptr, False)
    tl.store(out_ptr + m.to(tl.int64) * NL * W + owner * NL + offs, v, mask=mask)


def gather_cols(buf_like: torch.Tensor, table: torch.Tensor, flags: torch.Tensor, epoch: torch.Tensor, M: int, *,
                flag_off: int, rank: int, world_size: int) -> torch.Tensor:
    """[M, W*NL]: rows 0..M-1 of every rank's buffer [M_max, NL] side by side (rank r's at columns
    [r*NL, (r+1)*NL)), after a barrier with every rank (module doc). buf_like: this rank's buffer
    (gives the dtype, NL and the row stride); table, flags, epoch: as in `gather_sum_splits`."""
    assert buf_like.dim() == 2 and buf_like.stride(1) == 1, (buf_like.shape, buf_like.stride())
    assert table.dtype == flags.dtype == epoch.dtype == torch.int64
    assert table.numel() == flags.numel() == world_size
    M_max, NL = buf_like.shape
    assert 0 <= M <= M_max, (M, M_max)
    out = torch.empty(M, world_size * NL, dtype=buf_like.dtype, device=buf_like.device)
    if M and NL:
        bn = min(4096, next_pow2(NL))
        grid = (M, world_size, triton.cdiv(NL, bn))
        _gather_cols_kernel[grid](table, out, flags, epoch, NL, buf_like.stride(0), flag_off, rank, W=world_size,
                                  BLOCK_N=bn, num_warps=8, **launch_opts(buf_like, grid))
    return out


def gather_cols_ref(bufs: list[torch.Tensor], M: int) -> torch.Tensor:
    """Torch twin of `gather_cols` without the barrier: bufs[r] is rank r's buffer."""
    return torch.cat([b[:M] for b in bufs], dim=1)


def sum_splits_ref(p: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Torch twin of `sum_splits` (the same additions in the same order: the same bits)."""
    acc = p[0].clone()
    for s in range(1, p.shape[0]):
        acc += p[s]
    return acc.to(out_dtype)
