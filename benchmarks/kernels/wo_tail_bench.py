"""wo_a -> wo_b of V4-Flash's attention sublayer at 1-4 rows: linear_fp8's two Triton launches (the
step's path) against kernels/wo_tail.py's one persistent launch, each entry, with and without PDL.
One H200, ~1 min.

    python benchmarks/kernels/wo_tail_bench.py [--out DIR] [--rows 1,2,4] [--reps 20]

Every entry is first checked against the two launches' bits (and for a wait that gave up) at each
row count; one that fails is logged and not timed. Timing: CUDA-graph replays of calls that cycle
over three copies of the weights (3 x 67 MB, past the 60 MB L2), behind a small kernel that writes o
(as the attention does in the step). The table gives us per call (wo_a and wo_b together), their
67.1 MB of weights as GB/s, and % of the streaming read measured in the same run.
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

G, R, KA, N = 8, 1024, 4096, 4096  # V4-Flash: o groups, o LoRA rank, a group's o columns, hidden


def weights(gen: torch.Generator):
    """wo_a (e4m3 [G R, Ka] + scales) and wo_b (e4m3 [N, G R] + scales), random."""
    from megastep.checkpoint import formats as F
    wa = torch.randn(G * R, KA, generator=gen, device="cuda") * 0.02
    wb = torch.randn(N, G * R, generator=gen, device="cuda") * 0.02
    return (*F.quantize_fp8_weight(wa, 128), *F.quantize_fp8_weight(wb, 128))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "out/wo_tail_bench"))
    ap.add_argument("--rows", default="1,2,4")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    import bench_kernels as BK
    from megastep.kernels import common
    from megastep.kernels import linear_fp8 as LIN
    from megastep.kernels import wo_tail as WT

    os.makedirs(args.out, exist_ok=True)
    BK.LOG = open(os.path.join(args.out, "wo_tail_bench.log"), "w")
    WT.ENABLED = True
    for e, k in WT._KERNELS.items():
        a = k.attributes()
        BK.log(f"{k.name}: {a['num_regs']} registers, {a['local_size_bytes']} B local, {WT.shared_bytes(e)} B shared")
    bw = BK.measure_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = [weights(gen) for _ in range(3)]
    nbytes = sum(t.numel() * t.element_size() for t in copies[0])
    BK.log(f"device {torch.cuda.get_device_name(0)}; streaming read {bw['read']:.0f} GB/s; wo_a + wo_b "
           f"{nbytes / 1e6:.1f} MB with their scales, {nbytes / bw['read'] / 1e3:.2f} us at that rate")

    def pair(o, w):
        return LIN.linear_fp8(LIN.linear_fp8(o, w[0], w[1], quantize_act=False, groups=G), w[2], w[3])

    rows = []
    for M in [int(v) for v in args.rows.split(",")]:
        src = (torch.randn(M, G * KA, generator=gen, device="cuda") * 4).to(torch.bfloat16)
        o = torch.empty_like(src)
        o.copy_(src)
        want = [pair(o, w) for w in copies]
        ok = []
        for e in WT.ENTRIES:
            if WT.plan(o, copies[0][0], copies[0][2], G, e) is None:
                BK.log(f"M {M} {e}: not taken (plan)")
                continue
            bad = []
            for pdl in (False, True):
                old = common.set_pdl(pdl)
                try:
                    for w, ref in zip(copies, want):
                        y = WT.wo_tail(o, w[0], w[1], w[2], w[3], G, e)
                        if not torch.equal(y.view(torch.int16), ref.view(torch.int16)):
                            bad.append(f"pdl {pdl}: {int((y != ref).sum())} of {y.numel()} outputs differ")
                finally:
                    common.set_pdl(old)
            try:
                WT.check(o.device)
            except RuntimeError as err:
                bad.append(str(err))
            if bad:
                BK.log(f"FAILED M {M} {e}: {'; '.join(bad[:2])}")
                rows.append({"rows": M, "variant": f"tail w{e[0]} r{e[1]} kc{e[2]}", "error": bad[0]})
            else:
                BK.log(f"M {M} {e}: the two launches' bits, with and without PDL")
                ok.append(e)

        def timed(name: str, pdl: bool, fn) -> None:
            old = common.set_pdl(pdl)
            try:
                # a predecessor writes o before each call, as the attention does in the step
                us, best = BK.graph_time([lambda w=w: (o.copy_(src), fn(w)) for _ in range(4) for w in copies],
                                         reps=args.reps)
            finally:
                common.set_pdl(old)
            rows.append({"rows": M, "variant": name, "pdl": pdl, "us": us, "best_us": best,
                         "gb_s": nbytes / us / 1e3, "pct_read": 100 * nbytes / us / 1e3 / bw["read"]})
            BK.log(f"M {M} {name} pdl {pdl}: {us:.2f} us per call (best {best:.2f}), {nbytes / us / 1e3:.0f} GB/s")

        for pdl in (False, True):
            timed("triton (linear_fp8 x 2)", pdl, lambda w: pair(o, w))
            for e in ok:
                timed(f"tail w{e[0]} r{e[1]} kc{e[2]}", pdl, lambda w, e=e: WT.wo_tail(o, w[0], w[1], w[2], w[3], G, e))
        WT.check(o.device)

    with open(os.path.join(args.out, "wo_tail_bench.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "bandwidth": bw, "bytes": nbytes, "rows": rows}, f,
                  indent=1)
    BK.log("\n(each call also copies o, 64 KB a row: the predecessor)")
    BK.log(f"| rows | variant | PDL | us per call | GB/s | % of the streaming read ({bw['read']:.0f} GB/s) |")
    BK.log("| ---: | --- | --- | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            BK.log(f"| {r['rows']} | {r['variant']} | | FAILED | | |")
        else:
            BK.log(f"| {r['rows']} | {r['variant']} | {'on' if r['pdl'] else 'off'} | {r['us']:.2f} | {r['gb_s']:.0f} | "
                   f"{r['pct_read']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
