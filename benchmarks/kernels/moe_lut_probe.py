"""Where a few-row routed-experts call's time goes inside its launches: the "lut" kernels built with
-DMOE_LUT_PROBE (moe_lut.cu: thread 0 of each CTA stamps the phases of its first item, globaltimer
and clock64) and swapped into kernels/moe_lut.py, at V4-Flash shapes (E 256, D 4096, I 2048, top-6),
the last of N_CALLS calls of a CUDA graph (each its own random routing over two stacked copies of
the experts, as moe_cuda_variants.py), without PDL or with it (--pdl: the launches as the 1-4 row
step makes them, each CTA placed while its predecessor drains). --no-load builds the loop without
its memory as well (-DMOE_LUT_NO_LOAD: the weight streams load nothing, wrong values): its
"streamed" phase is then the loop's own time. --decode mix / table stamps the ring gate-up with or
without its mixed decode (moe_lut.RING_MIX).

    python benchmarks/kernels/moe_lut_probe.py --out DIR [--ms 1,4] [--pdl] [--no-load] [--decode table|mix]

Per launch (gate-up, down) and M: the CTAs' items, then per phase the median and the largest time
of the CTAs' stamps after the launch's first stamp (us): the table built, the routing's slot count
read, the first item's routing loaded, (down: the wait for the activation quantization), x staged,
the first item's weights streamed, its epilogue done, the CTA's end. Also the gap between gate-up's
last CTA end and down's first CTA start (the activation quantization's launch between them). A
gate-up launch of M in moe_lut.SPREAD_ROWS takes the spread kernel, which has no stamps: those M
are refused. The kernels probed are the pair-major ones (moe_lut.GATE_UP_GM and DOWN_GM off here): the
group-major kernels are not in the probe build. JSON and log under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import moe_variants as MV  # noqa: E402
from megastep.kernels import moe as MOE  # noqa: E402
from megastep.kernels.common import set_pdl  # noqa: E402
from megastep.kernels import moe_lut as LUTK  # noqa: E402
from megastep.kernels.cuda_module import CudaModule  # noqa: E402

CTAS, MARKS = 320, 10  # the .cu's kProbeCtas, kProbeMarks
PHASES = ("start", "table", "slot count", "routing", "aq wait", "x staged", "streamed", "epilogue", "end")
KERNELS = ("_GATE_UP", "_GATE_UP_SPREAD", "_DOWN", "_GATE_UP_RING", "_GATE_UP_SPREAD_RING",
           "_GATE_UP_RING_MIX")


def probe_kernels(no_load: bool):
    """Swap moe_lut's launches for the probe build's; returns the stamps' read kernel."""
    mod = CudaModule(LUTK.SOURCE, extra_flags=("-DMOE_LUT_PROBE",) + (("-DMOE_LUT_NO_LOAD",) if no_load else ()))
    for name in KERNELS:
        k = getattr(LUTK, name)
        setattr(LUTK, name, mod.kernel(k.name, k.signature))
    return mod.kernel("moe_lut_probe_read", "p")


def read_stamps(read) -> torch.Tensor:
    """[2 (gate-up, down), CTAS, MARKS, 2 (globaltimer ns, clock64)] int64, zeroed on the device after."""
    out = torch.zeros(2, CTAS, MARKS, 2, dtype=torch.int64, device="cuda")
    read.launch((8, 1, 1), (256, 1, 1), 0, None, out)
    torch.cuda.synchronize()
    return out.cpu()


