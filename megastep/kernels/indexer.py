"""CSA indexer for decode: score every compressed entry of a row and keep the top k, in two
launches (instead of a gather copy of the keys and ~20 small torch ops).

Semantics (`indexer_topk_ref`: FastDecoder._indexer after q and the head-weight logits), per row b:
  w       = bf16(wl[b]) * (di^-0.5 * H^-0.5)                          fp32 [H]
  score_t = sum_h relu(q[b, h] . keys_pool[slots[b], t]) * w[h]        fp32, t < n = pool rows - 1
  visible = (pos[b] + 1) // ratio;  score_t = -inf for t >= visible
  idx     = the k = min(topk, n) largest scores, ids ascending;  ok = idx < visible
The pool's last row (the discard row) and rows >= visible are never read.

Kernel 1 (`_score_kernel`, grid (entry blocks / BLOCKS_PER_PROG, B)): reads the keys straight from
the pool by slot (no gather copy), q for all heads (padded to >= 16 with zero rows and zero
weights), one tensor-core dot per 64-entry block (bf16 operands: every product is exact in fp32,
fp32 accumulation; fp32 operands under the interpreter or for fp32 inputs), relu, times the head
weights, a sum over heads (tl.sum: a fixed tree order), -inf past `visible`. Blocks that hold no
visible entry only store -inf (their keys and q are not loaded). Scores go to an fp32 [B, n] buffer.

Kernel 2 (`_select_kernel`, one program per row): radix select on the order-preserving uint32
image of the fp32 scores (-0.0 is first folded into +0.0). Candidates are the entries
t < max(visible, k); invisible ones get the key 0, below every score (even -inf). The bits that
all candidate keys share (above the highest bit where their min and max differ) are skipped; then
passes of RADIX-bit histograms (`tl.histogram`, integer counts) narrow the prefix P of the k-th
largest key, until P is the whole key or every entry matching P is needed (usually after 2-4
passes). One ordered pass then writes every entry above P plus the lowest-index entries equal to
P until k are taken, compacted in ascending order by one packed prefix count (`tl.cumsum`). Up to
n = 16384 the row stays in registers (one load); longer rows are walked in blocks. O(n) per pass.
When visible <= k the answer is exactly 0..k-1: all visible entries, then the smallest invisible
ids (ok False). When visible > k no invisible entry is chosen.

What differs from torch:
- ties: among equal scores the lower entry id wins (torch.topk's choice among equal values is
  unspecified). With visible <= k, the invisible ids emitted are visible..k-1 (torch: any).
- the order of the fp32 sums (over di in the dot, over heads in the tree): a score may differ
  from torch's by a few ulps, so two entries whose scores are within a few ulps of each other at
  the k-th place may swap. Products are exact and, for the fp4-simulated q and keys of the model,
  the di sums are usually exact too; only the head sum rounds differently.
Scores must be finite (NaN sorts above +inf, as in torch.topk). Deterministic, batch invariant
(rows are independent; the configuration depends on (n, H, di) only), static grids and no host
sync: CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megastep.kernels.common import f32_order_key, launch_opts, next_pow2, on_interpreter, pdl_enter, round_bf16

CSA_RATIO = 4


@dataclass(frozen=True)
class IndexerConfig:
    block_n: int = 64  # entries per scoring dot
    blocks_per_prog: int = 1  # scoring blocks walked by one program
    score_warps: int = 4
    sel_block: int = 1024  # entries per step of the selection passes
    sel_warps: int = 4
    radix_bits: int = 5  # key bits resolved per selection pass (32 bins cost the same as 16)

    def check(self) -> None:
        assert self.block_n in (16, 32, 64, 128), self
        assert self.blocks_per_prog >= 1, self
        assert 16 <= self.sel_block <= 16384 and self.sel_block & (self.sel_block - 1) == 0, self
        assert 1 <= self.radix_bits <= 8, self


def pick_config(n: int, H: int, di: int) -> IndexerConfig:
    """The one configuration for (n, H, di); never depends on the batch. Scoring: 64-entry blocks,
    at most ~64 programs per row (long pools walk several blocks per program; the tile choice
    moved the time by < 5% in the sweep)."""
    del H, di
    blocks = -(-n // 64)
    per = 1
    while blocks > 64 * per:
        per *= 2
    sel = min(max(16, next_pow2(n)), 16384)  # the whole row in registers up to n = 16384
    # H200 sweep (benchmarks/kernels/indexer_check.py --sweep): n 1024 best at 8 warps (8.1 vs
    # 8.6 µs at 4, B = 1), n 16384 at 16; radix 5 bits best or within noise of 4 and 6
    warps = 4 if sel <= 256 else 8 if sel <= 8192 else 16
    return IndexerConfig(64, per, 4, sel, warps, 5)


@triton.jit
def _score_kernel(
    q_ptr, wl_ptr, pool_ptr, slot_ptr, pos_ptr, out_ptr,
    n, H, scale,
    stride_qb, stride_qh, stride_wb, stride_ps, stride_pn, stride_ob,
    DI: tl.constexpr, HP: tl.constexpr, BLOCK_N: tl.constexpr, PER: tl.constexpr, RATIO: tl.constexpr,
    DOT_F32: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    vis = tl.minimum(tl.maximum((tl.load(pos_ptr + b) + 1) // RATIO, 0), n)  # pos >= -1: floor == trunc
    first = pid * (PER * BLOCK_N)
    slot = tl.load(slot_ptr + b).to(tl.int64)  # issued beside pos: not behind the branch
    rows = tl.arange(0, BLOCK_N)
    out_row = out_ptr + b * stride_ob
    if first < vis:
        hh = tl.arange(0, HP)
        dd = tl.arange(0, DI)
        hm = hh < H
        q = tl.load(q_ptr + b * stride_qb + hh[:, None] * stride_qh + dd[None, :], mask=hm[:, None], other=0.0)
        w = round_bf16(tl.load(wl_ptr + b * stride_wb + hh, mask=hm, other=0.0).to(tl.float32), INTERPRET) * scale
        if DOT_F32:
            qt = tl.trans(q.to(tl.float32))
        else:
            qt = tl.trans(q.to(tl.bfloat16))
        keys_row = pool_ptr + slot * stride_ps
        for i in range(PER):
            offs = first + i * BLOCK_N + rows
            lm = offs < vis
            k = tl.load(keys_row + offs.to(tl.int64)[:, None] * stride_pn + dd[None, :], mask=lm[:, None], other=0.0)
            if DOT_F32:
                s = tl.dot(k.to(tl.float32), qt, input_precision="ieee")  # [BLOCK_N, HP]
            else:
                s = tl.dot(k.to(tl.bfloat16), qt)
            sc = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1)
            sc = tl.where(lm, sc, float("-inf"))
            tl.store(out_row + offs, sc, mask=offs < n)
    else:
        for i in range(PER):
            offs = first + i * BLOCK_N + rows
            tl.store(out_row + offs, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=offs < n)


@triton.jit
def _ordered_key(s_ptr, offs, vis, m):
    """Scores -> (uint32 keys in the order of the fp32 values, -0.0 counted as +0.0; candidate
    mask offs < m). Entries at or past `vis` get the key 0, below every score (-inf: 0x007FFFFF)."""
    key = f32_order_key(tl.load(s_ptr + offs, mask=offs < vis, other=0.0))
    return tl.where(offs < vis, key, tl.zeros_like(key)), offs < m


@triton.jit
def _shr(key, s):
    """key >> s for a run-time s in 1..32 (a shift by 32 is undefined in one step)."""
    return (key >> (s - 1)) >> 1


@triton.jit
def _radix_hist(key, live, P, s, s_new, NB: tl.constexpr):
    """Histogram (NB bins) of the key bits [s_new, s) over the live entries whose bits above s equal P."""
    match = live & (_shr(key, s) == P)
    digit = ((key >> s_new) & ((1 << (s - s_new)) - 1)).to(tl.int32)
    return tl.histogram(digit, NB, mask=match).to(tl.int32)


@triton.jit
def _digit_combine(n1, a1, g1, n2, a2, g2):
    return n1 + n2, tl.maximum(a1, a2), tl.minimum(g1, g2)


@triton.jit
def _minmax_combine(h1, l1, h2, l2):
    return tl.maximum(h1, h2), tl.minimum(l1, l2)


@triton.jit
def _compact(idx_row, ok_row, key, live, offs, vis, P, s, rem, taken, eq_seen):
    """Writes the selected entries of one block in ascending order: keys whose bits above s exceed
    P, then entries equal to P while fewer than rem of those were taken. One packed prefix count
    gives both running counts (block <= 2^14: no overflow). Returns that packed count (its max:
    the block's greater and equal totals)."""
    top = tl.where(s > 0, _shr(key, tl.maximum(s, 1)), key)
    gt = live & (top > P)
    eq = live & (top == P)
    c = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), axis=0)
    c_gt = c & 0xFFFF
    c_eq = c >> 16
    sel = gt | (eq & (eq_seen + c_eq <= rem))
    slot = taken + c_gt + tl.minimum(eq_seen + c_eq, rem) - tl.minimum(eq_seen, rem) - 1
    tl.store(idx_row + slot, offs.to(tl.int64), mask=sel)
    tl.store(ok_row + slot, (offs < vis).to(tl.uint8), mask=sel)
    return c


