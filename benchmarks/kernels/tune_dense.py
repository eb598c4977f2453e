"""Sweep of the BF16 linear's configuration (megastep.kernels.dense.DenseConfig) at the shapes the
V4-Flash decode step launches, on one GPU: candidates checked, then timed at M = 1, 8, 16 and 64;
the winner per shape is printed as a Python literal for dense._PINNED (tune.py --only dense
--write pins it).

    python benchmarks/kernels/tune_dense.py [--json FILE]      (one H200: ~1-2 min, compiles included)
    TRITON_INTERPRET=1 python benchmarks/kernels/tune_dense.py --smoke
        (CPU, Triton interpreter, tiny shapes: checks this script only; its times mean nothing)

Why: pick_config's rule was never measured on a device (dense.py says so), and on one H200 the
compressors' projection, one launch over the concatenated BF16 weights of a layer, closes 12.4 us
of a 1-row CSA layer for 21.5 MB (1.7 TB/s) and 9.2 us of an HCA layer for 8.4 MB (0.9 TB/s)
(docs/PERFORMANCE.md, twenty-fourth measurement, item 4), against ~4.9 and ~1.9 us at the
streaming rate.

Shapes (ModelConfig's defaults, as model/fast.py launches them; K = hidden 4096):
  csa_x_dense  N 2624: the compressor's wkv + wgate (2 x 1024, the ratio-4 overlap doubles
               head_dim), the indexer's compressor wkv + wgate (2 x 256), its weights_proj (64);
  hca_x_dense  N 1024: the compressor's wkv + wgate (2 x 512);
  gate         N 256: the router's gate (linear_bf16 from 2 rows on, the router's one-launch
               gate_route_group at 1-4 rows, which takes the same configuration: the same sums).
Candidates (~25 per shape): BLOCK_N 16 / 32 / 64 / 128 with the split-K that gives about 264,
528 or 1056 programs at M = 1 (2, 4 or 8 per SM; the FP8 linear's weight pattern reached 2.6,
3.2-3.4 TB/s at 2 and 4 programs per SM: ninth measurement), K steps of 128 or 256, and the
current pick. A configuration changes the order of the fp32 sums, so the bits of the step: every
candidate is held to the ref's tolerance (tests/kernels/test_dense.py's: 1e-6 of the sum of
|terms|), run to run and a row alone against row 0 of 64 bit for bit, or it is reported and not
timed. Configurations depend on (N, K) only, never on M (batch invariance).
Timing: bench_kernels.graph_time (a CUDA graph of back-to-back calls, median of the replays, us per
call) on rotated weight copies (at least 128 MB of them: nothing from L2), x the same for every
call. Score: the sum over those M of t_M / best t_M among the candidates that pass; the winner
replaces the current pick only if its score is 2 % lower (noise between equal configurations must
not churn the pins). (Until 2026-12-01 it scored M = 1 and 64 only; its two pins made the 30-layer
step 1.4 % faster at 1 row and 0.7 % at 64 but 0.9 % slower at 16: docs/PERFORMANCE.md,
twenty-fifth measurement.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from dataclasses import asdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import bench_kernels as BK  # noqa: E402  (the kernels' shared CUDA-graph timer)

from megastep.config import ModelConfig  # noqa: E402
from megastep.kernels import dense as DN  # noqa: E402
from megastep.kernels.dense import DenseConfig  # noqa: E402

BS = (1, 8, 16, 64)  # rows timed (the score sums over them; the GB/s column is at BS[0])
TARGETS = (264, 528, 1056)  # programs at M = 1
WEIGHT_BYTES = 128 << 20  # weight copies per shape: at least this much (an H200's L2 is 50 MB)
REPS = 10
MARGIN = 0.02  # a winner must beat the current pick's score by this much
# Shapes swept and reported but never pinned: the 30-layer step measured their sweep winner against
# the current pick and kept the pick. The gate's winner (bn 32, bk 256, split 16), the fastest alone
# at every M, made the step 2-3 % slower at 8 rows and ~1 % at 16 (docs/PERFORMANCE.md,
# twenty-fifth measurement; dense._PINNED says more).
STEP_KEEPS = {"gate"}
SMOKE = False


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The step's BF16 launches: name -> (N, K)."""
    D = cfg.hidden_size
    if SMOKE:
        return {"a": (200, 512), "b": (48, 256)}
    csa = 2 * (2 * cfg.head_dim) + 2 * (2 * cfg.index_head_dim) + cfg.index_n_heads
    return {"csa_x_dense": (csa, D), "hca_x_dense": (2 * cfg.head_dim, D), "gate": (cfg.n_routed_experts, D)}


