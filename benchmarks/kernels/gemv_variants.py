"""The CUDA C++ FP8 GEMV (`gemv_fp8_cuda`) against the Triton linear it would replace, at the
shapes the V4-Flash decode step launches (those of linear_variants.py without wo_a).

For each shape and M: the Triton picked config ("f16", and "f16+c" with x_codes) and the CUDA
kernel (its picked config, with codes, and a few other NB / R choices; its wgmma form "cuda_wg",
`pick_config_wg`, and that form's staged prologue "cuda_wgc", with their bits against the mma form's;
"_cl": the mma and staged forms with the K splits combined in a cluster, their bits against the global
combine's), each checked against the torch ref (one bf16 step, as tests/kernels/test_linear_fp8.py), for determinism (3 repeats
bit-identical), and for the CUDA kernel for batch invariance (every row equal, bit for bit, to the
row computed alone), then timed (CUDA graph of calls on rotated weight copies, nothing from L2).
Also the residual epilogue (wo_b, shared w2: fp32 residual, as the step calls them).

    python benchmarks/kernels/gemv_variants.py --out DIR [--ms 1,4,16,64]

Prints a table last (µs per call, GB/s of the bytes that must be read); JSON under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
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
import gemv_fp8_cuda as GV  # noqa: E402
from megastep.kernels import linear_fp8 as LIN  # noqa: E402

SHAPES = {  # name: (N, K, kind, residual)
    "x_group": (1536, 4096, "plain", False),
    "qr_group": (40960, 1024, "plain", False),
    "wo_b": (4096, 8192, "plain", True),
    "shared_w13": (2048, 4096, "gated", False),
    "shared_w2": (4096, 2048, "plain", True),
}
LIMIT = 10.0


def cuda_call(x, w, s, M, N, kind, res, xc, cfg):
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    return GV.gemv_fp8(x, w, s, out, gated=kind == "gated", limit=LIMIT if kind == "gated" else 0.0,
                       residual=res, x_codes=xc, config=cfg)


def triton_call(x, w, s, M, N, kind, res, xc, cfg):
    if kind == "gated":
        return LIN.linear_fp8_swiglu(x, w, s, LIMIT, config=cfg, x_codes=xc)
    return LIN.linear_fp8(x, w, s, config=cfg, residual=res, x_codes=xc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out/gemv_variants"))
    ap.add_argument("--ms", default="1,4,16,64")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    BK.LOG = open(os.path.join(args.out, "gemv_variants.log"), "w")
    bw = BK.measure_bandwidth()
    BK.log(f"device {torch.cuda.get_device_name(0)}; streaming read {bw['read']:.0f} GB/s; "
           f"cuda kernel available: {GV.available()} {GV.why_unavailable()}")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (N, K, kind, has_res) in SHAPES.items():
        R = 2 * N if kind == "gated" else N
        nbytes = R * K + triton.cdiv(R, 128) * triton.cdiv(K, 128)
        copies = max(1, min(128, math.ceil(BK.L2_FLUSH_BYTES / nbytes)))
        ws = [BK.fp8_weight(R, K, g) for _ in range(copies)]
        for M in [int(m) for m in args.ms.split(",")]:
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            res = torch.randn(M, N, device="cuda", generator=g) if has_res else None
            if kind == "gated":
                ref = LIN.linear_fp8_swiglu_ref(x, *ws[0], LIMIT)
            else:
                ref = LIN.linear_fp8_ref(x, *ws[0], residual=res)
            codes = formats.fp8_act_quant(x.float(), 128)
            gated = kind == "gated"
            picked = GV.pick_config(M, N, K, gated)
            tri = LIN.pick_config_swiglu(M, N, K) if gated else LIN.pick_config(M, N, K)
            wg, wgc = GV.pick_config_wg(M, N, K, gated=gated), GV.pick_config_wg(M, N, K, cp=True, gated=gated)
            cands = [("triton", tri, None), ("triton+c", tri, codes), ("cuda", picked, None), ("cuda+c", picked, codes),
                     ("cuda_wg", wg, None), ("cuda_wg+c", wg, codes), ("cuda_wgc", wgc, None), ("cuda_wgc+c", wgc, codes)]
            for base, c in (("cuda", picked), ("cuda_wgc", wgc)):  # the cluster combine, where it has entries
                if GV.cluster_ok(dataclasses.replace(c, cl=True), K):
                    cands.append((base + "_cl", dataclasses.replace(c, cl=True), None))
            for nb in (1, 2, 4, 8):
                for r in (1, 2, 4, 8 // (2 if kind == "gated" else 1)):
                    c = GV.GemvConfig(nb, picked.nt, r)
                    if K % (128 * nb) == 0 and c != picked and r <= (4 if kind == "gated" else 8) and \
                            GV._smem(c.nt, nb, r * (2 if kind == "gated" else 1)) <= GV.SMEM_LIMIT:
                        cands.append(("cuda", c, None))
            y_of = {}  # engine -> its first output: the picked configuration's, without codes
            for engine, cfg, xc in cands:
                fn = cuda_call if engine.startswith("cuda") else triton_call
                r = dict(shape=name, N=N, K=K, M=M, engine=engine, config=str(cfg), picked=cfg == picked)
                try:
                    call = (lambda w, s, fn=fn, cfg=cfg, xc=xc: fn(x, w, s, M, N, kind, res, xc, cfg))  # noqa: E731
                    y = call(*ws[0])
                    ok, msg = BK.check_swiglu(y, x, *ws[0], LIMIT) if gated else BK.check_linear(y, ref)
                    same = all(torch.equal(y.view(torch.int16), call(*ws[0]).view(torch.int16)) for _ in range(3))
                    inv = None
                    y_of.setdefault(engine, y)
                    if engine.endswith("_cl"):  # the same sums, combined through DSMEM: the global combine's bits?
                        r["bits_as_global"] = torch.equal(y.view(torch.int16), y_of[engine[:-3]].view(torch.int16))
                    if engine in ("cuda", "cuda_wg", "cuda_wgc") and cfg in (picked, wg, wgc):
                        # each row alone (M = 1, its own config) gives the row's bits of the batch
                        one = GV.pick_config_wg(1, N, K, cfg.cp, gated) if cfg.wg else None
                        alone = [cuda_call(x[i:i + 1], *ws[0], 1, N, kind, None if res is None else res[i:i + 1],
                                           None, one) for i in range(M)]
                        inv = all(torch.equal(alone[i].view(torch.int16), y[i:i + 1].view(torch.int16)) for i in range(M))
                        if engine != "cuda" and "cuda" in y_of:  # the same sums through wgmma's k16 steps: the same bits?
                            r["bits_as_mma"] = torch.equal(y.view(torch.int16), y_of["cuda"].view(torch.int16))
                    med, best = BK.graph_time([lambda w=w, s=s, call=call: call(w, s) for (w, s) in ws])
                    r.update(ok=ok and same and inv is not False and r.get("bits_as_global") is not False, check=msg,
                             deterministic=same, batch_invariant=inv, us=med, gbps=(nbytes + M * K * 2) / med / 1e3)
                except Exception as e:  # noqa: BLE001
                    r.update(ok=False, error=repr(e)[:300])
                rows.append(r)
                BK.log(json.dumps(r))
    with open(os.path.join(args.out, "gemv_variants.json"), "w") as f:
        json.dump(dict(bandwidth=bw, rows=rows), f, indent=1)
    print(f"\n{'shape':11} {'M':>3} {'engine':8} {'config':40} {'us':>7} {'GB/s':>6} ok")
    for r in rows:
        print(f"{r['shape']:11} {r['M']:3} {r['engine']:8} {r['config'][:40]:40} {r.get('us', float('nan')):7.2f} "
              f"{r.get('gbps', 0):6.0f} {'ok' if r['ok'] else 'FAIL ' + r.get('check', r.get('error', ''))[:70]}"
              f"{' *' if r['picked'] else ''}")


if __name__ == "__main__":
    main()
