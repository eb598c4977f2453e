"""CSA indexer at V4-Flash shapes (H 64, di 128, top-k 512): indexer_topk (score + select, two
launches) against indexer_topk_ref (FastDecoder._indexer's torch code): agreement and time.

    python benchmarks/kernels/indexer_check.py [--sweep]

Data: q and keys fp4-simulated per 32 (as the model's), or plain bf16 normals; head-weight logits
normal. Positions: row 0 sees the whole context, the others random (some below k = 512).
Agreement per row: "same" = identical idx and ok; "tie" = the selected sets differ only in entries
whose ref score is within 1e-5 x the row's largest |score| of the ref's k-th score (the kernel's
documented tie rule and its different fp32 summation order); "BAD" = anything else. Also 5 runs
bit-identical and batch invariance (row 0 alone).
With --sweep, other configurations are timed too (the score and select kernels' tile and warps).
Timing: a CUDA graph of back-to-back calls, each on another copy of the key pool (so the keys come
from HBM, as in decode where each layer has its own pool), median of 20 replays, µs per call.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import torch
from bench_kernels import graph_time  # same folder: the kernels' shared graph-replay timer

from megastep.checkpoint import formats as F
from megastep.kernels.indexer import (indexer_scores, indexer_scores_ref, indexer_topk, indexer_topk_ref,
                                      pick_config)

H, DI, TOPK, RATIO = 64, 128, 512, 4
DEV = "cuda"


def make(B, ctx, data, seed, copies):
    g = torch.Generator(device=DEV).manual_seed(seed)
    n = ctx // RATIO
    sim = (lambda x: F.fp4_act_sim(x, 32)) if data == "fp4" else (lambda x: x)
    q = sim(torch.randn(B, H, DI, device=DEV, generator=g)).bfloat16()
    wl = torch.randn(B, H, device=DEV, generator=g)
    pools = [sim(torch.randn(B + 1, n + 1, DI, device=DEV, generator=g)).bfloat16() for _ in range(copies)]
    slots = torch.randperm(B + 1, device=DEV, generator=g)[:B]
    pos = torch.randint(0, ctx, (B,), device=DEV, generator=g)
    pos[0] = ctx - 1
    return q, wl, pools, slots, pos


def agreement(q, wl, pool, slots, pos):
    i, ok = indexer_topk(q, wl, pool, slots, pos, TOPK)
    ir, okr = indexer_topk_ref(q, wl, pool, slots, pos, TOPK)
    sr = indexer_scores_ref(q, wl, pool, slots, pos)
    s = indexer_scores(q, wl, pool, slots, pos)
    fin = torch.isfinite(sr)
    serr = ((s - sr).abs()[fin].max() / sr.abs()[fin].max()).item() if fin.any() else 0.0
    same = tie = bad = 0
    for b in range(q.shape[0]):
        if torch.equal(i[b], ir[b]) and torch.equal(ok[b], okr[b]):
            same += 1
            continue
        vis = int(okr[b].sum())
        if not torch.equal(ok[b], okr[b]) or not torch.all(i[b, 1:] > i[b, :-1]):
            bad += 1
            continue
        a, r = set(i[b][ok[b]].tolist()), set(ir[b][okr[b]].tolist())
        kth = sr[b][ir[b][okr[b]]].min()
        tol = 1e-5 * sr[b][fin[b]].abs().max()
        diff = torch.tensor(sorted(a ^ r), device=DEV, dtype=torch.long)
        if vis <= TOPK and a == r:  # only the invisible fill differs (documented)
            same += 1
        elif len(diff) and bool(((sr[b][diff] - kth).abs() <= tol).all()):
            tie += 1
        else:
            bad += 1
    runs = [indexer_topk(q, wl, pool, slots, pos, TOPK) for _ in range(5)]
    det = all(torch.equal(x[0], runs[0][0]) and torch.equal(x[1], runs[0][1]) for x in runs)
    one = indexer_topk(q[:1], wl[:1], pool, slots[:1], pos[:1], TOPK)
    inv = torch.equal(one[0], i[:1]) and torch.equal(one[1], ok[:1])
    return same, tie, bad, det, inv, serr


def sweep(q, wl, pools, slots, pos, n):
    base = pick_config(n, H, DI)
    cands = {base}
    for bn, per in ((32, 1), (128, 1), (64, 2), (64, 8)):
        if -(-n // (bn * per)) >= 8:
            cands.add(replace(base, block_n=bn, blocks_per_prog=per, score_warps=4 if bn < 128 else 8))
    for w in (4, 8, 16, 32):
        for r in (4, 5, 6, 8):
            if w * 32 <= base.sel_block:
                cands.add(replace(base, sel_warps=w, radix_bits=r))
    out = []
    for c in sorted(cands, key=str):
        us = graph_time([lambda p=p: indexer_topk(q, wl, p, slots, pos, TOPK, RATIO, c) for p in pools])[0]
        out.append((us, c))
    for us, c in sorted(out, key=lambda t: t[0])[:5] + [t for t in out if t[1] == base]:
        print(f"    {us:7.1f} us  {c}{'  (picked)' if c == base else ''}")


def main():
    do_sweep = "--sweep" in sys.argv
    t0 = time.time()
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    for _ in range(200):  # clocks up before the first timing
        a @ a
    torch.cuda.synchronize()
    rows = []
    cases = [(1, 4096), (16, 4096), (64, 4096), (1, 65536), (16, 65536)]
    for B, ctx in cases:
        copies = 8 if B * ctx <= 64 * 4096 else 2
        for data in ("fp4", "randn"):
            q, wl, pools, slots, pos = make(B, ctx, data, seed=B * 7 + ctx, copies=copies)
            same, tie, bad, det, inv, serr = agreement(q, wl, pools[0], slots, pos)
            print(f"B={B:3d} ctx={ctx:6d} {data:5s}: rows same {same} tie {tie} BAD {bad}  deterministic {det}  "
                  f"batch-invariant {inv}  max score err / max |score| {serr:.1e}", flush=True)
            if data != "fp4":
                continue
            kern = graph_time([lambda p=p: indexer_topk(q, wl, p, slots, pos, TOPK) for p in pools])[0]
            score = graph_time([lambda p=p: indexer_scores(q, wl, p, slots, pos) for p in pools])[0]
            ref = graph_time([lambda p=p: indexer_topk_ref(q, wl, p, slots, pos, TOPK) for p in pools])[0]
            vis = ((pos + 1) // RATIO).clamp(max=ctx // RATIO)
            gbs = int(vis.sum()) * DI * 2 / (score * 1e3)
            rows.append((B, ctx, kern, score, ref, gbs, bad == 0 and det and inv))
            if do_sweep:
                sweep(q, wl, pools, slots, pos, ctx // RATIO)
    print(f"\n(total {time.time() - t0:.0f} s)  µs per call, CUDA graph replay, keys from HBM")
    print("| B | ctx | n | kernel pair µs | score kernel µs (key GB/s) | select µs | torch ref µs | speedup | check |")
    print("|---|---|---|---|---|---|---|---|---|")
    for B, ctx, kern, score, ref, gbs, good in rows:
        print(f"| {B} | {ctx} | {ctx // RATIO} | {kern:.1f} | {score:.1f} ({gbs:.0f}) | {kern - score:.1f} | {ref:.1f} | "
              f"{ref / kern:.1f}x | {'ok' if good else 'FAIL'} |")


if __name__ == "__main__":
    main()
