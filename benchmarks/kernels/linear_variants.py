"""FP8 linear modes and tiles at the shapes the V4-Flash decode step launches: each candidate
checked against linear_fp8_ref (one bf16 step, as tests/kernels/test_linear_fp8.py), for
determinism and against the picked configuration's bits (a runtime choice by rows keeps batch
invariance only with the same bits), then timed (CUDA graph of calls on rotated weight copies,
nothing from L2); the picked "f16" configuration also with x's activation codes given ("f16+c":
x_codes, the quantization that x's producer writes beside x).

    python benchmarks/kernels/linear_variants.py --out DIR [--ms 1,64] [--shapes shared_w13,wo_b]
    python benchmarks/kernels/linear_variants.py --smoke --out DIR   (CPU interpreter, tiny shapes)

Shapes are the fused launches of one layer (model/fast.py): the x group (wq_a + wkv, 1536 x
4096), the qr group (wq_b + the indexer's wq_b, 40960 x 1024), wo_a (8 groups of 1024 x 4096,
bf16 activation: "dot16" only), wo_b (4096 x 8192), the shared expert's gated w1/w3
(2 x 2048 x 4096) and its w2 (4096 x 2048). Prints a table last (µs per
call, GB/s of the bytes that must be read; "=" where a candidate gives the picked one's bits) and
writes linear_variants.json under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import asdict

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import bench_kernels as BK  # noqa: E402
from megastep.checkpoint import formats  # noqa: E402
from megastep.kernels import linear_fp8 as LIN  # noqa: E402

WO_A_GROUPS = 8  # V4-Flash o_groups: wo_a is one launch over 8 groups of 1024 rows, each reading its 4096 columns
SHAPES = {  # name: (N, K, kind); kind "gated": w13 = 2 x N rows; "wo_a": grouped, bf16 activation
    "x_group": (1536, 4096, "plain"),
    "qr_group": (40960, 1024, "plain"),
    "wo_a": (8192, 4096, "wo_a"),
    "wo_b": (4096, 8192, "plain"),
    "shared_w13": (2048, 4096, "gated"),
    "shared_w2": (4096, 2048, "plain"),
}
SMOKE_SHAPES = {"x_group": (256, 512, "plain"), "wo_a": (1024, 256, "wo_a"), "shared_w13": (128, 512, "gated")}


def candidates(M: int, N: int, K: int, kind: str, regs: tuple[int, ...] = ()) -> list[LIN.LinearFp8Config]:
    """The picked configuration first, then the others; regs: register caps (maxnreg) to try too."""
    C = LIN.LinearFp8Config
    picked = (LIN.pick_config_swiglu(M, N, K) if kind == "gated" else
              LIN.pick_config(M, N, K, quantize_act=kind != "wo_a"))
    bm = 16 if M <= 16 else min(64, 1 << (M - 1).bit_length())
    out = [picked]
    if kind == "wo_a":  # "f16" picked since 2026-11-30; "dot16" (the earlier pick first), 128-row tiles
        specs = [(64, 4, 3, 264, 128), (128, 4, 3, 264, 128), (128, 8, 3, 264, 128), (64, 4, 3, 264, 256)]
        for bn, nw, ns, target, bk in specs:
            out.append(C("dot16", bn, bm, bk, BK.auto_split(-(-N // bn), K, bk, target), nw, ns))
        return list(dict.fromkeys(out))
    # (block_n, warps, stages, target programs). Measured on one H200 and slower or within 1 %, M = 1
    # and 64: 128-row tiles, 6 or 4 stages (2026-11-29); 32- and 16-row tiles, twice the programs
    # (though stream_floor.py reads wo_b's bytes in this pattern in 12.9 us with 256 programs and
    # 10.5 us with 512), 256-wide steps forming two 128-blocks' dots before adding them (bit-identical
    # on the GPU, 10-25 % slower: Triton waits for the first block's MMAs before the second's)
    # (2026-11-30, docs/PERFORMANCE.md, ninth measurement); half the programs (target 132, each
    # streaming twice the K: the experts' whole-K finding), 8-35 % slower at 1 and 4 rows for every
    # split linear and at 64 rows but for the shared w1/w3 (30.2 against 36.1 us) (fifteenth).
    specs = [(64, 4, 3, 264), (64, 4, 4, 264), (64, 4, 3, 528), (32, 4, 3, 264)]
    if kind == "gated":  # 2 warps: a program small enough to run beside the experts' spread gate-up
        # (one 12-warp CTA per SM leaves 16k registers; the 4-warp program takes 128 x 168)
        specs += [(64, 2, 3, 264), (32, 2, 3, 264)]
    for bn, nw, ns, target in specs:
        out.append(C("f16", bn, bm, 128, BK.auto_split(-(-N // bn), K, 128, target), nw, ns))
    if regs:  # ptxas's register cap (LinearFp8Config.maxnreg): the picked tiles, then twice the programs
        out += [dataclasses.replace(picked, maxnreg=r) for r in regs]
        for r in regs:
            out.append(C("f16", 64, bm, 128, BK.auto_split(-(-N // 64), K, 128, 528), 4, 3, maxnreg=r))
            out.append(C("f16", 32, bm, 128, BK.auto_split(-(-N // 32), K, 128, 528), 4, 3, maxnreg=r))
    return list(dict.fromkeys(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out/linear_variants"))
    ap.add_argument("--ms", default="1,64")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--shapes", default="", help="comma-separated names of SHAPES (default: all)")
    ap.add_argument("--regs", default="", help="register caps (maxnreg) to try beside the other candidates, e.g. 64,80")
    args = ap.parse_args()
    regs = tuple(int(r) for r in args.regs.split(",") if r)
    os.makedirs(args.out, exist_ok=True)
    BK.LOG = open(os.path.join(args.out, "linear_variants.log"), "w")
    if args.smoke:
        BK.DEV = "cpu"
    dev = BK.DEV
    bw = BK.measure_bandwidth()
    BK.log(f"device {torch.cuda.get_device_name(0) if dev == 'cuda' else 'cpu'}; streaming read {bw['read']:.0f} GB/s")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, (N, K, kind) in (SMOKE_SHAPES if args.smoke else SHAPES).items():
        if args.shapes and name not in args.shapes.split(","):
            continue
        R = 2 * N if kind == "gated" else N
        nbytes = R * K + triton.cdiv(R, 128) * triton.cdiv(K, 128)
        copies = 2 if args.smoke else max(1, min(128, math.ceil(BK.L2_FLUSH_BYTES / nbytes)))
        ws = [BK.fp8_weight(R, K, g) for _ in range(copies)]
        G = WO_A_GROUPS if kind == "wo_a" else 1
        ms = [int(m) for m in args.ms.split(",")]
        x_all = torch.randn(max(ms), G * K, device=dev, generator=g).bfloat16()
        row0 = {}  # (config but its row tile, codes) -> row 0's output at the first M: batch invariance
        for M in ms:
            x = x_all[:M]
            if kind == "gated":
                fn, ref = LIN.linear_fp8_swiglu, LIN.linear_fp8_swiglu_ref(x, *ws[0], 10.0)
            elif kind == "wo_a":
                fn, ref = LIN.linear_fp8, LIN.linear_fp8_ref(x, *ws[0], quantize_act=False, groups=G)
            else:
                fn, ref = LIN.linear_fp8, LIN.linear_fp8_ref(x, *ws[0])
            codes = formats.fp8_act_quant(x.float(), 128) if K % 128 == 0 and kind != "wo_a" else None
            cands = [(c, None) for c in candidates(M, N, K, kind, regs)]
            if codes is not None and kind != "wo_a":  # the picked configuration with x's codes
                cands += [(cands[0][0], codes)]
            picked_y = None  # the picked configuration's output: same_bits compares each candidate's
            for i, (c, xc) in enumerate(cands):
                r = dict(shape=name, N=N, K=K, M=M, config=asdict(c), picked=i == 0, codes=xc is not None)
                if kind == "gated":
                    call = (lambda c, w, s, xc=xc: fn(x, w, s, 10.0, config=c, x_codes=xc))  # noqa: E731
                elif kind == "wo_a":
                    call = (lambda c, w, s: fn(x, w, s, config=c, quantize_act=False, groups=G))  # noqa: E731
                else:
                    call = (lambda c, w, s, xc=xc: fn(x, w, s, config=c, x_codes=xc))  # noqa: E731
                try:
                    y = call(c, *ws[0])
                    picked_y = y if i == 0 else picked_y
                    r.update(same_bits_as_picked=picked_y is not None and torch.equal(y.view(torch.int16),
                                                                                       picked_y.view(torch.int16)))
                    ok, msg = BK.check_linear(y, ref)
                    key = (dataclasses.replace(c, block_m=0), xc is not None)
                    r.update(row0_same=torch.equal(row0.setdefault(key, y[:1]).view(torch.int16), y[:1].view(torch.int16)))
                    same = all(torch.equal(y.view(torch.int16), call(c, *ws[0]).view(torch.int16)) for _ in range(3))
                    med, best = BK.graph_time([lambda w=w, s=s, c=c, call=call: call(c, w, s) for (w, s) in ws])
                    r.update(ok=ok and same, check=msg, us=med, gbps=(nbytes + M * G * K * 2) / med / 1e3)
                except Exception as e:  # noqa: BLE001
                    r.update(ok=False, error=repr(e)[:300])
                rows.append(r)
                BK.log(json.dumps(r))
    with open(os.path.join(args.out, "linear_variants.json"), "w") as f:
        json.dump(dict(bandwidth=bw, rows=rows), f, indent=1)
    print(f"\n{'shape':11} {'M':>3} {'mode':5} {'bn':>3} {'bm':>3} {'bk':>3} {'sp':>3} {'w':>2} {'st':>2} {'reg':>3} {'us':>7} "
          f"{'GB/s':>6} ok")
    for r in rows:
        c = r["config"]
        mode = c["mode"] + ("+c" if r["codes"] else "")
        print(f"{r['shape']:11} {r['M']:3} {mode:5} {c['block_n']:3} {c['block_m']:3} {c['block_k']:3} {c['split_k']:3} "
              f"{c['num_warps']:2} {c['num_stages']:2} {c['maxnreg']:3} {r.get('us', float('nan')):7.2f} {r.get('gbps', 0):6.0f} "
              f"{'ok' if r['ok'] else 'FAIL'} {r.get('check', r.get('error', ''))[:70]}{'' if r.get('row0_same') else ' ROW0!'}"
              f"{' =' if r.get('same_bits_as_picked') else ' !='}{' *' if r['picked'] else ''}")


if __name__ == "__main__":
    main()