def summarize(st: torch.Tensor) -> dict:
    """One launch's stamps [CTAS, MARKS, 2] -> the CTAs' items and per phase the median / largest us
    after the launch's first stamp, with the median clock64 cycles between consecutive phases."""
    ran = st[:, 0, 0] > 0
    t = st[ran, :, 0].double()
    t0 = t[:, 0].min()
    phases = {}
    for m, name in enumerate(PHASES):
        have = t[:, m] > 0
        if have.any():
            rel = ((t[have, m] - t0) / 1e3).tolist()
            phases[name] = dict(median_us=round(statistics.median(rel), 2), max_us=round(max(rel), 2))
    cyc = {}  # over the CTAs with an item
    busy = st[:, 9, 0] > 0
    marks = [m for m in range(len(PHASES)) if busy.any() and (st[busy, m, 1] > 0).all()]
    for a, b in zip(marks, marks[1:]):
        cyc[f"{PHASES[a]} -> {PHASES[b]}"] = int(statistics.median((st[busy, b, 1] - st[busy, a, 1]).tolist()))
    items = st[ran, 9, 0].tolist()
    return dict(ctas=int(ran.sum()), items_per_cta={i: items.count(i) for i in sorted(set(items))},
                first_ns=float(t0), last_end_ns=float(t[:, 8].max()), phases=phases, median_cycles=cyc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out/moe_lut_probe"))
    ap.add_argument("--ms", default="1,4")
    ap.add_argument("--pdl", action="store_true")
    ap.add_argument("--no-load", action="store_true")
    ap.add_argument("--decode", choices=("table", "mix"), default="table")
    args = ap.parse_args()
    set_pdl(args.pdl)
    os.makedirs(args.out, exist_ok=True)
    ms = [int(m) for m in args.ms.split(",")]
    if any(m in LUTK.SPREAD_ROWS for m in ms):
        raise SystemExit(f"M in moe_lut.SPREAD_ROWS {LUTK.SPREAD_ROWS} takes the spread gate-up, which has no stamps")
    read = probe_kernels(args.no_load)
    LUTK.RING_MIX = args.decode == "mix"
    LUTK.GATE_UP_GM = LUTK.DOWN_GM = False  # (not in the probe build)
    MOE.DEFAULT_MODE = "lut"
    E, D, I = (MV.SHAPE[n] for n in ("E", "D", "I"))
    gen = torch.Generator(device="cuda").manual_seed(1)
    copies = [MV.random_experts(E, D, I, gen) for _ in range(MV.N_COPIES)]
    g = torch.Generator().manual_seed(7)
    results, lines = [], []
    for M in ms:
        x = torch.randn(M, D, generator=g).bfloat16().cuda()
        routes = [MV.routing(M, g) for _ in range(MV.N_CALLS)]
        calls = [lambda ids=ids, wts=wts, ex=copies[i % len(copies)]: MOE.moe_experts_mxfp4(x, ids, wts, **ex)
                 for i, (ids, wts) in enumerate(routes)]
        for c in calls[:2]:  # build, load, warm
            c()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for c in calls:
                c()
        graph.replay()
        torch.cuda.synchronize()
        read_stamps(read)  # (zeroed)
        graph.replay()
        torch.cuda.synchronize()
        st = read_stamps(read)
        up, down = summarize(st[0]), summarize(st[1])
        gap = (down["first_ns"] - up["last_end_ns"]) / 1e3
        results.append(dict(M=M, gate_up=up, down=down, gap_us=round(gap, 2)))
        for name, s in (("gate-up", up), ("down", down)):
            lines.append(f"M={M} {name}: {s['ctas']} CTAs, items per CTA (half 0) {s['items_per_cta']}")
            lines += [f"    {p:12} median {v['median_us']:7.2f} us  max {v['max_us']:7.2f} us"
                      for p, v in s["phases"].items()]
            lines.append("    median cycles: " + ", ".join(f"{k} {v}" for k, v in s["median_cycles"].items()))
        lines.append(f"M={M} gate-up's last end -> down's first start: {gap:.2f} us")
    with open(os.path.join(args.out, "moe_lut_probe.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(0), pdl=args.pdl, no_load=args.no_load, decode=args.decode,
                       results=results), f, indent=1)
    with open(os.path.join(args.out, "moe_lut_probe.log"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
