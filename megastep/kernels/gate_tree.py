"""The MoE gate's logits with their sums in one fixed order: y [B, E] = x [B, K] @ w [E, K]^T in fp32.

Semantics (`gate_tree_ref`): x holds bf16 values and w is bf16, so every product x[b, k] w[e, k] is
exact in fp32; the only freedom left is the order of the sums. Here it is a pairwise tree over K:
the K products, padded with +0.0 to KP = next_pow2(K), summed elements 2i and 2i+1 at every level
(mhc's `_tree_1d`). The order names no tile, layout, split or row count, so every kernel that
follows it gives the same bits:
- `gate_tree` (this module), any number of rows;
- the gate programs of mhc's finish launch (`mhc_post_pre(..., gate=)`), which make a row's normed
  x themselves and its logits straight after it, so that at few rows the MoE sublayer's chain has
  no gate launch between the mHC and the routing (`fast.GATE_IN_MHC_ROWS`).
A row's logits are therefore the same whichever of the two made them and whatever the batch: the
step may switch between them by rows. The torch reference sums the same tree, so it gives the same
bits too (the tests compare bit for bit). Against `dense.linear_bf16` (split-K tensor-core sums) only
the order of the fp32 sums differs.

Kernel `_gate_tree_kernel`, grid (cdiv(B, BLOCK_B), E / BLOCK_E, SPLITS): a program takes BLOCK_B
rows x BLOCK_E experts x one of SPLITS aligned K slices (a subtree), walks its slice in CHUNK-wide
aligned blocks (subtrees again), sums each block's products by the tree, then the block sums by
the tree. With SPLITS > 1 the slices' sums go to an fp32 buffer and the last program of a tile to
arrive (an int32 arrival counter that it resets; no atomics on data) sums them by the tree.
Because aligned power-of-two blocks are subtrees, none of BLOCK_B, BLOCK_E, CHUNK or SPLITS
changes a bit, so the configuration may follow B (`pick_config`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megastep.kernels.common import launch_opts, next_pow2, pdl_enter, workspace

_COUNTERS = 1 << 12  # arrival counters kept per device (row tiles x expert tiles of every call)


@dataclass(frozen=True)
class GateTreeConfig:
    block_b: int  # rows per program
    block_e: int  # experts per program
    chunk: int  # K per loop step (an aligned subtree)
    splits: int  # programs along K (aligned subtrees), summed by the last to arrive
    num_warps: int = 4

    def check(self) -> None:
        for v in (self.block_b, self.block_e, self.chunk, self.splits):
            assert v >= 1 and v & (v - 1) == 0, self


def pick_config(B: int, E: int, K: int) -> GateTreeConfig:
    """The configuration for B rows (any choice gives the same bits): at few rows one row a program
    and K in 8 slices, so the weight is read by ~E / 16 x 8 programs at once; at more rows 16-row
    tiles, each expert tile's weight read once per row tile."""
    kp = next_pow2(K)
    block_e = min(16, next_pow2(E))
    block_b = min(16, next_pow2(B))
    chunk = min(kp, 64 if block_b <= 4 else 32)
    splits = max(1, min(8, kp // chunk))
    return GateTreeConfig(block_b, block_e, chunk, splits)


@triton.jit
def tree_last(x, R: tl.constexpr, N: tl.constexpr):
    """x [R, N] (N a power of two) -> [R]: each row summed as a pairwise tree, elements 2i and 2i+1
    at every level. Each step adds exactly two values, so the result does not depend on how x is
    laid out over threads; aligned power-of-two blocks are subtrees; zero padding changes nothing."""
    for i in tl.static_range(24):
        if (N >> i) > 2:
            x = tl.sum(tl.reshape(x, (R, N >> (i + 1), 2)), axis=2)
    return tl.sum(x, axis=1)  # the last two (or the only one)


@triton.jit
def _gate_tree_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr, B, E, K, K_SPLIT,
    stride_xb, stride_we, stride_ob,
    BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, NCS: tl.constexpr,
    SPLITS: tl.constexpr, PDL: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_e = tl.program_id(1)
    pid_k = tl.program_id(2)
    R: tl.constexpr = BLOCK_B * BLOCK_E
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    ex = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    r_ok = rows < B
    e_ok = ex < E
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xb
    w_rows = w_ptr + ex.to(tl.int64)[:, None] * stride_we
    pdl_enter(PDL)
    cidx = tl.arange(0, NCS)
    sums = tl.zeros([R, NCS], dtype=tl.float32)  # the CHUNK blocks' sums of this slice
    for c in range(NCS):
        k = pid_k * K_SPLIT + c * CHUNK + tl.arange(0, CHUNK)
        k_ok = k < K
        xv = tl.load(x_rows + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        wv = tl.load(w_rows + k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        p = tl.reshape(xv[:, None, :] * wv[None, :, :], (R, CHUNK))  # exact products, row-major (b, e)
        sums = tl.where(cidx[None, :] == c, tree_last(p, R, CHUNK)[:, None], sums)
    tot = tree_last(sums, R, NCS)  # [R]: this slice's subtree
    rr = tl.reshape(tl.broadcast_to(rows[:, None], (BLOCK_B, BLOCK_E)), (R,))
    ee = tl.reshape(tl.broadcast_to(ex[None, :], (BLOCK_B, BLOCK_E)), (R,))
    ok = (rr < B) & (ee < E)
    out_ptrs = out_ptr + rr.to(tl.int64) * stride_ob + ee
    if SPLITS == 1:
        tl.store(out_ptrs, tot, mask=ok)
    else:
        tile = pid_b * tl.num_programs(1) + pid_e
        base = part_ptr + tile.to(tl.int64) * (R * SPLITS)
        lanes = tl.arange(0, R)
        tl.store(base + lanes * SPLITS + pid_k, tot)
        tl.debug_barrier()  # every thread's sum is issued before the release below
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:  # last program of this tile: the slices' sums by the tree
            tl.debug_barrier()
            s = tl.arange(0, SPLITS)
            parts = tl.load(base + lanes[:, None] * SPLITS + s[None, :], cache_modifier=".cg")
            tl.store(out_ptrs, tree_last(parts, R, SPLITS), mask=ok)
            tl.store(cnt_ptr + tile, 0)


def gate_tree(x: torch.Tensor, w: torch.Tensor, config: GateTreeConfig | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, K] bf16 (or fp32 holding bf16 values), w [E, K] bf16 -> fp32 [B, E], the sums by the tree."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    assert x.dtype in (torch.bfloat16, torch.float32) and w.dtype == torch.bfloat16, (x.dtype, w.dtype)
    assert x.stride(1) == 1 and w.stride(1) == 1 and x.device == w.device
    B, K = x.shape
    E = w.shape[0]
    if out is None:
        out = torch.empty(B, E, dtype=torch.float32, device=x.device)
    assert out.shape == (B, E) and out.dtype == torch.float32 and out.stride(1) == 1, (out.shape, out.dtype)
    if B == 0 or E == 0:
        return out
    if K == 0:
        return out.zero_()
    cfg = config or pick_config(B, E, K)
    cfg.check()
    kp = next_pow2(K)
    splits = min(cfg.splits, max(1, kp // cfg.chunk))
    chunk = min(cfg.chunk, kp)
    k_split = kp // splits
    grid = (-(-B // cfg.block_b), -(-E // cfg.block_e), splits)
    tiles = grid[0] * grid[1]
    R = cfg.block_b * cfg.block_e
    if splits > 1:
        part = workspace(x.device, "gate_tree_part", tiles * R * splits, torch.float32)
        cnt = workspace(x.device, "counters_gate_tree", max(tiles, _COUNTERS), torch.int32)
    else:
        part = cnt = out  # unused
    _gate_tree_kernel[grid](
        x, w, out, part, cnt, B, E, K, k_split, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_B=cfg.block_b, BLOCK_E=cfg.block_e, CHUNK=chunk, NCS=k_split // chunk, SPLITS=splits,
        num_warps=cfg.num_warps, enable_fp_fusion=False, **launch_opts(x, grid),
    )
    return out


def gate_tree_ref(x: torch.Tensor, w: torch.Tensor, config: GateTreeConfig | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The exact semantics: the fp32 products (exact), padded with +0.0 to next_pow2(K), summed by
    the pairwise tree (torch adds each pair with one rounding: the kernel's bits)."""
    del config
    B, K = x.shape
    E = w.shape[0]
    p = x.float()[:, None, :] * w.float()[None, :, :]  # [B, E, K]
    kp = next_pow2(K)
    if kp > K:
        p = torch.cat([p, torch.zeros(B, E, kp - K, dtype=p.dtype, device=p.device)], dim=2)
    while p.shape[2] > 1:
        p = p[:, :, 0::2] + p[:, :, 1::2]
    y = p[:, :, 0]
    return y if out is None else out.copy_(y)
