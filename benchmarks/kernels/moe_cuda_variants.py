"""The routed MXFP4 experts at V4-Flash shapes (E 256, D 4096, I 2048, top-6) with the runtime's Triton
kernels ("triton") and in its mode "lut" (the CUDA C++ table-lookup kernels, kernels/moe_lut.py), or
"lut" with the pair-major kernels ("lut_pairs": moe_lut.GATE_UP_GM and DOWN_GM off, their defaults;
every engine below but "lut_gm" and "lut_gm_down" takes them), or with whole items per CTA at every M ("lut_items":
moe_lut.SPREAD_ROWS = ()), or with the
spread gate-up at 1 and 2 rows ("lut_spread": (1, 2), its weights in registers; "lut_spread_ring":
in the ring's slots, moe_lut.SPREAD_RING, with the table's decode), or with the gate-up's weight
steps in flight in shared memory at every M ("lut_ring": moe_lut.RING_MIN_ROWS = 1) or at none
("lut_noring": None), or with the ring gate-up decoding half of its groups in registers with fp16
MMAs ("lut_mix": moe_lut.RING_MIX on) or none ("lut_table": off), or the spread gate-up at 1 and 2
rows with the ring's slots and the mixed decode ("lut_spread_mix": moe_lut.SPREAD_RING_MIX, the
default at 2 rows since 2026-12-01), or with the group-major gate-up on every launch and the
pair-major down ("lut_gm": moe_lut.GATE_UP_GM, the default from 2026-12-07 07:53 to 10:16), whose sums
run in another order, and with the group-major down too ("lut_gm_down": moe_lut.DOWN_GM, the default
since 2026-12-07 10:16, as "lut"), or without gate-up's task halves on warp pairs at 1 row ("lut_nofew":
moe_lut.GM_FEW_ROWS = (), the same bits) or with them at 1-2 rows ("lut_few2"), or with down's first item's routing
read after its PDL wait ("lut_downlate": moe_lut.DOWN_GM_EARLY off, the default until 2026-12-07 18:10, the same
bits); each engine's outputs
must equal bit for bit those of the first engine with the same order of sums (the same GATE_UP_GM and
DOWN_GM). (Earlier experiments measured with it and removed: a CUDA C++
gate-up, docs/PERFORMANCE.md's eighth measurement; L2 prefetches ahead of each warp's ring, the
fifteenth; the MMA columns in lane-major order, the twenty-second; the routed experts of 1-2 rows
in one launch, the twenty-third; every group decoded in registers, and the mixed decode in every
kernel, the twenty-fourth; the group-major gate-up's 4 ring slots at 1-2 rows, 2026-12-07 from 12:20.)

    python benchmarks/kernels/moe_cuda_variants.py --out DIR [--ms 1,4,16,64] [--engines triton,lut,lut_items]

For each M and engine: the output against moe_experts_mxfp4_ref (the tests' tolerance: rel L2 <=
4e-3, max <= 2e-2 of max |ref|), two runs bit-identical, row 0 alone bit-identical to row 0 of the
batch; the per-kernel device time (torch profiler, eager); then the time per call (CUDA graph of
20 calls, each with its own random routing on one of two stacked layer copies: nothing from L2,
as moe_variants.py), and the GB/s of the distinct experts read. Prints a table last; JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import bench_kernels as BK  # noqa: E402
import moe_variants as MV  # noqa: E402
from megastep.kernels import moe as MOE  # noqa: E402
from megastep.kernels import moe_lut as LUTK  # noqa: E402


def lut_settings(engine: str) -> dict:
    """moe_lut's settings of a lut engine (the pair-major ones with GATE_UP_GM and DOWN_GM off)."""
    pair_major = {"lut_pairs": {}, "lut_items": {"SPREAD_ROWS": ()},
                  "lut_spread": {"SPREAD_ROWS": (1, 2), "SPREAD_RING": False},
                  "lut_spread_ring": {"SPREAD_ROWS": (1, 2), "SPREAD_RING": True, "SPREAD_RING_MIX": False},
                  "lut_spread_mix": {"SPREAD_ROWS": (1, 2), "SPREAD_RING": True, "SPREAD_RING_MIX": True},
                  "lut_ring": {"RING_MIN_ROWS": 1}, "lut_noring": {"RING_MIN_ROWS": None},
                  "lut_mix": {"RING_MIX": True}, "lut_table": {"RING_MIX": False}}
    if engine in pair_major:
        return {"GATE_UP_GM": False, "DOWN_GM": False, **pair_major[engine]}
    return {"lut_gm": {"GATE_UP_GM": True, "DOWN_GM": False},
            "lut_gm_down": {"GATE_UP_GM": True, "DOWN_GM": True}, "lut_nofew": {"GM_FEW_ROWS": ()},
            "lut_few2": {"GM_FEW_ROWS": (1, 2)}, "lut_downlate": {"DOWN_GM_EARLY": False}}.get(engine, {})


def run(engine, fn):
    if engine.startswith("lut"):  # mode "lut" (kernels/moe_lut.py) as the kernels' default
        names = ("SPREAD_ROWS", "RING_MIN_ROWS", "SPREAD_RING", "RING_MIX", "SPREAD_RING_MIX", "GATE_UP_GM", "DOWN_GM",
                 "GM_FEW_ROWS", "DOWN_GM_EARLY")
        saved = MOE.DEFAULT_MODE, {n: getattr(LUTK, n) for n in names}
        MOE.DEFAULT_MODE = "lut"
        for n, v in lut_settings(engine).items():
            setattr(LUTK, n, v)
        try:
            return fn()
        finally:
            MOE.DEFAULT_MODE = saved[0]
            for n, v in saved[1].items():
                setattr(LUTK, n, v)
    return fn()


