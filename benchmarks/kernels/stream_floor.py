"""How fast can one decode-size launch stream a weight matrix, with no arithmetic to speak of?

The FP8 linears reach ~2.6 TB/s on large weights at M = 1 (launch_floor.py's fit) against ~4.4 TB/s
of streaming read, and the question is whether the missing third is their arithmetic or the way
they read. This script times kernels that read an e4m3 [N, K] matrix exactly as the "f16" linear's
programs do (BLOCK_N rows x 128 bytes per step, split-K to a fixed number of programs, Triton's
software pipeline of `num_stages`) but only XOR the bytes together, so whatever rate they reach is
the ceiling of that access pattern. Variants, each at several stage counts and program counts:
- rows:   the linear's pattern: per step BLOCK_N row segments of 128 bytes, K bytes apart;
- tiled:  the same programs and steps over a weight stored tile by tile (each step's 8 KB
          contiguous), i.e. what a load-time repack of the weight would give;
- tma:    the rows pattern through a host-made TMA descriptor (one bulk copy per step);
and the linear itself ("f16", M = 1) on the same shapes. CUDA-graph replay, each call on another
copy of the weight (>= 256 MB per graph, past the 60 MB L2), median of 20 replays.

    python benchmarks/kernels/stream_floor.py --json OUT.json
    python benchmarks/kernels/stream_floor.py --experts --json OUT.json   (the experts' byte shapes only)
    python benchmarks/kernels/stream_floor.py --plot OUT.json PNG          (no GPU needed)
"""

from __future__ import annotations

import argparse
import json
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

# x group, wo_b, qr group, 67 MB; and the byte shapes of six experts' MXFP4 w1 + w3 (rows of 2048
# bytes) and w2 (rows of 1024 bytes), the routed experts' reads at batch 1
SHAPES = ((1536, 4096), (4096, 8192), (40960, 1024), (16384, 4096), (24576, 2048), (24576, 1024))
WORDS = 32  # int32 words per 128-byte row segment
ROTATE_BYTES = 256 << 20  # bytes touched per graph (0 with --smoke)


@triton.jit
def _xor_rows_kernel(w_ptr, out_ptr, N, KW, KW_PER_SPLIT, BLOCK_N: tl.constexpr, TILED: tl.constexpr,
                     STEP: tl.constexpr = 32):
    """XOR of the program's [BLOCK_N, KW_PER_SPLIT] int32 words, STEP words (32: 128 bytes) per row
    and step. TILED: the weight is stored as [N / BLOCK_N, KW / 32, BLOCK_N, 32] (step-contiguous)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, STEP)
    acc = tl.zeros([BLOCK_N, STEP], dtype=tl.int32)
    k_lo = pid_k * KW_PER_SPLIT
    k_hi = tl.minimum(k_lo + KW_PER_SPLIT, KW)
    for k0 in range(k_lo, k_hi, STEP):
        if TILED:
            base = w_ptr + (pid_n * (KW // 32) + k0 // 32) * (BLOCK_N * 32)
            ptrs = base + offs_n[:, None] * 32 + offs_w[None, :]
        else:
            ptrs = w_ptr + (pid_n * BLOCK_N + offs_n)[:, None] * KW + (k0 + offs_w)[None, :]
        acc ^= tl.load(ptrs)
    tl.store(out_ptr + pid_k * tl.num_programs(0) + pid_n, tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0))


@triton.jit
def _xor_tma_kernel(desc, out_ptr, KW, KW_PER_SPLIT, BLOCK_N: tl.constexpr):
    """The rows pattern through a TMA descriptor of block [BLOCK_N, 32] int32."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    acc = tl.zeros([BLOCK_N, 32], dtype=tl.int32)
    k_lo = pid_k * KW_PER_SPLIT
    k_hi = tl.minimum(k_lo + KW_PER_SPLIT, KW)
    for k0 in range(k_lo, k_hi, 32):
        acc ^= desc.load([pid_n * BLOCK_N, k0])
    tl.store(out_ptr + pid_k * tl.num_programs(0) + pid_n, tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0))


