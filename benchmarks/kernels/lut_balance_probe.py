"""Are the "lut" experts' launches at one row bound per warp (latency) or per SM (shared issue and
memory resources)? One row, n distinct experts (top-n routing, n = 1..8: 32n items of 128 rows per
launch, all resident at once on an H200's 264 CTA slots), each kernel's device time against n:
whole items per CTA ("items", moe_lut.SPREAD_ROWS = ()) with the kernels' grid of 2 CTAs per SM and
with 1 (then n > 4 takes two rounds), and the spread gate-up ("spread", engine lut_spread).

    python benchmarks/kernels/lut_balance_probe.py --out DIR

Reading: up to n = 4 every SM holds at most one CTA (8 warps). If the time stays flat from n = 4 to
n = 8 (where most SMs hold two CTAs), a warp's stream is latency-bound and more warps per SM are
free: finer work per warp would pay. If it doubles, the SM is the bound and only fewer
instructions or bytes per weight byte pay. JSON and a table under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import moe_cuda_variants as MCV  # noqa: E402
import moe_variants as MV  # noqa: E402
from megastep.kernels import moe as MOE  # noqa: E402
from megastep.kernels import moe_lut as LUTK  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out/lut_balance_probe"))
    ap.add_argument("--ns", default="1,2,3,4,5,6,7,8")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    E, D, I = (MV.SHAPE[n] for n in ("E", "D", "I"))
    gen = torch.Generator(device="cuda").manual_seed(1)
    copies = [MV.random_experts(E, D, I, gen) for _ in range(MV.N_COPIES)]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, D, generator=g).bfloat16().cuda()
    rows = []
    for schedule, per_sm in (("spread", 2), ("items", 2), ("items", 1)):
        for n in [int(v) for v in args.ns.split(",")]:
            routes = [(torch.randperm(E, generator=g)[:n].to(torch.int32).view(1, n).cuda(),
                       (torch.rand(1, n, generator=g) + 0.1).cuda()) for _ in range(MV.N_CALLS)]
            calls = [lambda ids=ids, wts=wts, ex=copies[i % len(copies)]: MOE.moe_experts_mxfp4(x, ids, wts, **ex)
                     for i, (ids, wts) in enumerate(routes)]
            saved = LUTK.CTAS_PER_SM
            LUTK.CTAS_PER_SM = per_sm
            try:
                ks = MCV.kernel_times("lut_spread" if schedule == "spread" else "lut_items", calls)
            finally:
                LUTK.CTAS_PER_SM = saved
            r = dict(schedule=schedule, ctas_per_sm=per_sm, n=n, items=32 * n,
                     gate_up_us=next((v for k, v in ks.items() if "gate_up_lut" in k), None),
                     down_us=next((v for k, v in ks.items() if "down_lut" in k), None), kernels_us=ks)
            rows.append(r)
            print(json.dumps(r), flush=True)
    with open(os.path.join(args.out, "lut_balance_probe.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(0), rows=rows), f, indent=1)
    print(f"\n{'schedule':8} {'CTAs/SM':>7} {'n':>2} {'items':>5} {'gate-up us':>10} {'down us':>8}")
    for r in rows:
        print(f"{r['schedule']:8} {r['ctas_per_sm']:7} {r['n']:2} {r['items']:5} {r['gate_up_us'] or 0:10.2f} "
              f"{r['down_us'] or 0:8.2f}")


if __name__ == "__main__":
    main()
