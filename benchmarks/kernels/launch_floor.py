"""What a decode-size launch costs beyond its bytes: the fixed time per kernel in CUDA-graph replay.

Times, in graphs of back-to-back launches (weights rotated past L2, `bench_kernels.graph_time`):
- an empty Triton kernel on 1 and on 264 programs (the launch-to-launch floor);
- the FP8 linear at M = 1, K = 4096, for N from 128 to 16384 rows (0.5 to 67 MB): Triton ("f16",
  its picked config) with PDL off and on, and the CUDA C++ GEMV (`gemv_fp8_cuda`); PDL as
  `common` makes it (a grid over one wave releases the next kernel after its main loop, and a
  linear asks L2 for its first weight lines before it waits; the first runs of 2026-11-29 in
  docs/PERFORMANCE.md released at entry, with and without an L2 prefetch of the whole tile);
and fits t = a + bytes / b over N for each: a is the fixed cost of one launch (launch gap, ramp,
split-K round trip, tail), b the streaming rate it reaches.

Then the anatomy of that fixed cost at three shapes (M = 1): the Triton linear at split-K 1..16,
and the CUDA GEMV built with one stage taken out at a time (timing probes, wrong outputs): no
activation prologue, no memory fences around the split-K arrival, no L2 256-byte prefetch hint on
the weight loads.

    python benchmarks/kernels/launch_floor.py --out DIR
    python benchmarks/kernels/launch_floor.py --plot launch_floor.json PNG   (no GPU needed)
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
from megastep.kernels import common  # noqa: E402
from megastep.kernels import cuda_module  # noqa: E402
import gemv_fp8_cuda as GV  # noqa: E402
from megastep.kernels import linear_fp8 as LIN  # noqa: E402

K = 4096
VARIANTS = ("triton", "triton_pdl", "cuda")
NS = (128, 512, 1536, 4096, 8192, 16384)


@triton.jit
def _empty_kernel(p, PDL: tl.constexpr):
    common.pdl_enter(PDL)
    if tl.program_id(0) < 0:  # never: keeps the argument
        tl.store(p, 0)


# timing probes of the CUDA GEMV: (name, [(text in gemv_fp8_cuda.cu or its header, replacement)])
PROBES = [
    ("cuda_no_prologue", [("for (int i0 = warp; i0 < tasks; i0 += nwarps * kU) {", "for (int i0 = warp; i0 < 0; i0 += nwarps * kU) {")]),
    ("cuda_no_fence", [("__threadfence();", ";")]),
    ("cuda_no_l2_256B_hint", [("ld.global.nc.L1::no_allocate.L2::256B.v4.u32", "ld.global.nc.L1::no_allocate.v4.u32")]),
    ("cuda_no_prologue_no_fence", [("for (int i0 = warp; i0 < tasks; i0 += nwarps * kU) {", "for (int i0 = warp; i0 < 0; i0 += nwarps * kU) {"),
                                   ("__threadfence();", ";")]),
]
ANATOMY_SHAPES = ((128, 4096), (1536, 4096), (40960, 1024))


_COMMON = os.path.join(HERE, "..", "..", "megastep", "kernels", "cuda_common.cuh")
_COMMON_INCLUDE = '#include "../../megastep/kernels/cuda_common.cuh"'  # (cuda_experiments.cuh's)
# the kernel and the headers it includes
PROBE_FILES = (GV._SOURCE, os.path.join(HERE, "cuda_experiments.cuh"), os.path.normpath(_COMMON))


def probe_module(out_dir, name, edits):
    """The GEMV built from copies of its files (side by side under out_dir/name, the include
    pointed at the copy) with `edits` made in them."""
    texts = {p: open(p).read() for p in PROBE_FILES}
    for old, new in edits:
        hits = [p for p, t in texts.items() if old in t]
        assert len(hits) == 1, (old, hits)
        texts[hits[0]] = texts[hits[0]].replace(old, new)
    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    for p, t in texts.items():
        with open(os.path.join(d, os.path.basename(p)), "w") as f:
            f.write(t.replace(_COMMON_INCLUDE, '#include "cuda_common.cuh"'))
    return cuda_module.CudaModule(os.path.join(d, os.path.basename(GV._SOURCE)), arch=GV._MODULE.arch)


def anatomy(out_dir, g):
    rows = []
    mods = {name: probe_module(out_dir, name, edits) for name, edits in PROBES}
    for N, K in ANATOMY_SHAPES:
        nbytes = N * K + math.ceil(N / 128) * (K // 128)
        copies = max(2, min(128, math.ceil(BK.L2_FLUSH_BYTES / nbytes)))
        ws = [BK.fp8_weight(N, K, g) for _ in range(copies)]
        x = torch.randn(1, K, device="cuda", generator=g).bfloat16()
        variants = {}
        for split in (1, 2, 4, 8, 16):
            cfg = LIN.LinearFp8Config("f16", 64, 16, 128, split, 4, 3)
            variants[f"triton_split{split}"] = lambda w, s, cfg=cfg: LIN.linear_fp8(x, w, s, config=cfg)
        variants["cuda"] = lambda w, s, N=N: GV.gemv_fp8(x, w, s, torch.empty(1, N, dtype=torch.bfloat16, device="cuda"))
        for name, mod in mods.items():
            variants[name] = lambda w, s, N=N, mod=mod: GV.gemv_fp8(
                x, w, s, torch.empty(1, N, dtype=torch.bfloat16, device="cuda"), module=mod)
        for name, fn in variants.items():
            us, _ = BK.graph_time([lambda w=w, s=s, fn=fn: fn(w, s) for (w, s) in ws])
            rows.append(dict(kind=name, N=N, K=K, bytes=nbytes, us=us))
            BK.log(json.dumps(rows[-1]))
        del ws
        torch.cuda.empty_cache()
    return rows


def fit(points):
    """least squares t = a + x / b over (bytes, us) points -> (a us, b GB/s)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (t - my) for x, t in points)
    slope = sxy / sxx  # us per byte
    return my - slope * mx, 1e-3 / slope


