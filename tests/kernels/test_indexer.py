"""indexer_topk / indexer_scores against their refs (FastDecoder._indexer's torch code): visible
below, at and above k, none visible, pools whose invisible and discard rows hold large values,
every configuration path (several blocks per scoring program, several selection steps), the tie
rule, determinism and batch invariance.

Tolerances (why): scores differ from torch's only by the order of the fp32 sums (di in the dot,
heads in a tree): a few ulps of the largest head term. The selected ids must be identical: random
continuous inputs have no two scores within a few ulps of each other at the k-th place. Ties are
tested on integer inputs, where every score is exact in any order, against a stable-sort rule
(equal scores: the lower entry id first).
"""

import importlib
import os
import sys

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    for _m in ("megastep.kernels.indexer",):  # imported before the interpreter was set
        if _m in sys.modules:
            importlib.reload(sys.modules[_m])

from megastep.kernels.indexer import (  # noqa: E402
    IndexerConfig, indexer_scores, indexer_scores_ref, indexer_topk, indexer_topk_ref, pick_config,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
RATIO = 4


def make(B, H, di, n, S, seed, integer=False, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    if integer:  # small integers: every product and sum exact, many exact ties
        q = torch.randint(-3, 4, (B, H, di), generator=g).float()
        pool = torch.randint(-3, 4, (S, n + 1, di), generator=g).float()
        wl = torch.randint(-4, 5, (B, H), generator=g).float()
    else:
        q = torch.randn(B, H, di, generator=g)
        pool = torch.randn(S, n + 1, di, generator=g)
        wl = torch.randn(B, H, generator=g)
        # head 0 scores every entry with a distinct positive term: no exact ties (relu zeros on
        # every head would tie at 0.0)
        pool[..., 0] = 1 + pool[..., 0].abs()
        q[:, 0] = 0
        q[:, 0, 0] = 1
        wl[:, 0] = wl[:, 0].abs() + 0.5
    pool[:, n] = 1e4  # the discard row: would win every selection if it were read
    slots = torch.randint(0, S, (B,), generator=g)
    return q.to(dtype).to(DEV), wl.to(DEV), pool.to(dtype).to(DEV), slots.to(DEV)


def poison_invisible(pool, slots, pos):
    """Entries past `visible` get large random keys: they would be chosen if the kernel scored them.
    (A slot shared by rows is poisoned past the smallest visible: other rows see those entries.)"""
    pool = pool.clone()
    n = pool.shape[1] - 1
    g = torch.Generator().manual_seed(n)
    for s, p in zip(slots.tolist(), pos.tolist()):
        v = max(0, min(n, (p + 1) // RATIO))
        pool[s, v:n] = (20 + 10 * torch.rand(n - v, pool.shape[2], generator=g)).to(pool.dtype).to(pool.device)
    return pool


def positions(n, k, B):
    """visible: 0, 1, k-1, k, k+1, n, past n, then random."""
    vis = [0, 1, k - 1, k, k + 1, n, n + 7]
    pos = [max(4 * v - 1 + (i % 4), -1) if v > 0 else -1 + (i % 4) for i, v in enumerate(vis)]
    g = torch.Generator().manual_seed(n * 31 + k)
    while len(pos) < B:
        pos.append(int(torch.randint(0, 4 * n + 8, (1,), generator=g)))
    return torch.tensor(pos[:B], dtype=torch.int64, device=DEV)


def check_topk(got, want, pos, n, k):
    (i, ok), (ir, okr) = got, want
    assert i.dtype == torch.int64 and ok.dtype == torch.bool and i.shape == ir.shape == (pos.shape[0], k)
    vis = ((pos + 1) // RATIO).clamp(0, n)
    assert torch.all(i[:, 1:] > i[:, :-1]) and int(i.min()) >= 0 and int(i.max()) < n  # ascending, distinct, in range
    assert torch.equal(ok, i < vis[:, None])
    assert torch.equal(ok, okr)  # same number of visible picks (both list visible ids first)
    assert torch.equal(i[ok], ir[okr])  # the same visible entries
    few = vis <= k  # documented fill: all visible entries, then the smallest invisible ids
    if few.any():
        assert torch.equal(i[few], torch.arange(k, device=i.device).expand(int(few.sum()), k))


def check_scores(s, sr):
    assert s.dtype == torch.float32 and s.shape == sr.shape
    inf = torch.isinf(sr)
    assert torch.equal(torch.isinf(s), inf) and bool((s[inf] < 0).all())
    fin = ~inf
    if fin.any():
        err = float((s[fin] - sr[fin]).abs().max())
        assert err <= 1e-6 * float(sr[fin].abs().max().clamp_min(1.0)), err


CASES = [  # B, H, di, n, S, topk
    (9, 4, 32, 5, 3, 8),
    (9, 8, 64, 37, 4, 16),
    (10, 6, 32, 300, 5, 12),
]
CONFIGS = [None, IndexerConfig(16, 3, 4, 16, 4, 3), IndexerConfig(32, 2, 4, 64, 2, 8)]  # radix 5, 3, 8


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("cfg", range(len(CONFIGS)))
def test_topk_matches_ref(case, cfg):
    B, H, di, n, S, topk = case
    config = CONFIGS[cfg]
    k = min(topk, n)
    q, wl, pool, slots = make(B, H, di, n, S, seed=n + cfg)
    pos = positions(n, k, B)
    pool = poison_invisible(pool, slots, pos)
    s = indexer_scores(q, wl, pool, slots, pos, RATIO, config)
    check_scores(s, indexer_scores_ref(q, wl, pool, slots, pos, RATIO))
    got = indexer_topk(q, wl, pool, slots, pos, topk, RATIO, config)
    check_topk(got, indexer_topk_ref(q, wl, pool, slots, pos, topk, RATIO), pos, n, k)
    again = indexer_topk(q, wl, pool, slots, pos, topk, RATIO, config)
    assert torch.equal(got[0], again[0]) and torch.equal(got[1], again[1])
    assert torch.equal(s, indexer_scores(q, wl, pool, slots, pos, RATIO, config))


def test_batch_invariance():
    B, H, di, n, S, topk = 6, 8, 64, 300, 4, 16
    q, wl, pool, slots = make(B, H, di, n, S, seed=7)
    pos = positions(n, topk, B)
    s = indexer_scores(q, wl, pool, slots, pos)
    i, ok = indexer_topk(q, wl, pool, slots, pos, topk)
    for b in (0, 3, 5):
        sl = slice(b, b + 1)
        assert torch.equal(indexer_scores(q[sl], wl[sl], pool, slots[sl], pos[sl]), s[sl])
        i1, ok1 = indexer_topk(q[sl], wl[sl], pool, slots[sl], pos[sl], topk)
        assert torch.equal(i1, i[sl]) and torch.equal(ok1, ok[sl])


def stable_topk(scores, k):
    """The kernel's tie rule: the k largest, equal scores taken in ascending id order."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[:, :k].sort(-1).values


@pytest.mark.parametrize("H,di,n", [(4, 64, 37), (8, 32, 300)])
@pytest.mark.parametrize("cfg", [0, 1])
def test_ties_lowest_id(H, di, n, cfg):
    config = CONFIGS[cfg]
    B, S, topk = 8, 3, 16
    q, wl, pool, slots = make(B, H, di, n, S, seed=H + n, integer=True)
    pos = positions(n, topk, B)
    s = indexer_scores(q, wl, pool, slots, pos, RATIO, config)
    sr = indexer_scores_ref(q, wl, pool, slots, pos)
    assert torch.equal(s, sr)  # H * di = 256: the weight scale is 1/16, every score exact
    i, ok = indexer_topk(q, wl, pool, slots, pos, topk, RATIO, config)
    assert torch.equal(i, stable_topk(sr, min(topk, n)))
    assert torch.equal(ok, i < ((pos + 1) // RATIO)[:, None])
    # all scores equal (zero keys): the lowest visible ids
    zero = torch.zeros_like(pool)
    i0, ok0 = indexer_topk(q, wl, zero, slots, pos, topk, RATIO, config)
    assert torch.equal(i0, torch.arange(min(topk, n), device=DEV).expand_as(i0))


@pytest.mark.parametrize("multi_block", [False, True])
def test_long_pool(multi_block):
    """n = 16384 (64K context): several blocks per scoring program; the selection keeps the row in
    registers (default) or walks it in 2048-entry steps."""
    B, H, di, n, S, topk = 2, 4, 32, 16384, 2, 64
    cfg = pick_config(n, H, di)
    assert cfg.blocks_per_prog > 1 and cfg.sel_block == n
    if multi_block:
        cfg = IndexerConfig(cfg.block_n, cfg.blocks_per_prog, cfg.score_warps, 2048, 8)
    q, wl, pool, slots = make(B, H, di, n, S, seed=11)
    pos = torch.tensor([4 * 3000 + 2, 4 * 4100 + 5], device=DEV)  # visible 3000, 4101 (over 2 selection steps)
    got = indexer_topk(q, wl, pool, slots, pos, topk, RATIO, cfg)
    check_topk(got, indexer_topk_ref(q, wl, pool, slots, pos, topk), pos, n, topk)


def test_int32_index_inputs_and_fp32_operands():
    B, H, di, n, S, topk = 5, 4, 32, 37, 3, 8
    q, wl, pool, slots = make(B, H, di, n, S, seed=5, dtype=torch.float32)
    pos = positions(n, topk, B)
    got = indexer_topk(q, wl, pool, slots.int(), pos.int(), topk)
    check_topk(got, indexer_topk_ref(q, wl, pool, slots, pos, topk), pos, n, topk)