def kernel_times(engine, calls):
    """us per call of each kernel (device time under the profiler, eager calls)."""
    from torch.profiler import ProfilerActivity, profile
    run(engine, lambda: [c() for c in calls[:2]])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(engine, lambda: [c() for c in calls])
        torch.cuda.synchronize()
    per = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and "moe" in ev.name:
            per[ev.name[:40]] = per.get(ev.name[:40], 0.0) + ev.device_time / len(calls)
    return {k: round(v, 2) for k, v in per.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out/moe_cuda_variants"))
    ap.add_argument("--ms", default="1,4,16,64")
    ap.add_argument("--engines", default="triton,lut")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    BK.LOG = open(os.path.join(args.out, "moe_cuda_variants.log"), "w")
    bw = BK.measure_bandwidth()["read"]
    lut = [k.attributes() for k in (LUTK._GATE_UP, LUTK._DOWN, LUTK._GATE_UP_SPREAD, LUTK._GATE_UP_RING,
                                    LUTK._GATE_UP_SPREAD_RING, LUTK._GATE_UP_RING_MIX, LUTK._GATE_UP_SPREAD_RING_MIX,
                                    LUTK._DOWN4, LUTK._GATE_UP_GM, LUTK._GATE_UP_GM_SPREAD, LUTK._GATE_UP_GM_FEW,
                                    LUTK._DOWN_GM, LUTK._DOWN_GM_EARLY)]
    BK.log(f"device {torch.cuda.get_device_name(0)}; streaming read {bw:.0f} GB/s; lut kernels: {lut}")
    E, D, I = (MV.SHAPE[n] for n in ("E", "D", "I"))
    gen = torch.Generator(device="cuda").manual_seed(1)
    copies = [MV.random_experts(E, D, I, gen) for _ in range(MV.N_COPIES)]
    g = torch.Generator().manual_seed(7)
    rows = []
    for M in [int(m) for m in args.ms.split(",")]:
        x = (torch.randn(M, D, generator=g) * torch.exp2(torch.randint(-2, 3, (M, 1), generator=g).float())).bfloat16().cuda()
        routes = [MV.routing(M, g) for _ in range(MV.N_CALLS)]
        distinct = statistics.mean(len(torch.unique(ids)) for ids, _ in routes)
        nbytes = distinct * MV.expert_bytes()
        ref = MOE.moe_experts_mxfp4_ref(x, *routes[0], **copies[0])
        first_lut = {}  # the first lut engine's output, group-major or not: the others of its kind must equal it
        for engine in args.engines.split(","):
            r = dict(M=M, engine=engine, distinct_experts=distinct, mbytes=nbytes / 1e6)
            try:
                y = run(engine, lambda: MOE.moe_experts_mxfp4(x, *routes[0], **copies[0]))
                y2 = run(engine, lambda: MOE.moe_experts_mxfp4(x, *routes[0], **copies[0]))
                alone = run(engine, lambda: MOE.moe_experts_mxfp4(x[:1], routes[0][0][:1], routes[0][1][:1], **copies[0]))
                ok, rel, mx = MV.compare(y, ref)
                r.update(ok=ok, rel_l2=rel, max_err_rel=mx, deterministic=torch.equal(y, y2),
                         batch_invariant=torch.equal(alone[0], y[0]))
                if engine.startswith("lut"):
                    settings = lut_settings(engine)
                    kind = tuple(settings.get(n, getattr(LUTK, n)) for n in ("GATE_UP_GM", "DOWN_GM"))
                    first = first_lut.setdefault(kind, y)
                    r.update(same_bits_as_first_lut=torch.equal(y, first))
                calls = [lambda ids=ids, wts=wts, ex=copies[i % len(copies)]: MOE.moe_experts_mxfp4(x, ids, wts, **ex)
                         for i, (ids, wts) in enumerate(routes)]
                med, _ = run(engine, lambda: BK.graph_time(calls))
                r.update(us=med, gbps=nbytes / med / 1e3, kernels_us=kernel_times(engine, calls))
            except Exception as e:  # noqa: BLE001  (report, go on)
                r.update(ok=False, error=repr(e)[:800])
                BK.log(traceback.format_exc()[-2000:])
            rows.append(r)
            BK.log(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}))
    with open(os.path.join(args.out, "moe_cuda_variants.json"), "w") as f:
        json.dump(dict(bandwidth_read=bw, rows=rows), f, indent=1)
    print(f"\n{'M':>3} {'engine':8} {'us':>8} {'GB/s':>6} {'rel':>8} ok det inv same  kernels (us)")
    for r in rows:
        ks = " ".join(f"{k.split('(')[0][-18:]}={v}" for k, v in r.get("kernels_us", {}).items())
        print(f"{r['M']:3} {r['engine']:8} {r.get('us', float('nan')):8.1f} {r.get('gbps', 0):6.0f} "
              f"{r.get('rel_l2', float('nan')):8.1e} {r['ok']} {r.get('deterministic')} {r.get('batch_invariant')}"
              f" {r.get('same_bits_as_first_lut', '-')}"
              f"  {ks}{'  ' + r['error'][:80] if 'error' in r else ''}")


if __name__ == "__main__":
    main()