def plot(json_path: str, png_path: str) -> None:
    """us per call against MB of weight for each variant of a run, with its fitted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.load(open(json_path))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, f in d["fits"].items():
        pts = sorted((r["bytes"] / 1e6, r["us"]) for r in d["rows"] if r["kind"] == name)
        line = ax.plot(*zip(*pts), "o", label=f"{name}: {f['fixed_us']:.1f} us + bytes / {f['stream_gbps'] / 1e3:.2f} TB/s")
        xs = [0, pts[-1][0]]
        ax.plot(xs, [f["fixed_us"] + x * 1e3 / f["stream_gbps"] for x in xs], "-", color=line[0].get_color(), lw=0.8)
    ax.set_xlabel("FP8 weight read per call (MB), M = 1, K = 4096")
    ax.set_ylabel("us per call (CUDA-graph replay)")
    ax.set_title("One H200: time of one decode linear against its bytes")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out/launch_floor"))
    ap.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"), help="plot a run's results and exit")
    args = ap.parse_args()
    if args.plot:
        plot(*args.plot)
        return
    os.makedirs(args.out, exist_ok=True)
    BK.LOG = open(os.path.join(args.out, "launch_floor.log"), "w")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    p = torch.zeros(1, device="cuda")
    for pdl in (False, True):
        common.set_pdl(pdl)
        for grid in (1, 264):
            us, _ = BK.graph_time([lambda grid=grid: _empty_kernel[(grid,)](p, **common.launch_opts(p, (grid,)))] * 40)
            rows.append(dict(kind="empty", grid=grid, pdl=pdl, us=us))
            BK.log(json.dumps(rows[-1]))
    common.set_pdl(False)
    x = torch.randn(1, K, device="cuda", generator=g).bfloat16()
    for N in NS:
        nbytes = N * K + math.ceil(N / 128) * (K // 128)
        copies = max(2, min(128, math.ceil(BK.L2_FLUSH_BYTES / nbytes)))
        ws = [BK.fp8_weight(N, K, g) for _ in range(copies)]
        variants = {
            "triton": (False, lambda w, s: LIN.linear_fp8(x, w, s)),
            "triton_pdl": (True, lambda w, s: LIN.linear_fp8(x, w, s)),
            "cuda": (False, lambda w, s, N=N: GV.gemv_fp8(x, w, s, torch.empty(1, N, dtype=torch.bfloat16,
                                                                                 device="cuda"))),
        }
        for name, (pdl, fn) in variants.items():
            common.set_pdl(pdl)
            us, _ = BK.graph_time([lambda w=w, s=s, fn=fn: fn(w, s) for (w, s) in ws])
            common.set_pdl(False)
            rows.append(dict(kind=name, N=N, bytes=nbytes, us=us, gbps=nbytes / us / 1e3))
            BK.log(json.dumps(rows[-1]))
        del ws
        torch.cuda.empty_cache()
    fits = {}
    for name in VARIANTS:
        pts = [(r["bytes"], r["us"]) for r in rows if r["kind"] == name]
        a, b = fit(pts)
        fits[name] = dict(fixed_us=a, stream_gbps=b)
    anat = anatomy(args.out, g)
    with open(os.path.join(args.out, "launch_floor.json"), "w") as f:
        json.dump(dict(rows=rows, fits=fits, anatomy=anat), f, indent=1)
    print("\nempty kernel, us per launch in graph replay:")
    for r in rows:
        if r["kind"] == "empty":
            print(f"  grid {r['grid']:4}  pdl {str(r['pdl']):5}  {r['us']:6.2f}")
    print(f"\nFP8 linear M=1 K={K}, us per call:")
    print(f"  {'N':>6} {'MB':>6} " + " ".join(f"{n:>15}" for n in VARIANTS))
    for N in NS:
        rs = {r["kind"]: r for r in rows if r.get("N") == N}
        print(f"  {N:6} {rs['triton']['bytes'] / 1e6:6.1f} " + " ".join(f"{rs[n]['us']:15.2f}" for n in VARIANTS))
    print("fit t = a + bytes / b:  " + "; ".join(f"{n}: a {v['fixed_us']:.2f} us, b {v['stream_gbps']:.0f} GB/s"
                                               for n, v in fits.items()))
    print("\nanatomy, M=1, us per call; bytes / 4.4 TB/s: "
          + ", ".join(f"{N}x{K} {(N * K) / 4.4e6:.2f}" for N, K in ANATOMY_SHAPES))
    names = list(dict.fromkeys(r["kind"] for r in anat))
    print(f"  {'variant':28} " + " ".join(f"{f'{N}x{K}':>11}" for N, K in ANATOMY_SHAPES))
    for name in names:
        vals = {(r["N"], r["K"]): r["us"] for r in anat if r["kind"] == name}
        print(f"  {name:28} " + " ".join(f"{vals[(N, K)]:11.2f}" for N, K in ANATOMY_SHAPES))


if __name__ == "__main__":
    main()
