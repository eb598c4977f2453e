"""V4-Flash shared expert (D 4096, I 2048) at M = 1, 16, 64: the composition fast.py runs today
(w1, w3, ops.swiglu, w2, add: ~12 launches) against the fused pair (linear_fp8_swiglu on
w13 = cat(w1, w3), then linear_fp8 with the routed sum as residual: 2 launches).

    python benchmarks/kernels/shared_expert_check.py [--sweep] [--smoke]

1. The gated epilogue's silu against torch on the device, every bf16 gate value (fp32 bits).
2. Correctness per M: new vs old (bit-equal fraction), new vs the *_ref chain (the tests'
   tolerances), the residual epilogue against its composition, 5 runs bit-identical.
3. Time: CUDA graphs of back-to-back calls, each on another copy of the weights (>= 200 MB per
   graph, past the 60 MB L2), median of replays (bench_kernels.graph_time); a few alternative
   gated configurations next to the picked one at the smallest and largest M (--sweep: ~15; to pin
   `_PINNED_SWIGLU`). Also plain w1 alone for scale.
Prints a compact table last. --smoke: tiny shapes on CPU through the Triton interpreter.
"""

from __future__ import annotations

import os
import warnings
import sys
import time

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
SMOKE = "--smoke" in sys.argv
WIDE = "--sweep" in sys.argv  # time many gated configurations
if SMOKE and os.environ.get("TRITON_INTERPRET") != "1":  # kernels must be decorated in interpreter mode
    os.environ["TRITON_INTERPRET"] = "1"
    os.execv(sys.executable, [sys.executable] + sys.argv)

import bench_kernels as BK  # noqa: E402  (graph_time, measure_bandwidth, L2_FLUSH_BYTES)

from megastep.checkpoint import formats as F  # noqa: E402
from megastep.kernels import linear_fp8 as LIN  # noqa: E402
from megastep.model import ops  # noqa: E402

C = LIN.LinearFp8Config
warnings.filterwarnings("ignore", "overflow encountered in exp")  # interpreter silu(g < -88.7): g / inf = -0, as torch
LIMIT = 10.0
if SMOKE:
    BK.DEV = DEV = "cpu"
    D, I, MS, FLUSH = 256, 128, (1, 17), 1
else:
    DEV = "cuda"
    D, I, MS, FLUSH = 4096, 2048, (1, 16, 64), BK.L2_FLUSH_BYTES


@triton.jit
def _silu_probe(g_ptr, u_ptr, out_ptr, n, limit, INTERPRET: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, LIN._swiglu(g, u, limit, True, INTERPRET), mask=mask)


def probe_swiglu():
    """Every finite bf16 g against 8 values of u: fp32 and bf16 mismatches against ops.swiglu."""
    g = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    g = g[torch.isfinite(g)].to(DEV)
    u = torch.tensor([1.0, -0.3, 3.7, 9.96875, -12.0, 0.015625, 100.0, -1.5], device=DEV)
    g, u = g[:, None].expand(-1, 8).contiguous(), u[None, :].expand(g.shape[0], -1).contiguous()
    out = torch.empty_like(g)
    n = g.numel()
    _silu_probe[(triton.cdiv(n, 1024),)](g, u, out, n, LIMIT, INTERPRET=DEV == "cpu", BLOCK=1024)
    ref = ops.swiglu(g, u, LIMIT)
    same32 = (out.view(torch.int32) == ref.view(torch.int32)) | (out.isnan() & ref.isnan())
    return int((~same32).sum()), int((out.bfloat16() != ref.bfloat16()).sum()), n


