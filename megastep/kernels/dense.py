"""BF16-weight linear for decode (small M) with fp32 accumulation: y = x @ w^T.

Semantics (`linear_bf16_ref`): `x.float() @ w.float().T`, rounded once to `out_dtype`. Used for
the weights the checkpoint keeps in BF16 and the model multiplies in fp32: the compressors'
wkv / wgate, the router gate, the indexer's weights_proj and the lm head. x holds bf16 values
(bf16, or fp32 holding bf16-exact values), so every product is exact in fp32 and the kernel
differs from the ref only in the order of the fp32 sums.

The kernel streams the weight once. A program owns BLOCK_N output channels x BLOCK_M = 16 rows
x a contiguous K slice (split-K), multiplies on tensor cores (bf16 operands, fp32 accumulator;
fp32 operands of the same values under the interpreter). Split-K partials go to an fp32 buffer;
the last program of a tile to arrive (an int32 arrival counter that the last one resets; no
atomics on data) sums them in split order 0..S-1. For M > 16 the row tiles of one weight tile
are neighbouring program ids, so the weight comes from HBM once and from L2 after that.

Batch invariance: the configuration depends on (N, K) only, never on M, and rows of a tile are
independent (a tensor-core dot computes each output from its own row), so a row's result is
bit-identical whatever the number of rows in the call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megastep.kernels.common import (
    l2_prefetch_rows,
    launch_opts,
    on_interpreter,
    pdl_enter,
    pdl_release,
    prefetch_lines,
    round_bf16,
    workspace,
)

BLOCK_M = 16  # rows per program: fixed for every shape (batch invariance)
_TARGET_PROGRAMS = 264  # two per SM on an H200
_COUNTERS = 1 << 14  # arrival counters kept per device (enough for every decode shape)


@dataclass(frozen=True)
class DenseConfig:
    block_n: int  # output channels per program
    block_k: int  # K per loop step
    split_k: int  # programs along K, reduced in fixed order
    num_warps: int = 4
    num_stages: int = 3

    def check(self) -> None:
        assert self.block_n in (16, 32, 64, 128), self
        assert self.block_k in (32, 64, 128, 256), self
        assert self.split_k >= 1, self


# Pinned per (N, K) for the V4-Flash shapes (benchmarks/kernels/tune.py --only dense --write rewrites
# this table). The lm head's (129280 x 4096, 2020 column tiles) follows what linear_fp8 measured for
# the same bytes per step. An HCA layer's compressor projection (1024 x 4096) is tune_dense.py's
# winner on one H200 (docs/PERFORMANCE.md, twenty-fourth measurement): us per call at 1 / 64 rows
# 6.28 / 10.09 against the rule's 7.24 / 13.76. A CSA layer's (2624 x 4096) keeps the rule's (9.33 us
# at 1 row, 2.3 TB/s: no candidate beat it). The router's gate (256 x 4096) keeps the rule's too:
# its sweep winner (bn 32, bk 256, split 16: 4.25 us against 5.85 at 1 row, the fastest alone at 1,
# 8, 16 and 64 rows) made the 30-layer step slower at 8 and 16 rows, where the shared expert's
# launches run beside the gate. p50 ms at 1 / 8 / 16 / 64 rows, one call (twenty-fifth measurement):
# neither pin 4.522 / 11.134 / 16.571 / 48.133 (A/B means), the HCA pin 4.504 / 11.206 / 16.579 /
# 48.006, the gate pin 4.490 / 11.387 / 16.764 / 47.790, both 4.499 / 11.444 / 16.805 / 47.746.
# (tune_dense.py reports the gate and never pins it: STEP_KEEPS.)
_PINNED: dict[tuple[int, int], DenseConfig] = {
    (1024, 4096): DenseConfig(block_n=32, block_k=128, split_k=8, num_warps=4, num_stages=3),
    (129280, 4096): DenseConfig(block_n=64, block_k=64, split_k=1, num_warps=4, num_stages=4),
}


def pick_config(N: int, K: int) -> DenseConfig:
    """The one configuration for this weight shape; it never depends on M. Split-K: the largest
    power of two that keeps N tiles x splits <= two programs per SM and one K step per split."""
    cfg = _PINNED.get((N, K))
    if cfg is not None:
        return cfg
    bn = 64 if N >= 512 else 32 if N >= 32 else 16
    bk = 128
    tiles = -(-N // bn)
    steps = -(-K // bk)
    split = 1
    while tiles * split * 2 <= _TARGET_PROGRAMS and split * 2 <= steps:
        split *= 2
    return DenseConfig(bn, bk if split > 1 else 64, split, num_warps=4, num_stages=3)


@triton.jit
def _linear_bf16_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_wn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
    PREFETCH_LINES: tl.constexpr, GROUP: tl.constexpr = 4,
):
    pid_m = tl.program_id(0)  # fastest: the row tiles of one weight tile run side by side
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if PREFETCH_LINES:  # (PDL) the first weight lines, while the previous kernel drains
        l2_prefetch_rows(w_ptr, pid_n * BLOCK_N, N, stride_wn, pid_k, K_PER_SPLIT, K, BLOCK_N, PREFETCH_LINES)
    pdl_enter(PDL)
    bf16_tile(x_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_om,
              pid_m, pid_n, pid_k, tl.num_programs(0), tl.num_programs(0) * tl.num_programs(1),
              BLOCK_N, BLOCK_M, BLOCK_K, SPLIT_K, OUT_BF16, INTERPRET, PDL, GROUP)


@triton.jit
def bf16_tile(x_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_om,
              pid_m, pid_n, pid_k, m_tiles, tiles,
              BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
              OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr, GROUP: tl.constexpr):
    """The work of one program of `_linear_bf16_kernel` (row tile pid_m of m_tiles, column tile
    pid_n, K split pid_k; `tiles` = m_tiles x column tiles), for any kernel that computes the same
    output the same way (router.gate_route_group): the same sums, so the same bits. Returns
    whether this program stored its tile's output (the last split to arrive, or no split)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if INTERPRET:
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)))
        else:
            acc += tl.dot(w, tl.trans(x.to(tl.bfloat16)))
    pdl_release(PDL)  # every weight byte of this program is read

    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    out_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1:
        if OUT_BF16:
            acc = round_bf16(acc, INTERPRET)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        done = True
    else:
        tile = pid_n * m_tiles + pid_m
        tile_elems = BLOCK_N * BLOCK_M
        split_stride = tiles * tile_elems
        p_off = tile * tile_elems + tl.arange(0, BLOCK_M)[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        tl.store(part_ptr + pid_k * split_stride + p_off, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is issued before the release below
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        done = arrived == SPLIT_K - 1
        if done:  # last program of this tile: fixed-order sum
            tl.debug_barrier()
            # splits in order 0..S-1, loaded GROUP at a time (all in flight, few registers)
            tot = tl.load(part_ptr + p_off, mask=out_mask, other=0.0, cache_modifier=".cg")
            for g in range(1, SPLIT_K, GROUP):
                for i in tl.static_range(GROUP):
                    ok = out_mask & ((p_off * 0 + (g + i)) < SPLIT_K)
                    tot += tl.load(part_ptr + (g + i) * split_stride + p_off, mask=ok, other=0.0, cache_modifier=".cg")
            if OUT_BF16:
                tot = round_bf16(tot, INTERPRET)
            tl.store(out_ptrs, tot.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.store(cnt_ptr + tile, 0)
    return done


def split_plan(K: int, cfg: DenseConfig) -> tuple[int, int]:
    """(splits, K per split) of `cfg` for K: whole BLOCK_K steps per split, no empty split."""
    steps = -(-K // cfg.block_k)
    split = min(cfg.split_k, steps)
    k_per_split = -(-steps // split) * cfg.block_k
    return -(-K // k_per_split), k_per_split


def linear_bf16(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                config: DenseConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16 (or fp32 holding bf16 values), w [N, K] bf16 -> x @ w^T [M, N] (fp32 sums),
    or into `out` ([M, N] of out_dtype, unit stride along N)."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    assert x.dtype in (torch.bfloat16, torch.float32), x.dtype
    assert w.dtype == torch.bfloat16, w.dtype
    assert out_dtype in (torch.float32, torch.bfloat16), out_dtype
    assert x.stride(1) == 1 and w.stride(1) == 1
    assert x.device == w.device
    M, K = x.shape
    N = w.shape[0]
    cfg = config or pick_config(N, K)
    cfg.check()
    if out is None:
        out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    assert out.shape == (M, N) and out.dtype == out_dtype and out.stride(1) == 1, (out.shape, out.dtype, out.stride())
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    split, k_per_split = split_plan(K, cfg)
    grid = (-(-M // BLOCK_M), -(-N // cfg.block_n), split)
    tiles = grid[0] * grid[1]
    if split > 1:
        part = torch.empty(split * tiles * cfg.block_n * BLOCK_M, dtype=torch.float32, device=x.device)
        cnt = workspace(x.device, "counters_dense", max(tiles, _COUNTERS), torch.int32)
    else:
        part = cnt = out  # unused
    opts = launch_opts(x, grid)
    _linear_bf16_kernel[grid](
        x, w, out, part, cnt, M, N, K, k_per_split,
        x.stride(0), w.stride(0), out.stride(0),
        BLOCK_N=cfg.block_n, BLOCK_M=BLOCK_M, BLOCK_K=cfg.block_k, SPLIT_K=split,
        OUT_BF16=out_dtype == torch.bfloat16, INTERPRET=on_interpreter(x),
        PREFETCH_LINES=prefetch_lines(opts, k_per_split * w.element_size()),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **opts,
    )
    return out


def linear_bf16_ref(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                    config: DenseConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The exact semantics: fp32 product of the fp32 values, one rounding to out_dtype."""
    del config
    y = (x.float() @ w.float().T).to(out_dtype)
    return y if out is None else out.copy_(y)
