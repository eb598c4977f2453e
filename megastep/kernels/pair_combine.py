"""The routed experts' per-pair outputs summed in slot order, one launch: locally (`sum_pairs`) or
gathered from the ranks that computed them through peer-to-peer loads (`gather_sum_pairs`).

Shapes: pair outputs y [M*k, D] (row m*k + j: row m's j-th routed pair, x's dtype), expert ids
idx [M, k]; out fp32 [M, D] = ((y[m,0] + y[m,1]) + y[m,2]) + ... in fp32, exactly the additions of
`moe.sum_pairs` (the `*_ref` functions here), so the same y give the same bits.

Expert parallelism (runtime/distributed.py, `PeerPairs`): rank r of W owns experts
[r*E/W, (r+1)*E/W) and writes the outputs of its pairs into its own per-layer buffer, which every
rank can read over NVLink (symmetric memory). The combine kernel then
  1. signals (its first program): stores the step's epoch into flag [layer, r] of every rank
     (release, system scope);
  2. waits (every program) until its own flags [layer, p] hold the epoch for every rank p (acquire);
  3. reads pair (m, j) from the buffer of the rank that owns expert idx[m, j] and sums in slot order.
No pair is ever added to another rank's zeros or moved through an integer all-reduce: each value
arrives as its owner's bits, so the result equals the 1-rank sum bit for bit.

Why one buffer per layer is enough (with at least two MoE layers). A rank writes layer L's
buffer again in the next step only after passing the barrier of the layer before it, which every
peer reaches only after finishing its combine of layer L (kernels run in stream order). With one
layer that barrier would be layer L's own, and a fast rank could overwrite what a slow one still
reads: `PeerPairs` refuses that case. Flags hold the step's epoch (a device counter each rank
advances once per step), so they never need resetting.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megastep.kernels.common import launch_opts, next_pow2, on_interpreter, pdl_enter, round_bf16
from megastep.kernels.moe import sum_pairs as sum_pairs_ref  # the torch twin of `sum_pairs`


@triton.jit
def arrive_and_wait(flags_ptr, epoch_ptr, flag_off, rank, W: tl.constexpr):
    """The barrier of one combine call (module doc), run by every program of the launch. The first
    program announces this rank's arrival at every rank (itself included); then every program
    waits for every rank's. Blocks are dispatched in order, so the first one runs whatever the
    others do (the later ones spin, they never block it). Each poll is a system-scope acquire
    load, whose value the loop uses: a lone acquire after a relaxed polling loop (measured the
    same) is dropped as dead code by Triton 3.6."""
    epoch = tl.load(epoch_ptr)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        for p in tl.static_range(W):
            flags_p = tl.load(flags_ptr + p).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(flags_p + flag_off + rank, epoch, sem="release", scope="sys")
    mine = tl.load(flags_ptr + rank).to(tl.pointer_type(tl.int64))
    for p in tl.static_range(W):
        seen = tl.atomic_add(mine + flag_off + p, 0, sem="acquire", scope="sys")
        while seen < epoch:
            seen = tl.atomic_add(mine + flag_off + p, 0, sem="acquire", scope="sys")


@triton.jit
def peer_load(table_ptr, owner, off, mask, like_ptr, ALIGNED: tl.constexpr):
    """Elements `off` (element offsets from the base) of rank `owner`'s buffer, whose base address is
    table[owner], typed as like_ptr's elements. Another GPU wrote them during the caller's wait
    (arrive_and_wait): read past L1, which may hold the previous step's bytes (".cg"; Triton 3.6
    ignores ".cv" on vector loads). ALIGNED: the base is 16-byte aligned (host-checked), so the
    loads may be 16-byte vectors."""
    base = tl.load(table_ptr + owner).to(tl.pointer_type(like_ptr.dtype.element_ty))
    if ALIGNED:
        base = tl.multiple_of(base, 16)
    return tl.load(base + off, mask=mask, other=0.0, cache_modifier=".cg")


@triton.jit
def _pair_sum_kernel(y_ptr, table_ptr, idx_ptr, out_ptr, flags_ptr, epoch_ptr, sh_ptr, D, layer_off, flag_off, per,
                     rank, K: tl.constexpr, W: tl.constexpr, PEER: tl.constexpr, ALIGNED: tl.constexpr,
                     HAS_SHARED: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
                     BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    if PEER:
        arrive_and_wait(flags_ptr, epoch_ptr, flag_off, rank, W)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        row = (m * K + j).to(tl.int64) * D
        if PEER:
            owner = tl.load(idx_ptr + m * K + j) // per
            # rows start on 16 bytes when ALIGNED (their strides are host-checked)
            v = peer_load(table_ptr, owner, layer_off + row + offs, mask, y_ptr, ALIGNED).to(tl.float32)
        else:
            v = tl.load(y_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
        if j == 0:
            acc = v
        else:
            acc = acc + v
    if HAS_SHARED:  # the shared expert's output: w2's epilogue with the routed sum as residual
        acc = acc + tl.load(sh_ptr + m.to(tl.int64) * D + offs, mask=mask, other=0.0).to(tl.float32)
    if OUT_BF16:
        acc = round_bf16(acc, INTERPRET)
    tl.store(out_ptr + m.to(tl.int64) * D + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _block_d(D: int) -> int:
    return min(1024, next_pow2(D))


def _launch(y, table, idx, out, flags, epoch, shared, D, K, layer_off=0, flag_off=0, per=1, rank=0, world_size=1,
            peer=False, aligned=False):
    bd = min(1024, next_pow2(D))
    grid = (out.shape[0], triton.cdiv(D, bd))
    _pair_sum_kernel[grid](
        y, table, idx, out, flags, epoch, out if shared is None else shared, D, layer_off, flag_off, per, rank,
        K=K, W=world_size, PEER=peer, ALIGNED=aligned, HAS_SHARED=shared is not None,
        OUT_BF16=out.dtype == torch.bfloat16, INTERPRET=on_interpreter(y), BLOCK_D=bd, num_warps=4,
        **launch_opts(y, grid))


def sum_pairs(y: torch.Tensor) -> torch.Tensor:
    """Per-pair outputs y [M, k, D] -> fp32 [M, D], summed in slot order (`moe.sum_pairs`'s bits)."""
    assert y.dim() == 3 and y.is_contiguous(), (y.shape, y.stride())
    M, K, D = y.shape
    out = torch.empty(M, D, dtype=torch.float32, device=y.device)
    if M:  # the pointers the local sum does not read: y
        _launch(y, y, y, out, y, y, None, D, K)
    return out


def gather_sum_pairs(y_like: torch.Tensor, table: torch.Tensor, flags: torch.Tensor, epoch: torch.Tensor,
                     idx: torch.Tensor, *, layer_off: int, flag_off: int, per: int, rank: int,
                     world_size: int, shared: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [M, D]: pair (m, j) read from the buffer of the rank owning expert idx[m, j] and summed in
    slot order, after a barrier with every rank (module doc). With `shared` [M, D] (the shared
    expert's output, bf16 or fp32): that sum plus shared, rounded to shared's dtype, the bits of
    `linear_fp8(..., residual=<the sum>)` that it replaces (so w2 need not wait for the barrier).

    y_like: this rank's pair buffer (gives the dtype, device and D); table: int64 [W] the base
    address of every rank's buffer; flags: int64 [W] the base address of every rank's int64
    flags; epoch: int64 [1] this step's epoch (never wraps); idx [M, k] int; layer_off /
    flag_off: element offsets of this call's buffer and flags from the bases; per: experts per
    rank."""
    assert idx.dim() == 2 and idx.is_contiguous() and table.dtype == flags.dtype == torch.int64
    assert table.numel() == flags.numel() == world_size and epoch.dtype == torch.int64
    M, K = idx.shape
    D = y_like.shape[-1]
    if shared is not None:
        assert shared.shape == (M, D) and shared.is_contiguous(), (shared.shape, M, D)
    out = torch.empty(M, D, dtype=torch.float32 if shared is None else shared.dtype, device=y_like.device)
    if M:
        es = y_like.element_size()
        # every buffer base is 16-byte aligned here (torch and symmetric-memory allocations), so
        # rows are when the row and layer strides are
        aligned = (D * es) % 16 == 0 and (layer_off * es) % 16 == 0
        _launch(y_like, table, idx, out, flags, epoch, shared, D, K, layer_off, flag_off, per, rank, world_size,
                peer=True, aligned=aligned)
    return out


def gather_sum_pairs_ref(bufs: list[torch.Tensor], idx: torch.Tensor, per: int,
                         shared: torch.Tensor | None = None) -> torch.Tensor:
    """Torch twin of `gather_sum_pairs` without the barrier: bufs[r] is rank r's pair buffer
    [M*k, D]; pair (m, j) comes from bufs[idx[m, j] // per]."""
    M, K = idx.shape
    owner = (idx // per).reshape(-1).tolist()
    y = torch.stack([bufs[o][i] for i, o in enumerate(owner)]).view(M, K, -1)
    routed = sum_pairs_ref(y)
    return routed if shared is None else (routed + shared.float()).to(shared.dtype)
