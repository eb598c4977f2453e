"""The MoE router at V4-Flash shapes (256 experts, D 4096, top-6): router.py's Triton launches as
the step takes them (`gate_route_group` up to MAX_GATE_ROWS rows, else linear_bf16 + route_group,
else + route) against the gate GEMV followed by the one-launch CUDA routing (linear_bf16 +
route_cuda.route_group), us per call.

    python benchmarks/kernels/router_variants.py [--rows 1,4,16,64] [--pdl on|off|both] [--json FILE]

Method: a CUDA graph of 32 back-to-back calls, each on its own copy of the gate (64 MB in all:
nothing served from L2), median of 20 replays (bench_kernels.graph_time). With PDL each call's
launch may overlap its predecessor, as in the step. The two are checked first: the same experts,
weights and grouping, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import graph_time, write_results  # noqa: E402

from megastep.kernels import common, route_cuda, router  # noqa: E402
from megastep.kernels.dense import linear_bf16  # noqa: E402

E, D, K, SCALING, COPIES = 256, 4096, 6, 2.5, 32


def triton_router(x, gw, bias):
    B = x.shape[0]
    if B <= router.MAX_GATE_ROWS:
        return router.gate_route_group(x, gw, bias, None, K, SCALING, permute=False)[:3]
    logits = linear_bf16(x, gw, torch.float32)
    if B * K <= router.MAX_GROUPED_PAIRS:
        return router.route_group(logits, bias, None, K, SCALING, x, permute=False)
    return (*router.route(logits, bias, None, K, SCALING), None)


def cuda_router(x, gw, bias):
    group = x.shape[0] * K <= route_cuda.MAX_GROUPED_PAIRS
    return route_cuda.route_group(linear_bf16(x, gw, torch.float32), bias, None, None, K, SCALING,
                                  x if group else None, permute=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--pdl", default="both", choices=["on", "off", "both"])
    ap.add_argument("--json")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    gws = [(torch.randn(E, D, generator=g) / 64).bfloat16().cuda() for _ in range(COPIES)]
    bias = (torch.randn(E, generator=g) * 0.5).cuda()
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for pdl in ([False, True] if args.pdl == "both" else [args.pdl == "on"]):
        common.set_pdl(pdl)
        for B in rows:
            x = (torch.randn(B, D, generator=g) * 2).bfloat16().cuda()
            ti, tw, tr = triton_router(x, gws[0], bias)
            ci, cw, cr = cuda_router(x, gws[0], bias)
            same = torch.equal(ti, ci) and torch.equal(tw, cw)
            if tr is not None and cr is not None:
                same = same and torch.equal(tr.pairs, cr.pairs) and torch.equal(tr.xq, cr.xq)
            row = {"rows": B, "pdl": pdl, "same_results": bool(same)}
            for name, fn in (("triton", triton_router), ("cuda", cuda_router)):
                med, best = graph_time([lambda gw=gw, fn=fn: fn(x, gw, bias) for gw in gws])
                row[name] = round(med, 2)
                row[name + "_min"] = round(best, 2)
            results.append(row)
            print(row, flush=True)
    common.set_pdl(False)
    write_results(args.json, results)
    print(f"{'rows':>5} {'pdl':>5} {'triton us':>10} {'cuda us':>9}  same results")
    for r in results:
        print(f"{r['rows']:>5} {str(r['pdl']):>5} {r['triton']:>10.2f} {r['cuda']:>9.2f}  {r['same_results']}")


if __name__ == "__main__":
    main()
