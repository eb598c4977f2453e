"""Would the FP8 linears gain from finding their weight in L2, prefetched while the GPU waits?

At batch 1 a V4-Flash layer spends ~25 us in kernels that read almost nothing (indexer, attention,
mHC, the router) right before the largest weight streams (wo_a + wo_b, 67 MB; the experts). HBM idles
there. If a side-stream kernel asked L2 for the next linear's weight during that time, the linear
would read (part of) it from L2. This script measures the pieces, per shape, CUDA-graph replay,
median of 20 (weights rotated over copies past L2 unless said):
- cold:       the linear alone (the step's situation today);
- warm:       the linear on one weight copy, call after call (an upper bound: all of it in L2);
- prefetch:   the prefetch kernel alone (`prefetch.global.L2` per 128-byte line, 132 programs);
- spin:       a one-program kernel that spins SPIN_US on the global timer (the latency-bound
              stretch), then the linear, on one stream;
- spin+pf:    the same with the prefetch forked onto a second stream at the spin's start and
              joined before the linear (what the step would do).
spin+pf against spin says what the idea is worth at that idle length. (The step's prefetch on a stream
of its own, fast.L2_PREFETCH, measured slower: docs/PERFORMANCE.md, twenty-eighth measurement;
removed, read it at 00105ef.)

    python benchmarks/kernels/l2_prefetch.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import bench_kernels as BK  # noqa: E402

from megastep.kernels import linear_fp8 as LIN  # noqa: E402
from megastep.kernels.spin import _spin_kernel  # noqa: E402

SHAPES = {"x_group": (1536, 4096, 1), "qr_group": (40960, 1024, 1), "wo_a": (8192, 4096, 8),
          "wo_b": (4096, 8192, 1), "shared_w2": (4096, 2048, 1)}


@triton.jit
def _prefetch_kernel(p, nbytes, LINES: tl.constexpr):
    """prefetch.global.L2 of every 128-byte line of [p, p + nbytes), LINES lines per program step."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * LINES * 128
    for off in range(pid * LINES * 128, nbytes, step):
        o = off + tl.arange(0, LINES) * 128
        o = tl.where(o < nbytes, o, off)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                  [(p + o).to(tl.int64, bitcast=True)], dtype=tl.int32, is_pure=False, pack=1)


def graph_time(fn) -> float:
    """fn records the whole sequence once (several streams allowed); µs per replay."""
    return BK.graph_time([fn])[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--spin-us", default="10,20")
    ap.add_argument("--programs", type=int, default=132)
    args = ap.parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    side = torch.cuda.Stream()
    spin_out = torch.empty(1, dtype=torch.int64, device=dev)
    rows = []
    for name, (N, K, G) in SHAPES.items():
        nbytes = N * K
        copies = max(2, math.ceil((256 << 20) / nbytes))
        ws = [BK.fp8_weight(N, K, g) for _ in range(copies)]
        x = torch.randn(1, G * K, device=dev, generator=g).bfloat16()
        qa = G == 1

        def lin(w, s):
            return LIN.linear_fp8(x, w, s, quantize_act=qa, groups=G)

        def pf(w):
            _prefetch_kernel[(args.programs,)](w, nbytes, LINES=64, num_warps=2)

        r = {"shape": name, "N": N, "K": K, "bytes": nbytes}
        r["cold"] = graph_time(lambda: [lin(w, s) for w, s in ws]) / copies
        r["warm"] = graph_time(lambda: [lin(*ws[0]) for _ in range(copies)]) / copies
        r["prefetch"] = graph_time(lambda: [pf(w) for w, _ in ws]) / copies
        r["prefetch_then_linear"] = graph_time(lambda: [(pf(w), lin(w, s)) for w, s in ws]) / copies
        for sp in [float(v) for v in args.spin_us.split(",")]:
            ns = int(sp * 1000)

            def spin_only():
                for w, s in ws:
                    _spin_kernel[(1,)](spin_out, ns)
                    lin(w, s)

            def spin_pf():
                main = torch.cuda.current_stream()
                for w, s in ws:
                    side.wait_stream(main)
                    _spin_kernel[(1,)](spin_out, ns)
                    with torch.cuda.stream(side):
                        pf(w)
                    main.wait_stream(side)
                    lin(w, s)

            r[f"spin{sp:g}"] = graph_time(spin_only) / copies
            r[f"spin{sp:g}+pf"] = graph_time(spin_pf) / copies
        rows.append(r)
        BK.log(json.dumps(r))
        ws.clear()  # free the copies before the next shape
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    keys = [k for k in rows[0] if k not in ("shape", "N", "K", "bytes")]
    print(f"{'shape':10} {'MB':>5} " + " ".join(f"{k:>12}" for k in keys))
    for r in rows:
        print(f"{r['shape']:10} {r['bytes'] / 1e6:5.1f} " + " ".join(f"{r[k]:12.2f}" for k in keys))


if __name__ == "__main__":
    main()
