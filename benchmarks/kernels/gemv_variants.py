"""The FP8 linear's CUDA C++ loop for a few rows (`linear_fp8_small`) against its Triton loop, at the
shapes the V4-Flash decode step launches.

For each shape and M: the Triton loop and the CUDA loop (linear_fp8 with linear_fp8_small.ROWS 0 and
16, each load mode), each with and without x_codes, checked against the torch ref (one bf16 step, as
tests/kernels/test_linear_fp8.py), for determinism (3 repeats bit-identical), and the CUDA loop for
the same bits as the Triton loop; then timed (CUDA graph of calls on rotated weight copies, nothing
from L2). wo_b and the shared w2 take the fp32 residual, as the step calls them.

    python benchmarks/kernels/gemv_variants.py --out DIR [--ms 1,2,4,8,16]

Prints a table last (µs per call, GB/s of the bytes that must be read, CUDA against Triton); JSON
under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import bench_kernels as BK  # noqa: E402
from megastep.checkpoint import formats  # noqa: E402
from megastep.kernels import linear_fp8 as LIN  # noqa: E402
from megastep.kernels import linear_fp8_small as SMALL  # noqa: E402

SHAPES = {  # name: (N, K, kind, residual, groups)
    "x_group": (1536, 4096, "plain", False, 1),
    "qr_group": (40960, 1024, "plain", False, 1),
    "wo_a": (8192, 4096, "plain", False, 8),
    "wo_b": (4096, 8192, "plain", True, 1),
    "shared_w13": (2048, 4096, "gated", False, 1),
    "shared_w2": (4096, 2048, "plain", True, 1),
}
LIMIT = 10.0


def call(x, w, s, kind, res, xc, groups):
    if kind == "gated":
        return LIN.linear_fp8_swiglu(x, w, s, LIMIT, x_codes=xc)
    return LIN.linear_fp8(x, w, s, residual=res, x_codes=xc, quantize_act=groups == 1, groups=groups)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out/gemv_variants"))
    ap.add_argument("--ms", default="1,2,4,16")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    BK.LOG = open(os.path.join(args.out, "gemv_variants.log"), "w")
    bw = BK.measure_bandwidth()
    BK.log(f"device {torch.cuda.get_device_name(0)}; streaming read {bw['read']:.0f} GB/s; "
           f"cuda kernel available: {SMALL.available()}")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (N, K, kind, has_res, groups) in SHAPES.items():
        R = 2 * N if kind == "gated" else N
        nbytes = R * K + triton.cdiv(R, 128) * triton.cdiv(K, 128)
        copies = max(1, min(128, math.ceil(BK.L2_FLUSH_BYTES / nbytes)))
        ws = [BK.fp8_weight(R, K, g) for _ in range(copies)]
        for M in [int(m) for m in args.ms.split(",")]:
            x = torch.randn(M, K * groups, device="cuda", generator=g).bfloat16()
            res = torch.randn(M, N, device="cuda", generator=g) if has_res else None
            if kind == "gated":
                ref = LIN.linear_fp8_swiglu_ref(x, *ws[0], LIMIT)
            else:
                ref = LIN.linear_fp8_ref(x, *ws[0], residual=res, quantize_act=groups == 1, groups=groups)
            codes = formats.fp8_act_quant(x.float(), 128) if groups == 1 else None
            outs = {}
            engines = [("triton", 0, None, None), ("triton+c", 0, codes, None)] + \
                [(f"cuda_{load}", 16, None, load) for load in SMALL.LOADS] + \
                [(f"cuda_{load}+c", 16, codes, load) for load in SMALL.LOADS]
            for engine, rows_cuda, xc, load in engines:
                if engine.endswith("+c") and xc is None:
                    continue
                SMALL.ROWS, SMALL.LOAD = rows_cuda, load or SMALL.LOAD
                r = dict(shape=name, N=N, K=K, M=M, engine=engine)
                try:
                    fn = (lambda w, s, xc=xc: call(x, w, s, kind, res, xc, groups))  # noqa: E731
                    y = fn(*ws[0])
                    ok, msg = BK.check_linear(y, ref)
                    same = all(torch.equal(y.view(torch.int16), fn(*ws[0]).view(torch.int16)) for _ in range(3))
                    outs[engine] = y
                    tri = outs.get("triton+c" if engine.endswith("+c") else "triton")
                    as_triton = None if tri is None or engine.startswith("triton") else torch.equal(
                        y.view(torch.int16), tri.view(torch.int16))
                    med, best = BK.graph_time([lambda w=w, s=s: fn(w, s) for (w, s) in ws])
                    r.update(ok=ok and same and as_triton is not False, check=msg, deterministic=same,
                             same_bits_as_triton=as_triton, us=med, gbps=(nbytes + M * K * 2) / med / 1e3)
                except Exception as e:  # noqa: BLE001
                    r.update(ok=False, error=repr(e)[:300])
                rows.append(r)
                BK.log(json.dumps(r))
    SMALL.ROWS = 0
    with open(os.path.join(args.out, "gemv_variants.json"), "w") as f:
        json.dump(dict(bandwidth=bw, rows=rows), f, indent=1)
    us = {(r["shape"], r["M"], r["engine"]): r.get("us") for r in rows}
    print(f"\n{'shape':11} {'M':>3} {'engine':13} {'us':>7} {'GB/s':>6} {'x triton':>8} ok")
    for r in rows:
        base = us.get((r["shape"], r["M"], "triton+c" if r["engine"].endswith("+c") else "triton"))
        rel = f"{r['us'] / base:8.3f}" if r.get("us") and base and r["engine"].startswith("cuda") else " " * 8
        print(f"{r['shape']:11} {r['M']:3} {r['engine']:13} {r.get('us', float('nan')):7.2f} {r.get('gbps', 0):6.0f} "
              f"{rel} {'ok' if r['ok'] else 'FAIL ' + r.get('check', r.get('error', ''))[:70]}")


if __name__ == "__main__":
    main()