def candidates(N: int, K: int, smoke: bool = False) -> list[DenseConfig]:
    """The current pick first, then the grid (duplicates and configurations of empty splits out)."""
    out = [DN.pick_config(N, K)]
    block_ns, targets, block_ks = ((16, 64), (8, 32), (64,)) if smoke else ((16, 32, 64, 128), TARGETS, (128, 256))
    for bn in block_ns:
        tiles = -(-N // bn)
        for target in targets:
            for bk in block_ks:
                steps = -(-K // bk)
                split = 1
                while tiles * split * 2 <= target and split * 2 <= steps:
                    split *= 2
                c = DenseConfig(bn, bk, split, num_warps=8 if bn == 128 else 4)
                # (at least 64 programs at M = 1, as tests/kernels/test_dense.py asks of every pick)
                if DN.split_plan(K, c)[0] == split and c not in out and (smoke or tiles * split >= 64):
                    out.append(c)
    return out


def check(c: DenseConfig, x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> str | None:
    """None if c passes: the ref's tolerance, the same bits twice, a row alone = row 0 of the batch."""
    y = DN.linear_bf16(x, w, config=c)
    bad = ((y - ref).abs() > bound).sum().item()
    if bad:
        return f"{bad} outputs off the ref's tolerance"
    if not torch.equal(y, DN.linear_bf16(x, w, config=c)):
        return "not deterministic"
    if not torch.equal(y[:1], DN.linear_bf16(x[:1], w, config=c)):
        return "row 0 alone differs from row 0 of the batch"
    return None


def sweep(device, log=print) -> dict[tuple[int, int], DenseConfig]:
    """Winners per (N, K) of the step's BF16 launches (only those that beat the current pick)."""
    BK.DEV = device.type
    g = torch.Generator(device="cpu").manual_seed(0)
    winners = {}
    for name, (N, K) in shapes(ModelConfig()).items():
        copies = 1 if SMOKE else max(2, -(-WEIGHT_BYTES // (2 * N * K)))
        ws = [(torch.randn(N, K, generator=g) * 0.02).bfloat16().to(device) for _ in range(copies)]
        x = torch.randn(max(BS), K, generator=g).bfloat16().to(device)
        ref = DN.linear_bf16_ref(x, ws[0])
        bound = 1e-6 * (x.float().abs() @ ws[0].float().abs().T)
        rows = []
        for c in candidates(N, K, SMOKE):
            try:
                why = check(c, x, ws[0], ref, bound)
                if why is None:
                    t = [BK.graph_time([lambda j=j, m=m: DN.linear_bf16(x[:m], ws[j], config=c) for j in range(copies)],
                                       reps=REPS)[0] for m in BS]
                else:
                    t = None
            except Exception as e:  # one candidate that fails to build must not cost the others
                why, t = f"{type(e).__name__}: {e}", None
                traceback.print_exc()
            rows.append((c, t, why))
        timed = [(c, t) for c, t, _ in rows if t is not None]
        if not timed:
            log(f"{name} N {N} K {K}: no candidate passed")
            continue
        best = [min(t[i] for _, t in timed) for i in range(len(BS))]
        score = {c: sum(t[i] / best[i] for i in range(len(BS))) for c, t in timed}
        log(f"\n{name}: N {N} K {K}, {2 * N * K / 1e6:.1f} MB, {copies} copies; us per call at M = "
            f"{' / '.join(map(str, BS))} (GB/s of the weight at M = {BS[0]})")
        for c, t, why in rows:
            progs = -(-N // c.block_n) * DN.split_plan(K, c)[0]
            head = (f"  bn {c.block_n:3d} bk {c.block_k:3d} split {c.split_k:3d} warps {c.num_warps} "
                    f"({progs:4d} programs)")
            if t is None:
                log(f"{head}  failed: {why}")
            else:
                log(f"{head}  {' / '.join(f'{v:8.2f}' for v in t)}  ({2 * N * K / t[0] / 1e3:6.0f} GB/s)  score "
                    f"{score[c]:.3f}{'  (current)' if c == rows[0][0] else ''}")
        cur = rows[0][0]
        win = min(score, key=score.get)
        if cur in score and score[win] > score[cur] * (1 - MARGIN):
            win = cur
        if win != cur and name in STEP_KEEPS:
            log(f"{name}: keeps {cur!r} (STEP_KEEPS; the sweep's best: {win!r})")
            continue
        log(f"{name}: {'keeps' if win == cur else 'pins'} {win!r}")
        if win != cur:
            winners[(N, K)] = win
    return winners


def main() -> int:
    global SMOKE, BS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the winners here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (the interpreter on CPU)")
    args = p.parse_args()
    SMOKE = args.smoke
    if SMOKE:
        BS = (1, 17)  # two row tiles
    if not SMOKE and not torch.cuda.is_available():
        print("tune_dense.py measures on a CUDA device; none here (--smoke checks the script on CPU)")
        return 2
    log = []
    winners = sweep(torch.device("cpu" if SMOKE else "cuda"), log=lambda *a: (print(*a, flush=True), log.append(a)))
    print("\n_PINNED entries:", winners)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"winners": {repr(k): asdict(v) for k, v in winners.items()},
                       "log": [" ".join(map(str, a)) for a in log]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