@triton.jit
def _select_kernel(s_ptr, pos_ptr, idx_ptr, ok_ptr, n, K, stride_sb, stride_ib, stride_okb,
                   RATIO: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, RADIX: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    vis = tl.minimum(tl.maximum((tl.load(pos_ptr + b) + 1) // RATIO, 0), n).to(tl.int32)
    m = tl.maximum(vis, K)  # candidates: entries < m (K <= n)
    s_row = s_ptr + b * stride_sb
    idx_row = idx_ptr + b * stride_ib
    ok_row = ok_ptr + b * stride_okb
    offs0 = tl.arange(0, BLOCK)
    # the common prefix of all candidate keys: the bits above the highest bit where min and max differ
    if ONE_BLOCK:  # the row stays in registers for every pass
        key0, live0 = _ordered_key(s_row, offs0, vis, m)
        hi, lo = tl.reduce((tl.where(live0, key0, 0), tl.where(live0, key0, 0xFFFFFFFF)), 0, _minmax_combine)
    else:
        hi = tl.zeros([], dtype=tl.uint32)
        lo = tl.full([], 0xFFFFFFFF, tl.uint32)
        for start in range(0, m, BLOCK):
            key, live = _ordered_key(s_row, start + offs0, vis, m)
            bh, bl = tl.reduce((tl.where(live, key, 0), tl.where(live, key, 0xFFFFFFFF)), 0, _minmax_combine)
            hi = tl.maximum(hi, bh)
            lo = tl.minimum(lo, bl)
    x = hi ^ lo
    s = tl.zeros([], dtype=tl.int32)  # number of bits below the prefix: highest set bit of x, plus 1
    for step in tl.static_range(4, -1, -1):  # shifts 16, 8, 4, 2, 1
        up = (x >> (1 << step)) != 0
        s += tl.where(up, 1 << step, 0)
        x = tl.where(up, x >> (1 << step), x)
    s = tl.where(x != 0, s + 1, 0)
    P = tl.where(s > 0, _shr(hi, tl.maximum(s, 1)), hi)
    # radix select, RADIX bits per pass from the top: narrow the prefix P of the K-th largest key
    # until it is exact (s == 0) or every entry matching it is taken (cnt == rem)
    NB: tl.constexpr = max(32, 1 << RADIX)
    rem = K + 0 * m  # entries still to take among those matching P
    cnt = m  # candidates matching P
    while (s > 0) & (cnt > rem):
        s_new = tl.maximum(s - RADIX, 0)
        if ONE_BLOCK:
            hist = _radix_hist(key0, live0, P, s, s_new, NB)
        else:
            hist = tl.zeros([NB], dtype=tl.int32)
            for start in range(0, m, BLOCK):
                key, live = _ordered_key(s_row, start + offs0, vis, m)
                hist += _radix_hist(key, live, P, s, s_new, NB)
        ge = tl.cumsum(hist, axis=0, reverse=True)  # matching entries with digit >= bin (non-increasing)
        big = ge >= rem
        nd, above, ge_d = tl.reduce((big.to(tl.int32), tl.where(big, 0, ge), tl.where(big, ge, 2147483647)), 0,
                                    _digit_combine)
        # digit d = nd - 1; `above` entries lie in higher bins; ge_d - above match the new prefix
        cnt = ge_d - above
        rem = rem - above
        P = (P << (s - s_new)) | (nd - 1).to(tl.uint32)
        s = s_new
    if ONE_BLOCK:
        _compact(idx_row, ok_row, key0, live0, offs0, vis, P, s, rem, 0, 0)
    else:
        taken = 0
        eq_seen = 0
        for start in range(0, m, BLOCK):
            offs = start + offs0
            key, live = _ordered_key(s_row, offs, vis, m)
            last = tl.max(_compact(idx_row, ok_row, key, live, offs, vis, P, s, rem, taken, eq_seen), axis=0)
            taken += (last & 0xFFFF) + tl.minimum(eq_seen + (last >> 16), rem) - tl.minimum(eq_seen, rem)
            eq_seen += last >> 16


def _check_inputs(q, wl, keys_pool, slots, pos):
    assert q.dim() == 3 and keys_pool.dim() == 3, (q.shape, keys_pool.shape)
    B, H, di = q.shape
    assert keys_pool.shape[2] == di and keys_pool.shape[1] >= 2, (q.shape, keys_pool.shape)
    assert di >= 16 and di & (di - 1) == 0, di
    assert q.dtype in (torch.bfloat16, torch.float32) and keys_pool.dtype in (torch.bfloat16, torch.float32)
    assert q.stride(2) == 1 and keys_pool.stride(2) == 1, (q.stride(), keys_pool.stride())
    assert wl.shape == (B, H) and wl.dtype in (torch.float32, torch.bfloat16) and wl.stride(1) == 1, (wl.shape, wl.dtype)
    assert slots.shape == (B,) and pos.shape == (B,), (slots.shape, pos.shape)
    assert slots.dtype in (torch.int64, torch.int32) and pos.dtype in (torch.int64, torch.int32)
    for t in (wl, keys_pool, slots, pos):
        assert t.device == q.device, (t.device, q.device)
    return B, H, di, keys_pool.shape[1] - 1


def indexer_scores(q: torch.Tensor, wl: torch.Tensor, keys_pool: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                   ratio: int = CSA_RATIO, config: IndexerConfig | None = None) -> torch.Tensor:
    """q [B, H, di] bf16, wl [B, H] f32 (head-weight logits before the bf16 rounding), keys_pool
    [S, n+1, di] bf16 (last row: discard), slots, pos int [B] -> scores f32 [B, n], -inf past visible."""
    B, H, di, n = _check_inputs(q, wl, keys_pool, slots, pos)
    cfg = config or pick_config(n, H, di)
    cfg.check()
    out = torch.empty(B, n, dtype=torch.float32, device=q.device)
    if B == 0:
        return out
    slots, pos = slots.contiguous(), pos.contiguous()
    interp = on_interpreter(q)
    grid = (-(-n // (cfg.block_n * cfg.blocks_per_prog)), B)
    _score_kernel[grid](
        q, wl, keys_pool, slots, pos, out, n, H, float(di**-0.5 * H**-0.5),
        q.stride(0), q.stride(1), wl.stride(0), keys_pool.stride(0), keys_pool.stride(1), out.stride(0),
        DI=di, HP=max(16, next_pow2(H)), BLOCK_N=cfg.block_n, PER=cfg.blocks_per_prog, RATIO=ratio,
        DOT_F32=interp or q.dtype != torch.bfloat16 or keys_pool.dtype != torch.bfloat16, INTERPRET=interp,
        num_warps=cfg.score_warps, **launch_opts(q, grid),
    )
    return out


def indexer_topk(q: torch.Tensor, wl: torch.Tensor, keys_pool: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                 topk: int, ratio: int = CSA_RATIO, config: IndexerConfig | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (idx int64 [B, k] ascending, ok bool [B, k]) with k = min(topk, n); see the module doc."""
    B, H, di, n = _check_inputs(q, wl, keys_pool, slots, pos)
    cfg = config or pick_config(n, H, di)
    k = min(int(topk), n)
    assert k >= 1, topk
    scores = indexer_scores(q, wl, keys_pool, slots, pos, ratio, cfg)
    idx = torch.empty(B, k, dtype=torch.int64, device=q.device)
    ok = torch.empty(B, k, dtype=torch.bool, device=q.device)
    if B == 0:
        return idx, ok
    grid = (B,)
    _select_kernel[grid](
        scores, pos.contiguous(), idx, ok.view(torch.uint8), n, k, scores.stride(0), idx.stride(0), ok.stride(0),
        RATIO=ratio, BLOCK=cfg.sel_block, ONE_BLOCK=cfg.sel_block >= n, RADIX=cfg.radix_bits,
        num_warps=cfg.sel_warps, **launch_opts(scores, grid),
    )
    return idx, ok


def indexer_scores_ref(q, wl, keys_pool, slots, pos, ratio=CSA_RATIO, config=None):
    """FastDecoder._indexer's scores (its code): f32 [B, n], -inf past visible."""
    del config
    H, di = q.shape[1], q.shape[2]
    w = wl.to(torch.bfloat16).float() * (di**-0.5 * H**-0.5)
    n = keys_pool.shape[1] - 1
    keys = keys_pool[slots, :n]
    scores = (torch.relu(q.float() @ keys.float().transpose(1, 2)) * w[..., None]).sum(1)
    visible = (pos + 1) // ratio
    return scores.masked_fill(torch.arange(n, device=q.device)[None] >= visible[:, None], float("-inf"))


def indexer_topk_ref(q, wl, keys_pool, slots, pos, topk, ratio=CSA_RATIO, config=None):
    """FastDecoder._indexer's selection (its code) -> (idx int64 ascending, ok bool)."""
    scores = indexer_scores_ref(q, wl, keys_pool, slots, pos, ratio, config)
    n = scores.shape[1]
    idx = scores.topk(min(topk, n), dim=-1).indices.sort(-1).values
    return idx, idx < ((pos + 1) // ratio)[:, None]