def _xor_ref(w: torch.Tensor, block_n: int, split: int) -> torch.Tensor:
    """What the XOR kernels store (split-major), from the plain [N, KW] words."""
    N, KW = w.shape
    kps = -(-KW // split)
    out = []
    for k in range(split):
        r = w[:, k * kps:(k + 1) * kps].reshape(N // block_n, -1)
        while r.shape[1] > 1:  # XOR-reduce by halves
            h = r.shape[1] // 2
            r = torch.cat([r[:, :h] ^ r[:, h:2 * h], r[:, 2 * h:]], dim=1)
        out.append(r[:, 0])
    return torch.cat(out)


def _tile(w: torch.Tensor, block_n: int) -> torch.Tensor:
    N, KW = w.shape
    return w.view(N // block_n, block_n, KW // WORDS, WORDS).permute(0, 2, 1, 3).contiguous()


def run_case(N: int, K: int, variant: str, block_n: int, programs: int, stages: int, check: bool,
             step: int = WORDS) -> dict:
    KW = K // 4
    nbytes = N * K
    copies = max(2, -(-ROTATE_BYTES // nbytes))
    g = torch.Generator(device=BK.DEV).manual_seed(N + K)
    base = torch.randint(-2**31, 2**31 - 1, (N, KW), generator=g, device=BK.DEV, dtype=torch.int32)
    split = BK.auto_split(N // block_n, K, 128, programs)  # split-K as the linear's rule, to ~programs
    kps = -(-KW // split)
    grid = (N // block_n, split)
    out = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=BK.DEV)
    ws = [base] + [base.roll(i, 0) for i in range(1, copies)]
    if variant == "tiled":
        ws = [_tile(w, block_n) for w in ws]
    calls = []
    for w in ws:
        if variant == "tma":
            from triton.tools.tensor_descriptor import TensorDescriptor
            desc = TensorDescriptor.from_tensor(w, [block_n, WORDS])
            calls.append(lambda d=desc: _xor_tma_kernel[grid](d, out, KW, kps, BLOCK_N=block_n,
                                                              num_warps=4, num_stages=stages))
        else:
            calls.append(lambda w=w: _xor_rows_kernel[grid](w, out, N, KW, kps, BLOCK_N=block_n,
                                                            TILED=variant == "tiled", STEP=step, num_warps=4,
                                                            num_stages=stages))
    ok = None
    if check:
        calls[0]()
        ok = bool(torch.equal(out, _xor_ref(base, block_n, split)))
    us, best = BK.graph_time(calls)
    return {"N": N, "K": K, "variant": variant + ("" if step == WORDS else f"{step * 4}B"), "block_n": block_n,
            "programs": grid[0] * grid[1], "stages": stages, "bytes": nbytes, "us": us, "best_us": best, "gbps": nbytes / us / 1e3, "ok": ok}


def run_linear(N: int, K: int) -> dict:
    copies = max(2, -(-ROTATE_BYTES // (N * K)))
    g = torch.Generator(device=BK.DEV).manual_seed(N * 7 + K)
    x = torch.randn(1, K, generator=g, device=BK.DEV).to(torch.bfloat16)
    ws = []
    for _ in range(copies):
        w, s = BK.fp8_weight(N, K, g)
        ws.append((w, s))
    calls = [lambda w=w, s=s: LIN.linear_fp8(x, w, s) for w, s in ws]
    us, best = BK.graph_time(calls)
    nbytes = N * K + ws[0][1].numel()
    return {"N": N, "K": K, "variant": "linear_f16", "block_n": 64, "programs": None, "stages": 3,
            "bytes": nbytes, "us": us, "best_us": best, "gbps": nbytes / us / 1e3, "ok": None}


def plot(path: str, png: str) -> None:
    """Per shape: the time of its bytes at the run's streaming read, the best XOR read per pattern
    at up to / above two programs per SM, and the linear ("f16", M = 1)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = json.load(open(path))
    bw = next(r["bandwidth"]["read"] for r in rows if r["variant"] == "stream_read")
    shapes = list(dict.fromkeys((r["N"], r["K"]) for r in rows if "N" in r))
    series = {}  # label -> {shape: us}
    for r in rows:
        if "us" not in r:
            continue
        if r["variant"] == "linear_f16":
            label = "FP8 linear (f16, M = 1)"
        else:  # the best of a pattern at up to two programs per SM (one wave) and above
            label = f"XOR {r['variant']}, " + ("<= 2 programs / SM" if r["programs"] <= 264 else "> 2 programs / SM")
        d = series.setdefault(label, {})
        d[(r["N"], r["K"])] = min(d.get((r["N"], r["K"]), float("inf")), r["us"])
    keep = sorted(series, key=lambda k: (not k.startswith("FP8"), k))
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / (len(keep) + 1)
    for j, (N, K) in enumerate(shapes):
        ax.bar(j, N * K / bw / 1e3, width, color="black", label="bytes / streaming read" if j == 0 else None)
    for i, label in enumerate(keep, 1):
        xs = [j + i * width for j, sh in enumerate(shapes) if sh in series[label]]
        ys = [series[label][sh] for sh in shapes if sh in series[label]]
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks([j + 0.4 for j in range(len(shapes))])
    ax.set_xticklabels([f"{N}x{K}\n{N * K / 1e6:.0f} MB" for N, K in shapes])
    ax.set_ylabel("us per launch (CUDA-graph replay, weights past L2)")
    ax.set_title(f"One launch reading an e4m3 weight: XOR-only programs against the FP8 linear (M = 1); read {bw:.0f} GB/s")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--plot":
        plot(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, correctness only (interpreter)")
    ap.add_argument("--experts", action="store_true",
                    help="only the experts' byte shapes, with 64-byte row segments per step (their kernels' pattern)")
    args = ap.parse_args()
    global ROTATE_BYTES
    if args.smoke:
        BK.DEV, ROTATE_BYTES = "cpu", 0
        shapes, plan = ((128, 512),), [("rows", 64, 4, 2, 32), ("tiled", 64, 4, 2, 32), ("tma", 64, 4, 2, 32),
                                        ("rows", 64, 4, 2, 16)]
    elif args.experts:  # the experts' programs: 64 rows x 64 bytes per step, 384 programs at batch 1
        shapes = SHAPES[4:]
        plan = [("rows", 64, 384, s, w) for w in (16, 32) for s in (2, 3, 4)]
    else:
        shapes = SHAPES
        plan = ([("rows", 64, p, s, 32) for p in (264, 528) for s in (2, 3, 4, 6)]
                + [("rows", 128, 264, s, 32) for s in (3, 4)]
                + [("tiled", 64, p, s, 32) for p in (132, 264, 528) for s in (3, 4, 6)]
                + [("tma", 64, p, s, 32) for p in (264, 528) for s in (3, 4, 6)])
    rows = []
    if not args.smoke:
        bw = BK.measure_bandwidth()
        rows.append({"variant": "stream_read", "bandwidth": bw})
        BK.log(json.dumps(rows[-1]))
    for N, K in shapes:
        if not args.smoke and not args.experts and (N, K) in SHAPES[:4]:
            rows.append(run_linear(N, K))
            BK.log(json.dumps(rows[-1]))
        for variant, bn, p, s, step in plan:
            try:
                rows.append(run_case(N, K, variant, bn, p, s, check=True, step=step))
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result too
                rows.append({"N": N, "K": K, "variant": variant, "block_n": bn, "programs": p, "stages": s,
                             "error": f"{type(e).__name__}: {e}"[:300]})
            BK.log(json.dumps(rows[-1]))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
    print(f"{'N x K':>12} {'variant':>10} {'bn':>4} {'progs':>5} {'st':>3} {'us':>8} {'GB/s':>6} ok")
    for r in rows:
        if r["variant"] == "stream_read":
            print(f"stream read (bench_kernels.measure_bandwidth): {r['bandwidth']}")
            continue
        if "error" in r:
            print(f"{r['N']:>5} x {r['K']:<5} {r['variant']:>10} {r['block_n']:>4} {r['programs']:>5} "
                  f"{r['stages']:>3} error {r['error'][:60]}")
            continue
        print(f"{r['N']:>5} x {r['K']:<5} {r['variant']:>10} {r['block_n']:>4} {str(r['programs']):>5} "
              f"{r['stages']:>3} {r['us']:8.2f} {r['gbps']:6.0f} {r['ok']}")


if __name__ == "__main__":
    main()