def weights(copies):
    g = torch.Generator(device=DEV).manual_seed(0)
    w13, s13 = F.quantize_fp8_weight(torch.randn(2 * I, D, generator=g, device=DEV) * (4 / D**0.5), 128)
    w2, s2 = F.quantize_fp8_weight(torch.randn(D, I, generator=g, device=DEV) * (1 / I**0.5), 128)
    sets = []
    for _ in range(copies):
        c13, c2 = w13.clone(), w2.clone()
        sets.append(dict(w13=c13, s13=s13.clone(), w1=c13[:I], s1=s13[:I // 128], w3=c13[I:], s3=s13[I // 128:],
                         w2=c2, s2=s2.clone()))
    return sets


def old(x, y, W):  # model/fast.py `_moe`, shared expert part, today
    a = ops.swiglu(LIN.linear_fp8(x, W["w1"], W["s1"]), LIN.linear_fp8(x, W["w3"], W["s3"]), LIMIT).to(x.dtype)
    return (y + LIN.linear_fp8(a, W["w2"], W["s2"]).float()).to(x.dtype)


def new(x, y, W, cfg=None):
    a = LIN.linear_fp8_swiglu(x, W["w13"], W["s13"], LIMIT, config=cfg)
    return LIN.linear_fp8(a, W["w2"], W["s2"], residual=y)


def swiglu_bad(a, x, W):
    """Elements of a gated output outside the bound that g and u one bf16 step off allow."""
    g = LIN.linear_fp8_ref(x, W["w1"], W["s1"]).float()
    u = LIN.linear_fp8_ref(x, W["w3"], W["s3"]).float()
    dg, du = 2**-7 * g.abs() + 1e-5 * g.abs().max(), 2**-7 * u.abs() + 1e-5 * u.abs().max()
    g, u = g.clamp(max=LIMIT), u.clamp(-LIMIT, LIMIT)
    silu = torch.nn.functional.silu(g)
    ref = (silu * u).bfloat16().float()
    tol = 1.01 * ((silu.abs() + 1.1 * dg) * du + u.abs() * 1.1 * dg) + 2**-7 * ref.abs() + 1e-6 * ref.abs().max()
    return int(((a.float() - ref).abs() > tol).sum())


def alternatives(M, wide):
    mb = 16 if M <= 16 else min(triton.next_power_of_2(M), 64)
    picked = LIN.pick_config_swiglu(M, I, D)
    if not wide:
        bk = 256 if mb == 16 else 128
        alts = [C("dot16", 64, mb, bk, 8), C("dot16", 32, mb, 256, 4), C("dot16", 64, mb, 128, 4, 4, 4)]
    else:  # --sweep: (block_n, block_k, split, warps, stages)
        grid = [(64, 256, 4, 4, 3), (64, 256, 8, 4, 3), (64, 256, 16, 4, 3), (64, 128, 4, 4, 4), (64, 128, 8, 4, 4),
                (64, 128, 16, 4, 3), (64, 512, 4, 4, 2), (64, 256, 4, 8, 3), (32, 256, 4, 4, 3), (32, 512, 4, 4, 2),
                (32, 128, 8, 4, 4), (32, 128, 16, 4, 3), (128, 128, 4, 8, 3), (128, 256, 4, 8, 3),
                (128, 128, 8, 8, 3), (16, 512, 4, 4, 3), (16, 256, 8, 4, 3)]
        if mb > 16:  # 64-row tiles: 128-wide steps, fewer variants
            grid = [(64, 128, 4, 4, 3), (64, 128, 4, 4, 4), (64, 128, 8, 4, 3), (64, 128, 16, 4, 3), (64, 256, 4, 4, 3),
                    (64, 256, 8, 8, 3), (32, 128, 4, 4, 3), (32, 128, 8, 4, 3), (128, 128, 4, 8, 3), (128, 128, 8, 8, 3),
                    (16, 256, 4, 4, 3)]
        alts = [C("dot16", bn, mb, bk, sk, nw, ns) for bn, bk, sk, nw, ns in grid]
    return [c for c in alts if c != picked]


def main():
    t0 = time.time()
    dev_name = "cpu (interpreter, smoke)" if SMOKE else torch.cuda.get_device_name(0)
    print(f"device {dev_name}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    bw = BK.measure_bandwidth()["read"]
    p32, p16, pn = probe_swiglu()
    print(f"gated epilogue silu vs torch over {pn} (g, u): fp32 bits differ {p32}, bf16 differ {p16}", flush=True)
    copies = max(1, -(-FLUSH // (3 * I * D)))
    sets = weights(copies)
    W = sets[0]
    nbytes = 3 * I * D + 3 * (I // 128) * (D // 128)
    rows, sweep = [], []
    for M in MS:
        g = torch.Generator(device=DEV).manual_seed(M)
        x = torch.randn(M, D, generator=g, device=DEV).bfloat16()
        y = torch.randn(M, D, generator=g, device=DEV)
        o_old, o_new = old(x, y, W), new(x, y, W)
        a_new = LIN.linear_fp8_swiglu(x, W["w13"], W["s13"], LIMIT)
        det = all(torch.equal(o_new, new(x, y, W)) for _ in range(4))
        res_exact = torch.equal(o_new, (y + LIN.linear_fp8(a_new, W["w2"], W["s2"]).float()).bfloat16())
        a_ref = LIN.linear_fp8_swiglu_ref(x, W["w13"], W["s13"], LIMIT)
        o_ref = LIN.linear_fp8_ref(a_ref, W["w2"], W["s2"], residual=y).float()
        rel = ((o_new.float() - o_ref).norm() / o_ref.norm()).item()
        rel_old = ((o_old.float() - o_ref).norm() / o_ref.norm()).item()
        eq = (o_new == o_old).float().mean().item()
        bad = swiglu_bad(a_new, x, W)
        t_old = BK.graph_time([lambda W=W: old(x, y, W) for W in sets])[0]
        t_new = BK.graph_time([lambda W=W: new(x, y, W) for W in sets])[0]
        t_g = BK.graph_time([lambda W=W: LIN.linear_fp8_swiglu(x, W["w13"], W["s13"], LIMIT) for W in sets])[0]
        t_2 = BK.graph_time([lambda W=W: LIN.linear_fp8(a_new, W["w2"], W["s2"], residual=y) for W in sets])[0]
        t_1 = BK.graph_time([lambda W=W: LIN.linear_fp8(x, W["w1"], W["s1"]) for W in sets])[0]
        rows.append((M, t_old, t_new, t_g, t_2, t_1, nbytes / t_new / 1e3, det, res_exact, bad, eq, rel, rel_old))
        print(f"M={M} done ({time.time() - t0:.0f} s)", flush=True)
        if M in (MS[0], MS[-1]):
            for cfg in alternatives(M, WIDE):
                ok = swiglu_bad(LIN.linear_fp8_swiglu(x, W["w13"], W["s13"], LIMIT, config=cfg), x, W) == 0
                t = BK.graph_time([lambda W=W: LIN.linear_fp8_swiglu(x, W["w13"], W["s13"], LIMIT, config=cfg)
                                   for W in sets])[0]
                sweep.append((M, cfg, t, ok))

    print(f"\nshared expert D={D} I={I}: {nbytes / 1e6:.1f} MB of weights per call, {copies} weight copies rotated; "
          f"read roofline {bw:.0f} GB/s; total {time.time() - t0:.0f} s")
    print("alternative gated configs (picked: " + ", ".join(
        f"M={M} {_short(LIN.pick_config_swiglu(M, I, D))}" for M in (MS[0], MS[-1])) + ")")
    for M, cfg, t, ok in sweep:
        print(f"  M={M:3d} {_short(cfg):28} {t:7.2f} us {'ok' if ok else 'OFF-REF'}")
    print(f"{'M':>3} {'old us':>7} {'new us':>7} {'gated':>6} {'w2+res':>6} {'w1':>6} {'x':>5} {'GB/s':>6} {'%bw':>4} "
          f"det res== swiglu_bad new==old rel(new,ref) rel(old,ref)")
    for M, t_old, t_new, t_g, t_2, t_1, gbps, det, rex, bad, eq, rel, rel_old in rows:
        print(f"{M:3d} {t_old:7.2f} {t_new:7.2f} {t_g:6.2f} {t_2:6.2f} {t_1:6.2f} {t_old / t_new:5.2f} {gbps:6.0f} {100 * gbps / bw:4.0f} "
              f"{'Y' if det else 'N':>3} {'Y' if rex else 'N':>5} {bad:10d} {100 * eq:7.2f}% {rel:12.2e} {rel_old:12.2e}")


def _short(c):
    return f"bn{c.block_n} bm{c.block_m} bk{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}"


if __name__ == "__main__":
    main()
