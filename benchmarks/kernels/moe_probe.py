"""Timing probe of the routed experts at batch 1: how much of the call is the MXFP4 decode?

The experts' gate-up and down loops spend ~210 of ~345 instructions per 4 KB step decoding MXFP4
("dot_asm", 13 instructions per two bytes; benchmarks/kernels/sass_loop.py), yet deeper pipelines
and fewer decode instructions moved the call by 1 % or less (docs/PERFORMANCE.md). This script
times `moe_experts_mxfp4` at V4-Flash shapes, M = 1, with the decode as it is and with the decode
replaced by three instructions that only move the bytes and scales into the MMA operand (wrong
values: a timing probe, never a result). Run each probe in its own process (Triton keys its
cache on the inline assembly text, and a global changed after the first compile is an error):

    python benchmarks/kernels/moe_probe.py [--probe none|no_decode] [--json OUT.json]

`bench_kernels.graph_time` over 20 calls, each with its own random routing over two stacked 3.3 GB
layer copies (nothing served from L2): median (and best) of 20 replays, us per call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import bench_kernels as BK  # noqa: E402
from megastep.kernels import moe as MOE  # noqa: E402

# the bytes of each pair into both operand registers next to the scales: 3 instructions, no decode
NO_DECODE_ASM = """
{
.reg .b32 w;
cvt.u32.u16 w, $2;
prmt.b32 $0, w, $3, 0x5410;
prmt.b32 $1, w, $4, 0x5410;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", choices=("none", "no_decode"), default="none")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.probe == "no_decode":
        MOE._DECODE_ASM = tl.constexpr(NO_DECODE_ASM)
    E, D, I, k, M, calls = 256, 4096, 2048, 6, 1, 20
    g = torch.Generator(device="cuda").manual_seed(0)
    copies = []
    for _ in range(2):
        copies.append(dict(
            w13=torch.randint(-128, 128, (E, 2 * I, D // 2), generator=g, device="cuda", dtype=torch.int8),
            w13_scale=torch.randint(118, 124, (E, 2 * I, D // 32), generator=g, device="cuda",
                                    dtype=torch.uint8).view(torch.float8_e8m0fnu),
            w2=torch.randint(-128, 128, (E, D, I // 2), generator=g, device="cuda", dtype=torch.int8),
            w2_scale=torch.randint(118, 124, (E, D, I // 32), generator=g, device="cuda",
                                   dtype=torch.uint8).view(torch.float8_e8m0fnu)))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(M, D, generator=gen).bfloat16().cuda()
    routes = [(torch.randperm(E, generator=gen)[:k].view(1, k).to(torch.int32).cuda(),
               (torch.rand(1, k, generator=gen) + 0.1).cuda()) for _ in range(calls)]
    fns = [lambda ids=ids, w=w, c=copies[i % 2]: MOE.moe_experts_mxfp4(x, ids, w, **c) for i, (ids, w) in enumerate(routes)]
    us, best = BK.graph_time(fns)
    r = {"probe": args.probe, "M": M, "us_per_call": us, "us_min": best}
    print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(r, fh)


if __name__ == "__main__":
    main()
